"""Core relations and engine profiles (SPEC.md §6): the split is real, in both directions.

The reference model run another correct way (`kvcert.refimpl:alternative`: rank-order host eviction,
failed write copies invalidated) passes the core and fails the sglang-0.5.23 profile; the model
passes both. A mutant that only breaks a pinned choice (LFU metadata) is killed under the profile and
certified under the core. And each core rule in `ALONE` kills a mutant that no other rule catches:
with that one checker dropped, the mutant's recorded counterexample passes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvcert.conformance import zoo
from kvcert.conformance.adapters.sglang import radix as sglang_radix  # noqa: F401  (declares its profile without SGLang)
from kvcert.conformance.certification.certify import certify, core_verdict, load_factory
from kvcert.conformance.certification.replay import judged_as, replay_fails
from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
from kvcert.refimpl import RefCache, alternative, factory
from kvcert.spec import profiles
from kvcert.spec import storage as l3
from kvcert.spec.decisions import Batch, Decisions, Demote, LoadRoom, Throttle
from kvcert.spec.ops import (
    Checkpoint,
    CheckPrefetch,
    Complete,
    Evict,
    EvictHost,
    Fetch,
    Finish,
    InjectFault,
    Insert,
    LoadBack,
    Match,
    Op,
    Poll,
    Prefetch,
    Publish,
    RegisterRef,
    ReleaseRef,
    Start,
    StorageFault,
    Trace,
)
from kvcert.spec.types import CacheConfig, Capabilities, Snapshot

ZOO = (Path(__file__).parent / "corpus" / "zoo", Path(__file__).parent / "profiles")
"""The zoo's recorded counterexamples (the same-verdict corpus), and those of mutants added since."""

RECLAIM_TRACE = (
    CacheConfig(
        page_size=1, policy="lru", capacity=6, host_capacity=24, write_policy="write_back", load_back_threshold=1
    ),
    [Insert("lora-a", (1, 2, 1)), Evict(1), Insert("lora-a", (1,)), EvictHost(2)],
)
"""A host-only node split by an insert leaves a duplicate backup (1,) and a host-only leaf (2, 1): SGLang
drops the duplicate first, the alternative takes the older leaf first."""

RETRY_TRACE = (
    CacheConfig(
        page_size=1, policy="lru", capacity=6, host_capacity=6, write_policy="write_through", load_back_threshold=1
    ),
    [
        InjectFault("copy"),
        Insert(None, (1, 2, 3)),
        Complete(0),
        Poll(),
        Insert(None, (1, 2, 3, 4)),
        Evict(6),
        Match(None, (1, 2, 3)),
    ],
)
"""A write-through copy fails: SGLang keeps it pending, the alternative gives the backup up."""

ROOM_TRACE = (
    CacheConfig(
        page_size=1,
        policy="lru",
        capacity=8,
        host_capacity=6,
        write_policy="write_through",
        prefetch_policy="best_effort",
    ),
    [
        *(Insert(None, (t,)) for t in (5, 6, 7, 8)),
        *(Complete(i) for i in range(4)),  # the write copies, then the store copies they start
        Poll(),
        *(Complete(i) for i in range(4, 8)),
        Poll(),
        Evict(4),  # four host-only leaves, two host slots free
        Publish(None, (1, 2, 3)),
        Match(None, (1, 2, 3)),
        Prefetch(16),  # three stored pages do not fit
        CheckPrefetch(0),
    ],
)
"""A prefetch of three pages finds two host slots: SGLang host-evicts three leaves, the alternative one."""

BATCH_TRACE = (
    CacheConfig(
        page_size=1,
        policy="lru",
        capacity=6,
        host_capacity=24,
        write_policy="write_through_selective",
        prefetch_policy="best_effort",
    ),
    [Start(None, (2, 1, 1, 1), 0), Checkpoint(0), Match(None, (2,)), Finish(0, True), Complete(0), Complete(1), Poll()],
)
"""A request's match splits its checkpointed node, and its finish writes both halves: SGLang as one write copy and
then one store copy per node, the alternative one write copy per node, deepest first."""

