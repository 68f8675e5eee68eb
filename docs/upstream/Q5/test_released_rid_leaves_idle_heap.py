"""A released high-priority rid stays queued on the host-tier cache's idle-high heap.

RefAwareHiRadixCache.register_ref queues every idle high rid as a demotion candidate (_push_idle_hp: one entry in
_idle_hp_heap and one in its mirror set _idle_hp_rids). release_ref (reached from /release_ref through
Scheduler.handle_release_ref) leaves the entry. Only a demotion scan (_select_shortest_hp_rid, run from
evict_host(allow_high=True) when the host pool is full) drops stale entries, and only from the top of the heap. On a
server whose host pool is seldom full, memory grows by two entries per high-priority conversation served.

Run: python -m pytest -q test_released_rid_leaves_idle_heap.py  (fails on the RefAware fork; passes with fix.patch)
"""

import unittest
from collections import OrderedDict
from types import SimpleNamespace

import torch
from sglang.srt.managers.io_struct import ReleaseRefReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import (
    RadixKey,
    TreeNode,
    _key_match_page_size1,
    get_child_key,
)
from sglang.srt.mem_cache.ref_aware_hiradix_cache import RefAwareHiRadixCache


def _make_cache():
    """The fork's _HiRadixHarness._make_cache (test_ref_aware_kv_cache.py), without the host pool it does not use."""
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
    cache._adaptively_demoted_rids = OrderedDict()
    cache._idle_hp_heap = []
    cache._idle_hp_rids = set()
    cache._evict_scope_stack = []
    cache.evictable_leaves = set()
    cache.page_size = 1
    cache.get_child_key_fn = get_child_key
    cache.key_match_fn = _key_match_page_size1
    cache._last_inserted_node = None
    cache.evictable_size_ = 0
    return cache


def _append_node(cache, parent, token_ids):
    node = TreeNode()
    node.parent = parent
    node.key = RadixKey(token_ids)
    node.value = torch.tensor(token_ids, dtype=torch.int64)
    node.children = {}
    parent.children[token_ids[0]] = node
    cache._account_new_evictable_node(node)
    cache._update_ref_aware_leaf_status(node)
    return node


def _scheduler(cache):
    sched = Scheduler.__new__(Scheduler)
    sched.enable_ref_aware_kv_buffer = True
    sched.tree_cache = cache
    return sched


class TestReleasedRidLeavesIdleHeap(unittest.TestCase):
    def test_release_ref_unqueues_the_rid(self):
        cache = _make_cache()
        sched = _scheduler(cache)
        for i in range(3):
            # A high conversation's turn finishes (HiRadixCache reports the node its insert ended at) ...
            node = _append_node(cache, cache.root_node, [10 * i + 1, 10 * i + 2])
            sched._maybe_register_ref(
                SimpleNamespace(rid=f"c{i}", priority=2, last_node=node)
            )
            # ... and the client closes it.
            out = sched.handle_release_ref(ReleaseRefReqInput(rid=f"c{i}"))
            self.assertTrue(out.success, out.message)

        self.assertEqual(cache.rid_to_ref_info, {})
        # Nothing is left to demote: no released rid may stay queued.
        self.assertEqual(sorted(cache._idle_hp_rids), [])
        self.assertEqual(cache._idle_hp_heap, [])


if __name__ == "__main__":
    unittest.main()
