"""Every snapshot invariant accepts a real state and flags a hand-made corruption of it.

The corruption table is keyed by invariant ID and checked against
`SNAPSHOT_INVARIANTS`, so an invariant added without a case here fails the suite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from kvcert.conformance.harness.storage import FaultyStorage, MemoryStorage
from kvcert.refimpl import RefCache
from kvcert.spec import storage as l3
from kvcert.spec.contracts import node_paths
from kvcert.spec.decisions import Decisions, Fetch
from kvcert.spec.invariants import SNAPSHOT_INVARIANTS, Violation, check_snapshot, rooted
from kvcert.spec.types import CacheConfig, Namespace, NodeView, Snapshot

PS = 4


def _put(cache: RefCache, namespace: Namespace, tokens: list[int]) -> int:
    """The caller's side of an insert: allocate, insert, free the duplicates. Returns the node."""
    slots = cache.alloc(len(tokens))
    out = cache.insert(namespace, tokens, slots)
    cache.free(slots[: out.prefix_len])
    return out.node


def _base() -> Snapshot:
    """Two namespaces, two splits, a sibling at the root, one locked path, free pages left."""
    cache = RefCache(CacheConfig(page_size=PS, capacity=48, policy="lru"))
    _put(cache, None, list(range(1, 13)))  # (1..12)
    locked = _put(cache, None, [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23])  # split after 8
    _put(cache, None, [30, 31, 32, 33])
    _put(cache, "lora", [1, 2, 3, 4, 5, 6, 7, 8])
    _put(cache, "lora", [1, 2, 3, 4, 40, 41, 42, 43])  # split after 4
    cache.inc_lock_ref(locked)
    return cache.snapshot()


BASE = _base()


def _node(s: Snapshot, namespace: Namespace, path: tuple[int, ...]) -> NodeView:
    """The node whose root-to-end path is `path` in `namespace`."""
    ids = [i for i, p in node_paths(s).items() if p == (namespace, path)]
    assert len(ids) == 1, (namespace, path)
    return s.by_id()[ids[0]]


def _edit(s: Snapshot, node: NodeView, **changes: object) -> Snapshot:
    new = replace(node, **changes)
    return replace(s, nodes=tuple(new if n.id == node.id else n for n in s.nodes))


# Named nodes of BASE (the assertions in test_base_is_what_the_cases_assume pin them down).
HEAD = _node(BASE, None, tuple(range(1, 9)))  # (1..8), locked via its child
LEAF_9 = _node(BASE, None, tuple(range(1, 13)))  # (9..12) under HEAD, unlocked
LEAF_20 = _node(BASE, None, (1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23))  # locked leaf
LEAF_30 = _node(BASE, None, (30, 31, 32, 33))  # HEAD's sibling under the root
LORA_HEAD = _node(BASE, "lora", (1, 2, 3, 4))
LORA_LEAF = _node(BASE, "lora", (1, 2, 3, 4, 5, 6, 7, 8))


@dataclass(frozen=True)
class Corruption:
    inv: str
    name: str
    corrupt: Callable[[Snapshot], Snapshot]
    only: bool = False
    """True: the corruption is surgical, so `inv` must be the only violation."""


def _cycle(s: Snapshot) -> Snapshot:
    return _edit(s, HEAD, parent=LEAF_9.id)


def _swap_slot_with_free(s: Snapshot) -> Snapshot:
    free = s.free_slots[0]
    last = LEAF_30.slots[-1]
    s = _edit(s, LEAF_30, slots=(*LEAF_30.slots[:-1], free))
    return replace(s, free_slots=tuple(sorted((*s.free_slots[1:], last))))


def _pages_crossed(s: Snapshot) -> Snapshot:
    a, b = HEAD.slots[:PS], HEAD.slots[PS:]
    return _edit(s, HEAD, slots=(*a[:-1], b[-1], *b[:-1], a[-1]))


