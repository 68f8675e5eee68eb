"""Every finished request registers its rid, and only /release_ref drops it: one-shot requests leak.

Scheduler._maybe_register_ref (called for every finished request) registers the request's rid with
RefAwareCacheCore.register_ref: an entry in rid_to_ref_info, the rid in each node's tracked_rids and a LOW_REF or
HIGH_REF count on its path. Only /release_ref(rid) or a reset drops them. A client that sends one-shot requests, or
leaves the rid to the server (GenerateReqInput makes it a fresh uuid4), never releases one: the server's memory
grows with every request served, and the KV of every prompt it ever saw is held as LOW_REF/HIGH_REF.

Run: python -m pytest -q test_one_shot_request_keeps_no_ref.py  (fails on the RefAware fork; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace

import torch
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import (
    RadixKey,
    TreeNode,
    _key_match_page_size1,
    get_child_key,
)
from sglang.srt.mem_cache.ref_aware_radix_cache import RefAwareRadixCache


def _make_cache():
    """The fork's TestRefAwareRadixCache fixture (test_ref_aware_kv_cache.py), device-only cache."""
    cache = RefAwareRadixCache.__new__(RefAwareRadixCache)
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
    cache.rid_to_ref_info = {}
    cache._evict_scope_stack = []
    cache.evictable_leaves = set()
    cache.page_size = 1
    cache.get_child_key_fn = get_child_key
    cache.key_match_fn = _key_match_page_size1
    cache._last_inserted_node = None
    cache.evictable_size_ = 0
    return cache


def _node(cache, token_ids):
    node = TreeNode()
    node.parent = cache.root_node
    node.key = RadixKey(token_ids)
    node.value = torch.tensor(token_ids, dtype=torch.int64)
    node.children = {}
    cache.root_node.children[token_ids[0]] = node
    cache._account_new_evictable_node(node)
    cache._update_ref_aware_leaf_status(node)
    return node


def _finished(obj, node):
    """What the scheduler holds of a finished request sent as `obj`, after the tokenizer normalized it."""
    obj.normalize_batch_and_arguments()
    return SimpleNamespace(rid=obj.rid, priority=0, last_node=node, keep_ref=getattr(obj, "keep_ref", None))


class TestOneShotRequestKeepsNoRef(unittest.TestCase):
    def setUp(self):
        self.cache = _make_cache()
        self.sched = Scheduler.__new__(Scheduler)
        self.sched.enable_ref_aware_kv_buffer = True
        self.sched.tree_cache = self.cache

    def test_a_request_with_a_server_made_rid_is_not_tracked(self):
        for i in range(3):
            node = _node(self.cache, [10 * i + 1, 10 * i + 2])
            req = _finished(GenerateReqInput(input_ids=[10 * i + 1, 10 * i + 2]), node)
            self.sched._maybe_register_ref(req)

        # Nobody knows these rids to release them: nothing may stay tracked.
        self.assertEqual(self.cache.rid_to_ref_info, {})
        self.assertEqual(self.cache.low_ref_evictable_size_, 0)

    def test_a_conversation_the_client_names_is_still_tracked(self):
        node = _node(self.cache, [1, 2])
        req = _finished(GenerateReqInput(input_ids=[1, 2], rid="conv-7"), node)
        self.sched._maybe_register_ref(req)
        self.assertEqual(list(self.cache.rid_to_ref_info), ["conv-7"])


if __name__ == "__main__":
    unittest.main()
