"""`kvcert.spec.admission`: plans as a pure function of a counters record, checked input, fewest retractions."""

from __future__ import annotations

import itertools
import random
from dataclasses import FrozenInstanceError, replace

import pytest

from kvcert.gpu.cache import GpuCache
from kvcert.spec.admission import AdmissionCounters, fewest_covering, plan_admission
from kvcert.spec.types import AdmissionPlan, AdmissionProfile, CacheConfig, InvalidCount, InvalidPlan, Running

C = AdmissionCounters(page_size=4, layers=2, high_threshold=1, free=8, evictable=16, held_high=8, host_free=8)


def test_a_request_that_fits_evicts_only_its_shortfall() -> None:
    assert plan_admission(C, 8, 0, (), None) == AdmissionPlan(True, 0, False, (), (), 2, 8)
    assert plan_admission(C, 14, 0, (), None) == AdmissionPlan(True, 8, False, (), (), 2, 16)  # pages: 16
    assert plan_admission(C, 17, 0, (), None) == AdmissionPlan(False, allow_high=False)  # HIGH_REF is out of scope
    assert plan_admission(C, 17, 1, (), None) == AdmissionPlan(True, 12, True, (), (), 2, 20)


def test_a_high_request_retracts_the_fewest_low_ones_and_keeps_what_the_host_holds() -> None:
    running = (Running(1, 0, 5), Running(2, 0, 9), Running(3, 5, 40), Running(4, 0, 3))
    plan = plan_admission(C, 36, 1, running, None)  # short 36 - 8 - 16 = 12: the 9, then the 3 closes it
    assert plan == AdmissionPlan(True, 16, True, (2, 4), (False, True), 2, 36)  # 12 host slots for the 9: no
    assert plan_admission(replace(C, host_free=12), 36, 1, running, None).keep == (True, False)
    assert plan_admission(C, 36, 0, running, None) == AdmissionPlan(False)  # a low request never retracts


def test_a_profile_buys_partial_residency() -> None:
    cheap = AdmissionProfile(load=1, store=1, step=10, target=10 + 2 * 40)
    plan = plan_admission(replace(C, evictable=0, held_high=0), 40, 0, (), cheap)
    assert (plan.fits, plan.layers, plan.slots) == (False, 0, 0)  # 1 layer needs 20 slots; 8 free
    plan = plan_admission(replace(C, evictable=12, held_high=0), 40, 0, (), cheap)
    assert (plan.fits, plan.layers, plan.slots, plan.evict) == (True, 1, 20, 12)
    dear = replace(cheap, target=10)
    assert not plan_admission(replace(C, evictable=12, held_high=0), 40, 0, (), dear).fits


@pytest.mark.parametrize(
    "args, error",
    [
        ((-1, 0, (), None), InvalidPlan),
        ((True, 0, (), None), InvalidPlan),
        ((1, "hi", (), None), InvalidCount),
        ((1, 0, [(1, 0, 1)], None), InvalidPlan),
        ((1, 0, (Running(1, 0, 1), Running(1, 0, 2)), None), InvalidPlan),
        ((1, 0, (), AdmissionProfile(1, -1, 1, 1)), InvalidPlan),
        ((1, 0, (), (1, 1, 1, 1)), InvalidPlan),
    ],
)
def test_malformed_requests_raise(args: tuple, error: type[Exception]) -> None:
    with pytest.raises(error):
        plan_admission(C, *args)


def test_fewest_covering_is_minimal_and_ordered_as_the_spec_says() -> None:
    rng = random.Random(1)
    for _ in range(300):
        low = [Running(i, 0, rng.randrange(1, 12)) for i in range(rng.randrange(6))]
        short = rng.randrange(1, 30)
        picks = fewest_covering(low, short)
        sizes = [
            k
            for k in range(1, len(low) + 1)
            if any(sum(r.tokens for r in c) >= short for c in itertools.combinations(low, k))
        ]
        if not sizes:
            assert picks is None
            continue
        assert picks is not None and len(picks) == sizes[0] and sum(r.tokens for r in picks) >= short
        by_size = sorted(low, key=lambda r: (-r.tokens, r.id))
        assert picks[:-1] == by_size[: len(picks) - 1]


def test_counters_are_a_frozen_snapshot_of_the_cache() -> None:
    cache = GpuCache(CacheConfig(page_size=2, capacity=16, kv_layers=3, high_priority_threshold=2))
    slots = cache.alloc(4)
    cache.insert(None, (1, 2, 3, 4), slots)
    plan = cache.plan_admission(14, 2, (), None)
    c = AdmissionCounters(page_size=2, layers=3, high_threshold=2, free=12, evictable=4, held_high=0, host_free=0)
    assert plan == plan_admission(c, 14, 2, (), None) == AdmissionPlan(True, 2, True, (), (), 3, 14)
    with pytest.raises(FrozenInstanceError):
        c.free = 0  # type: ignore[misc]
