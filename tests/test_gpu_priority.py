"""kvcert.gpu's priority tiers (SPEC.md §11) on small hand-built states, each step compared with the model.

Every scenario drives a `Twin`: the same calls on `kvcert.gpu` and on the reference model, at the same
logical times, with distinct stamps so that no eviction ties. After every call both answers must be
equal and both states must agree on everything the spec fixes: the tree's paths and residency, locks,
refs, sessions (by path), tier sizes, the size counters and both free counts; the gpu's snapshot must
also pass every state invariant (INV-TIER-1/2 among them). On top of that each test asserts the rule
it is about, so a shared misreading of the spec would still show.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import pytest

from kvcert.conformance.harness import scheduler
from kvcert.gpu import CAPABILITIES, GpuCache, factory
from kvcert.refimpl import RefCache
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.types import (
    HIGH_REF,
    LOW_REF,
    UNUSED,
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    InvalidCount,
    InvalidPlan,
    InvalidScope,
    InvalidSession,
    KVCertError,
    Running,
    Snapshot,
    StaleHandle,
    UnknownSession,
    tier_of,
)

Path = tuple[int, ...]


def paths(snap: Snapshot) -> dict[int, Path]:
    return {n.id: snap.path_of(n.id)[1] for n in snap.nodes}


def canon(snap: Snapshot) -> dict[str, Any]:
    """What the spec fixes about a state, with node ids and slot choices left out."""
    of = paths(snap)
    return {
        "nodes": sorted(
            (of[n.id], n.slots is None, n.host_slots is None, n.lock_ref, n.high_ref, n.low_ref)
            for n in snap.nodes
            if n.id != snap.root
        ),
        "sessions": [(s.id, of[s.node], s.priority, s.high, s.demoted) for s in snap.sessions],
        "tiers": snap.tier_evictable,
        "sizes": (snap.evictable_size, snap.protected_size),
        "free": (len(snap.free_slots), len(snap.host_free_slots)),
        "pending": [(c.kind, c.finished) for c in snap.pending],
        "threshold": snap.high_priority_threshold,
    }


class Twin:
    """The gpu cache and the reference model, driven alike and compared after every call."""

    def __init__(self, capacity: int = 16, host: int = 0, layers: int = 2, **kw: Any) -> None:
        self.config = CacheConfig(
            page_size=1, capacity=capacity, host_capacity=host, kv_layers=layers, high_priority_threshold=1, **kw
        )
        self.gpu: GpuCache = factory(self.config)
        self.ref = RefCache(self.config)
        self.clock = 0
        self.lent = 0
        """Slots the test holds (running requests): INV-ACCT-3 counts only free and tree slots."""

    def lend(self, n: int) -> None:
        for cache in (self.gpu, self.ref):
            cache.alloc(n)
        self.lent += n

    def tick(self) -> None:
        self.clock += 1
        self.gpu.set_clock(self.clock)
        self.ref.set_clock(self.clock)

    def node(self, cache: Any, path: Path) -> int:
        """The node ending at `path` (no side effects: read off a snapshot)."""
        snap = cache.snapshot()
        return next(i for i, p in paths(snap).items() if p == path)

    def check(self) -> None:
        snap = self.gpu.snapshot()
        broken = [v for v in check_snapshot(snap) if not (self.lent and v.inv == "INV-ACCT-3")]
        assert broken == []
        assert canon(snap) == canon(self.ref.snapshot())

    def call(self, name: str, *args: Any, at: Optional[Path] = None) -> Any:
        """`name(*args)` on both sides (`at`: a node by path, passed first); same answer, same state."""
        self.tick()
        outs = []
        for cache in (self.gpu, self.ref):
            full = (self.node(cache, at), *args) if at is not None else args
            try:
                outs.append(getattr(cache, name)(*full))
            except KVCertError as err:
                outs.append(type(err))
        assert outs[0] == outs[1], (name, args, outs)
        self.check()
        return outs[0]

    def put(self, tokens: Sequence[int], priority: int = 0) -> None:
        """The caller's side of an insert on both sides: allocate, insert, free the duplicates."""
        self.tick()
        for cache in (self.gpu, self.ref):
            slots = cache.alloc(len(tokens))
            out = cache.insert(None, list(tokens), slots, priority)
            cache.free(slots[: out.prefix_len])
        self.check()

    def register(self, session: Any, path: Path, priority: Any) -> Any:
        self.tick()
        outs = []
        for cache in (self.gpu, self.ref):
            try:
                outs.append(cache.register_ref(session, self.node(cache, path), priority))
            except KVCertError as err:
                outs.append(type(err))
        assert outs[0] == outs[1]
        self.check()
        return outs[0]

    def settle(self) -> None:
        """Finish every copy and consume every ack on both sides."""
        self.tick()
        for cache in (self.gpu, self.ref):
            scheduler.settle(cache)
        self.check()

    def refs(self, path: Path) -> tuple[int, int]:
        n = self.gpu.snapshot().by_id()[self.node(self.gpu, path)]
        return n.high_ref, n.low_ref

    def tier(self, path: Path) -> int:
        return tier_of(*self.refs(path))

    def live(self) -> set[Path]:
        return {p for p in paths(self.gpu.snapshot()).values() if p}

    def session_paths(self) -> dict[str, Path]:
        snap = self.gpu.snapshot()
        of = paths(snap)
        return {s.id: of[s.node] for s in snap.sessions}


