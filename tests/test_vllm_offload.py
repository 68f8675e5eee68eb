"""vLLM 0.32's CPU offloading manager at its API (`conformance.adapters.vllm.offload`), judged by the offload contract
(`kvcert.spec.offload`): the model itself on hand-made histories (no vLLM), then the unmodified manager CERTIFIED
under lru and arc on a run that reaches evictions beside loads, failed stores, pending lookups and resets with copies
in flight, and each bug planted into vLLM's own manager or policy code (tests/vllm_offload_plants.py) failing under
the rule it breaks, in the cells its code runs in and nowhere else."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _vllm import plant_runs, run_vllm

from kvcert.spec import offload as off
from kvcert.spec.offload import HIT, HIT_PENDING, MISS, OffloadModel, StoreOutcome

# --------------------------------------------------------------------------- the model, without vLLM


def _stored(
    model: OffloadModel, req: str, keys: list[int], chunks: list[int], evicted: tuple[int, ...] = ()
) -> off.Offer:
    """A prepare_store the tier answered as the model expects, taken by the model; returns its offer."""
    offer = model.offer(req, keys)
    outcome = StoreOutcome(offer.new, tuple(chunks), evicted)
    assert off.check_store(model, offer, outcome) == []
    model.apply_store(outcome, req)
    return offer


def _full(policy: str = "lru") -> OffloadModel:
    """Three chunks holding keys 0, 1, 2, ready and unpinned, stored in that order."""
    model = OffloadModel(3, policy)
    model.open("a")
    _stored(model, "a", [0, 1, 2], [0, 1, 2])
    model.complete_store([0, 1, 2], True)
    return model


def test_lookup_follows_a_store_through_writing_ready_failed_and_reset() -> None:
    model = OffloadModel(4)
    model.open("a")
    assert model.lookup(5) == MISS
    _stored(model, "a", [5, 6], [0, 1])
    assert (model.lookup(5), model.lookup(6)) == (HIT_PENDING, HIT_PENDING)
    assert model.complete_store([5], True) == [5] and model.complete_store([6], False) == [6]
    assert (model.lookup(5), model.lookup(6), model.failed) == (HIT, MISS, {6})
    assert off.check_lookup(model, 6, HIT_PENDING)[0].inv == "INV-OFF-1"  # pending after a failure: no deadline
    assert off.check_lookup(model, 5, HIT) == []
    model.reset()
    assert model.lookup(5) == MISS and model.free() == 4


def test_a_store_fails_iff_its_new_keys_exceed_free_and_evictable_chunks_it_was_not_asked_for() -> None:
    model = _full()
    asked_all = model.offer("a", [0, 1, 2, 3])  # every evictable key is asked for: nothing may go
    assert not asked_all.fits and off.check_store(model, asked_all, None) == []
    bad = off.check_store(model, asked_all, StoreOutcome((3,), (0,), (0,)))
    assert {v.inv for v in bad} >= {"INV-OFF-4", "INV-OFF-3"}
    one = model.offer("a", [3])
    assert one.fits and one.need == 1
    assert [v.inv for v in off.check_store(model, one, None)] == ["INV-OFF-4"]
    assert [v.inv for v in off.check_store(model, one, StoreOutcome((3,), (0,), (0, 1)))] == [
        "INV-OFF-4",
        "INV-OFF-LRU-1",
    ]


def test_victims_are_ready_unpinned_and_not_asked_for() -> None:
    model = _full("arc")  # the only candidate is ARC's victim too
    model.prepare_load("a", [0])
    _stored(model, "a", [], [])
    model.complete_load([])
    offer = model.offer("a", [2, 3])
    assert offer.candidates == (1,)
    for victim, why in ((0, "pinned"), (2, "asked"), (9, "absent")):
        found = off.check_store(
            model, offer, StoreOutcome((3,), (model.entries.get(victim, off.Entry(0)).chunk,), (victim,))
        )
        assert "INV-OFF-3" in {v.inv for v in found}, (victim, why)
    assert off.check_store(model, offer, StoreOutcome((3,), (1,), (1,))) == []


def test_a_writing_key_is_never_a_victim() -> None:
    model = OffloadModel(2, "arc")
    model.open("a")
    _stored(model, "a", [0], [0])  # still being written
    _stored(model, "a", [1], [1])
    model.complete_store([1], True)
    offer = model.offer("a", [2])
    assert offer.candidates == (1,)
    assert [v.inv for v in off.check_store(model, offer, StoreOutcome((2,), (0,), (0,)))][:1] == ["INV-OFF-3"]


def test_store_keys_and_chunks() -> None:
    model = OffloadModel(4)
    model.open("a")
    _stored(model, "a", [0], [0])
    offer = model.offer("a", [1, 0, 2])
    assert offer.new == (1, 2)
    assert [v.inv for v in off.check_store(model, offer, StoreOutcome((2, 1), (1, 2), ()))] == ["INV-OFF-2"]
    for chunks in ((1, 1), (1, 4), (0, 1)):  # named twice, outside the pool, still key 0's
        assert [v.inv for v in off.check_store(model, offer, StoreOutcome((1, 2), chunks, ()))] == ["INV-OFF-5"], chunks
    model.entries[3] = off.Entry(0, True)
    assert [v.inv for v in off.check_capacity(model)] == ["INV-OFF-5"]


def test_lru_victims_follow_inserts_touches_and_finishes_but_not_loads() -> None:
    model = _full()  # recency 0 < 1 < 2
    assert model.offer("a", [9]).candidates == (0, 1, 2)
    assert off.lru_victims(*_ranked(model), 2) == [0, 1]
    model.touch([0, 1])  # the first key ends most recent
    assert off.lru_victims(*_ranked(model), 3) == [2, 1, 0]
    model.prepare_load("a", [2])
    model.complete_load([2])  # a load is not a use
    assert off.lru_victims(*_ranked(model), 1) == [2]
    model.open("b")
    model.prepare_load("b", [1])
    model.complete_load([1])
    model.finish("b")  # a finish is: b's keys become the most recent
    assert off.lru_victims(*_ranked(model), 3) == [2, 0, 1]
    model.finish("b")  # once
    assert off.lru_victims(*_ranked(model), 3) == [2, 0, 1]


def _ranked(model: OffloadModel) -> tuple[list[int], list[int]]:
    keys = sorted(model.entries)
    return keys, [model.ranks[k] for k in keys]


def test_a_finish_after_a_reset_ranks_nothing_it_saw_before() -> None:
    model = OffloadModel(4, groups=2)
    model.open("a")
    _stored(model, "a", [1, 2, 3], [0, 1, 2])
    model.complete_store([1, 2, 3], True)
    assert model.requests["a"].seen == [1, 2, 3]
    model.finish("a")  # group 0 first (2), then group 1 in first-seen order (1, 3); the first ends most recent
    assert off.lru_victims(*_ranked(model), 3) == [3, 1, 2]
    model.open("b")
    model.prepare_load("b", [3])
    model.reset()
    model.finish("b")
    assert model.entries == {} and model.ranks == {}


def test_the_threshold_tracker_admits_on_the_second_offer_and_forgets_its_oldest() -> None:
    model = OffloadModel(8, store_threshold=2, max_tracker_size=2)
    model.open("a")
    first = model.offer("a", [1])
    assert first.new == () and first.held == 1
    assert model.offer("a", [1]).new == (1,)
    model.offer("a", [2])
    model.offer("a", [3])  # the tracker is full: 1, the oldest not offered now, leaves it
    assert list(model.counts) == [2, 3]
    assert model.offer("a", [1]).new == ()
    model.reset()
    assert model.counts  # a reset keeps the tracker


def test_events_are_owed_for_completed_stores_and_evictions_only() -> None:
    model = OffloadModel(1)
    model.open("a")
    _stored(model, "a", [0], [0])
    model.complete_store([0], True)
    _stored(model, "a", [1], [0], evicted=(0,))
    model.complete_store([1], False)
    model.reset()
    want = [(False, (0,)), (True, (0,))]
    assert off.check_events(want, model.take_events()) == []
    assert model.take_events() == []
    assert [v.inv for v in off.check_events(want, [(False, (0,))])] == ["INV-OFF-10"]


def test_usage_loads_and_kv() -> None:
    model = _full()
    chunks = model.prepare_load("a", [2, 0])
    assert chunks == [2, 0]
    assert off.check_usage(model, 2, 0, 0, 0) == []  # two pinned
    assert [v.inv for v in off.check_usage(model, 3, 0, 0, 0)] == ["INV-OFF-6"]  # a leaked chunk
    assert [v.inv for v in off.check_load(model, [2, 0], [0, 2], chunks)] == ["INV-OFF-8"]
    good = [off.content(2), off.content(0)]
    assert off.check_kv([2, 0], chunks, good, "load") == []
    assert [v.inv for v in off.check_kv([2, 0], chunks, good[::-1], "load")] == ["INV-OFF-9", "INV-OFF-9"]
    assert len({off.content(k) for k in range(100)}) == 100


def test_shortfall_and_lru_victims() -> None:
    assert [off.shortfall(n, 2) for n in range(5)] == [0, 0, 0, 1, 2]
    assert off.lru_victims([5, 6, 7], [3, 1, 2], 2) == [6, 7]
    assert off.lru_victims([5], [1], 4) == [5] and off.lru_victims([5], [1], -1) == []


def test_arc_evicts_t1_first_until_promotions_and_a_ghost_hit_raise_its_target() -> None:
    model = _full("arc")  # T1 [0, 1, 2], all ready
    assert off.arc_victims(model.arc.t1, model.arc.t2, model.arc.target, [0, 1, 2], 2) == [(0, True), (1, True)]
    model.touch([1, 2])  # ready T1 keys are reused: to T2, the first key newest
    assert (model.arc.t1, model.arc.t2) == ([0], [2, 1])
    offer = model.offer("a", [3])
    assert offer.arc == (0,)  # T1 holds 1 >= int(target) 0: its oldest goes
    found = off.check_store(model, offer, StoreOutcome((3,), (2,), (2,)))
    assert [v.inv for v in found] == ["INV-OFF-ARC-1"], found
    model.apply_store(StoreOutcome((3,), (0,), (0,)), "a")
    assert (model.arc.t1, model.arc.b1) == ([3], [0])
    model.complete_store([3], True)
    model.touch([0])  # a ghost hit in B1: the target rises by max(1, |B2| / |B1|)
    assert model.arc.target == 1 and model.arc.hits == 1
    assert model.offer("a", [4]).arc == (3,)  # T1 holds 1 >= 1
    model.touch([0])
    assert model.arc.target == 2 and model.offer("a", [4]).arc == (2,)  # T1 holds 1 < 2: T2's oldest


def test_arc_a_store_is_not_a_reuse_but_a_load_is() -> None:
    model = OffloadModel(4, "arc")
    model.open("a")
    model.open("b")
    _stored(model, "a", [0, 1], [0, 1])
    model.complete_store([0, 1], True)
    model.touch([5])  # absent and no ghost: nothing moves
    model.prepare_load("b", [1])
    model.complete_load([1])  # a load is not a use until its request finishes
    assert (model.arc.t1, model.arc.t2) == ([0, 1], [])
    model.finish("a")  # a's keys are inserts only: T1's newest, its first key last
    assert (model.arc.t1, model.arc.t2) == ([1, 0], [])
    model.finish("b")  # b reused key 1
    assert (model.arc.t1, model.arc.t2) == ([0], [1])
    _stored(model, "b", [2], [2])  # b is finished: the walk sends nothing after a finish, the model takes it anyway
    model.touch([2])  # a T1 key being written stays in T1
    assert (model.arc.t1, model.arc.t2) == ([0, 2], [1])
    model.complete_store([2], False)  # a failed store leaves no ghost
    assert (model.arc.t1, model.arc.b1, model.arc.b2) == ([0], [], [])


def test_arc_store_misses_hit_a_ghost_once_a_request_and_a_reset_forgets_everything() -> None:
    model = OffloadModel(1, "arc")
    model.open("a")
    _stored(model, "a", [0], [0])
    model.complete_store([0], True)
    _stored(model, "a", [1], [0], evicted=(0,))  # 0 is B1's
    model.complete_store([1], True)
    assert model.arc.b1 == [0] and model.arc.target == 0
    model.open("b")
    model.offer("b", [0])  # a store miss on a B1 ghost: the target rises before the victims are picked
    assert model.arc.target == 1
    model.offer("b", [0])  # the same request's second miss of it is not seen again
    assert model.arc.target == 1
    model.reset()
    assert (model.arc.t1, model.arc.b1, model.arc.target) == ([], [], 0)


def test_arc_victims_and_ghost_target() -> None:
    assert off.arc_victims([1, 2], [3], 0, [1, 2, 3], 3) == [(1, True), (2, True), (3, False)]
    assert off.arc_victims([1, 2], [3], 2.5, [1, 2, 3], 3) == [(1, True), (3, False), (2, True)]
    assert off.arc_victims([1, 2], [3], 3, [2, 3], 2) == [(3, False), (2, True)]  # T1's size counts key 1, pinned
    assert off.arc_victims([1], [3], 0, [3], 2) is None
    assert off.ghost_target(0, 2, 3, True, 8) == 1.5 and off.ghost_target(7.5, 1, 1, True, 8) == 8
    assert off.ghost_target(3, 3, 2, False, 8) == 1.5 and off.ghost_target(0.5, 1, 1, False, 8) == 0


def test_every_rule_the_checkers_file_is_stated() -> None:
    source = (Path(__file__).resolve().parent.parent / "spec" / "offload.py").read_text()
    filed = set(re.findall(r'"(INV-OFF-[A-Z0-9-]+)"', source))
    assert filed == set(off.RULES), filed ^ set(off.RULES)


# --------------------------------------------------------------------------- vLLM's manager, in .venv-vllm

EXAMPLES = 50
PLANTS: dict[str, tuple[set[str], str]] = {
    "arc-evicts-loading": ({"INV-OFF-3"}, "arc"),
    "lru-evicts-asked": ({"INV-OFF-3"}, "lru"),
    "fail-keeps-key": ({"INV-OFF-7"}, ""),
    "fail-leaks-chunk": ({"INV-OFF-6"}, ""),
    "hit-while-pending": ({"INV-OFF-1"}, ""),
    "load-wrong-chunk": ({"INV-OFF-8", "INV-OFF-9"}, ""),
    "lru-touch-reversed": ({"INV-OFF-LRU-1"}, "lru"),
    "events-miss-removal": ({"INV-OFF-10"}, ""),
    "free-count-short": ({"INV-OFF-4"}, ""),
    "evict-double-free": ({"INV-OFF-5", "INV-OFF-6"}, ""),
    "threshold-first-offer": ({"INV-OFF-2"}, "store_threshold2"),
    "arc-touch-no-promotion": ({"INV-OFF-ARC-1"}, "arc"),
    "arc-ghost-no-adapt": ({"INV-OFF-ARC-1"}, "arc"),
    "arc-t2-first": ({"INV-OFF-ARC-1"}, "arc"),
    "arc-finish-promotes-inserted": ({"INV-OFF-ARC-1"}, "arc"),
}
"""Each plant: the rules any of which its certificate must name, and the part of a cell's name its code runs in
("" every cell); a cell without that part must pass."""


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return plant_runs(["tests/vllm_offload_plants.py", str(EXAMPLES), "none", *PLANTS])


def test_the_unmodified_manager_is_certified_on_a_run_that_reaches_the_races(runs: dict[str, dict[str, Any]]) -> None:
    clean = runs["none"]
    assert clean["passed"] and clean["rules"] == [], clean["failures"]
    assert len(clean["cells"]) == 4 and {c.split("-")[1] for c in clean["cells"]} == {"lru", "arc"}
    reached, ops = clean["reached"], clean["ops"]
    assert reached.get("evicted", 0) > 100 and reached.get("evicted_with_loads_in_flight", 0) > 10, reached
    assert reached.get("failed_stores", 0) > 20 and reached.get("pending_lookups", 0) > 100, reached
    assert reached.get("store_refused", 0) > 0 and reached.get("resets_with_copies_in_flight", 0) > 0, reached
    assert ops.get("lookup:HIT_PENDING", 0) > 10 and ops.get("lookup:after-failed-store", 0) > 0, ops
    assert ops.get("kv:reads", 0) > 100 and ops.get("threshold:held", 0) > 0 and ops.get("events:removed", 0) > 0, ops
    assert ops.get("arc:t2-victims", 0) > 10 and ops.get("arc:ghost-hits", 0) > 50, ops
    assert ops.get("arc:target-decided", 0) > 0, ops
    said = " ".join(clean["not_checked"])
    assert "ARC's victim order" not in said and "no step of this run exercised it" not in said


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_bug_fails_under_the_rule_it_breaks(runs: dict[str, dict[str, Any]], plant: str) -> None:
    got = runs[plant]
    rules, where = PLANTS[plant]
    assert not got["passed"] and set(got["rules"]) & rules, got["failures"]
    assert "INV-ERR-3" not in got["rules"], got["failures"]
    assert set(got["rules"]) <= set(off.RULES), got["rules"]
    for cell, broken in got["cells"].items():
        if where and where not in cell.split("-"):
            assert broken == [], (cell, broken)
    assert any(broken for cell, broken in got["cells"].items() if not where or where in cell.split("-"))


def test_the_same_seed_gives_the_same_walks_and_verdicts_in_other_processes(runs: dict[str, dict[str, Any]]) -> None:
    rc, out, stdout = run_vllm(["python", "tests/vllm_offload_plants.py", "same", str(EXAMPLES)])
    assert rc == 0, out[-3000:]
    again = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(again) == 2
    for other in again:
        assert other["digests"] == runs["none"]["digests"] and other["passed"] and other["ops"] == runs["none"]["ops"]