DEMOTE_TRACE = (
    CacheConfig(
        page_size=1,
        capacity=8,
        host_capacity=3,
        write_policy="write_through",
        high_priority_threshold=1,
        load_back_threshold=1,
    ),
    [
        *(Insert(None, (1,)), Complete(0), Poll(), Insert(None, (2,)), Complete(1), Poll(), Insert(None, (3,))),
        *(Evict(2), RegisterRef("a", 0, 1), RegisterRef("b", 3, 1), RegisterRef("c", 6, 1)),
        *(EvictHost(1), EvictHost(1), ReleaseRef("c")),
    ],
)
"""Host pressure demotes idle high sessions a, then b; releasing high session c restores one: the spec's latest (b),
the alternative's earliest (a)."""

MOVE_TRACE = (DEMOTE_TRACE[0], [*DEMOTE_TRACE[1][:-1], RegisterRef("c", 6, 1)])
"""As DEMOTE_TRACE, but high session c is registered again (moved) instead of released: SGLang restores nobody, the
alternative counts the move as c's release and restores a (the RefAware fork's composed move, H9)."""

LOAD_TRACE = (
    CacheConfig(page_size=1, capacity=8, host_capacity=8, write_policy="write_through"),
    [Insert(None, (1,)), Complete(0), Poll(), Evict(1), Match(None, (1,)), LoadBack(4)],
)
"""A load back in flight: SGLang keeps the node's host copy host-locked until the ack, the alternative leaves it to
the load's own pins (the RefAware fork's H1)."""

BACKUP_ROOM_TRACE = (
    CacheConfig(page_size=1, capacity=2, host_capacity=3, write_policy="write_through"),
    [
        *(Insert(None, (1,)), Complete(0), Poll(), Evict(1)),
        *(Insert(None, (2,)), Complete(1), Poll(), Evict(1)),
        Insert(None, (3, 3)),
    ],
)
"""A write-through backup of 2 tokens finds 1 host slot free: SGLang host-evicts the shortfall (one host-only leaf),
the alternative its whole size (both; the RefAware fork's H12)."""

H7 = Trace.from_json(
    (Path(__file__).parent.parent / "conformance" / "findings" / "refaware" / "H7-load-back-scope.json").read_text()
)
FETCH_TRACE = (
    CacheConfig(capacity=8, host_capacity=8, write_policy="write_through", prefetch_policy="best_effort"),
    [Publish(None, (1, 2, 3)), Match(None, (1, 2, 3)), Prefetch(1), Fetch(0), CheckPrefetch(0)],
)
"""A best-effort prefetch ended after one page of three: SGLang has not seen the batch yet and keeps nothing, the
alternative published the page and keeps it."""

THROTTLE_TRACE = (
    CacheConfig(capacity=8, host_capacity=8, write_policy="write_through", prefetch_policy="wait_complete"),
    [
        Publish(None, (1, 2)),
        Publish(None, (5, 6)),
        Match(None, (1, 2, 3, 4)),
        Prefetch(2),
        Match(None, (5, 6)),
        Prefetch(4),
    ],
)
"""A running prefetch asked for four pages, half the host pool: SGLang declines the next one, the alternative takes
it."""

LOAD_ROOM_TRACE = (H7.config, list(H7.ops))
"""A load back whose room only a high session's nodes can make: SGLang evicts them (the full scope), the alternative
makes room in a low requester's scope and refuses the load (the RefAware fork's H7)."""

WHOLE_LOAD_TRACE = (
    CacheConfig(page_size=1, capacity=4, host_capacity=8, write_policy="write_through"),
    [
        *(Insert(None, (1, 1)), Complete(0), Poll(), Evict(2)),
        *(Insert(None, (2,)), Insert(None, (3,)), Insert(None, (4,)), Complete(1), Complete(2), Complete(3), Poll()),
        *(Match(None, (1, 1)), LoadBack(11)),
    ],
)
"""A load of 2 tokens with 1 device slot free: SGLang evicts its shortfall (one leaf), the alternative its whole size
(two; the RefAware fork's H13)."""

