"""The suite's power: every mutant in the zoo is killed, the unmodified model passes."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from kvcert.conformance import zoo
from kvcert.conformance.driver import ConformanceFailure, run_trace
from kvcert.spec.ops import Op
from kvcert.spec.types import CacheConfig

EXAMPLES, STEPS, SEED = 600, 50, 0  # kvcert selftest's defaults


def test_every_edit_applies_once() -> None:
    for mutant in zoo.MUTANTS:
        zoo.build(mutant)  # raises if an edit no longer matches exactly once
    assert len(zoo.MUTANTS) >= 10
    assert len({m.name for m in zoo.MUTANTS}) == len(zoo.MUTANTS)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bool, int]]:
    out = tmp_path_factory.mktemp("zoo")
    result = {}
    for mutant in zoo.MUTANTS:
        cert = zoo.run_mutant_isolated(mutant, examples=EXAMPLES, steps=STEPS, seed=SEED, out_dir=out)
        failing = [c for c in cert.cells if not c.passed]
        result[mutant.name] = (bool(failing), failing[0].trace_len if failing else 0)
        if failing:
            assert failing[0].reproduced, f"{mutant.name}: saved trace does not replay"
    return result


def test_every_mutant_is_killed(verdicts: dict[str, tuple[bool, int]]) -> None:
    survivors = [name for name, (killed, _) in verdicts.items() if not killed]
    assert survivors == []


def test_counterexamples_are_short(verdicts: dict[str, tuple[bool, int]]) -> None:
    lengths = [n for killed, n in verdicts.values() if killed]
    assert statistics.median(lengths) <= 12


def test_unmodified_model_passes_the_same_cells(tmp_path: Path) -> None:
    assert zoo.run_control(examples=EXAMPLES, steps=STEPS, seed=SEED, out_dir=tmp_path).passed


def test_failed_store_visible_is_caught_by_its_trace() -> None:
    """A failed storage write must stay invisible: the mutant that indexes it is caught at the prefetch.

    Generation kills it too (it is in the zoo); this trace pins down why, in ten ops."""
    from kvcert.conformance.driver import ConformanceFailure, run_trace
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


def _directed_failure(mutant: zoo.Mutant, config: CacheConfig, ops: list[Op]) -> ConformanceFailure:
    """The unmodified model passes the trace; the mutant breaks a rule on it (the failure)."""
    run_trace(zoo.refcache.RefCache(config), config, zoo.refcache.RefCache.capabilities, ops)
    factory = zoo.build(mutant)
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(factory(config), config, factory.capabilities, ops)  # type: ignore[attr-defined]
    return failure.value


def test_tier_ignores_ref_counts_is_caught_by_its_trace() -> None:
    """Within a tier, the node fewer sessions hold goes first (SPEC.md §11.3): LRU alone would take
    the older node two sessions share; the mutant that drops refs from the rank does."""
    from kvcert.spec.ops import Evict, Insert, RegisterRef
    from kvcert.spec.types import CacheConfig

    (mutant,) = [m for m in zoo.DIRECTED if m.name == "tier_ignores_ref_counts"]
    config = CacheConfig(page_size=1, capacity=8)
    ops = [
        Insert(None, (1,)),
        Insert(None, (2,)),
        RegisterRef("a", 0, 0),
        RegisterRef("b", 0, 0),
        RegisterRef("c", 1, 0),
        Evict(1),
    ]
    failure = _directed_failure(mutant, config, ops)
    assert failure.step == 5 and "INV-EVICT-4" in str(failure)


def test_demotes_longest_session_is_caught_by_its_trace() -> None:
    """Host pressure demotes the idle high-priority session with the fewest tokens (SPEC.md §11.4)."""
    from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, Poll, RegisterRef
    from kvcert.spec.types import CacheConfig

    (mutant,) = [m for m in zoo.DIRECTED if m.name == "demotes_longest_session"]
    config = CacheConfig(page_size=1, capacity=8, host_capacity=6, write_policy="write_through")
    ops = [
        Insert(None, (1, 1)),  # write-through backs each insert up: copies 0 and 1
        Insert(None, (2, 2, 2)),
        Complete(0),
        Complete(1),
        Poll(),
        RegisterRef("short", 0, 1),
        RegisterRef("long", 1, 1),
        Evict(8),  # both demoted to the host: idle
        EvictHost(2),  # nothing UNUSED or LOW_REF: demote "short" and evict its 2 tokens
    ]
    failure = _directed_failure(mutant, config, ops)
    assert failure.step == 8 and "INV-TIER-5" in str(failure)


def test_demotion_never_restored_is_caught_by_its_trace() -> None:
    """A high-priority session's end gives the latest demoted session its tier back (SPEC.md §11.4)."""
    from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, Match, Poll, RegisterRef, ReleaseRef
    from kvcert.spec.types import CacheConfig

    (mutant,) = [m for m in zoo.DIRECTED if m.name == "demotion_never_restored"]
    config = CacheConfig(page_size=1, capacity=8, host_capacity=6, write_policy="write_through")
    ops = [
        Insert(None, (1, 1)),
        Complete(0),
        Poll(),
        RegisterRef("idle", 0, 1),
        Match(None, (9,)),  # a miss: its handle is the root
        RegisterRef("busy", 4, 1),  # high, holds nothing on the host: never idle
        Evict(8),  # "idle" is on the host only now
        EvictHost(2),  # nothing UNUSED or LOW_REF: "idle" is demoted and its copy evicted
        ReleaseRef("busy"),  # a high session ends: "idle" is high again
    ]
    failure = _directed_failure(mutant, config, ops)
    assert failure.step == 8 and "INV-TIER-5" in str(failure)


def test_write_acks_drained_on_one_path_is_caught_by_its_trace() -> None:
    """Write acks are consumed whether or not a load is pending (SPEC.md §9.8): the shrunk seed-0 trace."""
    from kvcert.spec.ops import Complete, Evict, Insert, LoadBack, Match, Poll
    from kvcert.spec.types import CacheConfig

    (mutant,) = [m for m in zoo.DIRECTED if m.name == "write_acks_drained_on_one_path"]
    config = CacheConfig(page_size=1, capacity=6, host_capacity=24, write_policy="write_through")
    ops = [Insert(None, (1,)), Complete(0), Poll(), Evict(1), Insert(None, (0,)), Match(None, (1,)), LoadBack(5)]
    failure = _directed_failure(mutant, config, ops)
    assert "INV-COPY-1" in str(failure)


def test_acks_out_of_order_is_caught_by_its_trace() -> None:
    """Acks are consumed in issue order (SPEC.md §9.8): the shrunk trace of a generated kill."""
    from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, Poll
    from kvcert.spec.types import CacheConfig

    (mutant,) = [m for m in zoo.DIRECTED if m.name == "acks_out_of_order"]
    config = CacheConfig(page_size=1, capacity=6, host_capacity=24, write_policy="write_through")
    ops = [
        Insert(None, (0,)),
        Complete(0),
        Poll(),
        Evict(1),
        EvictHost(1),
        Insert(None, (1,)),
        Insert("lora-a", (0,)),
        Insert(None, (0,)),
        Complete(3),
        Poll(),
    ]
    failure = _directed_failure(mutant, config, ops)
    assert "INV-COPY-2" in str(failure)
