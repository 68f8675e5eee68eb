"""pytest plugin: `pytest --kvcert-target MODULE:FACTORY` runs each certification cell as one test.

The cells are `kvcert certify`'s (`certify.cells_for`), each run by `certify.run_cell`, so a test passes
exactly when that cell of the certificate would; `-k` selects cells by name
(`page_size:4-lru-write_back`). Registered through the `pytest11` entry point, so it loads in every
pytest session of an environment with kvcert installed: without `--kvcert-target` it only adds its
options, and imports nothing of the suite (Hypothesis, the model) until a target asks for cells.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional, cast

import pytest

if TYPE_CHECKING:
    from kvcert.conformance.backend import Factory
    from kvcert.conformance.certification.certificate import CellResult
    from kvcert.spec.types import CacheConfig, Capabilities


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcert", "kvcert conformance cells (one test per `kvcert certify` cell)")
    group.addoption(
        "--kvcert-target", default=None, metavar="MODULE:FACTORY", help="certify this backend factory, cell by cell"
    )
    group.addoption("--kvcert-examples", type=int, default=200, help="Hypothesis examples per cell (default 200)")
    group.addoption("--kvcert-steps", type=int, default=50, help="maximum operations per example (default 50)")
    group.addoption("--kvcert-seed", type=int, default=0, help="same seed, same run (default 0)")
    group.addoption(
        "--kvcert-profile", default=None, help="hold the backend to this profile instead of the one it declares"
    )
    group.addoption("--kvcert-out", default="kvcert-failures", help="where failing cells save their minimal traces")
    group.addoption(
        "--kvcert-certificate",
        default=None,
        metavar="JSON",
        help="a `kvcert certify --json` certificate of the same run: each cell's digest must equal its digest there",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("kvcert_target"):
        config.addinivalue_line("markers", "kvcert: a kvcert certification cell (pytest --kvcert-target)")


def cell_id(config: CacheConfig) -> str:
    """A cell's test id: page size, policy, then the tiers as the certificate names them (`device` for none).
    pytest's `-k` grammar has no `=`, hence `page_size:4`."""
    from kvcert.conformance.certification.certify import _tier

    return f"page_size:{config.page_size}-{config.policy}-{_tier(config) or 'device'}"


@pytest.hookimpl(tryfirst=True)  # before `-k`/`-m` deselect, so they select among the cells too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    target: Optional[str] = config.getoption("kvcert_target")
    if not target:
        return
    items.extend(session.genitems(KVCertCells.from_parent(session, name="kvcert", nodeid="kvcert", target=target)))


class KVCertCells(pytest.Collector):
    """The target's cells, in certificate order."""

    def __init__(self, *, target: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target

    def collect(self) -> list[pytest.Item]:
        from dataclasses import replace

        from kvcert.conformance.backend import capabilities_of
        from kvcert.conformance.certification.certify import cells_for, load_factory
        from kvcert.spec import profiles

        factory = load_factory(self.target)
        caps = capabilities_of(factory)
        wanted = self.config.getoption("kvcert_profile")
        if wanted is not None:  # as `certify(profile=...)` does
            caps = replace(caps, profile=profiles.profile(wanted).name)
        configs, _ = cells_for(caps, None, None)
        items: list[pytest.Item] = [
            CellItem.from_parent(self, name=f"test_cell[{cell_id(c)}]", factory=factory, capabilities=caps, cell=c)
            for c in configs
        ]
        items.append(FindingsItem.from_parent(self, name="test_known_findings", factory=factory, capabilities=caps))
        return items


class CellFailed(Exception):
    """A cell broke the spec: its report is the test's whole failure text (no plugin traceback)."""


class CellItem(pytest.Item):
    """One cell: `run_cell` at the session's budget, failing with the cell's report."""

    def __init__(self, *, factory: Factory, capabilities: Capabilities, cell: CacheConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factory, self.capabilities, self.cell = factory, capabilities, cell
        self.add_marker("kvcert")

    def runtest(self) -> None:
        from kvcert.conformance.certification.certify import run_cell

        opt = self.config.getoption
        result = run_cell(
            self.factory,
            self.capabilities,
            self.cell,
            examples=opt("kvcert_examples"),
            steps=opt("kvcert_steps"),
            seed=opt("kvcert_seed"),
            target=opt("kvcert_target"),
            out_dir=Path(opt("kvcert_out")),
        )
        self.user_properties += [("examples", result.examples), ("steps", result.steps), ("digest", result.digest)]
        want = self._certified_digest()
        if result.passed and want is not None and want != result.digest:
            raise CellFailed(
                f"INV-DET-1: this cell's digest {result.digest} differs from the certificate's {want}: the same seed "
                "and budget did not make the same run"
            )
        if result.passed:
            return
        text = f"{result.failure}"
        if result.trace_path:
            text += (
                f"\nminimal trace: {result.trace_len} ops (replay reproduces: {result.reproduced})"
                f"\nsaved: {result.trace_path}  (kvcert replay {result.trace_path})"
            )
        raise CellFailed(text)

    def _certified_digest(self) -> Optional[str]:
        """This cell's digest in the `--kvcert-certificate` given, or None without one. A certificate of another
        seed or budget, or one without this cell, is a usage error."""
        import json

        from kvcert.conformance.certification.certificate import config_name
        from kvcert.conformance.certification.reports import cell_name

        path = self.config.getoption("kvcert_certificate")
        if path is None:
            return None
        body = json.loads(Path(path).read_text())
        opt = self.config.getoption
        ours = (opt("kvcert_target"), opt("kvcert_seed"), opt("kvcert_examples"), opt("kvcert_steps"))
        theirs = (body.get("target"), body.get("seed"), body.get("examples"), body.get("steps"))
        if ours != theirs:
            raise pytest.UsageError(
                f"--kvcert-certificate {path} is of (target, seed, examples, steps) {theirs}, not {ours}"
            )
        for cell in body.get("cells", []):
            if cell_name(cast("CellResult", SimpleNamespace(**cell))) == config_name(self.cell):
                return str(cell.get("digest", ""))
        raise pytest.UsageError(f"--kvcert-certificate {path} has no cell {config_name(self.cell)}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, CellFailed):
            return str(excinfo.value)  # the headline (`reportinfo`) names the cell
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, Optional[int], str]:
        return self.path, None, f"kvcert cell {cell_id(self.cell)}"


class FindingsItem(pytest.Item):
    """The target's logged findings (`conformance.certification.known`), replayed as `kvcert certify` replays them before its
    cells: one that still reproduces fails this test, as it makes the certificate NOT CERTIFIED."""

    def __init__(self, *, factory: Factory, capabilities: Capabilities, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factory, self.capabilities = factory, capabilities
        self.add_marker("kvcert")

    def runtest(self) -> None:
        from kvcert.conformance.certification.known import replay_findings

        judged = replay_findings(self.config.getoption("kvcert_target"), self.factory, self.capabilities)
        self.user_properties += [(f"{j.finding.id} {j.trace}", j.summary) for j in judged]
        still = [j for j in judged if j.reproduced]
        if still:
            raise CellFailed("\n".join(f"known finding {j.finding.id} ({j.trace}): {j.summary}" for j in still))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, CellFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, Optional[int], str]:
        return self.path, None, "kvcert known findings"
