"""`kvcert.gpu.host.HostTier`, called directly on a cache's tree: room, backups, host eviction, load-back."""

from __future__ import annotations

from kvcert.conformance.harness import scheduler
from kvcert.gpu.cache import GpuCache
from kvcert.gpu.host import HostTier
from kvcert.gpu.node import Node
from kvcert.spec.types import CacheConfig


def cache_of(**kw: object) -> tuple[GpuCache, HostTier]:
    config = CacheConfig(**{"page_size": 1, "capacity": 16, "host_capacity": 8, **kw})  # type: ignore[arg-type]
    cache = GpuCache(config)
    assert cache.host is not None
    return cache, cache.host


def put(cache: GpuCache, tokens: tuple[int, ...]) -> Node:
    """The caller's side of an insert (`conformance.harness.scheduler`)."""
    return cache.nodes[scheduler.insert_request(cache, None, tokens).node]


def settle(cache: GpuCache) -> None:
    scheduler.settle(cache)


def test_write_through_backs_up_parents_first_in_one_copy() -> None:
    cache, host = cache_of()
    a = put(cache, (1, 2))
    b = put(cache, (1, 2, 3))
    assert a.host_slots is not None and b.host_slots is not None and len(cache.copies) == 2
    assert a.lock_ref == 2 and b.lock_ref == 1  # each write locks its node's path until its ack
    settle(cache)
    assert (a.lock_ref, b.lock_ref) == (0, 0) and host.alloc.available == 5
    cache.inject_fault("host_alloc")
    orphan = put(cache, (7, 8))
    assert orphan.host_slots is None and host.alloc.available == 5
    cache.inject_fault("host_alloc")
    child = put(cache, (7, 8, 9))  # the parent's retry fails: the child is not tried (INV-HOST-2)
    assert orphan.host_slots is None and child.host_slots is None
    assert host.alloc.failures == 0 and host.alloc.available == 5


def test_take_makes_room_by_host_eviction_and_honours_an_armed_fault() -> None:
    cache, host = cache_of()
    for i in range(4):
        put(cache, (10 + i, 20 + i))
    settle(cache)
    cache.evict(16)  # every node host only now
    assert host.alloc.available == 0 and len(cache.index.host_leaves) == 4
    got = host.take(3)  # the shortfall: two leaves of two tokens
    assert got is not None and len(got) == 3 and len(cache.nodes) == 3
    host.alloc.failures = 1
    assert host.take(1) is None and host.alloc.failures == 0
    assert host.take(3, reclaim_all=True) is not None and len(cache.nodes) == 1  # D17: evicts all 3, not the 2 short


def test_host_eviction_reclaims_duplicates_oldest_first_then_leaves_by_rank() -> None:
    cache, host = cache_of(write_policy="write_back")
    nodes = []
    for i in range(3):
        cache.set_clock(i + 1)
        nodes.append(put(cache, (i, i)))
    cache.evict(6)  # write-back backs each victim up at eviction: all three host only
    for n in (nodes[2], nodes[0]):
        cache.load_back(n.id)
    settle(cache)
    assert set(cache.index.dups) == {nodes[0].id, nodes[2].id}  # on both tiers, settled
    assert host.evict(1) == 2 and nodes[0].host_slots is None and nodes[2].host_slots is not None
    assert host.evict(1) == 2 and nodes[2].host_slots is None and nodes[1].id in cache.nodes
    assert host.evict(1) == 2 and nodes[1].id not in cache.nodes  # no duplicate left: the host-only leaf


def test_host_only_leaves_go_by_rank() -> None:
    cache, host = cache_of()
    nodes = []
    for i, at in enumerate((3, 1, 2)):
        cache.set_clock(at)
        nodes.append(put(cache, (i, i)))
    settle(cache)
    cache.evict(16)
    host.evict(3)
    assert [n.id in cache.nodes for n in nodes] == [True, False, False]  # LRU: clock 1, then 2


def test_deleting_a_host_subtree_hands_its_sessions_to_the_parent() -> None:
    cache, host = cache_of()
    top = put(cache, (1, 2))
    leaf = put(cache, (1, 2, 3, 4))
    settle(cache)
    cache.evict(16)
    cache.register_ref("s", leaf.id, 0)
    host.delete_subtree(top)
    assert set(cache.nodes) == {0} and cache.sessions["s"].node is cache.root and host.alloc.available == 8


def test_load_back_refuses_under_its_threshold_and_without_room() -> None:
    cache, host = cache_of(load_back_threshold=3)
    short = put(cache, (5, 6))
    settle(cache)
    cache.evict(16)
    assert host.load_back(short) == 0  # 2 tokens, threshold 3
    host.load_back_threshold = 1
    blocker = cache.alloc(16)  # the device is full of lent slots: no room to make
    assert host.load_back(short) == 0 and short.slots is None and short.host_lock_ref == 0
    cache.free(blocker)
    assert host.load_back(short) == 2 and short.slots is not None
    (copy,) = cache.copies.values()
    assert copy.kind == "load" and short.host_lock_ref == 1 and short.hl_owners == [copy]
    settle(cache)
    assert short.host_lock_ref == 0 and short.lock_ref == 0


def test_a_high_ref_copy_goes_only_after_a_demotion() -> None:
    cache, host = cache_of(high_priority_threshold=1)
    n = put(cache, (3, 4))
    settle(cache)
    cache.register_ref("hi", n.id, 1)
    cache.evict(16)
    assert host.evict(2) == 2  # no UNUSED or LOW_REF leaf: the idle high session is demoted, then its copy goes
    assert cache.sessions["hi"].demoted and list(cache.demotions) == ["hi"] and n.id not in cache.nodes
