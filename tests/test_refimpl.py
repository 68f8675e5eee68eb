"""The reference model's semantics (SGLang `RadixCache`-compatible) and its handling of bad input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.refimpl import RefCache
from kvcert.spec import types
from kvcert.spec.contracts import cached_prefix_len, slot_changes
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.types import (
    AdmissionProfile,
    BadInput,
    CacheConfig,
    InsertOut,
    InvalidCount,
    InvalidPlan,
    InvalidScope,
    InvalidSession,
    InvalidToken,
    KVCertError,
    LengthMismatch,
    LockUnderflow,
    Namespace,
    PoolExhausted,
    Running,
    SlotNotOwned,
    StaleHandle,
    UnalignedKey,
    UnknownCopy,
    UnknownFault,
    UnknownPrefetch,
    UnknownRetraction,
    UnknownSession,
)


def make(page_size: int = 1, policy: str = "lru", capacity: int = 32) -> RefCache:
    return RefCache(CacheConfig(page_size=page_size, policy=policy, capacity=capacity))


def put(cache: RefCache, namespace: Namespace, tokens: list[int], priority: int = 0) -> InsertOut:
    """The caller's side of SGLang's insert: allocate, insert, free the duplicates."""
    slots = cache.alloc(len(tokens))
    out = cache.insert(namespace, tokens, slots, priority)
    cache.free(slots[: out.prefix_len])
    return out


def leaf_keys(cache: RefCache) -> set[tuple[int, ...]]:
    """Full token paths of the current leaves."""
    s = cache.snapshot()
    return {s.path_of(n.id)[1] for n in cache.evictable_leaves()}


def all_paths(cache: RefCache) -> set[tuple[int, ...]]:
    s = cache.snapshot()
    return {s.path_of(n.id)[1] for n in s.nodes if n.id != s.root}


# --------------------------------------------------------------------------- split, match, insert


def test_split_keeps_the_handles_identity_on_the_suffix() -> None:
    cache = make()
    leaf = put(cache, None, [1, 2, 3, 4]).node
    slots = cache.nodes[leaf].slots
    cache.inc_lock_ref(leaf)
    m = cache.match_prefix(None, [1, 2, 9])  # ends inside the edge: split after 2
    assert (m.length, m.slots) == (2, slots[:2])
    head = cache.nodes[m.node]
    assert m.node != leaf and head.key == (1, 2) and head.slots == slots[:2] and head.parent is cache.root
    assert (cache.nodes[leaf].key, cache.nodes[leaf].slots) == ((3, 4), slots[2:])
    assert cache.nodes[leaf].parent is head
    # The handle still names the same cached sequence, and its lock moved with it.
    assert cache.snapshot().path_of(leaf) == (None, (1, 2, 3, 4))
    assert head.lock_ref == 1 and head.own_locks == 0 and cache.nodes[leaf].own_locks == 1
    cache.dec_lock_ref(leaf)
    assert head.lock_ref == 0 and cache.nodes[leaf].lock_ref == 0
    assert (cache.evictable_size, cache.protected_size) == (4, 0)
    assert check_snapshot(cache.snapshot()) == []


def test_match_splits_where_the_match_ends() -> None:
    cache = make()
    leaf = put(cache, None, [1, 2, 3, 4]).node
    free_before = cache.snapshot().free_slots
    full = cache.match_prefix(None, [1, 2, 3, 4, 5])  # runs past the edge: no split
    assert (full.length, full.node, len(cache.nodes)) == (4, leaf, 2)
    miss = cache.match_prefix(None, [9, 1])
    assert (miss.length, miss.slots, miss.node) == (0, (), cache.root.id)
    exact = cache.match_prefix(None, [1, 2])  # ends inside the edge: split there
    assert exact.length == 2 and cache.nodes[exact.node].key == (1, 2) and len(cache.nodes) == 3
    assert all_paths(cache) == {(1, 2), (1, 2, 3, 4)}
    assert cache.snapshot().free_slots == free_before  # matching never allocates or frees


def test_match_splits_only_at_page_boundaries() -> None:
    cache = make(page_size=2)
    leaf = put(cache, None, [1, 2, 3, 4, 5, 6]).node
    tail = cache.match_prefix(None, [1, 2, 3, 4, 5])  # query floored to 4 tokens
    assert tail.length == 4 and cache.nodes[tail.node].key == (1, 2, 3, 4)
    assert cache.nodes[leaf].key == (5, 6)
    diverge = cache.match_prefix(None, [1, 2, 3, 9, 5, 6])  # differs inside page 2: only page 1 matches
    assert diverge.length == 2 and cache.nodes[diverge.node].key == (1, 2)
    assert all_paths(cache) == {(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)}
    assert check_snapshot(cache.snapshot()) == []


def test_insert_returns_prefix_len_and_the_tree_owns_the_rest() -> None:
    cache = make(capacity=16)
    a = cache.alloc(4)
    first = cache.insert(None, [1, 2, 3, 4], a)
    assert first.prefix_len == 0
    with pytest.raises(SlotNotOwned):
        cache.free(a[:1])  # the tree owns all of a now
    b = cache.alloc(4)
    second = cache.insert(None, [1, 2, 7, 8], b)
    assert second.prefix_len == 2
    assert cache.nodes[second.node].key == (7, 8) and cache.nodes[second.node].slots == b[2:]
    with pytest.raises(SlotNotOwned):
        cache.free(b[2:])  # adopted by the tree
    cache.free(b[:2])  # duplicates of cached KV: still the caller's to free
    assert cache.match_prefix(None, [1, 2, 7, 8]).slots == a[:2] + b[2:]
    assert cache.match_prefix(None, [1, 2, 3, 4]).slots == a
    c = cache.alloc(4)
    again = cache.insert(None, [1, 2, 3, 4], c)  # fully cached: nothing adopted
    assert again.prefix_len == 4 and again.node == first.node
    cache.free(c)
    assert len(cache.snapshot().free_slots) == 16 - 6
    assert check_snapshot(cache.snapshot()) == []


def test_insert_counts_hits_and_keeps_the_highest_priority() -> None:
    cache = make()
    node = put(cache, None, [1, 2], priority=1).node
    put(cache, None, [1, 2], priority=3)
    put(cache, None, [1, 2], priority=2)
    cache.match_prefix(None, [1, 2])  # a match refreshes recency but is not a hit
    assert (cache.nodes[node].hit_count, cache.nodes[node].priority) == (3, 3)


def test_empty_insert_and_empty_match() -> None:
    cache = make()
    out = cache.insert(None, [], [])
    assert (out.prefix_len, out.node) == (0, cache.root.id)
    m = cache.match_prefix(None, [])
    assert (m.length, m.slots, m.node) == (0, (), cache.root.id)
    assert len(cache.nodes) == 1


def test_namespaces_never_share_a_prefix() -> None:
    cache = make()
    a = put(cache, "lora-a", [1, 2, 3])
    b = put(cache, "lora-b", [1, 2, 3])
    assert b.prefix_len == 0 and a.node != b.node
    assert cache.match_prefix(None, [1, 2, 3]).length == 0
    assert cache.match_prefix("lora-b", [1, 2, 3]).slots == cache.nodes[b.node].slots


# --------------------------------------------------------------------------- locks


def test_lock_and_unlock_account_along_the_path() -> None:
    cache = make()
    left = put(cache, None, [1, 2, 3, 4]).node
    right = put(cache, None, [1, 2, 5, 6]).node  # splits: (1,2) -> {(3,4), (5,6)}
    head = cache.nodes[left].parent
    assert head is not None and head.key == (1, 2)
    assert (cache.evictable_size, cache.protected_size) == (6, 0)

    cache.inc_lock_ref(left)
    assert (head.lock_ref, cache.nodes[left].lock_ref, cache.nodes[right].lock_ref) == (1, 1, 0)
    assert (cache.evictable_size, cache.protected_size) == (2, 4)
    cache.inc_lock_ref(right)
    assert (head.lock_ref, cache.nodes[right].lock_ref) == (2, 1)
    assert (cache.evictable_size, cache.protected_size) == (0, 6)
    cache.inc_lock_ref(left)  # locks nest
    assert (head.lock_ref, cache.nodes[left].lock_ref) == (3, 2)
    assert (cache.evictable_size, cache.protected_size) == (0, 6)
    assert check_snapshot(cache.snapshot()) == []

    assert cache.evict(100) == 0  # everything is in use
    cache.dec_lock_ref(right)
    assert (head.lock_ref, cache.nodes[right].lock_ref) == (2, 0)
    assert (cache.evictable_size, cache.protected_size) == (2, 4)
    assert cache.evict(100) == 2 and right not in cache.nodes  # only the unlocked leaf goes
    cache.dec_lock_ref(left)
    cache.dec_lock_ref(left)
    assert (head.lock_ref, cache.nodes[left].lock_ref) == (0, 0)
    assert (cache.evictable_size, cache.protected_size) == (4, 0)
    assert check_snapshot(cache.snapshot()) == []


def test_locking_the_root_changes_nothing() -> None:
    cache = make()
    put(cache, None, [1, 2])
    root = cache.match_prefix(None, [9]).node
    before = cache.snapshot()
    cache.inc_lock_ref(root)
    assert cache.snapshot() == before
    cache.dec_lock_ref(root)
    assert cache.snapshot() == before


# --------------------------------------------------------------------------- eviction


def policy_scene(policy: str) -> tuple[RefCache, dict[str, int]]:
    """Five one-token leaves whose (creation, last_access, hits, priority) make each policy pick another:

    W (1, 6, 3, 5)  created first            -> fifo
    X (2, 2, 2, 5)  used longest ago         -> lru
    Y (3, 7, 1, 5)  fewest hits              -> lfu  (ties: recency)
    Z (4, 8, 2, 5)  used most recently       -> mru
    V (5, 5, 4, 0)  lowest priority          -> priority  (ties: recency)
    """
    cache = make(policy=policy)
    ids: dict[str, int] = {}
    plan: list[tuple[int, str, str, int]] = [  # (clock, action, leaf, priority)
        (1, "insert", "W", 5),
        (2, "insert", "X", 5),
        (2, "insert", "X", 5),
        (3, "insert", "Y", 5),
        (4, "insert", "Z", 5),
        (4, "insert", "Z", 5),
        *[(5, "insert", "V", 0)] * 4,
        (6, "insert", "W", 5),
        (6, "insert", "W", 5),
        (7, "match", "Y", 0),
        (8, "match", "Z", 0),
    ]
    token = {"W": 1, "X": 2, "Y": 3, "Z": 4, "V": 5}
    for clock, action, name, priority in plan:
        cache.set_clock(clock)
        if action == "insert":
            ids[name] = put(cache, None, [token[name]], priority).node
        else:
            cache.match_prefix(None, [token[name]])
    return cache, ids


FIRST_VICTIM = {"fifo": "W", "lru": "X", "lfu": "Y", "mru": "Z", "priority": "V"}


def test_policy_scene_metadata() -> None:
    cache, ids = policy_scene("lru")
    got = {
        name: (n.creation, n.last_access, n.hit_count, n.priority)
        for name, n in ((name, cache.nodes[i]) for name, i in ids.items())
    }
    assert got == {"W": (1, 6, 3, 5), "X": (2, 2, 2, 5), "Y": (3, 7, 1, 5), "Z": (4, 8, 2, 5), "V": (5, 5, 4, 0)}


@pytest.mark.parametrize("policy", sorted(FIRST_VICTIM))
def test_evict_takes_the_minimal_rank_leaf_of_each_policy(policy: str) -> None:
    cache, ids = policy_scene(policy)
    assert cache.evict(1) == 1
    gone = {name for name, i in ids.items() if i not in cache.nodes}
    assert gone == {FIRST_VICTIM[policy]}


def test_lru_evicts_in_recency_order() -> None:
    cache, ids = policy_scene("lru")
    order: list[str] = []
    while cache.evict(1):
        order.extend(name for name, i in ids.items() if i not in cache.nodes and name not in order)
    assert order == ["X", "V", "W", "Y", "Z"]  # last_access 2, 5, 6, 7, 8


def test_ties_go_to_the_choose_callback() -> None:
    cache = make()
    a, b = put(cache, None, [1]).node, put(cache, None, [2]).node  # same clock: tied under lru
    seen: list[list[int]] = []

    def choose(tied: list[int]) -> int:
        seen.append(sorted(tied))
        return max(tied)

    assert cache.evict(1, choose=choose) == 1
    assert seen == [sorted([a, b])] and b not in cache.nodes and a in cache.nodes


def test_evict_overshoots_by_at_most_one_node() -> None:
    def scene() -> RefCache:
        cache = make()
        for t, key in enumerate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], start=1):
            cache.set_clock(t)
            put(cache, None, key)
        return cache

    for asked, freed, left in [(0, 0, 3), (1, 3, 2), (3, 3, 2), (4, 6, 1), (6, 6, 1), (7, 9, 0), (100, 9, 0)]:
        cache = scene()
        assert cache.evict(asked) == freed, asked
        assert len(cache.nodes) - 1 == left, asked
        assert cache.evictable_size == 9 - freed
        assert len(cache.snapshot().free_slots) == 32 - 9 + freed


def test_evict_climbs_to_parents_that_become_leaves() -> None:
    cache = make()
    put(cache, None, [1, 2, 3, 4])
    put(cache, None, [1, 2, 5, 6])  # (1,2) -> {(3,4), (5,6)}
    assert cache.evict(3) == 4 and all_paths(cache) == {(1, 2)}  # both leaves; the head was not needed
    assert cache.evict(1) == 2 and all_paths(cache) == set()


# --------------------------------------------------------------------------- bad input


@dataclass
class Scene:
    cache: RefCache
    leaf: int  # unlocked leaf (1..4, 5..8)
    head: int  # inner node (1..4), locked only through `locked`
    locked: int  # leaf (1..4, 9..12) with one lock of its own
    was_locked: int  # leaf locked once and unlocked again
    stale: int  # an evicted node
    lent: tuple[int, ...]  # slots the caller holds
    returned: tuple[int, ...]  # slots the caller held and already freed
    tree_slots: tuple[int, ...]


def scene() -> Scene:
    cache = make(page_size=4, capacity=48)
    cache.set_clock(1)
    stale = put(cache, None, [20, 21, 22, 23]).node
    cache.set_clock(2)
    was_locked = put(cache, None, [30, 31, 32, 33]).node
    cache.set_clock(3)
    leaf = put(cache, None, [1, 2, 3, 4, 5, 6, 7, 8]).node
    locked = put(cache, None, [1, 2, 3, 4, 9, 10, 11, 12]).node
    cache.inc_lock_ref(locked)
    cache.inc_lock_ref(was_locked)
    cache.dec_lock_ref(was_locked)
    assert cache.evict(4) == 4 and stale not in cache.nodes  # the oldest leaf
    cache.register_ref("s", locked, 2)  # a high-priority session, so bad session calls have something to spoil
    lent = cache.alloc(4)
    returned = cache.alloc(4)
    cache.free(returned)
    parent = cache.nodes[leaf].parent
    assert parent is not None
    return Scene(cache, leaf, parent.id, locked, was_locked, stale, lent, returned, cache.nodes[leaf].slots)


def hidden_state(cache: RefCache) -> tuple[Any, ...]:
    """What a snapshot does not show: policy metadata, own locks, lent slots, id counter."""
    nodes = tuple(
        (n.id, n.last_access, n.hit_count, n.creation, n.priority, n.own_locks, n.lock_ref, tuple(n.children))
        for n in cache.nodes.values()
    )
    faults = tuple(sorted(cache.armed_faults.items()))
    counters = (cache._next_id, cache._next_copy, cache._next_prefetch, cache._next_retraction, cache._next_seq)
    faults += (tuple(cache.demotions), cache.scope, tuple(cache.tier_evictable))
    return nodes, tuple(sorted(cache.pool.lent)), tuple(cache.pool.free_list), counters, cache.now, faults


BAD_INPUTS: list[tuple[str, type[KVCertError], Callable[[Scene], object]]] = [
    ("insert: unaligned key", UnalignedKey, lambda s: s.cache.insert(None, [1, 2, 3], s.lent[:3])),
    ("insert: more tokens than slots", LengthMismatch, lambda s: s.cache.insert(None, [1, 2, 3, 4], s.lent[:3])),
    ("insert: more slots than tokens", LengthMismatch, lambda s: s.cache.insert(None, [], s.lent)),
    ("insert: negative token", InvalidToken, lambda s: s.cache.insert(None, [40, 41, 42, -1], s.lent)),
    ("insert: float token", InvalidToken, lambda s: s.cache.insert(None, [40, 41, 42, 43.0], s.lent)),
    ("insert: str token", InvalidToken, lambda s: s.cache.insert(None, [40, 41, 42, "43"], s.lent)),
    ("insert: None token", InvalidToken, lambda s: s.cache.insert(None, [40, 41, 42, None], s.lent)),
    ("insert: bool token", InvalidToken, lambda s: s.cache.insert(None, [40, 41, 42, True], s.lent)),
    ("insert: token past int64", InvalidToken, lambda s: s.cache.insert(None, [40, 41, 42, 2**63], s.lent)),
    ("insert: float priority", InvalidCount, lambda s: s.cache.insert(None, [40, 41, 42, 43], s.lent, 1.5)),
    ("insert: bool priority", InvalidCount, lambda s: s.cache.insert(None, [40, 41, 42, 43], s.lent, True)),
    ("insert: slots the tree owns", SlotNotOwned, lambda s: s.cache.insert(None, [40, 41, 42, 43], s.tree_slots)),
    ("insert: free slots", SlotNotOwned, lambda s: s.cache.insert(None, [40, 41, 42, 43], s.returned)),
    ("insert: a lent slot twice", SlotNotOwned, lambda s: s.cache.insert(None, [40, 41, 42, 43], s.lent[:1] * 4)),
    (
        "insert: float slot ids",
        SlotNotOwned,
        lambda s: s.cache.insert(None, [40, 41, 42, 43], [float(x) for x in s.lent]),
    ),
    ("insert: unhashable slot", SlotNotOwned, lambda s: s.cache.insert(None, [40, 41, 42, 43], [[x] for x in s.lent])),
    (
        "insert: bad token on a cached prefix",
        InvalidToken,
        lambda s: s.cache.insert(None, [1, 2, 3, 4, 5, 6, 7, -8], s.lent + s.lent),
    ),
    ("match: negative token", InvalidToken, lambda s: s.cache.match_prefix(None, [1, 2, 3, -4])),
    ("match: bool token", InvalidToken, lambda s: s.cache.match_prefix(None, [True, 2, 3, 4])),
    ("match: bad token past the last page", InvalidToken, lambda s: s.cache.match_prefix(None, [1, 2, 3, 4, 5.5])),
    ("lock: unknown handle", StaleHandle, lambda s: s.cache.inc_lock_ref(10_000)),
    ("lock: negative handle", StaleHandle, lambda s: s.cache.inc_lock_ref(-1)),
    ("lock: str handle", StaleHandle, lambda s: s.cache.inc_lock_ref("1")),
    ("lock: None handle", StaleHandle, lambda s: s.cache.inc_lock_ref(None)),
    ("lock: bool handle", StaleHandle, lambda s: s.cache.inc_lock_ref(True)),
    ("lock: evicted node", StaleHandle, lambda s: s.cache.inc_lock_ref(s.stale)),
    ("unlock: unknown handle", StaleHandle, lambda s: s.cache.dec_lock_ref(10_000)),
    ("unlock: evicted node", StaleHandle, lambda s: s.cache.dec_lock_ref(s.stale)),
    ("unlock: never locked", LockUnderflow, lambda s: s.cache.dec_lock_ref(s.leaf)),
    ("unlock: locked only through a child", LockUnderflow, lambda s: s.cache.dec_lock_ref(s.head)),
    ("unlock: already unlocked", LockUnderflow, lambda s: s.cache.dec_lock_ref(s.was_locked)),
    ("unlock: the root, never locked", LockUnderflow, lambda s: s.cache.dec_lock_ref(s.cache.root.id)),
    ("evict: negative count", InvalidCount, lambda s: s.cache.evict(-1)),
    ("evict_host: negative count", InvalidCount, lambda s: s.cache.evict_host(-1)),
    ("complete: a copy never issued", UnknownCopy, lambda s: s.cache.complete(0)),
    ("complete: a bool copy id", UnknownCopy, lambda s: s.cache.complete(True)),
    ("load_back: unknown handle", StaleHandle, lambda s: s.cache.load_back(10_000)),
    ("prefetch: unknown handle", StaleHandle, lambda s: s.cache.prefetch(10_000, None, [1, 2, 3, 4])),
    ("prefetch: negative token", InvalidToken, lambda s: s.cache.prefetch(s.cache.root.id, None, [1, 2, 3, -4])),
    ("fetch: a prefetch never issued", UnknownPrefetch, lambda s: s.cache.fetch(0)),
    ("check_prefetch: a bool prefetch id", UnknownPrefetch, lambda s: s.cache.check_prefetch(True)),
    ("abort_prefetch: a negative prefetch id", UnknownPrefetch, lambda s: s.cache.abort_prefetch(-1)),
    ("inject_fault: an unknown kind", UnknownFault, lambda s: s.cache.inject_fault("disk_full")),
    ("retraction_backup: no slots", InvalidCount, lambda s: s.cache.retraction_backup(())),
    ("retraction_backup: a free slot", SlotNotOwned, lambda s: s.cache.retraction_backup(s.returned)),
    ("retraction_restore: a backup never made", UnknownRetraction, lambda s: s.cache.retraction_restore(0, s.lent)),
    ("retraction_discard: a bool backup id", UnknownRetraction, lambda s: s.cache.retraction_discard(True)),
    ("register_ref: int session id", InvalidSession, lambda s: s.cache.register_ref(7, s.leaf, 1)),
    ("register_ref: evicted node", StaleHandle, lambda s: s.cache.register_ref("a", s.stale, 1)),
    ("register_ref: float priority", InvalidCount, lambda s: s.cache.register_ref("a", s.leaf, 0.5)),
    ("update_ref: unknown session", UnknownSession, lambda s: s.cache.update_ref("nobody", 1)),
    ("update_ref: bool priority", InvalidCount, lambda s: s.cache.update_ref("s", True)),
    ("release_ref: unknown session", UnknownSession, lambda s: s.cache.release_ref("nobody")),
    ("release_ref: None session", UnknownSession, lambda s: s.cache.release_ref(None)),
    ("evict: high tier without low", InvalidScope, lambda s: s.cache.evict(4, allow_low=False, allow_high=True)),
    ("evict: int scope flag", InvalidScope, lambda s: s.cache.evict(4, allow_low=1)),
    ("evict: bad count before bad scope", InvalidCount, lambda s: s.cache.evict(-1, allow_low=None)),
    ("plan_admission: negative tokens", InvalidPlan, lambda s: s.cache.plan_admission(-4, 0, (), None)),
    ("plan_admission: float priority", InvalidCount, lambda s: s.cache.plan_admission(4, 1.0, (), None)),
    (
        "plan_admission: repeated running ids",
        InvalidPlan,
        lambda s: s.cache.plan_admission(4, 1, (Running(1, 0, 4), Running(1, 0, 8)), None),
    ),
    ("plan_admission: running not Running", InvalidPlan, lambda s: s.cache.plan_admission(4, 1, ((1, 0, 4),), None)),
    (
        "plan_admission: negative profile",
        InvalidPlan,
        lambda s: s.cache.plan_admission(4, 1, (), AdmissionProfile(1, 1, -1, 10)),
    ),
    ("evict: float count", InvalidCount, lambda s: s.cache.evict(1.5)),
    ("evict: str count", InvalidCount, lambda s: s.cache.evict("4")),
    ("evict: bool count", InvalidCount, lambda s: s.cache.evict(True)),
    ("evict: None count", InvalidCount, lambda s: s.cache.evict(None)),
    ("alloc: negative count", InvalidCount, lambda s: s.cache.alloc(-4)),
    ("alloc: unaligned count", UnalignedKey, lambda s: s.cache.alloc(3)),
    ("alloc: more than free", PoolExhausted, lambda s: s.cache.alloc(48)),
    ("free: slots the tree owns", SlotNotOwned, lambda s: s.cache.free(s.tree_slots)),
    ("free: already freed", SlotNotOwned, lambda s: s.cache.free(s.returned)),
    ("free: a lent slot twice", SlotNotOwned, lambda s: s.cache.free(s.lent[:1] * 2)),
    ("free: never allocated", SlotNotOwned, lambda s: s.cache.free([10_000])),
]


def test_scene_is_what_the_bad_inputs_assume() -> None:
    s = scene()
    nodes = s.cache.nodes
    assert nodes[s.locked].own_locks == 1 and nodes[s.head].lock_ref == 1 and nodes[s.head].own_locks == 0
    assert nodes[s.leaf].own_locks == 0 and nodes[s.was_locked].own_locks == 0
    assert s.stale not in nodes and s.lent and set(s.lent) == s.cache.pool.lent
    assert set(s.returned) <= set(s.cache.pool.free_list) and not set(s.tree_slots) & set(s.cache.pool.free_list)
    # The caller holds 4 slots, neither free nor the tree's: the pool closes only once they come back.
    assert [v.inv for v in check_snapshot(s.cache.snapshot())] == ["INV-ACCT-3"]
    s.cache.free(s.lent)
    assert check_snapshot(s.cache.snapshot()) == []


@pytest.mark.parametrize("name,error,call", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_its_error_and_changes_nothing(
    name: str, error: type[KVCertError], call: Callable[[Scene], object]
) -> None:
    s = scene()
    before, hidden = s.cache.snapshot(), hidden_state(s.cache)
    with pytest.raises(KVCertError) as raised:
        call(s)
    assert type(raised.value) is error
    assert s.cache.snapshot() == before
    assert hidden_state(s.cache) == hidden


def test_bad_input_errors_are_bad_input() -> None:
    errors = {e for _, e, _ in BAD_INPUTS}
    for e in errors - {PoolExhausted}:
        assert issubclass(e, BadInput) and issubclass(e, KVCertError) and issubclass(e, ValueError)
    assert issubclass(PoolExhausted, KVCertError) and not issubclass(PoolExhausted, BadInput)
    # Every BadInput subclass the spec defines is exercised above.
    defined = {
        obj
        for obj in vars(types).values()
        if isinstance(obj, type) and issubclass(obj, BadInput) and obj is not BadInput
    }
    assert defined <= errors


# --------------------------------------------------------------------------- random runs


op = st.one_of(
    st.tuples(
        st.just("insert"), st.sampled_from([None, "a"]), st.lists(st.integers(0, 2), max_size=8), st.integers(0, 2)
    ),
    st.tuples(st.just("match"), st.sampled_from([None, "a"]), st.lists(st.integers(0, 2), max_size=8)),
    st.tuples(st.just("lock"), st.integers(0, 20)),
    st.tuples(st.just("unlock"), st.integers(0, 20)),
    st.tuples(st.just("evict"), st.integers(0, 10)),
)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from(sorted(FIRST_VICTIM)), st.lists(op, min_size=10, max_size=40))
def test_random_runs_keep_every_invariant(page_size: int, policy: str, ops: list[tuple[Any, ...]]) -> None:
    cache = make(page_size=page_size, policy=policy, capacity=24 * page_size)
    handles: list[int] = []
    for clock, (kind, *args) in enumerate(ops, start=1):
        cache.set_clock(clock)
        before = cache.snapshot()
        if kind == "insert":
            ns, key, priority = args
            key = key[: len(key) // page_size * page_size]
            if len(key) > len(before.free_slots):
                cache.evict(len(key))
            now = before = cache.snapshot()  # the room-making eviction is not part of the insert
            if len(key) <= len(now.free_slots):
                out = put(cache, ns, key, priority)
                assert out.prefix_len == cached_prefix_len(now, ns, key)
                handles.append(out.node)
        elif kind == "match":
            ns, key = args
            m = cache.match_prefix(ns, key)
            assert m.length == cached_prefix_len(before, ns, key)
            handles.append(m.node)
        elif kind in ("lock", "unlock") and args[0] < len(handles):
            node = cache.nodes.get(handles[args[0]])
            try:
                (cache.inc_lock_ref if kind == "lock" else cache.dec_lock_ref)(handles[args[0]])
            except (StaleHandle, LockUnderflow) as err:
                assert node is None or (kind == "unlock" and node.own_locks == 0), err
        elif kind == "evict":
            freed = cache.evict(args[0])
            assert freed >= min(args[0], before.evictable_size)
        after = cache.snapshot()
        assert check_snapshot(after) == []
        assert slot_changes(before, after) == []