def test_gpu_declares_priority_refs() -> None:
    assert CAPABILITIES.priority_refs and CAPABILITIES.strict_input


# --------------------------------------------------------------------------- refs (§11.1)


def test_refs_follow_sessions_through_a_split_and_priority_changes() -> None:
    t = Twin()
    t.put([1, 2, 3, 4])
    t.register("hi", (1, 2, 3, 4), 5)
    t.register("lo", (1, 2, 3, 4), 0)
    t.put([1, 2, 9])  # splits (1,2,3,4) at 2: the new head lies on both paths and takes their refs
    assert t.refs((1, 2)) == (1, 1) and t.refs((1, 2, 3, 4)) == (1, 1) and t.refs((1, 2, 9)) == (0, 0)
    assert t.session_paths() == {"hi": (1, 2, 3, 4), "lo": (1, 2, 3, 4)}  # the suffix keeps its sessions
    t.call("match_prefix", None, [1, 2, 3])  # a split of the suffix: three nodes on the path now
    assert t.refs((1, 2, 3)) == (1, 1)
    t.call("release_ref", "hi")
    assert [t.tier(p) for p in [(1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 9)]] == [LOW_REF] * 3 + [UNUSED]
    t.call("update_ref", "lo", 3)
    assert t.tier((1, 2, 3, 4)) == HIGH_REF
    t.register("lo", (1, 2, 9), 0)  # re-registered: moved to the other branch, to the end of the order
    assert t.refs((1, 2, 3, 4)) == (0, 0) and t.refs((1, 2)) == (0, 1) and t.refs((1, 2, 9)) == (0, 1)


def test_registration_order_and_re_registration() -> None:
    t = Twin()
    t.put([1, 2])
    for name in ("a", "b", "c"):
        t.register(name, (1, 2), 0)
    t.register("a", (1, 2), 1)  # again: "a" moves to the end
    assert [s.id for s in t.gpu.snapshot().sessions] == ["b", "c", "a"]
    t.call("release_ref", "b")
    assert [s.id for s in t.gpu.snapshot().sessions] == ["c", "a"]
    assert t.refs((1, 2)) == (1, 1)


def test_a_dropped_leaf_hands_its_sessions_to_the_surviving_parent() -> None:
    t = Twin()
    t.put([1, 2])
    t.put([1, 2, 3])
    t.register("s", (1, 2, 3), 0)
    t.register("u", (1, 2, 3), 2)
    assert t.call("evict", 1) == 1  # the leaf (3), HIGH_REF, is the only candidate: it goes
    assert t.session_paths() == {"s": (1, 2), "u": (1, 2)}
    parent = t.gpu.nodes[t.node(t.gpu, (1, 2))]
    assert parent.ending is not None and set(parent.ending) == {"s", "u"}  # the index moved with them
    assert t.refs((1, 2)) == (1, 1)
    assert t.call("evict", 2) == 2  # the last node goes: both sessions hold the root's empty path
    assert t.session_paths() == {"s": (), "u": ()}
    t.call("release_ref", "u")
    t.call("release_ref", "s")
    assert t.gpu.snapshot().tier_evictable == (0, 0, 0)


