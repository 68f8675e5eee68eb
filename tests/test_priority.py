"""Priority tiers (SPEC.md §11) in the reference model, and the checkers that judge them.

Each rule is pinned by a small hand-built state; the checkers (`contracts.tier_eviction_violations`,
`host_tier_violations`, `plan_violations`) are shown to accept the model and to flag a broken result.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from _refcache import put, settle

from kvcert.conformance.cli import plain_ops
from kvcert.conformance.harness.driver import run_trace
from kvcert.refimpl import RefCache
from kvcert.spec import contracts
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.ops import Admit, Insert, Match, Op, Trace
from kvcert.spec.types import (
    HIGH_REF,
    LOW_REF,
    UNUSED,
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    Running,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "proactive_vs_lru.json"


def make(capacity: int = 16, host: int = 0, layers: int = 2) -> RefCache:
    return RefCache(
        CacheConfig(page_size=1, capacity=capacity, host_capacity=host, kv_layers=layers, high_priority_threshold=1)
    )


def tiers(cache: RefCache) -> dict[tuple[int, ...], int]:
    return {cache._full_path(n): cache.tier(n) for n in cache.nodes.values() if n is not cache.root}


# --------------------------------------------------------------------------- refs (§11.1)


def test_refs_follow_sessions_through_split_and_release() -> None:
    cache = make()
    leaf = put(cache, [1, 2, 3, 4])
    cache.register_ref("hi", leaf, 5)
    cache.register_ref("lo", leaf, 0)
    put(cache, [1, 2, 9])  # splits (1,2,3,4) at 2: the new head lies on both sessions' paths
    assert tiers(cache) == {(1, 2): HIGH_REF, (1, 2, 3, 4): HIGH_REF, (1, 2, 9): UNUSED}
    head = cache.match_prefix(None, [1, 2]).node
    assert (cache.nodes[head].high_ref, cache.nodes[head].low_ref) == (1, 1)
    cache.release_ref("hi")
    assert tiers(cache)[(1, 2, 3, 4)] == LOW_REF
    cache.update_ref("lo", 3)
    assert tiers(cache)[(1, 2, 3, 4)] == HIGH_REF
    assert check_snapshot(cache.snapshot()) == []


def test_a_deleted_node_moves_its_sessions_to_the_surviving_parent() -> None:
    cache = make()
    put(cache, [1, 2])
    leaf = put(cache, [1, 2, 3])
    cache.register_ref("s", leaf, 0)
    assert cache.evict(1) == 1  # the leaf (3) goes; the session now holds (1, 2)
    (view,) = cache.snapshot().sessions
    assert cache._full_path(cache.nodes[view.node]) == (1, 2)
    assert check_snapshot(cache.snapshot()) == []


def test_tier_sizes_track_locks_and_refs() -> None:
    cache = make()
    a = put(cache, [1, 2])
    b = put(cache, [3, 4, 5])
    cache.register_ref("hi", a, 1)
    cache.register_ref("lo", b, 0)
    assert cache.snapshot().tier_evictable == (0, 3, 2)
    cache.inc_lock_ref(b)
    assert cache.snapshot().tier_evictable == (0, 0, 2)
    cache.release_ref("hi")
    assert cache.snapshot().tier_evictable == (2, 0, 0)


# --------------------------------------------------------------------------- scoped eviction (§11.3)


def test_scope_orders_tiers_and_spares_what_it_does_not_allow() -> None:
    cache = make()
    hi = put(cache, [1])  # oldest: LRU alone would take it first
    lo = put(cache, [2])
    put(cache, [3])
    cache.register_ref("hi", hi, 1)
    cache.register_ref("lo", lo, 0)
    before = cache.snapshot()
    assert cache.evict(3, allow_low=True, allow_high=False) == 2  # UNUSED (3), then LOW_REF (2); HIGH_REF stays
    assert [cache._full_path(n) for n in cache.nodes.values() if n is not cache.root] == [(1,)]
    assert contracts.tier_eviction_violations(before, cache.snapshot(), True, False) == []
    assert cache.scope == (True, True)  # the scope did not outlive the call
    assert cache.evict(1) == 1  # the full scope takes it


def test_fewer_refs_go_first_within_a_tier() -> None:
    cache = make()
    shared = put(cache, [1])  # older, but two sessions hold it
    single = put(cache, [2])
    cache.register_ref("a", shared, 0)
    cache.register_ref("b", shared, 0)
    cache.register_ref("c", single, 0)
    cache.evict(1)
    assert [cache._full_path(n) for n in cache.nodes.values() if n is not cache.root] == [(1,)]


def test_tier_checker_flags_out_of_scope_and_out_of_order_evictions() -> None:
    cache = make()
    hi = put(cache, [1])
    put(cache, [2])
    cache.register_ref("hi", hi, 1)
    before = cache.snapshot()
    cache.evict(1, allow_low=True, allow_high=False)  # the UNUSED (2) goes, as it should
    assert contracts.tier_eviction_violations(before, cache.snapshot(), True, False) == []
    # Had the HIGH_REF node gone instead: out of a low requester's scope, and before an UNUSED candidate.
    gone = before.by_id()[hi]
    wrong = replace(
        before,
        nodes=tuple(n for n in before.nodes if n.id != hi),
        free_slots=tuple(sorted(before.free_slots + (gone.slots or ()))),
    )
    found = {i for i, _ in contracts.tier_eviction_violations(before, wrong, True, False)}
    assert found == {"INV-TIER-3", "INV-TIER-4"}


# --------------------------------------------------------------------------- host pressure (§11.4)


def host_scene() -> RefCache:
    """Two idle high sessions on the host only (2 and 3 tokens), and a free device."""
    cache = make(capacity=8, host=6)
    short = put(cache, [1, 1])
    long = put(cache, [2, 2, 2])
    settle(cache)  # write-through backed both up as they were inserted
    cache.register_ref("short", short, 1)
    cache.register_ref("long", long, 1)
    cache.evict(8)  # both demoted to host
    assert all(n.slots is None for n in cache.nodes.values() if n is not cache.root)
    return cache


def test_host_pressure_demotes_the_shortest_idle_session_first_and_release_restores_it() -> None:
    cache = host_scene()
    before = cache.snapshot()
    assert cache.evict_host(2) == 2  # nothing UNUSED or LOW_REF: demote "short" (2 tokens), then evict it
    after = cache.snapshot()
    demoted = {s.id: s.demoted for s in after.sessions}
    assert demoted == {"short": True, "long": False}
    assert contracts.host_tier_violations(before, after) == []
    cache.register_ref("other", cache.root.id, 1)
    cache.release_ref("other")  # a high session leaves: the most recent demotion is undone
    assert {s.id: s.high for s in cache.snapshot().sessions} == {"short": True, "long": True}
    assert check_snapshot(cache.snapshot()) == []


def test_host_tier_checker_flags_a_high_copy_evicted_without_demotion() -> None:
    cache = host_scene()
    before = cache.snapshot()
    cache.evict_host(2)
    after = cache.snapshot()
    undone = replace(after, sessions=tuple(replace(s, high=True, demoted=False) for s in after.sessions))
    assert [i for i, _ in contracts.host_tier_violations(before, undone)] == ["INV-TIER-4"]


# --------------------------------------------------------------------------- admission (§11.5, §11.6)


def admission_scene(host: int = 0) -> RefCache:
    """An 8-token device: 2 tokens UNUSED, 2 LOW_REF, 2 HIGH_REF, 2 free."""
    cache = make(capacity=8, host=host)
    put(cache, [1, 1])
    lo = put(cache, [2, 2])
    hi = put(cache, [3, 3])
    cache.register_ref("lo", lo, 0)
    cache.register_ref("hi", hi, 1)
    return cache


def check(cache: RefCache, tokens: int, priority: int, running: tuple[Running, ...], profile=None) -> AdmissionPlan:
    plan = cache.plan_admission(tokens, priority, running, profile)
    assert contracts.plan_violations(cache.snapshot(), tokens, priority, running, profile, cache.kv_layers, plan) == []
    return plan


def test_plan_evicts_within_the_requesters_scope() -> None:
    cache = admission_scene()
    assert check(cache, 6, 0, ()) == AdmissionPlan(True, 4, False, (), (), 2, 6)
    assert check(cache, 8, 0, ()).fits is False  # the HIGH_REF pair is out of a low request's reach
    assert check(cache, 8, 1, ()) == AdmissionPlan(True, 6, True, (), (), 2, 8)


def test_plan_retracts_the_fewest_low_requests_by_the_stated_rule() -> None:
    cache = make(capacity=16, host=4)
    running = (Running(0, 0, 3), Running(1, 0, 5), Running(2, 1, 8), Running(3, 0, 2))
    for r in running[:3]:
        cache.alloc(r.tokens)  # they hold their slots: 3 + 5 + 8 fill the device
    plan = check(cache, 6, 1, running[:3])
    # short 6: the largest low request (5) is not enough alone; two are needed: 5, then the smallest closing (3)
    assert (plan.retract, plan.keep) == ((1, 0), (False, True))  # 5 does not fit the 4-slot host; 3 does
    assert check(cache, 6, 0, running[:3]).fits is False  # a low-priority request retracts nobody
    assert check(cache, 20, 1, running[:3]).fits is False  # nothing retractable covers it; high ones are spared


def test_partial_residency_needs_the_profile() -> None:
    cache = make(capacity=8, layers=4)
    cache.alloc(4)
    assert check(cache, 8, 0, ()).fits is False  # 4 free, 8 needed, no profile
    cheap = AdmissionProfile(load=1, store=1, step=10, target=26)  # 2 layers streamed: 10 + 2*8*2 = 42 > 26
    assert check(cache, 8, 0, (), cheap).fits is False
    roomy = AdmissionProfile(load=1, store=1, step=10, target=42)
    assert check(cache, 8, 0, (), roomy) == AdmissionPlan(True, 0, False, (), (), 2, 4)


def test_plan_checker_has_teeth() -> None:
    cache = admission_scene()
    snap = cache.snapshot()
    good = check(cache, 6, 0, ())

    def invs(plan: AdmissionPlan, running: tuple[Running, ...] = (), profile=None) -> set[str]:
        return {i for i, _ in contracts.plan_violations(snap, 6, 0, running, profile, 2, plan)}

    assert invs(replace(good, allow_high=True)) == {"INV-ADMIT-1"}
    assert invs(replace(good, evict=2)) == {"INV-ADMIT-1"}
    assert invs(AdmissionPlan(False)) == {"INV-ADMIT-4"}
    assert "INV-ADMIT-1" in invs(replace(good, retract=(0,), keep=(False,)), (Running(0, 2, 4),))
    tight = AdmissionProfile(1, 1, 0, 1)
    assert "INV-ADMIT-3" in invs(replace(good, layers=1, slots=3), (), tight)


def test_bad_plan_input_changes_nothing() -> None:
    cache = admission_scene()
    before = cache.snapshot()
    for args in [(-1, 0, (), None), (2, 0, (Running(0, 0, -2),), None), (2, 0, (), AdmissionProfile(-1, 0, 0, 0))]:
        with pytest.raises(Exception) as raised:
            cache.plan_admission(*args)
        assert type(raised.value).__name__ == "InvalidPlan"
    assert cache.snapshot() == before


# --------------------------------------------------------------------------- the worked example (docs/priority.md)


def test_worked_example_proactive_keeps_the_agents_prefix_and_lru_loses_it() -> None:
    trace = Trace.from_json(EXAMPLE.read_text())
    hits = {}
    for label, ops in (("proactive", list(trace.ops)), ("plain", plain_ops(trace.ops))):
        matched: dict[int, int] = {}

        def hook(i, op, outcome, matched=matched) -> None:
            if isinstance(op, Match) and op.tokens:
                matched[i] = outcome.length

        run_trace(RefCache(trace.config), trace.config, RefCache.capabilities, ops, hook=hook)
        hits[label] = matched
    assert hits == {"proactive": {7: 4}, "plain": {7: 0}}


def test_plan_checker_flags_retractions_beyond_the_fewest() -> None:
    """INV-ADMIT-2: one low request (5 tokens) covers the shortfall of 4; retracting two is not minimal,
    and retracting the 3-token one alone would not cover it."""
    cache = make(capacity=16)
    running = (Running(0, 0, 3), Running(1, 0, 5))
    for r in running:
        cache.alloc(r.tokens)
    plan = check(cache, 12, 1, running)
    assert (plan.retract, plan.keep) == ((1,), (False,))  # no host tier: discarded
    snap = cache.snapshot()
    too_many = replace(plan, retract=(1, 0), keep=(False, False))
    found = {i for i, _ in contracts.plan_violations(snap, 12, 1, running, None, 2, too_many)}
    assert found == {"INV-ADMIT-2"}


def test_an_eviction_whose_ranks_change_midway_is_judged_by_replay() -> None:
    """A write-back victim's backup needs host room; host pressure demotes the idle high session, so the node
    its path shares drops a tier halfway through the eviction and goes before an older HIGH_REF node
    (SPEC.md §11.4). No order over the ranks before the call explains that; the harness lets the oracle
    re-rank as it goes instead of reporting INV-EVICT-4 against a correct cache (found by a refimpl run)."""
    from kvcert.conformance.harness.driver import run_trace
    from kvcert.refimpl import RefCache
    from kvcert.spec.ops import Evict, Insert, RegisterRef, UpdateRef
    from kvcert.spec.types import CacheConfig

    config = CacheConfig(
        page_size=1, capacity=6, host_capacity=6, write_policy="write_back", prefetch_policy="best_effort"
    )
    ops = [
        Insert(None, (1, 1, 1)),
        Insert(None, (2,)),
        RegisterRef("c", 1, 0),
        UpdateRef("c", 1),
        RegisterRef("a", 0, 1),
        Evict(1),
        Insert(None, (1, 2, 1, 1, 0)),
        Evict(5),
    ]
    h = run_trace(RefCache(config), config, RefCache.capabilities, ops, quiesce=False)
    assert any(s.demoted for s in h.oracle.sessions.values()), "the eviction demoted a session on the way"


class _OtherTies(RefCache):
    """A correct cache that breaks rank ties the other way (the newest node first, not the oldest)."""

    def _pick(self, candidates, choose):  # type: ignore[no-untyped-def]
        if choose is None:
            tied = min(self.rank(n) for n in candidates)
            return max((n for n in candidates if self.rank(n) == tied), key=lambda n: n.id)
        return super()._pick(candidates, choose)


def test_an_admissions_eviction_follows_the_backends_tie_break() -> None:
    """SPEC.md §4.5 leaves tied leaves to the backend: the plan's scoped eviction inside `Admit` is steered to the
    backend's victims among them, as a plain `Evict` is (found on the RefAware fork, whose two tied leaves after a
    split went the other way)."""
    config = CacheConfig(page_size=4, policy="mru", capacity=64, high_priority_threshold=1)
    ops: list[Op] = [
        Insert(None, (2, 2, 2, 2, 1, 1, 1, 1)),
        Insert(None, (2, 2, 2, 2, 2, 2, 2, 2)),
        Admit(54, 0, ((2, 0), (0, 0)), (1, 1, 4, 18)),
    ]
    leaves = []
    for cache in (RefCache(config), _OtherTies(config)):
        h = run_trace(cache, config, RefCache.capabilities, ops, quiesce=False, close=False)
        nodes = h.backend.snapshot().nodes
        parents = {n.parent for n in nodes}
        leaves.append({n.key for n in nodes if n.parent is not None and n.id not in parents})
        h.close()
    assert leaves[0] != leaves[1]  # a real tie, broken two ways, both followed


class _NoMoves(RefCache):
    """The model, as an engine with no move call: a registration of a session off its own path's end raises."""

    capabilities = replace(
        RefCache.capabilities, priority_parts=tuple(p for p in RefCache.capabilities.priority_parts if p != "move")
    )

    def register_ref(self, session_id: str, node_id: int, priority: int) -> None:
        old = self.sessions.get(session_id)
        if old is not None and node_id in self.nodes:  # (a bad handle is the model's to refuse)
            node = self.nodes.get(node_id)
            while node is not None and node is not old.node:
                node = node.parent
            assert node is not None, f"{session_id} moved off its path: the suite sent a move it was not offered"
        super().register_ref(session_id, node_id, priority)


def test_a_backend_without_moves_is_sent_none_and_the_certificate_says_so(tmp_path: Path) -> None:
    """Without the `move` part a session is registered again only at or below its node (its next turn), else
    released first; with it (the model) the same seed moves sessions, and the certificate counts the moves."""
    from kvcert.conformance.certification.certify import certify

    def run(make: type[RefCache]) -> object:
        return certify(
            "kvcert.refimpl:factory",
            factory=make,
            examples=20,
            seed=1,
            page_sizes=[1],
            policies=["priority"],
            out_dir=tmp_path / make.__name__,
        )

    without, model = run(_NoMoves), run(RefCache)
    assert without.passed, [c.failure for c in without.cells if not c.passed]  # type: ignore[attr-defined]
    assert any("priority tiers, move" in g and "not declared" in g for g in without.not_checked)  # type: ignore[attr-defined]
    assert sum(c.ops.get("RegisterRef", 0) for c in without.cells) > 0  # type: ignore[attr-defined]
    assert sum(c.ops.get("event:move", 0) for c in model.cells) > 0  # type: ignore[attr-defined]
    assert not any("priority tiers, move" in g for g in model.not_checked)  # type: ignore[attr-defined]
