"""A rid's next turn on another branch leaves the rid holding its old branch too.

Scheduler._maybe_register_ref calls RefAwareCacheCore.register_ref for every finished turn. For a rid it already
tracks, register_ref adds refs from the turn's last_node up to the first node the rid already holds, and drops none
(_collect_untracked_nodes_from_last_node; the token-walk branch likewise only adds). A turn that does not extend the
previous one exactly (an edited or regenerated turn, a forked rollout, a template that tokenizes differently) leaves
the old branch in the HIGH_REF / LOW_REF tier until /release_ref: protected memory grows per conversation, and
low-priority traffic gets less cache.

Run: python -m pytest -q test_register_ref_moves_to_new_path.py  (fails on the RefAware fork; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace

import torch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import (
    RadixCache,
    RadixKey,
    TreeNode,
    _key_match_page_size1,
    get_child_key,
)
from sglang.srt.mem_cache.ref_aware_cache_mixin import RefAwareCacheMixin


class _MixinCache(RefAwareCacheMixin, RadixCache):
    """Light harness: mixin over plain RadixCache, constructed via __new__."""


def _make_mixin_cache():
    cache = _MixinCache.__new__(_MixinCache)
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
    cache._last_inserted_node = None
    cache.evictable_leaves = set()
    cache.disable = False
    cache.evictable_size_ = 0
    cache.protected_size_ = 0
    cache.page_size = 1
    cache.get_child_key_fn = get_child_key
    cache.key_match_fn = _key_match_page_size1
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


class TestRegisterRefMovesToNewPath(unittest.TestCase):
    def test_turn_on_another_branch_drops_the_old_branch(self):
        cache = _make_mixin_cache()
        sched = Scheduler.__new__(Scheduler)
        sched.enable_ref_aware_kv_buffer = True
        sched.tree_cache = cache

        prompt = _append_node(cache, cache.root_node, [1, 2, 3, 4])
        first_answer = _append_node(cache, prompt, [5, 6, 7, 8])
        # Turn 1 finishes at first_answer (req.last_node is where its insert ended).
        sched._maybe_register_ref(
            SimpleNamespace(rid="s0", priority=1, last_node=first_answer)
        )

        # Turn 2 regenerates the answer: same prompt, another continuation.
        second_answer = _append_node(cache, prompt, [9, 10, 11, 12])
        sched._maybe_register_ref(
            SimpleNamespace(rid="s0", priority=1, last_node=second_answer)
        )

        # The rid holds the path its last turn ended on; the abandoned answer is no longer protected.
        self.assertEqual(first_answer.high_ref, 0, "high refs on the abandoned answer")
        self.assertNotIn("s0", first_answer.tracked_rids)
        self.assertEqual(cache.rid_to_ref_info["s0"].nodes, {prompt, second_answer})
        self.assertEqual(cache.high_ref_evictable_size_, 8)
        self.assertEqual(cache.unused_evictable_size_, 4)


if __name__ == "__main__":
    unittest.main()
