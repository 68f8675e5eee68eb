"""A /release_ref that arrives while a turn of the rid runs is undone when the turn finishes.

Scheduler.handle_release_ref drops the rid's refs at once (RefAwareCacheCore.release_ref) and answers success. A turn
of the same rid that is running at that moment finishes later, and process_batch_result_* calls
Scheduler._maybe_register_ref -> register_ref for it, which registers the rid afresh on the turn's path. The session
the client released keeps its KV protected (HIGH_REF / LOW_REF tier) until a second /release_ref, which nothing
prompts; low-priority admission cannot use that KV meanwhile.

Run: python -m pytest -q test_release_during_turn.py  (fails on the RefAware fork; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace

import torch
from sglang.srt.managers.io_struct import ReleaseRefReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import (
    RadixKey,
    TreeNode,
    _key_match_page_size1,
    get_child_key,
)
from sglang.srt.mem_cache.ref_aware_radix_cache import RefAwareRadixCache


class _FakeAllocator:
    def __init__(self):
        self.device = torch.device("cpu")

    def free(self, indices):
        pass


class _ReqToTokenPool:
    """One request slot holding KV indices 0, 1, 2, ...: a prefix keeps the indices it has in the tree."""

    def __init__(self, size=64):
        self.req_to_token = torch.arange(size, dtype=torch.int32).unsqueeze(0)

    def write(self, indices, values):
        self.req_to_token[indices] = values


def _make_ref_aware_radix_cache():
    """The fork's harness (test_ref_aware_kv_cache.py) plus what cache_finished_req and match_prefix read."""
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
    cache._last_inserted_node = None
    cache.evictable_leaves = set()
    cache.disable = False
    cache.evictable_size_ = 0
    cache.protected_size_ = 0
    cache.page_size = 1
    cache.get_child_key_fn = get_child_key
    cache.key_match_fn = _key_match_page_size1
    cache.enable_kv_cache_events = False
    cache.metrics_collector = None
    cache.token_to_kv_pool_allocator = _FakeAllocator()
    cache.eviction_strategy = SimpleNamespace(
        get_priority=lambda node: node.last_access_time
    )
    cache.disable_finished_insert = False
    cache.is_eagle = False
    cache.device = torch.device("cpu")
    cache.req_to_token_pool = _ReqToTokenPool()
    return cache


def _scheduler(cache):
    sched = Scheduler.__new__(Scheduler)
    sched.enable_ref_aware_kv_buffer = True
    sched.tree_cache = cache
    sched.running_batch = SimpleNamespace(reqs=[])
    sched.last_batch = None
    sched.waiting_queue = []
    sched.chunked_req = None
    return sched


def _admit(cache, rid, priority, prompt):
    """A turn as admission leaves it: its cached prefix matched and locked."""
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(prompt))))
    cache.inc_lock_ref(match.last_device_node)
    req = SimpleNamespace(
        rid=rid,
        priority=priority,
        origin_input_ids=list(prompt),
        output_ids=[],
        fill_ids=list(prompt),
        extra_key=None,
        req_pool_idx=0,
        cache_protected_len=len(match.device_indices),
        last_node=match.last_device_node,
        kv_committed_len=0,
        finished=lambda: False,
    )
    req.pop_committed_kv_cache = lambda: req.kv_committed_len
    return req


def _finish(sched, req, output):
    """The turn decodes `output` and finishes: process_batch_result_decode calls release_kv_cache
    (cache_finished_req), then _maybe_register_ref (register_ref)."""
    req.output_ids = list(output)
    req.kv_committed_len = len(req.origin_input_ids) + len(output) - 1
    req.finished = lambda: True
    sched.tree_cache.cache_finished_req(req)
    sched._maybe_register_ref(req)


class TestReleaseDuringTurn(unittest.TestCase):
    def test_release_taken_while_a_turn_runs_stays_released(self):
        cache = _make_ref_aware_radix_cache()
        sched = _scheduler(cache)
        first = _admit(cache, "s0", priority=1, prompt=[1, 2, 3, 1, 2, 3])
        _finish(sched, first, output=[4, 5])

        second = _admit(cache, "s0", priority=1, prompt=[1, 2, 3, 1, 2, 3, 4, 6])
        cache.cache_unfinished_req(second)  # prefilled, now decoding
        sched.running_batch.reqs.append(second)

        # The client closes the session while its turn is decoding.
        out = sched.handle_release_ref(ReleaseRefReqInput(rid="s0"))
        self.assertTrue(out.success, out.message)

        _finish(sched, second, output=[7, 8])

        # The release was answered with success: nothing holds the session's KV afterwards.
        self.assertNotIn("s0", set(cache.rid_to_ref_info))
        self.assertEqual(cache.high_ref_evictable_size_, 0)


if __name__ == "__main__":
    unittest.main()