CASES = [
    Corruption("INV-TREE-1", "parent missing", lambda s: _edit(s, LEAF_9, parent=999), only=True),
    Corruption("INV-TREE-1", "parent cycle", _cycle, only=True),
    Corruption("INV-TREE-1", "duplicate id", lambda s: replace(s, nodes=(*s.nodes, LEAF_30)), only=True),
    Corruption("INV-TREE-1", "root not among nodes", lambda s: replace(s, root=999), only=True),
    Corruption(
        "INV-TREE-1",
        "root has a key",
        lambda s: _edit(s, s.by_id()[s.root], key=(1, 2, 3, 4), slots=(0, 1, 2, 3)),
        only=True,
    ),
    Corruption(
        "INV-TREE-2", "key not whole pages", lambda s: _edit(s, LEAF_9, key=LEAF_9.key[:3], slots=LEAF_9.slots[:3])
    ),
    Corruption("INV-TREE-2", "fewer slots than tokens", lambda s: _edit(s, LEAF_9, slots=LEAF_9.slots[:3])),
    Corruption("INV-TREE-2", "empty edge", lambda s: _edit(s, LEAF_30, key=(), slots=())),
    Corruption("INV-TREE-3", "siblings share a first page", lambda s: _edit(s, LEAF_30, key=HEAD.key[:PS]), only=True),
    Corruption("INV-NS-1", "namespace changes below the root", lambda s: _edit(s, LEAF_9, namespace="lora"), only=True),
    Corruption("INV-LOCK-1", "negative lock count", lambda s: _edit(s, LEAF_9, lock_ref=-1)),
    Corruption(
        "INV-LOCK-3",
        "child locked more than its parent",
        lambda s: _edit(s, LEAF_20, lock_ref=HEAD.lock_ref + 1),
        only=True,
    ),
    Corruption(
        "INV-ACCT-1", "evictable counter off", lambda s: replace(s, evictable_size=s.evictable_size + 1), only=True
    ),
    Corruption(
        "INV-ACCT-2", "protected counter off", lambda s: replace(s, protected_size=s.protected_size - PS), only=True
    ),
    Corruption("INV-ACCT-3", "capacity not accounted for", lambda s: replace(s, capacity=s.capacity + PS), only=True),
    Corruption("INV-ACCT-3", "slots leaked", lambda s: replace(s, free_slots=s.free_slots[PS:]), only=True),
    Corruption("INV-SLOT-1", "two nodes share slots", lambda s: _edit(s, LEAF_30, slots=LEAF_9.slots), only=True),
    Corruption(
        "INV-SLOT-1", "a held slot is also free", lambda s: replace(s, free_slots=(*s.free_slots, LEAF_9.slots[0]))
    ),
    Corruption("INV-SLOT-2", "slot id past slot_limit", lambda s: replace(s, slot_limit=s.capacity - PS), only=True),
    Corruption("INV-SLOT-2", "negative slot id", lambda s: _edit(s, LEAF_30, slots=(-4, -3, -2, -1)), only=True),
    Corruption("INV-SLOT-4", "page slots not contiguous", _pages_crossed, only=True),
    Corruption("INV-SLOT-4", "page split between a node and the free list", _swap_slot_with_free, only=True),
]


def _host_base() -> Snapshot:
    """A host tier mid-flight: a demoted node, a pending write, a pending load."""
    cache = RefCache(CacheConfig(page_size=PS, capacity=32, host_capacity=48, write_policy="write_through"))
    _put(cache, None, list(range(1, 9)))  # backed up by copy 0
    _put(cache, None, [30, 31, 32, 33])  # copy 1
    for copy in (0, 1):
        cache.complete(copy)
    cache.poll()
    _put(cache, None, [1, 2, 3, 4, 20, 21, 22, 23])  # split after 4; the new leaf's write (copy 2) stays pending
    assert cache.evict(2 * PS) == 2 * PS  # demotes (30..33), then (5..8): both stay in the tree on the host
    assert cache.load_back(cache.match_prefix(None, [30, 31, 32, 33]).host_node or 0) == PS  # copy 3, pending
    return cache.snapshot()


HOST_BASE = _host_base()
H_HEAD = _node(HOST_BASE, None, (1, 2, 3, 4))
H_TAIL = _node(HOST_BASE, None, tuple(range(1, 9)))
H_WRITING = _node(HOST_BASE, None, (1, 2, 3, 4, 20, 21, 22, 23))
H_LOADING = _node(HOST_BASE, None, (30, 31, 32, 33))


def _host(corrupt: Callable[[Snapshot], Snapshot]) -> Callable[[Snapshot], Snapshot]:
    """A corruption of HOST_BASE (the device-only BASE has no host tier to corrupt)."""
    return lambda _: corrupt(HOST_BASE)


