"""CI's test-run plumbing: marks the long runs (`tests/long_runs.py`) `long`, so that CI (`scripts/test.sh`) can
leave them out and `scripts/long.sh` run them; starts the files `long_runs.FIRST` names before the rest, so that no
slow file runs alone at the end; and prints the files that took longest."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from long_runs import FIRST, LONG  # noqa: E402

_file_seconds: dict[str, float] = defaultdict(float)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks must be on the items when it looks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    used = set()
    for item in items:
        for prefix in LONG:
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.long)
                used.add(prefix)
    # Only a whole-suite collection can say an entry matches nothing (a run of one file collects one file's tests).
    if not config.args or config.args == [str(Path(__file__).parent)] or config.args == ["tests"]:
        stale = sorted(set(LONG) - used)
        if stale and len(items) > 1000:
            raise pytest.UsageError(f"tests/long_runs.py names tests that do not exist: {stale}")
        files = {item.nodeid.partition("::")[0] for item in items}
        missing = sorted(set(FIRST) - files)
        if missing and len(items) > 1000:
            raise pytest.UsageError(f"tests/long_runs.py FIRST names files that do not exist: {missing}")


@pytest.hookimpl(optionalhook=True)  # xdist's hook; pytest runs without xdist too
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` with the files `FIRST` names handed out first, in its order, then xdist's own order (most
    tests first). xdist alone starts a slow file with few tests last, where it runs alone while the other worker
    idles."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowFilesFirst(LoadFileScheduling):
        _ordered = False

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the queue is whole at the first assignment
                self._ordered = True
                for scope in reversed(FIRST):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return SlowFilesFirst(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[report.nodeid.partition("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(_file_seconds) < 2:
        return
    terminalreporter.section("slowest files (setup + call + teardown, summed over their tests)")
    for path, s in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{s:8.1f} s  {path}")