D17 = Trace.from_json((Path(__file__).parent / "traces" / "d17-retraction-reclaims-its-size.json").read_text())
BACKUP_TRACE = (D17.config, list(D17.ops))
"""A retraction backup that does not fit: SGLang host-evicts its whole size (D17), the alternative the shortfall."""


def _verdict(make, caps: Capabilities, config: CacheConfig, ops: list[Op], profile: str) -> set[str]:
    try:
        run_trace(make(config), config, replace(caps, profile=profile), ops)
    except ConformanceFailure as failure:
        return {v.inv for v in failure.violations}
    return set()


def test_backends_declare_their_profiles() -> None:
    assert factory.capabilities.profile == "sglang-0.5.23"  # type: ignore[attr-defined]
    assert load_factory("kvcert.gpu:factory").capabilities.profile == "sglang-0.5.23"  # type: ignore[attr-defined]
    assert sglang_radix.factory.capabilities.profile == "sglang-0.5.23"  # type: ignore[attr-defined]
    assert alternative.capabilities.profile == "core"  # type: ignore[attr-defined]
    assert Capabilities(name="anything").profile == "core"
    assert profiles.SGLANG.pins == {c.id for c in profiles.CHOICES} and not profiles.CORE.pins
    with pytest.raises(ValueError, match="unknown profile 'sglang'"):
        profiles.profile("sglang")


@pytest.mark.parametrize(
    "trace, broken",
    [
        (RECLAIM_TRACE, {"INV-HOST-8"}),
        (RETRY_TRACE, {"INV-HOST-10", "INV-COPY-1"}),
        (ROOM_TRACE, {"INV-TREE-4"}),  # SGLang's prefetch would have removed two more host-only leaves
        (BACKUP_TRACE, {"INV-TREE-4"}),
        (BATCH_TRACE, {"INV-COPY-1"}),
        (DEMOTE_TRACE, {"INV-TIER-5"}),
        (LOAD_TRACE, {"INV-HOST-6", "INV-HOST-11"}),
        (BACKUP_ROOM_TRACE, {"INV-TREE-4"}),
        (MOVE_TRACE, {"INV-TIER-5"}),
        (LOAD_ROOM_TRACE, {"INV-LOAD-1"}),
        (WHOLE_LOAD_TRACE, {"INV-HOST-6", "INV-HOST-10"}),  # its load lock (LOAD_LOCK) differs first
        (FETCH_TRACE, {"INV-PF-3"}),
        (THROTTLE_TRACE, {"INV-PF-2"}),
    ],
    ids=[
        "reclaim",
        "retry",
        "room-prefetch",
        "room-backup",
        "batch",
        "demote",
        "load-lock",
        "room-write-through",
        "demote-move",
        "load-room",
        "load-whole",
        "fetch",
        "throttle",
    ],
)
def test_the_alternative_passes_the_core_and_fails_the_profile(
    trace: tuple[CacheConfig, list[Op]], broken: set[str]
) -> None:
    config, ops = trace
    caps = alternative.capabilities  # type: ignore[attr-defined]
    assert _verdict(alternative, caps, config, ops, "core") == set()
    assert _verdict(alternative, caps, config, ops, "sglang-0.5.23") & broken
    for profile in ("core", "sglang-0.5.23"):
        assert _verdict(factory, factory.capabilities, config, ops, profile) == set()  # type: ignore[attr-defined]


class _WholeLoad(RefCache):
    """Load-back evicts its whole size, not its shortfall (LOAD_ROOM; SGLang 0.5.10's `load_back`)."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config, Decisions(load_room=LoadRoom(ask="whole")))


class _LoadEvictsPastItsSize(_WholeLoad):
    """Load-back evicts everything it can, past its whole size: more than any room choice allows."""

    def load_back(self, node_id: int) -> int:
        self._evict(10_000, None)
        return super().load_back(node_id)


def test_load_back_may_evict_up_to_its_whole_size_under_the_core() -> None:
    config, ops = WHOLE_LOAD_TRACE
    caps = replace(alternative.capabilities, profile="core")  # type: ignore[attr-defined]
    assert _verdict(_WholeLoad, caps, config, ops, "core") == set()
    assert _verdict(_WholeLoad, caps, config, ops, "sglang-0.5.23") & {"INV-HOST-10", "INV-TREE-4"}
    assert _verdict(_LoadEvictsPastItsSize, caps, config, ops, "core") & {"INV-HOST-10", "INV-TREE-4"}


class _PerAck(RefCache):
    """A write ack's nodes stored in one copy, deepest first (another correct cut, BATCH)."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config, Decisions(batch=Batch("per_ack")))


