"""A finished turn of a tracked rid in the other priority class exits the scheduler.

With --enable-ref-aware-kv-buffer --enable-priority-scheduling every finished request goes through
release_kv_cache (tree_cache.cache_finished_req) and then Scheduler._maybe_register_ref
(RefAwareCacheCore.register_ref). register_ref raises ValueError("Priority class mismatch for ref-aware KV
buffer.") when the rid is already tracked in the other class. Nothing on the way catches it: the exception
reaches run_scheduler_process, which logs "Scheduler hit an exception" and sends SIGQUIT to the server; every
request in flight fails. A client does this by sending its next turn at another class without calling
/update_ref first, or by leaving `priority` unset on a later turn (the scheduler then assigns -sys.maxsize - 1).

Run: python -m pytest -q test_ref_class_change_on_finish.py  (fails on the RefAware fork; passes with fix.patch)
"""

import sys
import unittest
from types import SimpleNamespace

import torch
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
    """The turn decodes `output` and finishes: process_batch_result_* calls release_kv_cache (cache_finished_req),
    then _maybe_register_ref (register_ref)."""
    req.output_ids = list(output)
    req.kv_committed_len = len(req.origin_input_ids) + len(output) - 1
    req.finished = lambda: True
    sched.tree_cache.cache_finished_req(req)
    sched._maybe_register_ref(req)


class TestRefClassChangeOnFinish(unittest.TestCase):
    def _two_turns(self, second_priority):
        cache = _make_ref_aware_radix_cache()
        sched = _scheduler(cache)
        first = _admit(cache, "s1", priority=2, prompt=[1, 2, 3, 4])
        _finish(sched, first, output=[5, 6])
        self.assertTrue(cache.rid_to_ref_info["s1"].is_high)

        # The session's next turn arrives in the low class; the client did not call /update_ref.
        second = _admit(cache, "s1", priority=second_priority, prompt=[1, 2, 3, 4, 5, 7, 8])
        error = None
        try:
            _finish(sched, second, output=[9, 10])
        except ValueError as exc:
            error = repr(exc)
        self.assertIsNone(
            error,
            "raised in the scheduler's batch-result processing: "
            "run_scheduler_process then exits the server",
        )
        return cache

    def test_next_turn_in_the_other_class_finishes(self):
        cache = self._two_turns(second_priority=0)
        # The rid now holds its path in the turn's (low) class.
        info = cache.rid_to_ref_info["s1"]
        self.assertFalse(info.is_high)
        self.assertTrue(all(n.high_ref == 0 and n.low_ref == 1 for n in info.nodes))

    def test_next_turn_without_priority_finishes(self):
        # _set_or_validate_priority gives a request without `priority` this value.
        self._two_turns(second_priority=-sys.maxsize - 1)


if __name__ == "__main__":
    unittest.main()