CASES += [
    Corruption("INV-HOST-1", "a node on neither tier", _host(lambda s: _edit(s, H_TAIL, host_slots=None))),
    Corruption("INV-HOST-2", "device node under a host-only parent", _host(lambda s: _edit(s, H_HEAD, slots=None))),
    Corruption("INV-HOST-3", "backup under a parent without one", _host(lambda s: _edit(s, H_HEAD, host_slots=None))),
    Corruption(
        "INV-HOST-4",
        "host capacity not accounted for",
        _host(lambda s: replace(s, host_capacity=s.host_capacity + PS)),
        only=True,
    ),
    Corruption(
        "INV-HOST-5",
        "two nodes share host slots",
        _host(lambda s: _edit(s, H_LOADING, host_slots=H_HEAD.host_slots)),
        only=True,
    ),
    Corruption(
        "INV-HOST-6",
        "a pending copy names a node that left",
        _host(lambda s: replace(s, pending=(replace(s.pending[0], nodes=(999,)), *s.pending[1:]))),
        only=True,
    ),
    Corruption(
        "INV-HOST-6", "a pending write whose node is unlocked", _host(lambda s: _edit(s, H_WRITING, lock_ref=0))
    ),
    Corruption(
        "INV-HOST-6",
        "a pending load whose node's host copy is unprotected",
        _host(lambda s: _edit(s, H_LOADING, host_lock_ref=0)),
    ),
    Corruption("INV-HOST-7", "negative host lock", _host(lambda s: _edit(s, H_TAIL, host_lock_ref=-1)), only=True),
]


def _prefetch_base() -> Snapshot:
    """A storage tier mid-flight: a prefetch of two stored pages below a host-only anchor."""
    config = CacheConfig(
        page_size=PS, capacity=32, host_capacity=48, write_policy="write_through", prefetch_policy="wait_complete"
    )
    cache = RefCache(config)
    cache.own = cache.decided = Decisions(fetch=Fetch(batch=1))  # progress published per page (FETCH): the base has one page of two fetched and seen
    store = FaultyStorage(MemoryStorage())
    cache.attach_storage(store)
    anchor = list(range(1, 1 + PS))
    _put(cache, None, anchor)
    cache.complete(0)
    cache.poll()  # issues the store copy 1
    cache.complete(1)
    cache.poll()
    cache.evict(PS)
    request = anchor + list(range(50, 50 + 2 * PS))
    pairs = l3.stored_pages(None, request, PS, 2, cache.digest)
    store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])
    assert cache.prefetch(cache.match_prefix(None, request).host_node or 0, None, request) == 2 * PS
    cache.fetch(0)
    return cache.snapshot()


PF_BASE = _prefetch_base()


def _pf(corrupt: Callable[[Snapshot], Snapshot]) -> Callable[[Snapshot], Snapshot]:
    return lambda _: corrupt(PF_BASE)


def _pf_edit(**changes: object) -> Callable[[Snapshot], Snapshot]:
    return _pf(lambda s: replace(s, prefetches=(replace(s.prefetches[0], **changes),)))


def _pf_anchor(**changes: object) -> Callable[[Snapshot], Snapshot]:
    return _pf(lambda s: _edit(s, s.by_id()[s.prefetches[0].anchor], **changes))


def _pf_short(s: Snapshot) -> Snapshot:
    """The prefetch reserves one page less than it asked for; that page is free instead."""
    p = s.prefetches[0]
    return replace(
        s,
        prefetches=(replace(p, host_slots=p.host_slots[PS:]),),
        host_free_slots=tuple(sorted(s.host_free_slots + p.host_slots[:PS])),
    )


CASES += [
    Corruption("INV-PF-1", "the prefetch's anchor lost its host protection", _pf_anchor(host_lock_ref=0), only=True),
    Corruption("INV-PF-1", "the prefetch's anchor left the tree", _pf_edit(anchor=9_999), only=True),
    Corruption("INV-PF-1", "fetched more than requested", _pf_edit(fetched=3 * PS), only=True),
    Corruption("INV-PF-1", "reserves less than it requested", _pf(_pf_short), only=True),
    Corruption(
        "INV-HOST-4", "prefetch reservation leaked", _pf(lambda s: replace(s, host_free_slots=s.host_free_slots[PS:]))
    ),
]


def _retraction_base() -> Snapshot:
    """Two retraction backups: one of a page and a token (two host pages), one of a page."""
    cache = RefCache(CacheConfig(page_size=PS, capacity=4 * PS, host_capacity=4 * PS))
    own = cache.alloc(2 * PS)
    assert cache.retraction_backup(own[: PS + 1]) == 0
    assert cache.retraction_backup(own[:PS]) == 1
    cache.free(own)
    return cache.snapshot()


RT_BASE = _retraction_base()


def _rt(corrupt: Callable[[Snapshot], Snapshot]) -> Callable[[Snapshot], Snapshot]:
    return lambda _: corrupt(RT_BASE)


