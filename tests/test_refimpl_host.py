"""The host tier of the reference model (SPEC.md §9), one rule per test."""

from __future__ import annotations

import pytest

from kvcert.refimpl import RefCache
from kvcert.spec.contracts import NodeShape, shape_difference
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.types import CacheConfig, UnknownCopy


def make(write_policy: str = "write_through", capacity: int = 16, host: int = 32, threshold: int = 1) -> RefCache:
    return RefCache(
        CacheConfig(capacity=capacity, host_capacity=host, write_policy=write_policy, load_back_threshold=threshold)
    )


def put(cache: RefCache, tokens: list[int], namespace: str | None = None) -> int:
    slots = cache.alloc(len(tokens))
    out = cache.insert(namespace, tokens, slots)
    cache.free(slots[: out.prefix_len])
    assert check_snapshot(cache.snapshot()) == []
    return out.node


def settle(cache: RefCache) -> None:
    for copy in list(cache.copies):
        if not copy.finished:
            cache.complete(copy.id)
    cache.poll()


def test_write_through_backs_up_on_insert_and_locks_until_the_ack() -> None:
    c = make()
    node = c.nodes[put(c, [1, 2, 3])]
    assert node.host_slots is not None and node.lock_ref == 1 and c.protected_size == 3
    assert [(p.kind, p.nodes) for p in c.snapshot().pending] == [("write", (node.id,))]
    c.complete(0)
    assert node.lock_ref == 1, "finished is not acknowledged: the lock waits for poll"
    assert c.poll() == 1 and node.lock_ref == 0 and c.evictable_size == 3 and not c.copies


def test_selective_waits_for_the_second_hit() -> None:
    c = make("write_through_selective")
    node = c.nodes[put(c, [1, 2])]
    assert node.host_slots is None and not c.copies
    put(c, [1, 2])
    assert node.host_slots is not None and len(c.copies) == 1


def test_write_back_backs_up_at_eviction_synchronously() -> None:
    c = make("write_back")
    node = c.nodes[put(c, [1, 2])]
    assert node.host_slots is None and not c.copies
    assert c.evict(2) == 2
    assert node.slots is None and node.host_slots is not None and not c.copies
    assert check_snapshot(c.snapshot()) == []


def test_acks_are_consumed_in_issue_order() -> None:
    c = make()
    first, second = c.nodes[put(c, [1])], c.nodes[put(c, [2])]
    c.complete(1)
    assert c.poll() == 0 and second.lock_ref == 1, "the finished second ack waits behind the first"
    c.complete(0)
    assert c.poll() == 2 and first.lock_ref == second.lock_ref == 0
    with pytest.raises(UnknownCopy):
        c.complete(0)


def test_demotion_and_the_host_hit() -> None:
    c = make()
    put(c, [1, 2, 3, 4])
    settle(c)
    put(c, [1, 2, 5, 6])  # splits after 2; the new leaf's write stays pending
    settle(c)
    assert c.evict(2) == 2  # LRU: (3, 4) goes, demoted
    m = c.match_prefix(None, [1, 2, 3, 4])
    assert (m.length, m.host_length) == (2, 2)
    assert c.nodes[m.host_node].key == (3, 4) and c.nodes[m.host_node].slots is None


def test_load_back_threshold_all_or_nothing_and_protection() -> None:
    c = make(capacity=8, threshold=2)
    put(c, [1, 2, 3, 4])
    settle(c)
    c.evict(4)  # (1..4) demoted: the device is empty
    b, d = put(c, [9, 9, 9, 9]), put(c, [8, 8, 8, 8])
    settle(c)
    c.inc_lock_ref(b)
    c.inc_lock_ref(d)  # the device is full and nothing can be evicted
    tip = c.match_prefix(None, [1, 2, 3, 4]).host_node
    assert tip is not None and c.nodes[tip].slots is None
    before = c.snapshot()
    assert c.load_back(tip) == 0 and c.snapshot() == before, "all or nothing"
    c.dec_lock_ref(d)
    assert c.load_back(tip) == 4, "evicting (8..8) makes room"
    node = c.nodes[tip]
    assert node.slots is not None and node.lock_ref == 1 and node.host_lock_ref == 1
    assert c.nodes[d].slots is None, "the victim was demoted, not lost"
    assert [p.kind for p in c.snapshot().pending] == ["load"]
    settle(c)
    assert node.lock_ref == 0 and node.host_lock_ref == 0
    tiny = make(threshold=3)
    put(tiny, [5, 6])
    settle(tiny)
    tiny.evict(2)
    assert tiny.load_back(tiny.match_prefix(None, [5, 6]).host_node or 0) == 0, "below the threshold"