class _StoresOne(_PerAck):
    """The same cut, but a store copy of several nodes keeps only the first: the rest are never stored."""

    def _store(self, nodes):  # type: ignore[no-untyped-def]
        super()._store(nodes[:1])


def test_the_core_takes_any_cut_of_the_same_copies() -> None:
    """Under the core the oracle re-cuts its new copies as the backend did (BATCH): one store copy for a write
    ack's two nodes passes; under sglang-0.5.23 it is INV-COPY-1. A cut that drops a node is not a re-cut."""
    config, ops = BATCH_TRACE
    caps = replace(alternative.capabilities, profile="core")  # type: ignore[attr-defined]
    assert _verdict(_PerAck, caps, config, ops, "core") == set()
    assert "INV-COPY-1" in _verdict(_PerAck, caps, config, ops, "sglang-0.5.23")
    assert "INV-COPY-1" in _verdict(_StoresOne, caps, config, ops, "core")


class _UncountedRoot(RefCache):
    """A restore hands back the root without counting a lock on it, and unlocking the root is a no-op (SGLang's
    own inc/dec_lock_ref stop below the root): correct, as the request's one unlock succeeds."""

    def retraction_restore(self, backup_id, slots):  # type: ignore[no-untyped-def]
        node = super().retraction_restore(backup_id, slots)
        self.root.own_locks -= 1
        return node

    def dec_lock_ref(self, node_id: int) -> None:
        if node_id != self.root.id:
            super().dec_lock_ref(node_id)


def test_a_restore_may_leave_the_root_uncounted() -> None:
    """Seed 003's counterexample (a resumed request's unlock finds nothing to release) passes a cache that does not
    count the root's lock but lets the unlock succeed, under both profiles; the zoo mutant that crashes it does not."""
    trace = Trace.from_json(
        (
            ZOO[0]
            / "kvcert.conformance.zoo_retracted_resume_without_last_node-ps1-lru-write_through+best_effort-seed0.json"
        ).read_text()
    )
    assert any(type(op).__name__ == "Restore" for op in trace.ops)
    for name in ("core", "sglang-0.5.23"):
        caps = replace(factory.capabilities, profile=name)  # type: ignore[attr-defined]
        assert _verdict(_UncountedRoot, caps, trace.config, list(trace.ops), name) == set()
    (mutant,) = [m for m in zoo.MUTANTS + zoo.DIRECTED if m.name == "retracted_resume_without_last_node"]
    make = zoo.build(mutant)
    assert replay_fails(make, make.capabilities, trace)  # type: ignore[attr-defined]