def _rt_short(s: Snapshot) -> Snapshot:
    """The first backup keeps one host page for its page and a token; the other page is free."""
    r = s.retractions[0]
    return replace(
        s,
        retractions=(replace(r, host_slots=r.host_slots[:PS]), *s.retractions[1:]),
        host_free_slots=tuple(sorted(s.host_free_slots + r.host_slots[PS:])),
    )


CASES += [
    Corruption("INV-RETRACT-1", "a backup holds fewer host pages than its tokens need", _rt(_rt_short), only=True),
    Corruption(
        "INV-RETRACT-1",
        "two backups share an id",
        _rt(lambda s: replace(s, retractions=(s.retractions[0], replace(s.retractions[1], id=s.retractions[0].id)))),
        only=True,
    ),
    Corruption(
        "INV-HOST-4",
        "a retraction backup's host slots leaked",
        _rt(lambda s: replace(s, retractions=s.retractions[:1])),
    ),
    Corruption(
        "INV-HOST-5",
        "a backup and the free list own one host slot",
        _rt(
            lambda s: replace(
                s, retractions=(replace(s.retractions[1], host_slots=s.host_free_slots[:PS]),) + s.retractions[:1]
            )
        ),
    ),
]


def _session_base() -> Snapshot:
    """BASE's tree with sessions: high "h" holds LEAF_9's path, low "l" holds HEAD's, low "x" LEAF_30's."""
    cache = RefCache(CacheConfig(page_size=PS, capacity=48, policy="lru", high_priority_threshold=2))
    _put(cache, None, list(range(1, 13)))
    locked = _put(cache, None, [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23])
    side = _put(cache, None, [30, 31, 32, 33])
    cache.inc_lock_ref(locked)
    leaf = cache.match_prefix(None, list(range(1, 13))).node
    head = cache.match_prefix(None, list(range(1, 9))).node
    cache.register_ref("h", leaf, 5)
    cache.register_ref("l", head, 0)
    cache.register_ref("x", side, 1)
    return cache.snapshot()


SS_BASE = _session_base()
SS_LEAF = _node(SS_BASE, None, tuple(range(1, 13)))
SS_HEAD = _node(SS_BASE, None, tuple(range(1, 9)))


def _ss(corrupt: Callable[[Snapshot], Snapshot]) -> Callable[[Snapshot], Snapshot]:
    return lambda _: corrupt(SS_BASE)


def _session(s: Snapshot, name: str, **changes: object) -> Snapshot:
    return replace(s, sessions=tuple(replace(x, **changes) if x.id == name else x for x in s.sessions))


CASES += [
    Corruption("INV-TIER-1", "a split head without its suffix's refs", _ss(lambda s: _edit(s, SS_HEAD, high_ref=0))),
    Corruption("INV-TIER-1", "a ref kept past the session", _ss(lambda s: replace(s, sessions=s.sessions[:1]))),
    Corruption("INV-TIER-1", "a session on a deleted node", _ss(lambda s: _session(s, "x", node=999)), only=True),
    Corruption("INV-TIER-1", "a demoted session still high", _ss(lambda s: _session(s, "h", demoted=True)), only=True),
    Corruption("INV-TIER-1", "below threshold yet high", _ss(lambda s: _session(s, "x", high=True))),
    Corruption(
        "INV-TIER-2",
        "tier sizes drift",
        _ss(lambda s: replace(s, tier_evictable=(s.tier_evictable[0] + PS, s.tier_evictable[1], s.tier_evictable[2]))),
        only=True,
    ),
]


def test_session_base_is_what_the_cases_assume() -> None:
    assert check_snapshot(SS_BASE) == []
    assert (SS_LEAF.high_ref, SS_LEAF.low_ref) == (1, 0) and (SS_HEAD.high_ref, SS_HEAD.low_ref) == (1, 1)
    assert [(x.id, x.high) for x in SS_BASE.sessions] == [("h", True), ("l", False), ("x", False)]
    # HEAD is locked (through LEAF_20); LEAF_9 is HIGH_REF, LEAF_30 LOW_REF; nothing evictable is UNUSED
    assert SS_BASE.tier_evictable == (0, PS, PS)


def test_retraction_base_is_what_the_cases_assume() -> None:
    assert check_snapshot(RT_BASE) == []
    assert [(r.tokens, len(r.host_slots)) for r in RT_BASE.retractions] == [(PS + 1, 2 * PS), (PS, PS)]


