"""Operation contracts: prefix lookup, page ownership, slot stability, eviction bounds and witnesses.

Expected values come from independent models built in the tests (the list of
inserted keys, first-writer-wins page ownership, brute force over eviction
orders), never from the functions under test.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.refimpl import RefCache
from kvcert.spec.contracts import (
    EvictNode,
    cached_prefix_len,
    eviction_bounds,
    eviction_witness,
    host_eviction_bounds,
    node_paths,
    order_breach,
    page_slots,
    prefix_slots,
    slot_changes,
)
from kvcert.spec.types import CacheConfig, Namespace, NodeView, Snapshot

FAST = settings(max_examples=150, deadline=None)


def _put(cache: RefCache, namespace: Namespace, tokens: list[int]) -> tuple[int, ...]:
    """Allocate, insert, free the duplicates; returns the slots the caller allocated."""
    slots = cache.alloc(len(tokens))
    out = cache.insert(namespace, tokens, slots)
    cache.free(slots[: out.prefix_len])
    return slots


def _node(s: Snapshot, namespace: Namespace, path: tuple[int, ...]) -> NodeView:
    ids = [i for i, p in node_paths(s).items() if p == (namespace, path)]
    assert len(ids) == 1, (namespace, path)
    return s.by_id()[ids[0]]


def _without(s: Snapshot, *nodes: NodeView, free: bool = True) -> Snapshot:
    """`s` with `nodes` removed and (unless free=False) their slots back on the free list."""
    gone = {n.id for n in nodes}
    freed = [x for n in nodes for x in n.slots] if free else []
    return replace(
        s,
        nodes=tuple(n for n in s.nodes if n.id not in gone),
        free_slots=tuple(sorted((*s.free_slots, *freed))),
        evictable_size=s.evictable_size - sum(len(n.key) for n in nodes if n.lock_ref == 0),
    )


# --------------------------------------------------------------------------- prefixes and pages


def test_cached_prefix_len_examples() -> None:
    cache = RefCache(CacheConfig(page_size=1, capacity=16))
    _put(cache, None, [1, 2, 3, 4])
    _put(cache, None, [1, 2, 5])
    _put(cache, "a", [1, 2, 3])
    s = cache.snapshot()
    assert cached_prefix_len(s, None, [1, 2, 3, 4, 9]) == 4
    assert cached_prefix_len(s, None, [1, 2, 5, 6]) == 3
    assert cached_prefix_len(s, None, [1, 2, 9]) == 2
    assert cached_prefix_len(s, None, [9, 1, 2]) == 0
    assert cached_prefix_len(s, None, []) == 0
    assert cached_prefix_len(s, "a", [1, 2, 3, 4]) == 3  # namespaces do not share
    assert cached_prefix_len(s, "b", [1, 2, 3]) == 0


def test_cached_prefix_len_counts_whole_pages_only() -> None:
    cache = RefCache(CacheConfig(page_size=4, capacity=16))
    _put(cache, None, [1, 2, 3, 4, 5, 6, 7, 8])
    s = cache.snapshot()
    assert cached_prefix_len(s, None, [1, 2, 3, 4, 5, 6, 7]) == 4  # the second page is incomplete
    assert cached_prefix_len(s, None, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    assert cached_prefix_len(s, None, [1, 2, 3]) == 0


def test_pages_sharing_leading_tokens_stay_apart() -> None:
    """Two cached second pages start with the same tokens (5, 6) but are different pages."""
    cache = RefCache(CacheConfig(page_size=4, capacity=32))
    a = _put(cache, None, [1, 2, 3, 4, 5, 6, 7, 8])
    b = _put(cache, None, [1, 2, 3, 4, 5, 6, 9, 9])
    s = cache.snapshot()
    assert page_slots(s) == {
        (None, (1, 2, 3, 4)): a[:4],
        (None, (1, 2, 3, 4, 5, 6, 7, 8)): a[4:],
        (None, (1, 2, 3, 4, 5, 6, 9, 9)): b[4:],
    }
    assert a[4:] != b[4:]
    assert cached_prefix_len(s, None, [1, 2, 3, 4, 5, 6, 7, 9]) == 4
    assert cached_prefix_len(s, None, [1, 2, 3, 4, 5, 6, 9, 9]) == 8
    assert prefix_slots(s, None, [1, 2, 3, 4, 5, 6, 9, 9], 8) == a[:4] + b[4:]
    assert prefix_slots(s, None, [1, 2, 3, 4, 5, 6, 7, 8], 8) == a
    assert prefix_slots(s, None, [1, 2, 3, 4, 5, 6, 7, 8], 4) == a[:4]
    assert prefix_slots(s, None, [1, 2, 3, 4, 5, 6, 7, 8], 0) == ()


@st.composite
def _workload(draw: st.DrawFn) -> tuple[int, list[tuple[Namespace, list[int]]], list[tuple[Namespace, list[int]]]]:
    """A page size, keys to insert (small alphabet: many shared prefixes), and queries."""
    ps = draw(st.sampled_from([1, 2, 4]))
    key = st.tuples(
        st.sampled_from([None, "a"]), st.lists(st.integers(0, 2), max_size=3 * ps).map(lambda k: k[: len(k) // ps * ps])
    )
    inserts = draw(st.lists(key, max_size=6))
    queries = draw(
        st.lists(st.tuples(st.sampled_from([None, "a", "b"]), st.lists(st.integers(0, 2), max_size=12)), max_size=6)
    )
    return ps, [(ns, list(k)) for ns, k in inserts], [(ns, list(q)) for ns, q in queries]


@FAST
@given(_workload())
def test_prefixes_and_pages_agree_with_a_model_of_the_inserts(
    work: tuple[int, list[tuple[Namespace, list[int]]], list[tuple[Namespace, list[int]]]],
) -> None:
    ps, inserts, queries = work
    cache = RefCache(CacheConfig(page_size=ps, capacity=64 * ps))
    owner: dict[tuple[Namespace, tuple[int, ...]], tuple[int, ...]] = {}
    for ns, key in inserts:
        slots = _put(cache, ns, key)
        for end in range(ps, len(key) + 1, ps):  # the first insert of a page owns it
            owner.setdefault((ns, tuple(key[:end])), slots[end - ps : end])
    s = cache.snapshot()
    assert page_slots(s) == owner
    for ns, q in queries:
        want = max(
            (end for end in range(0, len(q) + 1, ps) if (ns, tuple(q[:end])) in owner or end == 0),
            default=0,
        )
        assert cached_prefix_len(s, ns, q) == want
        want_slots = tuple(x for end in range(ps, want + 1, ps) for x in owner[(ns, tuple(q[:end]))])
        assert prefix_slots(s, ns, q, want) == want_slots
        got = cache.match_prefix(ns, q)
        assert (got.length, got.slots) == (want, want_slots)


def test_slot_changes() -> None:
    cache = RefCache(CacheConfig(page_size=2, capacity=16))
    a = _put(cache, None, [1, 2, 3, 4])
    _put(cache, None, [5, 6])
    before = cache.snapshot()
    cache.match_prefix(None, [1, 2])  # splits (1,2 | 3,4) but moves no slot
    _put(cache, None, [1, 2, 7, 8])
    cache.evict(2)
    after = cache.snapshot()
    assert len(after.nodes) != len(before.nodes)
    assert slot_changes(before, after) == []

    leaf = _node(before, None, (1, 2, 3, 4))
    moved = (before.free_slots[0], before.free_slots[1])
    bad = replace(
        before,
        nodes=tuple(replace(n, slots=n.slots[:2] + moved) if n.id == leaf.id else n for n in before.nodes),
        free_slots=tuple(sorted((*before.free_slots[2:], *a[2:]))),
    )
    (msg,) = slot_changes(before, bad)
    assert str(a[2:]) in msg and str(moved) in msg
    (msg,) = slot_changes(bad, before)  # the relation is symmetric in what it flags
    assert str(moved) in msg


# --------------------------------------------------------------------------- eviction bounds


def _eviction_scene() -> RefCache:
    """ps 1, lru. Under the root: (1,2) -> {(3,4), (5)}; (6,7,8); (9,9) locked. 8 tokens evictable."""
    cache = RefCache(CacheConfig(page_size=1, capacity=32, policy="lru"))
    for t, key in enumerate([[1, 2, 3, 4], [1, 2, 5], [6, 7, 8], [9, 9]], start=1):
        cache.set_clock(t)
        _put(cache, None, key)
    cache.inc_lock_ref(cache.match_prefix(None, [9, 9]).node)
    return cache


def _bounds(before: Snapshot, after: Snapshot, asked: int, reported: int) -> set[str]:
    return {inv for inv, _ in eviction_bounds(before, after, asked, reported)}


def test_real_evictions_are_within_bounds() -> None:
    base = _eviction_scene()
    before = base.snapshot()
    assert before.evictable_size == 8 and before.protected_size == 2
    for asked in range(0, 11):
        cache = copy.deepcopy(base)
        freed = cache.evict(asked)
        assert eviction_bounds(before, cache.snapshot(), asked, freed) == [], asked


def test_evict_1_freeing_too_little() -> None:
    before = _eviction_scene().snapshot()
    assert _bounds(before, before, 2, 0) == {"INV-EVICT-1"}
    assert _bounds(before, before, 0, 0) == set()
    leaf = _node(before, None, (1, 2, 5))
    assert _bounds(before, _without(before, leaf), 3, 1) == {"INV-EVICT-1"}  # asked 3, one token left


def test_evict_1_asking_past_evictable_needs_everything() -> None:
    before = _eviction_scene().snapshot()
    unlocked = [n for n in before.nodes if n.id != before.root and n.lock_ref == 0]
    assert _bounds(before, _without(before, *unlocked), 100, 8) == set()
    fewer = [n for n in unlocked if n.key != (6, 7, 8)]
    assert _bounds(before, _without(before, *fewer), 100, 5) == {"INV-EVICT-1"}


def test_evict_2_going_on_past_the_node_that_sufficed() -> None:
    before = _eviction_scene().snapshot()
    a = _node(before, None, (1, 2, 3, 4))
    b = _node(before, None, (1, 2, 5))
    c = _node(before, None, (6, 7, 8))
    assert _bounds(before, _without(before, a, b), 1, 3) == {"INV-EVICT-2"}
    assert _bounds(before, _without(before, a, b), 3, 3) == set()  # the second leaf was needed
    assert _bounds(before, _without(before, c), 1, 3) == set()  # one node may overshoot
    assert _bounds(before, _without(before, b), 0, 1) == {"INV-EVICT-2"}  # asked nothing, freed something


def test_evict_3_locked_node_evicted() -> None:
    before = _eviction_scene().snapshot()
    locked = _node(before, None, (9, 9))
    assert locked.lock_ref == 1
    assert _bounds(before, _without(before, locked), 2, 2) == {"INV-EVICT-3"}


def test_evict_3_inner_node_evicted_under_a_surviving_child() -> None:
    before = _eviction_scene().snapshot()
    head = _node(before, None, (1, 2))
    child = _node(before, None, (1, 2, 3, 4))
    sibling = _node(before, None, (1, 2, 5))
    # The child survives at the same path, hung from the root; the head and sibling are gone.
    after = _without(before, head, sibling)
    after = replace(
        after,
        nodes=tuple(replace(n, parent=before.root, key=(1, 2, 3, 4)) if n.id == child.id else n for n in after.nodes),
    )
    assert "INV-EVICT-3" in _bounds(before, after, 3, 3)


def test_evict_3_eviction_created_a_node() -> None:
    cache = _eviction_scene()
    before = cache.snapshot()
    _put(cache, None, [7, 7])
    # The new node took two free slots, so the free list shrank as well (INV-EVICT-5).
    assert _bounds(before, cache.snapshot(), 0, 0) == {"INV-EVICT-3", "INV-EVICT-5"}


def test_evict_5_reported_and_free_list_must_match_the_tree() -> None:
    cache = _eviction_scene()
    before = cache.snapshot()
    freed = cache.evict(3)
    after = cache.snapshot()
    assert _bounds(before, after, 3, freed) == set()
    assert _bounds(before, after, 3, freed + 1) == {"INV-EVICT-5"}
    leaf = _node(before, None, (6, 7, 8))
    assert _bounds(before, _without(before, leaf, free=False), 3, 3) == {"INV-EVICT-5"}  # slots leaked


# --------------------------------------------------------------------------- eviction witness


def _kids(nodes: dict[int, EvictNode]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {i: set() for i in nodes}
    for n in nodes.values():
        if n.parent in out:
            out[n.parent].add(n.id)
    return out


def _legal(nodes: dict[int, EvictNode], root: int, asked: int, order: list[int]) -> bool:
    """Replays `order` against SPEC.md §4.5, written out step by step."""
    kids = _kids(nodes)
    gone: set[int] = set()
    freed = 0

    def leaves() -> list[EvictNode]:
        return [n for n in nodes.values() if n.id != root and n.id not in gone and not n.locked and kids[n.id] <= gone]

    for pick in order:
        options = leaves()
        if freed >= asked or pick not in {n.id for n in options}:
            return False
        if nodes[pick].rank != min(n.rank for n in options):
            return False
        gone.add(pick)
        freed += nodes[pick].size
    return freed >= asked or not leaves()


def _tree(*spec: tuple[int, int, int, bool, tuple[int, ...]]) -> dict[int, EvictNode]:
    """(id, parent, size, locked, rank) rows under root 0."""
    nodes = {0: EvictNode(0, None, 0, False, ())}
    for i, parent, size, locked, rank in spec:
        nodes[i] = EvictNode(i, parent, size, locked, rank)
    return nodes


CHAIN = _tree(
    (1, 0, 2, False, (5,)),  # inner node, leaf once 2 is gone
    (2, 1, 2, False, (1,)),
    (3, 0, 2, False, (3,)),
)


def test_witness_finds_the_legal_order() -> None:
    # 2 goes first (rank 1); then leaves 1 (rank 5) and 3 (rank 3): 3 goes; 4 >= 3 freed.
    assert eviction_witness(CHAIN, 0, 3, frozenset({2, 3})) == [2, 3]
    assert eviction_witness(CHAIN, 0, 6, frozenset({1, 2, 3})) == [2, 3, 1]
    assert eviction_witness(CHAIN, 0, 1, frozenset({2})) == [2]
    assert eviction_witness(CHAIN, 0, 0, frozenset()) == []


def test_witness_rejects_illegal_sets() -> None:
    assert eviction_witness(CHAIN, 0, 3, frozenset({2, 1})) is None  # 3 outranks 1
    assert eviction_witness(CHAIN, 0, 3, frozenset({2})) is None  # stopped short with leaves left
    assert eviction_witness(CHAIN, 0, 3, frozenset({2, 3, 1})) is None  # went on past enough
    assert eviction_witness(CHAIN, 0, 3, frozenset({3, 1})) is None  # 1 is no leaf while 2 stays
    assert eviction_witness(CHAIN, 0, 1, frozenset()) is None  # asked, and nothing evicted
    assert eviction_witness(CHAIN, 0, 0, frozenset({2})) is None  # asked nothing
    assert eviction_witness(CHAIN, 0, 6, frozenset({0, 1, 2, 3})) is None  # the root is never evicted
    assert eviction_witness(CHAIN, 0, 6, frozenset({1, 2, 3, 42})) is None  # unknown node


def test_witness_exists_for_each_tied_choice() -> None:
    tied = _tree((1, 0, 1, False, (2,)), (2, 0, 1, False, (2,)), (3, 0, 1, False, (2,)), (4, 0, 1, False, (9,)))
    for pick in (1, 2, 3):
        assert eviction_witness(tied, 0, 1, frozenset({pick})) == [pick]
    for pair in itertools.combinations((1, 2, 3), 2):
        got = eviction_witness(tied, 0, 2, frozenset(pair))
        assert got is not None and set(got) == set(pair)
    assert eviction_witness(tied, 0, 1, frozenset({4})) is None
    assert eviction_witness(tied, 0, 2, frozenset({1, 4})) is None


def test_locked_node_is_never_in_a_witness() -> None:
    nodes = _tree(
        (1, 0, 1, True, (0,)),  # locked: would be first by rank
        (2, 1, 1, True, (0,)),
        (3, 0, 2, False, (7,)),
        (4, 0, 2, False, (8,)),
    )
    assert eviction_witness(nodes, 0, 1, frozenset({3})) == [3]
    assert eviction_witness(nodes, 0, 100, frozenset({3, 4})) == [3, 4]
    for bad in ({2}, {1, 2}, {2, 3, 4}, {1, 2, 3, 4}):
        assert eviction_witness(nodes, 0, 100, frozenset(bad)) is None


@st.composite
def _forest(draw: st.DrawFn) -> tuple[dict[int, EvictNode], int, frozenset[int]]:
    n = draw(st.integers(1, 6))
    rows = []
    for i in range(1, n + 1):
        parent = draw(st.integers(0, i - 1))
        rows.append((i, parent, draw(st.integers(1, 3)), draw(st.booleans()), (draw(st.integers(0, 2)),)))
    nodes, asked = _tree(*rows), draw(st.integers(0, 10))
    # Mostly a legal outcome (a random run, ties broken at random) or a near miss of one.
    kids, freed = _kids(nodes), 0
    gone: set[int] = set()
    while freed < asked:
        leaves = [m for m in nodes.values() if m.id and m.id not in gone and not m.locked and kids[m.id] <= gone]
        if not leaves:
            break
        pick = draw(st.sampled_from(sorted(m.id for m in leaves if m.rank == min(x.rank for x in leaves))))
        gone.add(pick)
        freed += nodes[pick].size
    how = draw(st.sampled_from(["legal", "drop", "add", "any"]))
    if how == "drop" and gone:
        gone.discard(draw(st.sampled_from(sorted(gone))))
    elif how == "add" and len(gone) < n:
        gone.add(draw(st.sampled_from(sorted(set(range(1, n + 1)) - gone))))
    elif how == "any":
        gone = draw(st.sets(st.integers(1, n)))
    return nodes, asked, frozenset(gone)


@settings(max_examples=300, deadline=None)
@given(_forest())
def test_witness_matches_brute_force(case: tuple[dict[int, EvictNode], int, frozenset[int]]) -> None:
    nodes, asked, removed = case
    exists = any(_legal(nodes, 0, asked, list(order)) for order in itertools.permutations(removed))
    got = eviction_witness(nodes, 0, asked, removed)
    assert (got is not None) == exists
    if got is not None:
        assert sorted(got) == sorted(removed) and _legal(nodes, 0, asked, got)
        assert not any(nodes[i].locked for i in got)


@FAST
@given(
    st.sampled_from(["lru", "lfu", "fifo", "mru", "priority"]),
    st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=4), st.integers(0, 2)), min_size=1, max_size=7),
    st.sets(st.integers(0, 6), max_size=2),
    st.integers(0, 14),
    st.randoms(use_true_random=False),
)
def test_reference_evictions_have_witnesses(policy, keys, locks, asked, rng) -> None:
    """Whatever tie the model breaks, and however, the spec can explain the outcome."""
    cache = RefCache(CacheConfig(page_size=1, capacity=64, policy=policy))
    handles = []
    for t, (key, priority) in enumerate(keys, start=1):
        cache.set_clock(t)
        slots = cache.alloc(len(key))
        out = cache.insert(None, key, slots, priority)
        cache.free(slots[: out.prefix_len])
        handles.append(out.node)
    for k in locks:
        if k < len(handles) and handles[k] in cache.nodes:
            cache.inc_lock_ref(handles[k])
    before = cache.snapshot()
    view = {
        n.id: EvictNode(n.id, n.parent.id if n.parent else None, len(n.key), n.lock_ref > 0, cache.rank(n))
        for n in cache.nodes.values()
    }
    freed = cache.evict(asked, choose=rng.choice)
    after = cache.snapshot()
    assert eviction_bounds(before, after, asked, freed) == []
    removed = frozenset(i for i in view if i not in cache.nodes)
    witness = eviction_witness(view, cache.root.id, asked, removed)
    assert witness is not None and _legal(view, cache.root.id, asked, witness)


# ----------------------------------------------------------------- host eviction (SPEC.md §9.4, INV-HOST-8)


def _host_scene(write_policy: str) -> RefCache:
    """[1,2] settled on both tiers (a duplicate under write-back) and [3,4] on the host only."""
    c = RefCache(CacheConfig(capacity=8, host_capacity=8, write_policy=write_policy, load_back_threshold=1))
    _put(c, None, [1, 2])
    c.evict(2)  # write-back backs it up here; write-through backed it up on insert
    for pending in list(c.copies):
        c.complete(pending.id)
    c.poll()
    _put(c, None, [1, 2])  # restored from the request: on both tiers
    _put(c, None, [3, 4])
    for pending in list(c.copies):
        c.complete(pending.id)
    c.poll()
    c.set_clock(9)
    c.match_prefix(None, [1, 2])
    c.evict(2)  # [3, 4] is the LRU device leaf
    return c


def _host_bounds(before: Snapshot, after: Snapshot, asked: int, reported: int) -> set[str]:
    return {inv for inv, _ in host_eviction_bounds(before, after, asked, reported)}


def _strip_backup(s: Snapshot, node: NodeView) -> Snapshot:
    nodes = tuple(replace(n, host_slots=None) if n.id == node.id else n for n in s.nodes)
    return replace(s, nodes=nodes, host_free_slots=tuple(sorted(s.host_free_slots + (node.host_slots or ()))))


def test_host_scene_is_what_the_cases_assume() -> None:
    for wp in ("write_back", "write_through"):
        s = _host_scene(wp).snapshot()
        dup, leaf = _node(s, None, (1, 2)), _node(s, None, (3, 4))
        assert dup.slots is not None and dup.host_slots is not None and not s.pending
        assert leaf.slots is None and leaf.host_slots is not None


def test_write_back_reclaims_duplicates_before_leaves() -> None:
    c = _host_scene("write_back")
    before = c.snapshot()
    assert c.evict_host(2) == 2
    after = c.snapshot()
    assert _node(after, None, (1, 2)).host_slots is None and _host_bounds(before, after, 2, 2) == set()
    dup = _node(before, None, (1, 2))
    assert _host_bounds(before, _strip_backup(before, dup), 2, 2) == set()
    leaf = _node(before, None, (3, 4))
    leaf_gone = _without(before, leaf, free=False)
    leaf_gone = replace(leaf_gone, host_free_slots=tuple(sorted(before.host_free_slots + (leaf.host_slots or ()))))
    assert "INV-HOST-8" in _host_bounds(before, leaf_gone, 2, 2), "a leaf went while a duplicate kept its backup"


def test_reclaiming_past_the_asked_count_by_a_whole_node_is_flagged() -> None:
    c = _host_scene("write_back")
    before = c.snapshot()
    dup = _node(before, None, (1, 2))
    assert "INV-HOST-8" in _host_bounds(before, _strip_backup(before, dup), 0, 2)


def test_write_through_never_strips_a_device_nodes_backup() -> None:
    before = _host_scene("write_through").snapshot()
    dup = _node(before, None, (1, 2))
    assert "INV-HOST-8" in _host_bounds(before, _strip_backup(before, dup), 2, 2)


def test_a_locked_host_only_node_is_not_host_evictable() -> None:
    c = _host_scene("write_through")
    leaf = _node(c.snapshot(), None, (3, 4))
    c.inc_lock_ref(leaf.id)
    before = c.snapshot()
    gone = replace(
        _without(before, _node(before, None, (3, 4)), free=False),
        host_free_slots=tuple(sorted(before.host_free_slots + (leaf.host_slots or ()))),
    )
    assert "INV-HOST-8" in _host_bounds(before, gone, 2, 2)


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=8))
def test_order_breach_is_refinement_by_brute_force(pairs: list[tuple[int, int]]) -> None:
    """INV-META-1's relation against every pair: the backend's order refines the spec's exactly when no node the
    spec ranks strictly first is ranked at or after by the backend; a reported pair is such a node pair."""
    ranks = [((a,), (b,)) for a, b in pairs]
    bad = [
        (i, j)
        for i, j in itertools.permutations(range(len(ranks)), 2)
        if ranks[i][0] < ranks[j][0] and ranks[i][1] >= ranks[j][1]
    ]
    got = order_breach(ranks)
    assert (got is None) == (not bad)
    assert got is None or got in bad


def test_order_breach_leaves_ties_and_units_free() -> None:
    spec = [(5,), (5,), (7,)]
    assert order_breach(list(zip(spec, [(900,), (100,), (901,)]))) is None  # a tie ordered either way, other units
    assert order_breach(list(zip(spec, [(900,), (100,), (900,)]))) == (0, 2)  # 7 after 5, yet not after 900
