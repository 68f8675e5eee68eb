"""CI's test-run plumbing: marks the long runs (`tests/long_runs.py`) `long`, so that CI (`scripts/test.sh`) can
leave them out and `scripts/long.sh` run them; and prints the files that took longest."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from long_runs import LONG  # noqa: E402

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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[report.nodeid.partition("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(_file_seconds) < 2:
        return
    terminalreporter.section("slowest files (setup + call + teardown, summed over their tests)")
    for path, s in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{s:8.1f} s  {path}")
