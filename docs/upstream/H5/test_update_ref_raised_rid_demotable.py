"""A rid raised to high priority by /update_ref is never a demotion candidate of the host-tier cache.

RefAwareHiRadixCache queues an idle high rid on its idle-high heap (_push_idle_hp) when register_ref registers it as
high and when _adaptive_restore restores it; update_ref (reached from /update_ref through Scheduler.handle_update_ref)
moves a rid's refs to the high class and queues nothing. Under host pressure evict_host(allow_high=True) demotes the
queued rid with the fewest tokens, "shortest HP request(s) first", and falls back to evicting HIGH_REF host copies
directly only when the heap is empty. A raised rid is skipped by the first and taken by the second: a longer high
conversation is demoted and loses its host KV where the shortest-first rule would have taken the raised one.

Run: python -m pytest -q test_update_ref_raised_rid_demotable.py  (fails on the RefAware fork; passes with fix.patch)
"""

import unittest
from collections import OrderedDict
from types import SimpleNamespace

import torch
from sglang.srt.managers.io_struct import UpdateRefReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import (
    RadixKey,
    TreeNode,
    _key_match_page_size1,
    get_child_key,
)
from sglang.srt.mem_cache.ref_aware_hiradix_cache import RefAwareHiRadixCache


class _DummyHostPool:
    def __init__(self, available_size):
        self._available_size = available_size

    def available_size(self):
        return self._available_size


class _DummyCacheController:
    """The fork's own test double (test_ref_aware_kv_cache.py): records host frees."""

    def __init__(self):
        self.mem_pool_host = _DummyHostPool(0)
        self.write_policy = "write_through"
        self.evicted_host_lengths = []

    def evict_host(self, host_indices):
        self.evicted_host_lengths.append(len(host_indices))
        return len(host_indices)


def _make_cache():
    """The fork's _HiRadixHarness._make_cache (test_ref_aware_kv_cache.py)."""
    cache = RefAwareHiRadixCache.__new__(RefAwareHiRadixCache)
    cache.root_node = TreeNode()
    cache.root_node.key = RadixKey([])
    cache.root_node.value = torch.tensor([], dtype=torch.int64)
    cache.root_node.lock_ref = 1
    cache.high_priority_threshold = 1
    cache._enable_priority_scheduling = True
    cache.unused_evictable_leaves = set()
    cache.low_ref_evictable_leaves = set()
    cache.high_ref_evictable_leaves = set()
    cache.unused_evictable_size_ = 0
    cache.low_ref_evictable_size_ = 0
    cache.high_ref_evictable_size_ = 0
    cache.evictable_host_leaves = set()
    cache.rid_to_ref_info = {}
    cache.ongoing_write_through = {}
    cache.eviction_strategy = SimpleNamespace(get_priority=lambda node: node.last_access_time)
    cache.cache_controller = _DummyCacheController()
    cache._adaptively_demoted_rids = OrderedDict()
    cache._idle_hp_heap = []
    cache._idle_hp_rids = set()
    cache._evict_scope_stack = []
    cache.evictable_leaves = set()
    cache.page_size = 1
    cache.get_child_key_fn = get_child_key
    cache.key_match_fn = _key_match_page_size1
    cache.enable_kv_cache_events = False
    cache._last_inserted_node = None
    cache.metrics_collector = None
    cache.evictable_size_ = 0
    return cache


def _host_only_node(cache, token_ids):
    """A conversation's prefix the device has evicted: its copy is on the host only."""
    node = TreeNode()
    node.parent = cache.root_node
    node.key = RadixKey(token_ids)
    node.value = None
    node.host_value = torch.tensor(token_ids, dtype=torch.int64)
    node.children = {}
    cache.root_node.children[token_ids[0]] = node
    cache.evictable_host_leaves.add(node)
    return node


def _scheduler(cache):
    sched = Scheduler.__new__(Scheduler)
    sched.enable_ref_aware_kv_buffer = True
    sched.tree_cache = cache
    sched.running_batch = None
    sched.waiting_queue = []
    sched.chunked_req = None
    return sched


class TestUpdateRefRaisedRidDemotable(unittest.TestCase):
    def test_host_pressure_demotes_the_shortest_high_rid_raised_or_registered(self):
        cache = _make_cache()
        sched = _scheduler(cache)
        long = _host_only_node(cache, [1, 2, 3, 4, 5, 6])
        short = _host_only_node(cache, [7, 8])
        # A high conversation of six tokens finishes a turn; a low one of two tokens finishes a turn ...
        sched._maybe_register_ref(SimpleNamespace(rid="long", priority=2, last_node=long))
        sched._maybe_register_ref(SimpleNamespace(rid="short", priority=0, last_node=short))
        # ... and its client raises it to high before its next turn, as the fork asks.
        out = sched.handle_update_ref(UpdateRefReqInput(rid="short", new_priority=2))
        self.assertTrue(out.success, out.message)

        # Host pressure for two tokens: demote the shortest idle high rid, evict what it now holds as LOW_REF.
        freed = cache.evict_host(2, allow_high=True)

        self.assertEqual(freed, 2)
        self.assertEqual(list(cache._adaptively_demoted_rids), ["short"])
        self.assertIsNotNone(long.host_value)  # the six-token conversation keeps its host copy and its class
        self.assertTrue(cache.rid_to_ref_info["long"].is_high)


if __name__ == "__main__":
    unittest.main()