def test_host_eviction_and_a_subtree_drop_move_sessions_up() -> None:
    t = Twin(capacity=8, host=8)
    t.put([1, 1])
    t.put([1, 1, 2, 2])
    t.settle()  # write-through backed both up
    t.register("s", (1, 1, 2, 2), 0)
    assert t.call("evict", 2) == 2  # the leaf is demoted to host: refs stay
    assert t.refs((1, 1, 2, 2)) == (0, 1)
    assert t.call("evict_host", 2) == 2  # LOW_REF host leaf: host eviction may take it
    assert t.session_paths() == {"s": (1, 1)}
    # write-back: a device node without a backup, dropped with the host-only node below it
    w = Twin(capacity=8, host=8, write_policy="write_back")
    w.put([1, 1])
    w.put([1, 1, 2, 2])
    w.register("deep", (1, 1, 2, 2), 0)
    assert w.call("evict", 2) == 2  # (2,2) backed up synchronously and demoted; (1,1) has no backup
    w.call("inject_fault", "host_alloc")  # (1,1)'s backup fails: it is dropped with its host-only child
    assert w.call("evict", 2) == 2
    assert w.live() == set() and w.session_paths() == {"deep": ()}


def test_tier_sizes_follow_locks_refs_and_residency() -> None:
    t = Twin()
    t.put([1, 2])
    t.put([3, 4, 5])
    t.put([6])
    t.register("hi", (1, 2), 1)
    t.register("lo", (3, 4, 5), 0)
    assert t.gpu.snapshot().tier_evictable == (1, 3, 2)
    t.call("inc_lock_ref", at=(3, 4, 5))
    assert t.gpu.snapshot().tier_evictable == (1, 0, 2)
    t.call("release_ref", "hi")
    assert t.gpu.snapshot().tier_evictable == (3, 0, 0)
    t.call("dec_lock_ref", at=(3, 4, 5))
    assert t.gpu.snapshot().tier_evictable == (3, 3, 0)
    t.call("update_ref", "lo", 7)
    assert t.gpu.snapshot().tier_evictable == (3, 0, 3)


# --------------------------------------------------------------------------- scoped eviction (§11.3)


def test_scoped_eviction_goes_tier_by_tier_and_spares_the_rest() -> None:
    t = Twin()
    t.put([1])  # oldest: LRU alone would take it first
    t.put([2])
    t.put([3])
    t.register("hi", (1,), 1)
    t.register("lo", (2,), 0)
    assert t.call("evict", 1, False, False) == 1  # the UNUSED tier only
    assert t.live() == {(1,), (2,)}
    assert t.call("evict", 5, False, False) == 0  # nothing UNUSED is left
    assert t.call("evict", 5, True, False) == 1  # a low requester: LOW_REF goes, HIGH_REF stays
    assert t.live() == {(1,)}
    assert t.call("evict", 1) == 1  # the next call has the full scope again


def test_within_a_tier_fewer_refs_go_first_then_the_policy() -> None:
    t = Twin()
    t.put([1])  # oldest, but two low sessions hold it
    t.put([2])
    t.put([3])  # newest, one low session
    t.put([4])  # two high sessions
    t.put([5])  # one high session, newest of all
    for name, path, prio in [("a", (1,), 0), ("b", (1,), 0), ("c", (2,), 0), ("d", (3,), 0)]:
        t.register(name, path, prio)
    for name, path in [("e", (4,)), ("f", (4,)), ("g", (5,))]:
        t.register(name, path, 1)
    order = []
    for _ in range(5):
        before = t.live()
        assert t.call("evict", 1) == 1
        (gone,) = before - t.live()
        order.append(gone)
    assert order == [(2,), (3,), (1,), (5,), (4,)]  # LOW_REF by refs then age; HIGH_REF by refs


def test_a_ref_change_re_ranks_the_candidates_on_its_path() -> None:
    t = Twin()
    t.put([1])
    t.put([2])
    t.register("s", (1,), 0)  # (1) LOW_REF: (2) goes first
    t.call("release_ref", "s")  # (1) UNUSED again, and older
    t.register("s", (2,), 0)
    assert t.call("evict", 1) == 1 and t.live() == {(2,)}