class _ThrottlesAlone(RefCache):
    """Admission declines every prefetch, even one made while no other runs."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config, Decisions(throttle=Throttle(fraction=0.0)))


class _HoldsPastAMiss(RefCache):
    """A failed prefetch does not publish the pages before its miss."""

    def fetch(self, prefetch_id: int) -> None:
        p = self._prefetching(prefetch_id)
        before = p.published
        super().fetch(prefetch_id)
        p.published = before if p.failed else p.published


def test_the_core_bounds_fetch_publishing_and_admission() -> None:
    """Under the core a backend may publish per page or per batch and throttle while others run (the alternative
    does neither, SGLang both); declining with nothing running, or holding progress past a miss, fails."""
    config, ops = THROTTLE_TRACE
    caps = replace(alternative.capabilities, profile="core")  # type: ignore[attr-defined]
    assert "INV-PF-2" in _verdict(_ThrottlesAlone, caps, config, ops[:4], "core")
    config, ops = FETCH_TRACE
    keys = l3.page_keys(None, (1, 2, 3), 1, l3.canonical_digest(1, config.model_id))
    at = sorted(keys).index(keys[1])  # StorageFault names a page by its place among the stored keys, sorted
    faulted = [*ops[:3], Fetch(0), StorageFault("corrupt", at), Fetch(0), CheckPrefetch(0)]
    assert _verdict(factory, caps, config, faulted, "core") == set()
    assert "INV-PF-3" in _verdict(_HoldsPastAMiss, caps, config, faulted, "core")


class _OverEvicts(RefCache):
    """A prefetch that does not fit empties the whole host first: more than any prefetch may ask for."""

    def _prefetch_alloc(self, size: int):  # type: ignore[no-untyped-def]
        self.evict_host(10**6)
        return super()._prefetch_alloc(size)


def test_the_core_bounds_a_prefetchs_host_eviction() -> None:
    """Under the core a prefetch may host-evict anything up to its size (ROOM); evicting past it fails."""
    config, ops = ROOM_TRACE
    caps = replace(alternative.capabilities, profile="core")  # type: ignore[attr-defined]
    assert _verdict(_OverEvicts, caps, config, ops, "core") == {"INV-TREE-4"}


@pytest.mark.parametrize("name", ["room-backup-demotes-a-session", "room-prefetch-write-back-timeout"])
def test_room_is_followed_where_host_pressure_demotes(name: str) -> None:
    """The alternative's shortfall eviction finds nothing to take and demotes an idle high session: the oracle,
    seated on the tokens freed (none), would not have demoted. Where the backend demoted, the harness also tries
    the whole size and the shortfall (the first certification of the alternative under ROOM failed both)."""
    trace = Trace.from_json((Path(__file__).parent / "profiles" / f"{name}.json").read_text())
    assert trace.profile == "core"
    assert not replay_fails(alternative, alternative.capabilities, trace)  # type: ignore[attr-defined]
    assert not replay_fails(factory, replace(factory.capabilities, profile="core"), trace)  # type: ignore[attr-defined]


def test_the_alternative_invalidates_what_it_cannot_keep() -> None:
    """After the failed copy the alternative's node has no backup, its host pool is whole, and the ack releases
    the copy's lock (a given-up copy moves nothing)."""
    config, ops = RETRY_TRACE
    h = run_trace(alternative(config), config, alternative.capabilities, ops[:4], quiesce=False, close=False)  # type: ignore[attr-defined]
    snap = h.backend.snapshot()
    node = next(n for n in snap.nodes if n.id != snap.root)
    assert node.host_slots is None and node.lock_ref == 0 and not snap.pending
    assert len(snap.host_free_slots) == config.host_capacity
    h.close()


def _zoo_trace(mutant: str) -> Trace:
    (path,) = [p for d in ZOO for p in d.glob(f"*zoo_{mutant}-*.json")]
    return Trace.from_json(path.read_text())


def test_a_pinned_choice_is_the_profiles_alone() -> None:
    """LFU that ignores hits changes only the eviction rank: the profile kills it, the core certifies it."""
    trace = _zoo_trace("lfu_ignores_hits")
    mutant = load_factory(trace.target)
    assert replay_fails(mutant, mutant.capabilities, trace)  # type: ignore[attr-defined]
    assert not replay_fails(mutant, mutant.capabilities, replace(trace, profile="core"))  # type: ignore[attr-defined]


