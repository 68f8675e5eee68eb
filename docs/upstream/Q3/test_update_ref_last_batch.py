"""/update_ref misses a turn that sits in the scheduler's last batch; the turn's finish then exits the scheduler.

Scheduler.handle_update_ref writes the new priority into the requests of running_batch, waiting_queue and
chunked_req, then moves the rid's refs to the new class (RefAwareCacheCore.update_ref). A turn that has been
prefilled sits in last_batch until the next get_next_batch_to_run merges it into running_batch; /update_ref does not
reach it. The turn keeps its old priority, finishes in it, and Scheduler._maybe_register_ref -> register_ref meets a
rid that update_ref already moved to the other class: ValueError("Priority class mismatch for ref-aware KV buffer."),
uncaught in the scheduler, so run_scheduler_process exits the server. The client did what the fork asks (it announced
the class change through /update_ref).

Run: python -m pytest -q test_update_ref_last_batch.py  (fails on the RefAware fork; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace

import torch
from sglang.srt.managers.io_struct import UpdateRefReqInput
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


class TestUpdateRefLastBatch(unittest.TestCase):
    def setUp(self):
        self.cache = _make_ref_aware_radix_cache()
        self.sched = _scheduler(self.cache)
        first = _admit(self.cache, "s0", priority=0, prompt=[1, 2, 3, 1, 2, 3])
        _finish(self.sched, first, output=[4, 5])  # registered low

        # The session's next turn is admitted at 0 and prefilled: it is in the last batch, not yet merged into
        # the running batch, when the client raises the session to 1.
        self.turn = _admit(self.cache, "s0", priority=0, prompt=[1, 2, 3, 1, 2, 3, 2, 3, 4, 5])
        self.cache.cache_unfinished_req(self.turn)
        self.sched.last_batch = SimpleNamespace(reqs=[self.turn])
        out = self.sched.handle_update_ref(UpdateRefReqInput(rid="s0", new_priority=1))
        self.assertTrue(out.success, out.message)

    def test_update_ref_reaches_a_prefilled_turn(self):
        self.assertEqual(self.turn.priority, 1, "the prefilled turn's priority")

    def test_turn_finishes_after_update_ref(self):
        error = None
        try:
            _finish(self.sched, self.turn, output=[6, 7, 8])
        except ValueError as exc:
            error = repr(exc)
        self.assertIsNone(
            error,
            "raised in the scheduler's batch-result processing: "
            "run_scheduler_process then exits the server",
        )
        info = self.cache.rid_to_ref_info["s0"]
        self.assertTrue(info.is_high)
        self.assertTrue(all(n.high_ref == 1 and n.low_ref == 0 for n in info.nodes))


if __name__ == "__main__":
    unittest.main()
