"""The suite's power: every mutant in the zoo is killed, the unmodified model passes.

The verdicts come from `run_selftest` at `kvcert selftest`'s defaults, the same function the CLI
calls, so the two agree on every verdict (and tests/test_determinism.py shows that what else a
process imported changes nothing).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from kvcert.conformance import zoo
from kvcert.conformance.zoo.selftest import DIRECTED_TRACES, SelftestReport, directed_failure, run_selftest


def test_every_edit_applies_once() -> None:
    for mutant in zoo.MUTANTS + zoo.DIRECTED:
        zoo.build(mutant)  # raises if an edit no longer matches exactly once
    assert len(zoo.MUTANTS) >= 10
    names = [m.name for m in zoo.MUTANTS + zoo.DIRECTED]
    assert len(set(names)) == len(names)


def test_every_directed_mutant_has_its_trace() -> None:
    assert {m.name for m in zoo.DIRECTED} == set(DIRECTED_TRACES)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> SelftestReport:
    return run_selftest(out_dir=tmp_path_factory.mktemp("zoo"), jobs=2)


def test_every_mutant_is_killed(report: SelftestReport) -> None:
    assert [v.name for v in report.generated if not v.killed] == []
    assert len(report.generated) == len(zoo.MUTANTS)


def test_counterexamples_are_short(report: SelftestReport) -> None:
    assert statistics.median(v.trace_len or 0 for v in report.generated) <= 12


def test_unmodified_model_passes_the_same_cells(report: SelftestReport) -> None:
    assert report.control_passed, report.control_failure


def test_directed_mutants_are_killed_by_their_traces(report: SelftestReport) -> None:
    assert [v.name for v in report.directed if not v.by_trace] == []
    assert report.passed


@pytest.mark.parametrize("name", sorted(DIRECTED_TRACES))
def test_directed_trace_breaks_the_rule_it_names(name: str) -> None:
    """The model passes the trace; the mutant breaks the named rule, at the named step where one is given."""
    trace = DIRECTED_TRACES[name]
    failure = directed_failure(name)
    assert trace.invariant in {v.inv for v in failure.violations}, failure
    if trace.step is not None:
        assert failure.step == trace.step, failure


def test_a_selftest_of_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no mutant named"):
        run_selftest(["no_such_mutant"], out_dir=tmp_path)
    with pytest.raises(ValueError, match="no mutant to run"):
        run_selftest([m.name for m in zoo.DIRECTED], directed=False, out_dir=tmp_path)


def test_failed_store_visible_is_caught_by_its_trace() -> None:
    """A failed storage write must stay invisible: the mutant that indexes it is caught at the prefetch.

    Generation kills it too (it is in the zoo); this trace pins down why, in ten ops."""
    from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
    from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, Match, Poll, Prefetch, StorageFault
    from kvcert.spec.types import CacheConfig

    (mutant,) = [m for m in zoo.MUTANTS + zoo.DIRECTED if m.name == "failed_store_visible"]
    factory = zoo.build(mutant)
    config = CacheConfig(
        page_size=1, capacity=6, host_capacity=6, write_policy="write_through", prefetch_policy="wait_complete"
    )
    ops = [
        Insert(None, (1, 2)),
        Complete(0),
        Poll(),  # the write's ack issues store copy 1
        StorageFault("error"),
        Complete(1),  # the store fails: nothing reaches storage
        Poll(),
        Evict(6),
        EvictHost(6),
        Match(None, (1, 2)),
        Prefetch(8),
    ]
    run_trace(zoo.refcache.factory(config), config, factory.capabilities, ops)  # the spec: nothing to prefetch
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(factory(config), config, factory.capabilities, ops)
    assert failure.value.step == 9 and "INV-PF-2" in {v.inv for v in failure.value.violations}
