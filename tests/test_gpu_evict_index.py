"""`kvcert.gpu.evict_index` on hand-built nodes: memberships, heap order, lazy deletion, tiers, compaction."""

from __future__ import annotations

import pytest

from kvcert.gpu.evict_index import EvictionIndex
from kvcert.gpu.node import Node
from kvcert.gpu.run import EMPTY, Run
from kvcert.spec import pages
from kvcert.spec.types import HIGH_REF, LOW_REF, POLICIES


class Tree:
    """A root and a node table, as `RadixTree` keeps them; nodes are hung below the root by hand."""

    def __init__(self, policy: str = "lru", write_back: bool = False) -> None:
        self.root = Node(0, None, None, EMPTY)
        self.root.slots = EMPTY
        self.nodes = {0: self.root}
        self.index = EvictionIndex(self.root, policy, write_back, host=True)

    def leaf(self, nid: int, at: int, parent: Node | None = None, device: bool = True, host: bool = False) -> Node:
        parent = parent or self.root
        n = Node(nid, parent, None, Run.of_ints((nid,)))
        n.slots = Run.of_ints((nid,)) if device else None
        n.host_slots = Run.of_ints((nid,)) if host else None
        n.last_access = at
        parent.children[n.key.raw] = n
        if device:
            parent.dev_children += 1
        self.nodes[nid] = n
        self.index.refresh(n)
        self.index.refresh(parent)
        return n

    def drain(self, **scope: bool) -> list[int]:
        out = []
        while (n := self.index.pop_device(self.nodes, **scope)) is not None:
            out.append(n.id)
        return out


def test_refresh_derives_each_membership() -> None:
    t = Tree()
    a = t.leaf(1, 5)
    b = t.leaf(2, 6, parent=a)
    idx = t.index
    assert idx.dev_leaves == {2}  # a has a child on the device
    b.lock_ref = 1
    idx.refresh(b)
    assert idx.dev_leaves == set()
    b.lock_ref = 0
    b.slots, a.dev_children = None, 0  # b is host only now (a backup assumed), a is a device leaf
    b.host_slots = Run.of_ints((2,))
    idx.refresh(b)
    idx.refresh(a)
    assert idx.dev_leaves == {1} and idx.host_leaves == {2}
    b.host_lock_ref = 1
    idx.refresh(b)
    assert idx.host_leaves == set()
    idx.refresh(t.root)  # the root is never a candidate
    assert 0 not in idx.dev_leaves
    idx.forget(1)
    assert idx.dev_leaves == set()


def test_pops_go_by_rank_and_skip_stale_entries() -> None:
    t = Tree()
    for nid, at in ((1, 5), (2, 3), (3, 9)):
        t.leaf(nid, at)
    n2 = t.nodes[2]
    n2.last_access = 10  # re-ranked: its old entry goes stale, a new one is pushed
    t.index.refresh(n2)
    assert len(t.index.dev_heap) == 4 and n2.dev_pushed == (10, 2)
    assert t.drain() == [1, 3, 2]
    assert t.index.dev_heap == []  # the stale entry was popped and dropped


def test_a_node_out_of_the_set_is_not_popped() -> None:
    t = Tree()
    t.leaf(1, 1)
    t.leaf(2, 2)
    t.nodes[1].lock_ref = 1
    t.index.refresh(t.nodes[1])
    assert t.drain() == [2]
    del t.nodes[2]  # a node gone from the table: its entry is skipped
    t.leaf(3, 0)
    t.nodes.pop(3)
    assert t.drain() == []


def test_tiers_have_their_own_heaps_and_the_scope_picks_them() -> None:
    t = Tree()
    for nid, at, high, low in ((1, 1, 0, 0), (2, 2, 0, 2), (3, 3, 1, 0), (4, 0, 0, 1)):
        n = Node(nid, t.root, None, Run.of_ints((nid,)))
        n.slots, n.last_access, n.high_ref, n.low_ref = Run.of_ints((nid,)), at, high, low
        n.tier = HIGH_REF if high else LOW_REF if low else 0
        t.nodes[nid] = n
        t.index.refresh(n)
    idx = t.index
    assert idx.dev_heap == [(1, 1)] and sorted(idx.dev_heap_low) == [(0, 0, 1, 0, 4), (0, 0, 2, 2, 2)]
    assert idx.dev_heap_high == [(0, 0, 1, 0, 3, 3)]  # (retained, -deadline, high_ref, low_ref, *rank, id)
    assert t.drain(allow_low=False, allow_high=False) == [1]
    assert t.drain(allow_low=True, allow_high=False) == [4, 2]  # fewer low refs first
    assert t.drain() == [3]


def test_host_eviction_never_ranks_a_high_ref_copy() -> None:
    t = Tree()
    n = t.leaf(1, 1, device=False, host=True)
    n.high_ref, n.tier = 1, HIGH_REF
    t.index.refresh(n)
    assert 1 in t.index.host_leaves and n.host_pushed is None
    assert t.index.pop_host(t.nodes) is None  # its UNUSED entry went stale: it is no host candidate now
    n.high_ref, n.low_ref, n.tier = 0, 1, LOW_REF  # a demotion
    t.index.refresh(n)
    assert t.index.host_heap_low == [(0, 0, 1, 1, 1)] and t.index.pop_host(t.nodes) is n


def test_settled_duplicates_go_oldest_first() -> None:
    t = Tree(write_back=True)
    for nid in (3, 1, 2):
        t.leaf(nid, nid, host=True)
    idx = t.index
    assert set(idx.dups) == {1, 2, 3}
    t.nodes[1].copies.append(object())  # type: ignore[arg-type]  # a pending copy: no longer settled
    idx.refresh(t.nodes[1])
    assert set(idx.dups) == {2, 3}
    got = [idx.pop_dup() for _ in range(3)]
    assert [n.id if n else None for n in got] == [None, 2, 3]  # id 1's heap entry is stale


def test_compaction_rebuilds_without_losing_a_candidate() -> None:
    t = Tree()
    leaves = [t.leaf(nid, nid) for nid in range(1, 6)]
    held = leaves[0]
    held.lock_ref = 1
    t.index.refresh(held)  # out of the set; its entry stays behind
    for at in range(100):
        n = leaves[1 + at % 4]
        n.last_access = 10 + at
        t.index.refresh(n)
    assert len(t.index.dev_heap) > 4 * 4 + 64
    t.index.compact(t.nodes)
    assert len(t.index.dev_heap) == 4 and held.dev_pushed is None
    held.lock_ref = 0
    t.index.refresh(held)
    assert t.drain() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("policy", POLICIES)
def test_entries_rank_as_the_spec_says(policy: str) -> None:
    t = Tree(policy)
    n = t.leaf(7, 4)
    n.hit_count, n.creation, n.priority = 3, 2, 5
    shape = {"depth": n.end, "size": n.size, "history": n.history} if policy == "tlru" else {}
    assert t.index.entry(n) == (*pages.policy_rank(policy, 4, 3, 2, 5, **t.index.params, **shape), 7)
    n.low_ref = 2
    assert t.index.tier_entry(n) == (0, 0, 2, *t.index.entry(n))
    n.retained = {9: 1, 12: 2}  # held by retentions ending at 9 and 12: it counts the earlier (SPEC.md §11.7)
    assert t.index.tier_entry(n) == (1, -9, 2, *t.index.entry(n))