def test_load_back_makes_room_with_the_full_scope() -> None:
    t = Twin(capacity=4, host=8)
    t.put([1, 1])
    t.settle()
    t.register("hi", (1, 1), 1)
    assert t.call("evict", 2) == 2  # demoted to the host
    t.put([2, 2])
    t.put([3, 3])
    t.settle()  # their write-through copies no longer lock them
    t.register("hi2", (2, 2), 1)
    t.register("hi3", (3, 3), 1)  # the device is all HIGH_REF now
    assert t.call("evict", 2, True, False) == 0  # a low requester's scope frees nothing
    assert t.call("load_back", at=(1, 1)) == 2  # load-back's own eviction may take HIGH_REF


# --------------------------------------------------------------------------- host pressure (§11.4)


def host_scene() -> Twin:
    """Three idle high sessions on the host only (2, 3 and 2 tokens), and a free device."""
    t = Twin(capacity=8, host=8)
    t.put([1, 1])
    t.put([2, 2, 2])
    t.put([3, 3])
    t.settle()
    t.register("short", (1, 1), 1)
    t.register("long", (2, 2, 2), 1)
    t.register("late", (3, 3), 1)  # as short as "short", registered later
    assert t.call("evict", 8) == 7
    return t


def test_host_pressure_demotes_the_shortest_earliest_idle_session_and_never_evicts_high_directly() -> None:
    t = host_scene()
    assert t.call("evict_host", 1) == 2  # nothing UNUSED or LOW_REF: "short" is demoted, then evicted
    sessions = {s.id: (s.high, s.demoted) for s in t.gpu.snapshot().sessions}
    assert sessions == {"short": (False, True), "long": (True, False), "late": (True, False)}
    assert t.session_paths()["short"] == ()
    assert t.call("evict_host", 1) == 2  # then "late" (2 tokens, registered after "short")
    assert t.call("evict_host", 1) == 3  # then "long"
    assert [s.id for s in t.gpu.snapshot().sessions if s.demoted] == ["short", "long", "late"]
    assert list(t.gpu.demotions) == ["short", "late", "long"]


def test_release_of_a_high_session_restores_the_latest_demotion() -> None:
    t = host_scene()
    t.call("evict_host", 1)  # demotes "short"
    t.call("evict_host", 1)  # demotes "late"
    t.register("other", (), 1)
    t.call("release_ref", "other")  # a high session leaves: "late", the latest demotion, is restored
    assert {s.id: s.demoted for s in t.gpu.snapshot().sessions} == {"short": True, "long": False, "late": False}
    t.call("update_ref", "short", 2)  # an update clears a demotion too
    assert {s.id: s.high for s in t.gpu.snapshot().sessions} == {"short": True, "long": True, "late": True}
    t.call("release_ref", "long")  # nobody left demoted: nothing to restore
    assert not t.gpu.demotions


def test_a_demotion_that_frees_nothing_still_counts() -> None:
    t = Twin(capacity=8, host=8)
    t.put([1, 1])
    t.settle()
    t.register("a", (1, 1), 1)
    t.register("b", (1, 1), 1)  # two high sessions on the same node
    t.call("evict", 2)
    assert t.call("evict_host", 2) == 2  # "a" is demoted (still HIGH_REF through "b"), then "b": then it goes
    assert {s.id: s.demoted for s in t.gpu.snapshot().sessions} == {"a": True, "b": True}


# --------------------------------------------------------------------------- admission (§11.5, §11.6)


def admission_scene(host: int = 0) -> Twin:
    """An 8-token device: 2 tokens UNUSED, 2 LOW_REF, 2 HIGH_REF, 2 free."""
    t = Twin(capacity=8, host=host)
    t.put([1, 1])
    t.put([2, 2])
    t.put([3, 3])
    t.register("lo", (2, 2), 0)
    t.register("hi", (3, 3), 1)
    return t


def test_plan_evicts_within_the_requesters_scope() -> None:
    t = admission_scene()
    assert t.call("plan_admission", 6, 0, (), None) == AdmissionPlan(True, 4, False, (), (), 2, 6)
    assert t.call("plan_admission", 8, 0, (), None) == AdmissionPlan(False, allow_high=False)
    assert t.call("plan_admission", 8, 1, (), None) == AdmissionPlan(True, 6, True, (), (), 2, 8)
    assert t.call("plan_admission", 1, 0, (), None) == AdmissionPlan(True, 0, False, (), (), 2, 1)