ALONE: dict[str, str] = {
    "INV-ACCT-1": "size_units_mismatch",
    "INV-ACCT-2": "protected_counts_locks",
    "INV-ACCT-3": "free_group_left_open",
    "INV-ADMIT-4": "admission_refusal_drops_scope",
    "INV-COPY-1": "split_copy_keeps_suffix",
    "INV-COPY-2": "poll_count_reset_per_queue",
    "INV-ERR-1": "unlock_below_zero",
    "INV-ERR-2": "retracted_resume_without_last_node",
    "INV-EVICT-5": "evict_reports_asked",
    "INV-HANDLE-1": "insert_returns_walk_end",
    "INV-HOST-4": "restore_deferred_host_free",
    "INV-HOST-5": "host_pool_pops_reversed",
    "INV-HOST-8": "evict_host_uncounts_reclaim",
    "INV-HOST-10": "write_back_restore_drops_backup",
    "INV-HOST-11": "split_host_lock_not_segment",
    "INV-INS-1": "insert_prefix_excludes_own_head",
    "INV-KV-1": "load_back_slots_leaf_first",
    "INV-KV-2": "split_host_slices_swapped",
    "INV-KV-3": "restore_reversed",
    "INV-LOAD-1": "load_back_counts_last_node",
    "INV-LOCK-2": "relock_not_counted",
    "INV-MATCH-1": "match_crosses_evicted_node",
    "INV-MATCH-2": "match_slots_out_of_order",
    "INV-MATCH-3": "host_hit_counts_device_part",
    "INV-NS-1": "split_suffix_loses_namespace",
    "INV-NS-2": "handle_index_ignores_namespace",
    "INV-PF-1": "failed_prefetch_frees_reservation_early",
    "INV-PF-2": "prefetch_reports_unshrunk",
    "INV-PF-3": "prefetch_end_counts_fetched",
    "INV-REQ-2": "kv_write_floors_pages",
    "INV-RETRACT-1": "retraction_backup_one_extra",
    "INV-RETRACT-2": "retraction_reclaim_without_retry",
    "INV-SLOT-1": "alloc_cut_off_by_one",
    "INV-SLOT-2": "slot_ids_one_based",
    "INV-SLOT-3": "split_rehomes_prefix",
    "INV-SLOT-4": "alloc_pops_descending",
    "INV-STORE-1": "failed_store_copy_written",
    "INV-TIER-1": "lock_skips_self",
    "INV-TIER-2": "tier_size_drift",
    "INV-TIER-4": "rank_ignores_tiers",
    "INV-TIER-5": "reregister_keeps_priority",
    "INV-TREE-1": "evicted_node_lingers",
    "INV-TREE-4": "insert_no_path_compression",
}
"""Core rule -> a zoo mutant that rule alone kills under the core (its recorded counterexample passes with
that checker dropped). Rules not listed have no such mutant yet: SPEC.md §6.4."""


def _run(trace: Trace, ignore: frozenset[str]) -> set[str]:
    return core_verdict(trace, ignore)[0]


@pytest.mark.parametrize("rule", sorted(ALONE))
def test_a_core_rule_alone_kills_its_mutant(rule: str) -> None:
    trace = _zoo_trace(ALONE[rule])
    assert rule in _run(trace, frozenset())
    assert _run(trace, frozenset({rule})) == set(), f"{ALONE[rule]} is caught by another rule too"


def test_a_crash_is_seen_by_inv_err_3_alone() -> None:
    """A crash ends the step at once, so its checker cannot be dropped and the run go on: INV-ERR-3 earns its place
    by a mutant whose counterexample breaks it and nothing else (an eviction that picks from no candidate)."""
    trace = _zoo_trace("evict_empty_crashes")
    assert _run(trace, frozenset()) == {"INV-ERR-3"}
    assert _run(trace, frozenset({"INV-ERR-3"})) == {"INV-ERR-3"}


def test_the_certificate_names_its_profile_and_its_traces_keep_it(tmp_path: Path) -> None:
    kw = dict(
        examples=60,  # 40 no longer reach the reclaim order it differs in, since retraction joined the host cells
        page_sizes=[1],
        write_policies=["write_back"],
        prefetch_policies=[],
        device_cells=False,
        out_dir=tmp_path,
        fail_fast=True,
    )
    core = certify("kvcert.refimpl:alternative", **kw)  # type: ignore[arg-type]
    assert core.passed and core.profile == "core", [c.failure for c in core.cells]
    pinned = certify("kvcert.refimpl:alternative", profile="sglang-0.5.23", **kw)  # type: ignore[arg-type]
    assert not pinned.passed and pinned.profile == "sglang-0.5.23"
    trace = Trace.from_json(Path(pinned.cells[0].trace_path or "").read_text())
    assert trace.profile == "sglang-0.5.23"
    assert judged_as(alternative.capabilities, trace).profile == "sglang-0.5.23"  # type: ignore[attr-defined]
    assert replay_fails(alternative, alternative.capabilities, trace)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown profile"):
        certify("kvcert.refimpl:alternative", profile="nope", **kw)  # type: ignore[arg-type]


