"""A low-priority request that fits the device only by evicting high-ref KV is never admitted, even on an idle server.

Ref-aware admission (PrefillAdder._add_one_ref_aware_req) checks a low-priority candidate against safe capacity only:
free slots plus the unused and low-ref tiers (_ref_aware_demand_fits -> _ref_aware_deficits ->
_ref_aware_full_capacity, allow_high=False), and allocation evicts the high-ref tier only under a high-priority
request's authorization (mem_cache/common.py evict_from_tree_cache; ScheduleBatch._evict_for_decode). Once the KV of
sessions nobody released (HIGH_REF) fills what such a request needs, it is refused with NO_TOKEN on every scheduler
round. On an idle server nothing changes between rounds -- nothing runs, so nothing frees a slot, and no high-priority
request comes to evict the tier -- so the request waits in the waiting queue until its client gives up, while the
server does nothing.

Run: python -m pytest -q test_idle_server_admits_low_priority.py  (fails on the RefAware fork; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace
from unittest.mock import MagicMock

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import (
    RadixKey,
    TreeNode,
    _key_match_page_size1,
    get_child_key,
)
from sglang.srt.mem_cache.ref_aware_radix_cache import RefAwareRadixCache
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

KV_SLOTS = 16


class _TokenPool:
    """A token-to-KV allocator of KV_SLOTS slots: what admission and eviction read and free."""

    def __init__(self, size):
        self.device = torch.device("cpu")
        self.free_slots = list(range(size))

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, indices):
        self.free_slots.extend(indices.tolist())


def _make_ref_aware_radix_cache(allocator, req_to_token_pool):
    """The fork's harness (test_ref_aware_kv_cache.py) plus what insert and match_prefix read."""
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
    cache.token_to_kv_pool_allocator = allocator
    cache.eviction_strategy = SimpleNamespace(
        get_priority=lambda node: node.last_access_time
    )
    cache.disable_finished_insert = False
    cache.is_eagle = False
    cache.device = torch.device("cpu")
    cache.req_to_token_pool = req_to_token_pool
    return cache


class TestIdleServerAdmitsLowPriority(unittest.TestCase):
    def setUp(self):
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
        self.allocator = _TokenPool(KV_SLOTS)
        self.req_to_token_pool = ReqToTokenPool(
            size=4, max_context_len=64, device="cpu", enable_memory_saver=False
        )
        self.cache = _make_ref_aware_radix_cache(self.allocator, self.req_to_token_pool)
        # A high-priority session's finished turn: 12 tokens cached and registered
        # (HIGH_REF); its client never calls /release_ref. 4 slots stay free.
        self.session = list(range(1, 13))
        self.cache.insert(
            InsertParams(key=RadixKey(self.session), value=self.allocator.alloc(12))
        )
        self.cache.register_ref(
            SimpleNamespace(
                rid="s-high",
                priority=1,
                last_node=None,
                origin_input_ids=self.session,
                output_ids=[],
                kv_committed_len=12,
                extra_key=None,
            )
        )
        self.assertEqual(self.cache.high_ref_evictable_size_, 12)
        self.assertEqual(self.allocator.available_size(), 4)

    def _waiting_low_req(self):
        """A low-priority request sharing the session's first 4 tokens, as
        init_next_round_input leaves it: 4 tokens to prefill, 4 to decode."""
        prompt = self.session[:4] + [50, 51, 52, 53]
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
        req = MagicMock(spec=Req)
        req.rid = "low"
        req.priority = 0
        req.origin_input_ids = prompt
        req.fill_ids = list(prompt)
        req.prefix_indices = match.device_indices
        req.extend_input_len = len(prompt) - len(match.device_indices)
        req.last_node = match.last_device_node
        req.host_hit_length = 0
        req.req_pool_idx = None
        req.output_ids = []
        req.sampling_params = SimpleNamespace(max_new_tokens=4, ignore_eos=False)
        req.finished.return_value = False

        def set_extend_input_len(value):
            req.extend_input_len = value

        req.set_extend_input_len.side_effect = set_extend_input_len
        return req

    def _schedule_round(self, running_reqs, req):
        """One round of Scheduler._get_new_batch_prefill_raw: a fresh PrefillAdder, the waiting request offered."""
        running_batch = MagicMock()
        running_batch.reqs = list(running_reqs)
        adder = PrefillAdder(
            page_size=1,
            tree_cache=self.cache,
            token_to_kv_pool_allocator=self.allocator,
            running_batch=running_batch,
            new_token_ratio=1.0,
            rem_input_tokens=100,
            rem_chunk_tokens=None,
            enable_ref_aware_kv_buffer=True,
        )
        result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        return adder, result

    def test_idle_server_admits_a_low_request_that_needs_high_ref_kv(self):
        low = self._waiting_low_req()
        self.assertEqual(low.extend_input_len, 4)

        # Nothing runs and nothing else waits: the scheduler offers the request every loop iteration.
        results = []
        for _ in range(3):
            adder, result = self._schedule_round([], low)
            results.append(result)
            if low in adder.can_run_list:
                break

        self.assertIn(
            "low",
            [r.rid for r in adder.can_run_list],
            f"an idle server (nothing running, all {self.req_to_token_pool.size} request slots free) answered the "
            f"waiting low-priority request {[r.name for r in results]} round after round: it needs 8 KV slots "
            f"(4 to prefill, 4 to decode), {self.allocator.available_size()} are free, and "
            f"{self.cache.high_ref_evictable_size_} hold an unreleased high-priority session (HIGH_REF), which only a "
            "high-priority request may evict, so it waits in the waiting queue forever",
        )
        # Its whole demand is free: alloc_for_extend and decode (which evicts
        # high-ref KV only for high-priority requests) find the slots.
        self.assertGreaterEqual(
            self.allocator.available_size(),
            adder.reserved_full_current + adder.reserved_full_future,
        )
        # The prefix it reuses was locked, not evicted.
        self.assertIs(low.last_node.parent, self.cache.root_node)
        self.assertIsNotNone(low.last_node.value)
        self.assertEqual(low.last_node.lock_ref, 1)

    def test_high_ref_kv_stays_protected_while_a_request_runs(self):
        # The same request while another request runs: it holds a request slot, and its finish may free KV.
        running = MagicMock(spec=Req)
        running.priority = 0
        running.req_pool_idx = None
        running.finished.return_value = False
        running.output_ids = []
        running.sampling_params = SimpleNamespace(max_new_tokens=0, ignore_eos=False)
        self.req_to_token_pool.alloc([running])
        low = self._waiting_low_req()

        adder, result = self._schedule_round([running], low)

        self.assertEqual(result, AddReqResult.NO_TOKEN)
        self.assertEqual(adder.can_run_list, [])
        self.assertEqual(self.cache.high_ref_evictable_size_, 12)
        self.assertEqual(self.allocator.available_size(), 4)
        self.assertEqual(low.last_node.lock_ref, 0)  # the admission lock was released


if __name__ == "__main__":
    unittest.main()