def test_insert_restores_an_evicted_node_and_keeps_its_host_copy() -> None:
    c = make()
    node = c.nodes[put(c, [1, 2, 3])]
    settle(c)
    host = node.host_slots
    c.evict(3)
    assert node.slots is None
    slots = c.alloc(5)
    out = c.insert(None, [1, 2, 3, 4, 5], slots)
    assert out.prefix_len == 0, "nothing was on the device: the caller frees no duplicates"
    assert node.slots == slots[:3] and node.host_slots == host
    assert check_snapshot(c.snapshot()) == []


def test_a_split_during_a_write_moves_both_halves() -> None:
    c = make()
    tail = c.nodes[put(c, [1, 2, 3, 4])]
    c.match_prefix(None, [1, 2, 9])  # splits the in-flight node after 2
    head = tail.parent
    assert head is not None and head is not c.root
    (copy,) = c.copies
    assert {n.id for n in copy.nodes} == {tail.id, head.id}
    assert head.host_slots is not None and tail.host_slots is not None and head.lock_ref == 1
    settle(c)
    assert head.lock_ref == tail.lock_ref == 0


def test_host_eviction_takes_only_unprotected_host_only_leaves() -> None:
    c = make()
    put(c, [1, 2])
    put(c, [3, 4])
    settle(c)
    assert c.evict_host(4) == 0, "both are still on the device"
    c.evict(2)  # demotes (1, 2)
    assert c.evict_host(4) == 2 and len(c.host.free_list) == 30  # type: ignore[union-attr]
    assert check_snapshot(c.snapshot()) == []


def test_residency_and_host_lock_differences_name_their_invariants() -> None:
    spec = NodeShape(size=2, lock_ref=0, on_device=True, backed_up=True, host_lock_ref=0)
    assert shape_difference(spec, spec) is None
    assert shape_difference(NodeShape(2, 1, True, True, 0), spec) == "INV-LOCK-2"
    assert shape_difference(NodeShape(2, 0, False, True, 0), spec) == "INV-HOST-10"
    assert shape_difference(NodeShape(2, 0, True, True, 1), spec) == "INV-HOST-11"


# ----------------------------------------------------------------- decided by calibration (SPEC.md §9.1, §9.2, §9.4)


def test_one_insert_issues_one_write_copy_for_every_node_it_backs_up() -> None:
    c = make("write_through_selective")
    put(c, [1, 1])
    c.match_prefix(None, [1])  # splits [1] | [1]
    put(c, [1, 1])  # both halves reach two hits
    assert len(c.copies) == 1, "the writes of one operation form one copy"
    head, tail = sorted((n for n in c.nodes.values() if n is not c.root), key=lambda n: n.id)[::-1]
    assert set(c.snapshot().pending[0].nodes) == {head.id, tail.id}
    assert head.lock_ref == 2 and tail.lock_ref == 1
    settle(c)
    assert head.lock_ref == tail.lock_ref == 0 and c.protected_size == 0 and c.evictable_size == 2


def test_a_host_only_node_can_be_locked_and_then_is_neither_evictable_nor_host_evictable() -> None:
    c = make()
    node = c.nodes[put(c, [1, 2])]
    settle(c)
    c.evict(2)
    assert node.slots is None
    c.inc_lock_ref(node.id)
    assert node.lock_ref == 1 and c.protected_size == 0 and c.evictable_size == 0, "no device tokens to count"
    assert c.evict_host(2) == 0 and node.id in c.nodes, "a locked host-only node is not a host leaf"
    c.dec_lock_ref(node.id)
    assert c.evict_host(2) == 2 and node.id not in c.nodes