def test_plan_retracts_the_fewest_low_requests_with_the_tie_break() -> None:
    t = Twin(capacity=16, host=6)
    running = (Running(0, 0, 4), Running(1, 0, 4), Running(2, 0, 2), Running(3, 0, 2), Running(4, 1, 4))
    t.lend(16)  # they hold the whole device
    # short 6: the largest (4, id 0) alone is not enough; the last pick is the smallest closing the gap: 2, id 2
    plan = t.call("plan_admission", 6, 1, running, None)
    assert plan == AdmissionPlan(True, 0, True, (0, 2), (True, True), 2, 6)
    # short 9: 4 + 4 then the smallest that closes 1 more: 2 (id 2); the 6-slot host keeps the first only
    plan = t.call("plan_admission", 9, 1, running, None)
    assert plan == AdmissionPlan(True, 0, True, (0, 1, 2), (True, False, True), 2, 9)
    assert t.call("plan_admission", 6, 0, running, None).fits is False  # a low request retracts nobody
    assert t.call("plan_admission", 13, 1, running, None).fits is False  # the high request (4) is spared


def test_partial_residency_takes_the_most_layers_the_profile_allows() -> None:
    t = Twin(capacity=8, layers=4)
    t.lend(4)
    assert t.call("plan_admission", 8, 0, (), None).fits is False  # 4 free, 8 needed, no profile
    tight = AdmissionProfile(load=1, store=1, step=10, target=26)  # 2 layers streamed: 10 + 2*8*2 = 42 > 26
    assert t.call("plan_admission", 8, 0, (), tight).fits is False
    roomy = AdmissionProfile(load=1, store=1, step=10, target=42)
    assert t.call("plan_admission", 8, 0, (), roomy) == AdmissionPlan(True, 0, False, (), (), 2, 4)
    free = AdmissionProfile(load=0, store=0, step=0, target=0)  # streaming costs nothing: 3 layers need 6 > 4
    assert t.call("plan_admission", 8, 0, (), free) == AdmissionPlan(True, 0, False, (), (), 2, 4)
    assert t.call("plan_admission", 9, 0, (), free) == AdmissionPlan(True, 0, False, (), (), 1, 3)  # ceil(9/4)
    assert t.call("plan_admission", 17, 0, (), free).fits is False  # even one layer needs 5


def test_planning_changes_nothing() -> None:
    t = admission_scene(host=4)
    before = t.gpu.snapshot()
    t.call("plan_admission", 8, 1, (Running(0, 0, 2),), AdmissionProfile(1, 1, 1, 100))
    after = t.gpu.snapshot()
    assert canon(after) == canon(before) and after.nodes == before.nodes


# --------------------------------------------------------------------------- bad input


BAD_CALLS: list[tuple[str, tuple[Any, ...], type[KVCertError]]] = [
    ("register_ref", (7, 0, 1), InvalidSession),
    ("register_ref", (7, 10_000, 1.5), InvalidSession),  # the session is checked first
    ("register_ref", ("a", 10_000, 1), StaleHandle),
    ("register_ref", ("a", 10_000, 1.5), StaleHandle),  # then the handle
    ("register_ref", ("a", 0, 1.5), InvalidCount),
    ("register_ref", ("a", 0, True), InvalidCount),
    ("update_ref", ("nobody", 1), UnknownSession),
    ("update_ref", ("nobody", 1.5), InvalidCount),  # the priority is checked first
    ("update_ref", ("s", None), InvalidCount),
    ("update_ref", (5, 1), UnknownSession),
    ("release_ref", ("nobody",), UnknownSession),
    ("release_ref", (None,), UnknownSession),
    ("evict", (-1, 1, False), InvalidCount),  # the count is checked before the scope
    ("evict", (1, False, True), InvalidScope),
    ("evict", (1, 1, False), InvalidScope),
    ("evict", (1, True, None), InvalidScope),
    ("plan_admission", (-1, 1.5, (), None), InvalidPlan),  # tokens first
    ("plan_admission", (2.5, 0, (), None), InvalidPlan),
    ("plan_admission", (2, 1.5, (Running(0, 0, -1),), None), InvalidCount),  # then the priority
    ("plan_admission", (2, 0, (Running(0, 0, -1),), None), InvalidPlan),
    ("plan_admission", (2, 0, (Running(0, 0, 1), Running(0, 1, 2)), None), InvalidPlan),
    ("plan_admission", (2, 0, [(0, 0, 1)], None), InvalidPlan),
    ("plan_admission", (2, 0, (), AdmissionProfile(-1, 0, 0, 0)), InvalidPlan),
    ("plan_admission", (2, 0, (), (1, 1, 1, 1)), InvalidPlan),
]


