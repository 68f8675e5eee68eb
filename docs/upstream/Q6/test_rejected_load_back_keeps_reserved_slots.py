"""A host-prefix load-back for a request that admission then rejects takes the slots reserved for the batch.

PrefillAdder._add_one_ref_aware_req (the ref-aware admission) first checks a request as if its host hit were already
on the device, then, under the request's lock, init_load_back moves the host prefix to free device slots with no
mem_quota, then checks the request again and may reject it (NO_TOKEN). The load-back is not undone: it has taken
free slots the adder had reserved for a request it admitted earlier in the same batch. That request's
alloc_for_extend then finds too few and raises "Ref-aware allocation ledger drift after successful admission"
(mem_cache/common.py) in the scheduler, and run_scheduler_process exits the server.

Run: python -m pytest -q test_rejected_load_back_keeps_reserved_slots.py  (fails on the RefAware fork; passes with
fix.patch)
"""

import unittest
from types import SimpleNamespace
from unittest.mock import MagicMock

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import DecLockRefResult, IncLockRefResult
from sglang.srt.mem_cache.ref_aware_cache_core import RefAwareCacheCore
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler


class _LedgerAllocator:
    def __init__(self, free: int):
        self.free = free

    def available_size(self):
        return self.free


class _LedgerReqPool:
    def __init__(self, *, req_slots: int):
        self._req_slots = req_slots

    def available_size(self):
        return self._req_slots

    def req_slot_need(self, req):
        return int(req.req_pool_idx is None)


class _LedgerRefAwareHostCache(RefAwareCacheCore):
    """The fork's _LedgerRefAwareCache (test_prefill_adder.py), no Mamba, plus a host tier.

    init_load_back moves a request's host hit onto free device slots the way RefAwareHiRadixCache.load_back does:
    all of it or none, and none when it exceeds mem_quota.
    """

    def __init__(self, allocator: _LedgerAllocator, *, req_slots: int):
        self.req_to_token_pool = _LedgerReqPool(req_slots=req_slots)
        self.allocator = allocator
        self.load_back_quotas = []
        self.lock_depth = 0
        self.disable = False

    def supports_mamba(self):
        return False

    def supports_swa(self):
        return False

    def is_tree_cache(self):
        return True

    def is_high_priority(self, priority):
        return priority >= 1

    def safe_evictable_size_by_tier(self, allow_low=True, allow_high=False):
        return 0

    def inc_lock_ref(self, _node):
        self.lock_depth += 1
        return IncLockRefResult()

    def dec_lock_ref(self, _node, _params=None):
        self.lock_depth -= 1
        return DecLockRefResult()

    def init_load_back(self, params):
        self.load_back_quotas.append(params.mem_quota)
        n = params.host_hit_length
        if n > self.allocator.free or (params.mem_quota is not None and n > params.mem_quota):
            return torch.empty((0,), dtype=torch.int64), params.req.last_node
        self.allocator.free -= n
        return torch.arange(n, dtype=torch.int64), params.last_host_node


class TestRejectedLoadBackKeepsReservedSlots(unittest.TestCase):
    def setUp(self):
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))

    def _make_adder(self, *, full_available):
        allocator = _LedgerAllocator(full_available)
        cache = _LedgerRefAwareHostCache(allocator, req_slots=8)
        running_batch = MagicMock()
        running_batch.reqs = []
        adder = PrefillAdder(
            page_size=1,
            tree_cache=cache,
            token_to_kv_pool_allocator=allocator,
            running_batch=running_batch,
            new_token_ratio=1.0,
            rem_input_tokens=100,
            rem_chunk_tokens=None,
            enable_ref_aware_kv_buffer=True,
        )
        return adder, cache, allocator

    def _make_req(self, rid, *, extend, priority, host_hit=0, max_new_tokens=0):
        req = MagicMock(spec=Req)
        req.rid = rid
        req.priority = priority
        req.extend_input_len = extend
        req.host_hit_length = host_hit
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)
        req.fill_ids = list(range(extend))
        req.last_node = object()
        req.last_host_node = object()
        req.req_pool_idx = None
        req.output_ids = []
        req.sampling_params = SimpleNamespace(max_new_tokens=max_new_tokens, ignore_eos=False)
        req.finished.return_value = False

        def set_extend_input_len(value):
            req.extend_input_len = value

        req.set_extend_input_len.side_effect = set_extend_input_len
        return req

    def _add(self, adder, req):
        return adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)

    def test_rejected_low_request_leaves_the_reserved_slots_free(self):
        adder, cache, allocator = self._make_adder(full_available=10)
        high = self._make_req("high", extend=6, priority=1)
        # 8 prompt tokens, the first 6 cached on the host: as if loaded, it needs 2 more slots (fits: 6 + 2 <= 10).
        low = self._make_req("low", extend=8, priority=0, host_hit=6)

        self._add(adder, high)
        self.assertEqual(adder.can_run_list, [high])
        self.assertEqual(adder.reserved_full_current, 6)

        result = self._add(adder, low)

        self.assertEqual(result, AddReqResult.NO_TOKEN)
        self.assertEqual(adder.can_run_list, [high])
        self.assertEqual(cache.lock_depth, 1)  # only high's persistent lock remains
        # alloc_for_extend of the batch needs the 6 slots reserved for `high`; a rejected request must not take them.
        self.assertGreaterEqual(
            allocator.available_size(),
            adder.reserved_full_current,
            f"free slots after `low` was rejected (its load-back's mem_quota: {cache.load_back_quotas}) vs. slots "
            "reserved for `high`: its alloc_for_extend raises 'Ref-aware allocation ledger drift after successful "
            "admission' and the scheduler exits",
        )


if __name__ == "__main__":
    unittest.main()