def test_a_node_restored_while_locked_counts_as_protected() -> None:
    c = make()
    node = c.nodes[put(c, [1, 2])]
    settle(c)
    c.evict(2)
    c.inc_lock_ref(node.id)
    put(c, [1, 2])  # restores it with the request's slots
    assert node.slots is not None and c.protected_size == 2 and c.evictable_size == 0
    c.dec_lock_ref(node.id)
    assert c.protected_size == 0 and c.evictable_size == 2


def test_a_split_of_a_loading_node_host_locks_both_halves_and_the_ack_releases_both() -> None:
    c = make()
    node = c.nodes[put(c, [1, 2, 3, 4])]
    settle(c)
    c.evict(4)
    assert c.load_back(node.id) == 4 and node.host_lock_ref == 1
    put(c, [1, 2])  # splits the loading node
    head = node.parent
    assert head is not None and head is not c.root and head.host_lock_ref == 1 and node.host_lock_ref == 1
    assert set(c.snapshot().pending[0].nodes) == {head.id, node.id}
    settle(c)
    assert head.host_lock_ref == node.host_lock_ref == 0 and head.lock_ref == node.lock_ref == 0


def test_load_back_host_protects_only_the_node_it_loads() -> None:
    c = make()
    upper = c.nodes[put(c, [1, 2])]
    lower = c.nodes[put(c, [1, 2, 3, 4])]
    settle(c)
    c.evict(4)
    assert upper.slots is None and lower.slots is None
    assert c.load_back(lower.id) == 4
    assert lower.host_lock_ref == 1 and upper.host_lock_ref == 0 and upper.lock_ref == 1


def test_write_back_host_eviction_first_drops_settled_duplicates() -> None:
    c = make("write_back", capacity=8, host=4)
    d = c.nodes[put(c, [1, 2])]
    c.evict(2)  # backed up at eviction, demoted
    put(c, [1, 2])  # restored: on both tiers, settled
    h = c.nodes[put(c, [3, 4])]
    c.set_clock(5)
    c.match_prefix(None, [1, 2])  # `d` is now the most recent: `h` is evicted next
    c.evict(2)
    assert h.slots is None and h.host_slots is not None and d.slots is not None and d.host_slots is not None
    assert c.evict_host(2) == 2
    assert d.host_slots is None and d.slots is not None and h.id in c.nodes, "the duplicate goes before the leaf"
    assert c.evict_host(2) == 2 and h.id not in c.nodes
    assert check_snapshot(c.snapshot()) == []


def test_write_through_keeps_duplicates_and_evicts_host_only_leaves() -> None:
    c = make("write_through", capacity=8, host=4)
    d = c.nodes[put(c, [1, 2])]
    settle(c)
    assert c.evict_host(2) == 0 and d.host_slots is not None, "write-through never strips a device node's backup"


# ----------------------------------------------------------------- injected faults (SPEC.md §10.5)


def test_a_failed_host_allocation_means_no_backup_and_no_write() -> None:
    c = make()
    c.inject_fault("host_alloc")
    node = c.nodes[put(c, [1, 2])]
    assert node.host_slots is None and not c.copies and c.armed_faults["host_alloc"] == 0
    put(c, [1, 2, 3, 4])  # the fault is spent: the parent is backed up now, and so the child
    assert node.host_slots is not None and len(c.copies) == 1


def test_write_back_drops_a_victim_whose_backup_failed() -> None:
    c = make("write_back")
    node = c.nodes[put(c, [1, 2])]
    c.inject_fault("host_alloc")
    assert c.evict(2) == 2 and node.id not in c.nodes, "dropped, never demoted without a copy"
    assert check_snapshot(c.snapshot()) == []
