"""The engine zoo (conformance/zoo/engines.py): every mutant of the reference engine's direct linker and of the
reference decode server is killed under one of its own rules (generation, or its directed trace), and the unmodified
engines pass the same cells and traces.

It runs `run_engine_zoo` at `kvcert engine-zoo`'s defaults, in this process, once for the module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcert.conformance.backend import capabilities_of
from kvcert.conformance.certification.certify import load_factory
from kvcert.conformance.certification.replay import replay_failure
from kvcert.conformance.zoo import engines
from kvcert.conformance.zoo.engines import ENGINE_MUTANTS, EngineMutant, EngineZooReport, build, run_engine_zoo
from kvcert.spec.ops import Trace


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> EngineZooReport:
    return run_engine_zoo(out_dir=tmp_path_factory.mktemp("engine-zoo"))


def test_every_engine_mutant_is_killed_under_its_rules_and_the_engine_passes(report: EngineZooReport) -> None:
    assert not report.control_failure, report.control_failure
    assert report.control_cells and report.control_traces == sum(m.trace is not None for m in ENGINE_MUTANTS)
    survivors = {v.name: (v.generated, v.by_trace, sorted(v.rules)) for v in report.verdicts if not v.killed}
    assert not survivors, survivors
    assert [v.name for v in report.verdicts] == [m.name for m in ENGINE_MUTANTS]
    assert report.passed


def test_every_cache_side_linker_rule_is_broken_by_some_mutant(report: EngineZooReport) -> None:
    """INV-LINK-1..7: each is itself broken, by generation or a directed trace, on some mutant it is a rule of."""
    caught = {r for v in report.verdicts for r in (set(v.generated) | set(v.by_trace)) & v.rules}
    assert {f"INV-LINK-{i}" for i in range(1, 8)} <= caught, caught


def test_every_decode_admission_rule_is_broken_by_some_mutant(report: EngineZooReport) -> None:
    """INV-DEC-1..6 (SPEC.md §15) on mutants of the reference decode server."""
    caught = {r for v in report.verdicts for r in (set(v.generated) | set(v.by_trace)) & v.rules}
    assert {f"INV-DEC-{i}" for i in range(1, 7)} <= caught, caught


def test_a_saved_trace_replays_through_the_zoo_target(report: EngineZooReport) -> None:
    killed = next(v for v in report.verdicts if v.killed_generated and v.trace_path)
    assert killed.trace_path is not None
    trace = Trace.from_json(Path(killed.trace_path).read_text())
    assert trace.target == f"kvcert.conformance.zoo.engines:{killed.name}"
    factory = load_factory(trace.target)  # a fresh build, through the module's __getattr__
    assert capabilities_of(factory).name == f"mutant:{killed.name}"
    failure = replay_failure(factory, capabilities_of(factory), trace.config, list(trace.ops))
    assert failure is not None and {v.inv for v in failure.violations} & killed.rules
    with pytest.raises(AttributeError):
        engines.__getattr__("no_such_mutant")


@pytest.mark.parametrize("find", ["no such text in the engine", "        self.cache.dec_lock_ref"])
def test_an_edit_whose_find_is_not_there_exactly_once_raises(find: str) -> None:
    """Missing (0) or ambiguous (several): a refactor of the engine breaks the zoo loudly."""
    with pytest.raises(AssertionError, match="occurs [0-9]+ times"):
        build(EngineMutant("broken", "nothing", ((find, ""),), frozenset({"INV-LINK-1"})))


def test_a_mutant_of_an_unknown_engine_module_raises() -> None:
    with pytest.raises(AssertionError, match="not one of"):
        build(EngineMutant("elsewhere", "nothing", (), frozenset(), module="engine_nowhere"))


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="no engine mutant named"):
        run_engine_zoo(["no_such_mutant"])