@pytest.mark.parametrize(("name", "args", "error"), BAD_CALLS)
def test_bad_input_raises_the_typed_error_and_changes_nothing(
    name: str, args: tuple[Any, ...], error: type[KVCertError]
) -> None:
    t = admission_scene(host=4)
    t.register("s", (2, 2), 1)
    before = t.gpu.snapshot()
    with pytest.raises(error):
        getattr(t.gpu, name)(*args)
    assert t.gpu.snapshot() == before
    with pytest.raises(error):  # the model agrees on the error
        call = list(args)
        if name == "register_ref" and call[1] == 0:
            call[1] = t.ref.root.id
        getattr(t.ref, name)(*call)


# --------------------------------------------------------------------------- no scans


class CountingDict(dict):  # type: ignore[type-arg]
    """A node table that counts whole-table iterations (as tests/test_gpu_cache.py's)."""

    scans = 0

    def values(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().values()

    def items(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().items()

    def __iter__(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().__iter__()


def test_tier_counters_and_session_calls_never_scan_the_tree() -> None:
    config = CacheConfig(page_size=1, capacity=4096, host_capacity=4096, high_priority_threshold=1)
    cache = factory(config)
    for i in range(1500):
        cache.set_clock(i + 1)
        slots = cache.alloc(3)
        out = cache.insert(None, [i % 7, i, i + 1], slots)
        cache.free(slots[: out.prefix_len])
    while cache.snapshot().pending:
        for c in cache.snapshot().pending:
            cache.complete(c.id)
        cache.poll()
    handles = [cache.match_prefix(None, [k % 7, k, k + 1]).node for k in range(0, 1500, 100)]
    cache.nodes = CountingDict(cache.nodes)
    refreshes = [0]
    original = cache.refresh

    def counted(n: Any) -> None:
        refreshes[0] += 1
        original(n)

    cache.refresh = counted  # type: ignore[method-assign]
    CountingDict.scans = 0
    cache.set_clock(5000)
    for k, h in enumerate(handles):
        cache.register_ref(f"s{k}", h, k % 3)
    cache.update_ref("s0", 2)
    cache.release_ref("s1")
    cache.register_ref("s2", handles[3], 0)
    assert sum(cache.tier_evictable) == cache.evictable_size
    for _ in range(1000):
        assert cache.tier_evictable[0] >= 0  # a counter read, O(1)
    plan = cache.plan_admission(5000, 1, (Running(0, 0, 8),), AdmissionProfile(1, 1, 1, 10**9))
    assert plan.fits
    assert cache.evict(3, allow_low=True, allow_high=False) >= 3
    assert cache.evict(3000, allow_low=False, allow_high=False) > 0
    assert cache.evict(4096, allow_low=True, allow_high=False) > 0
    assert cache.evict(4096) > 0  # the sessions' nodes are on the host only now: they are idle
    assert cache.evict_host(4096) > 0  # host pressure: the idle high sessions are demoted one by one
    assert CountingDict.scans == 0
    assert refreshes[0] < 40 * 1500, refreshes[0]  # O(1) per node touched, no sweep per call
    snap = cache.snapshot()
    assert check_snapshot(snap) == []
    assert any(s.demoted for s in snap.sessions)


def test_session_calls_touch_only_the_path() -> None:
    config = CacheConfig(page_size=1, capacity=4096, high_priority_threshold=1)
    cache = factory(config)
    for i in range(1000):
        slots = cache.alloc(2)
        out = cache.insert(None, [i, i + 1], slots)
        cache.free(slots[: out.prefix_len])
    handle = cache.match_prefix(None, [5, 6]).node
    refreshes = [0]
    original = cache.refresh

    def counted(n: Any) -> None:
        refreshes[0] += 1
        original(n)

    cache.refresh = counted  # type: ignore[method-assign]
    cache.nodes = CountingDict(cache.nodes)
    CountingDict.scans = 0
    cache.register_ref("a", handle, 1)
    cache.update_ref("a", 0)
    cache.release_ref("a")
    assert CountingDict.scans == 0 and refreshes[0] == 3  # one node on the path, once per call