def test_prefetch_base_is_what_the_cases_assume() -> None:
    assert check_snapshot(PF_BASE) == []
    (p,) = PF_BASE.prefetches
    assert p.requested == 2 * PS and p.fetched == PS and not p.failed and len(p.host_slots) == 2 * PS
    assert PF_BASE.by_id()[p.anchor].host_lock_ref == 1


def test_host_base_is_what_the_cases_assume() -> None:
    assert check_snapshot(HOST_BASE) == []
    assert H_TAIL.slots is None and H_TAIL.host_slots is not None and H_TAIL.parent == H_HEAD.id
    assert H_HEAD.slots is not None and H_HEAD.host_slots is not None
    assert [(c.kind, c.nodes) for c in HOST_BASE.pending] == [("write", (H_WRITING.id,)), ("load", (H_LOADING.id,))]
    assert H_WRITING.lock_ref == 1 and H_LOADING.lock_ref == 1 and H_LOADING.host_lock_ref == 1


def test_base_is_what_the_cases_assume() -> None:
    assert check_snapshot(BASE) == []
    assert HEAD.lock_ref == 1 and LEAF_20.lock_ref == 1 and LEAF_9.lock_ref == 0
    assert LEAF_9.parent == HEAD.id and LEAF_20.parent == HEAD.id
    assert LEAF_30.parent == BASE.root and HEAD.parent == BASE.root
    assert LORA_LEAF.parent == LORA_HEAD.id and LORA_HEAD.parent == BASE.root
    assert len(BASE.free_slots) >= PS and BASE.evictable_size > 0 and BASE.protected_size > 0


def test_every_invariant_has_a_corruption_case() -> None:
    assert {c.inv for c in CASES} == set(SNAPSHOT_INVARIANTS)


@pytest.mark.parametrize("inv", sorted(SNAPSHOT_INVARIANTS))
def test_valid_snapshot_passes_each_checker(inv: str) -> None:
    assert SNAPSHOT_INVARIANTS[inv](BASE) == []
    assert SNAPSHOT_INVARIANTS[inv](HOST_BASE) == []


@pytest.mark.parametrize("case", CASES, ids=[f"{c.inv}:{c.name}" for c in CASES])
def test_corruption_is_flagged_with_its_id(case: Corruption) -> None:
    bad = case.corrupt(BASE)
    assert bad != BASE
    assert SNAPSHOT_INVARIANTS[case.inv](bad), f"{case.inv} checker missed: {case.name}"
    found = {v.inv for v in check_snapshot(bad)}
    assert case.inv in found
    if case.only:
        assert found == {case.inv}
    if case.inv == "INV-TREE-1":
        # Structure first: nothing else runs on a snapshot whose links are broken.
        assert found == {"INV-TREE-1"}


def test_rooted_keeps_the_tree_the_root_reaches() -> None:
    """Setting INV-TREE-1 aside (SPEC.md §6.4) cuts the snapshot to the root's tree, so every other rule still reads
    it: a detached node goes, and so does a node below it and both holders of a duplicated id; a sound tree stays."""
    assert rooted(BASE) is BASE
    detached = _edit(BASE, HEAD, parent=999)  # HEAD and everything below it leave the root's tree
    kept = {n.id for n in rooted(detached).nodes}
    assert kept == {n.id for n in BASE.nodes} - {HEAD.id, LEAF_9.id, LEAF_20.id}
    assert check_snapshot(rooted(detached)) != []  # what the cut leaves is judged: HEAD's locks now leak
    twice = replace(BASE, nodes=(*BASE.nodes, LEAF_30))
    assert LEAF_30.id not in {n.id for n in rooted(twice).nodes}
    assert rooted(replace(BASE, root=999)).root == 999  # no root, no tree to cut to: left as it is


def test_violation_renders_its_id() -> None:
    assert str(Violation("INV-SLOT-1", "slot 3 owned 2 times")) == "INV-SLOT-1: slot 3 owned 2 times"


def test_paging_rule_is_off_at_page_size_one() -> None:
    cache = RefCache(CacheConfig(page_size=1, capacity=8))
    _put(cache, None, [1, 2, 3])
    s = cache.snapshot()
    (leaf,) = [n for n in s.nodes if n.id != s.root]
    scrambled = _edit(s, leaf, slots=tuple(reversed(leaf.slots)))
    assert check_snapshot(scrambled) == []
    # The same scramble is a violation once slots come in pages.
    paged = replace(scrambled, page_size=3, capacity=6, slot_limit=6, free_slots=(3, 4, 5))
    assert [v.inv for v in check_snapshot(paged)] == ["INV-SLOT-4"]