def _reversing(make):  # type: ignore[no-untyped-def]
    """A backend whose every snapshot lists its eviction choices reversed: a report that does not explain the state."""

    def reversed_choices(snap: Snapshot) -> Snapshot:
        return replace(snap, choices=tuple(reversed(snap.choices)))

    def build(config: CacheConfig):  # type: ignore[no-untyped-def]
        backend = make(config)
        shown = backend.snapshot
        backend.snapshot = lambda: reversed_choices(shown())
        return backend

    return build


def test_reported_choices_are_followed_and_held_to_the_state() -> None:
    """Under the core the oracle takes a reporting backend's victims in the reported order: the model's true
    report passes; reversed, the oracle stops after the bigger victim and the tree no longer agrees."""
    config = CacheConfig(page_size=1, policy="lru", capacity=8)
    ops: list[Op] = [Insert(None, (1,)), Insert(None, (2, 2, 2)), Evict(2)]
    caps = replace(factory.capabilities, profile="core")  # type: ignore[attr-defined]
    h = run_trace(RefCache(config), config, caps, ops, quiesce=False, close=False)
    assert [k for k, _ in h.backend.snapshot().choices] == ["evict", "evict"]
    h.close()
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(_reversing(RefCache)(config), config, caps, ops)
    assert "INV-EVICT-4" in {v.inv for v in failure.value.violations}


@pytest.mark.parametrize("target", ["kvcert.gpu:factory", "kvcert.gpu:factory_threaded"])
def test_kvcert_gpu_reports_its_choices_as_the_model_does(target: str) -> None:
    """kvcert.gpu lists its choices like the model (a write-back reclaim, then victims in order; the clock starts
    a new report), its report is followed under the core, and a reversed report fails the step."""
    make = load_factory(target)
    config = CacheConfig(page_size=1, policy="lru", capacity=8, host_capacity=8, write_policy="write_back")
    ops: list[Op] = [Insert(None, (1,)), Insert(None, (2, 2, 2)), Evict(2)]
    caps = replace(make.capabilities, profile="core")  # type: ignore[attr-defined]
    assert caps.reports_choices
    h = run_trace(make(config), config, caps, ops, quiesce=False, close=False)
    o = run_trace(RefCache(config), config, caps, ops, quiesce=False, close=False)
    assert [k for k, _ in h.backend.snapshot().choices] == [k for k, _ in o.backend.snapshot().choices] == ["evict"] * 2
    h.backend.set_clock(99)
    assert h.backend.snapshot().choices == ()
    h.close()
    o.close()
    device = replace(config, host_capacity=0, write_policy="")
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(_reversing(make)(device), device, caps, ops)
    assert "INV-EVICT-4" in {v.inv for v in failure.value.violations}


def test_the_certificate_says_what_the_profile_leaves_open() -> None:
    """Under the core the certificate lists each open choice the backend's declarations make arise, and the
    SGLang choices pinned under every profile; under sglang-0.5.23 no choice is left open."""
    from kvcert.conformance.certification.scope import scope_gaps

    caps = factory.capabilities  # type: ignore[attr-defined]
    core = scope_gaps(replace(caps, profile="core"), [])
    assert [g.split(" ")[1] for g in core if g.startswith("choice ")] == [
        "RANK",
        "RECLAIM",
        "RETRY",
        "ROOM",
        "BATCH",
        "DEMOTE",
        "LOAD_LOCK",
        "LOAD_ROOM",
        "FETCH",
        "THROTTLE",
    ]
    assert sum(g.startswith("pinned under every profile") for g in core) == len(profiles.STILL_PINNED)
    assert not [g for g in scope_gaps(caps, []) if g.startswith("choice ")]
    device_only = scope_gaps(Capabilities(name="device-only"), [])
    assert [g.split(" ")[1] for g in device_only if g.startswith("choice ")] == ["RANK"]
    assert not [g for g in device_only if g.startswith("pinned under every profile")]


class _DemotesNewest(RefCache):
    """Host pressure demotes the newest high session, and a high release restores the earliest demoted one: both
    the backend's to pick under the core (DEMOTE)."""

    def __init__(self, config: CacheConfig) -> None:
        newest = Demote(pick=lambda high: high[-1] if high else None, restore_pick=lambda d: d[0] if d else None)
        super().__init__(config, Decisions(demote=newest))


class _RestoresNone(RefCache):
    """A high release gives its room back to nobody while a session is demoted: the seed's design says it restores
    one, so the core does too."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config, Decisions(demote=Demote(restore_pick=lambda demoted: None)))


class _DemotesTwice(RefCache):
    """Host pressure demotes two high sessions where one was enough: a demotion the core does not allow."""

    def _demote_idle_session(self) -> bool:
        return super()._demote_idle_session() | super()._demote_idle_session()


class _LowMoveRestores(RefCache):
    """A low session registered again restores a demoted one too: no high-priority room came back."""

    def register_ref(self, session_id: str, node_id: int, priority: int) -> None:
        old = self.sessions.get(session_id)
        super().register_ref(session_id, node_id, priority)
        if old is not None and not self._is_high(old):
            self._restore_one(self._restore_pick(self._still_demoted()))


def test_the_core_takes_any_demotion_and_restore_but_not_an_extra_one() -> None:
    config, ops = DEMOTE_TRACE
    caps = factory.capabilities  # type: ignore[attr-defined]
    assert _verdict(_DemotesNewest, caps, config, ops, "core") == set()
    assert "INV-TIER-5" in _verdict(_DemotesNewest, caps, config, ops, "sglang-0.5.23")
    assert "INV-TIER-5" in _verdict(_DemotesTwice, caps, config, ops, "core")
    assert "INV-TIER-5" in _verdict(_RestoresNone, caps, config, ops, "core")  # a release must restore one
    assert _verdict(_RestoresNone, caps, config, MOVE_TRACE[1], "core") == set()  # a move may restore none
    # a move restores only where a high session moved: a low session's move that restores is an extra restore
    low_move = [*ops[:-1], RegisterRef("d", 6, 0), RegisterRef("d", 6, 0)]
    assert _verdict(_LowMoveRestores, caps, config, low_move, "core") >= {"INV-TIER-5"}
    assert _verdict(factory, caps, config, low_move, "core") == set()


FAULT_AFTER_THROTTLE = (
    CacheConfig(
        page_size=4, capacity=24, host_capacity=24, write_policy="write_through", prefetch_policy="best_effort"
    ),
    [
        Publish(None, (0, 0, 0, 1)),
        Match(None, (0, 0, 0, 1, 2, 2, 2, 2, 1, 1, 1, 1)),
        Prefetch(1),
        InjectFault("host_alloc"),
        Match(None, (0, 0, 0, 1)),
        Prefetch(4),
        Prefetch(4),
    ],
)
"""A running prefetch's span is half the host pool. The alternative, which never throttles, takes the second prefetch,
asks storage, and fails on the armed host-allocation fault; SGLang's rule declines it without asking storage, the
fault still armed. Both leave the same snapshot, so only the storage lookup tells the two declines apart: the third
prefetch is the alternative's, and the core must follow its spent fault."""


def test_the_core_tells_a_throttled_prefetch_from_one_that_failed_after_asking_storage() -> None:
    config, ops = FAULT_AFTER_THROTTLE
    caps = alternative.capabilities  # type: ignore[attr-defined]
    assert _verdict(alternative, caps, config, ops, "core") == set()
    assert _verdict(alternative, caps, config, ops, "sglang-0.5.23") & {"INV-PF-2", "INV-PF-3"}
