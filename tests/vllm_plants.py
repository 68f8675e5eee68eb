"""vLLM 0.32 broken on purpose, certified through its own request path: run in `.venv-vllm` by
tests/test_vllm_requests.py as `python tests/vllm_plants.py TARGET PLANT...`.

Each plant is one bug of a class real prefix caches have had, put into vLLM's own code for the length of one
certification; the script prints one JSON line per plant: the rules the certificate's failures name, and what the
run reached in vLLM (evictions, preemptions, prefix hits), counted at vLLM's own functions.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from kvcert.conformance.adapters.vllm import env as _vllm_env  # noqa: F401  (VLLM_TARGET_DEVICE before vLLM imports)
from kvcert.conformance.certification.certify import certify


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    from vllm.v1.core import block_pool as bp
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.core import single_type_kv_cache_manager as st
    from vllm.v1.core.sched import scheduler as sc

    if name == "none":
        yield
    elif name == "leak-on-free":  # free_blocks drops a request's first block without its reference
        real = bp.BlockPool.free_blocks

        def free_blocks(self: Any, blocks: Any) -> None:
            blocks = list(blocks)
            real(self, blocks[1:] if len(blocks) > 2 else blocks)

        with mock.patch.object(bp.BlockPool, "free_blocks", free_blocks):
            yield
    elif name == "lora-unhashed":  # blocks hashed without their LoRA
        with mock.patch.object(ku, "_gen_lora_extra_hash_keys", lambda request: []):
            yield
    elif name == "salt-unhashed":  # blocks hashed without their cache salt
        real_keys = ku.generate_block_hash_extra_keys

        def keys(request: Any, *a: Any, **k: Any) -> Any:
            with mock.patch.object(request, "cache_salt", None):
                return real_keys(request, *a, **k)

        with mock.patch.object(ku, "generate_block_hash_extra_keys", keys):
            yield
    elif name == "evict-keeps-hash":  # a block taken from the free queue stays in the hash map
        with mock.patch.object(bp.BlockPool, "_maybe_evict_cached_block", lambda self, block: False):
            yield
    elif name == "hit-stays-queued":  # a prefix hit takes a reference but leaves the block on the free queue
        def touch(self: Any, blocks: Any) -> None:
            for b in blocks:
                b.ref_cnt += 1

        with mock.patch.object(bp.BlockPool, "touch", touch):
            yield
    elif name == "hit-one-block-more":  # the hit search adds the free queue's last cached block past the first miss
        real_hit = st.FullAttentionManager.find_longest_cache_hit.__func__

        def find(cls: Any, *a: Any, **k: Any) -> Any:
            blocks, hit = real_hit(cls, *a, **k)
            pool, size = k["block_pool"], k["kv_cache_spec"].block_size
            extra = pool.free_block_queue.fake_free_list_tail.prev_free_block
            fits = (len(blocks[0]) + 1) * size <= k["max_length"]
            if blocks[0] and fits and extra.block_id >= 0 and extra.block_hash is not None:
                return tuple(list(b) + [extra] for b in blocks), hit + size
            return blocks, hit

        with mock.patch.object(st.FullAttentionManager, "find_longest_cache_hit", classmethod(find)):
            yield
    elif name == "preempt-keeps-blocks":  # a preempted request's blocks are never freed
        real_preempt = sc.Scheduler._preempt_request

        def preempt(self: Any, request: Any, *a: Any, **k: Any) -> Any:
            with mock.patch.object(self.kv_cache_manager, "free", lambda req: None):
                return real_preempt(self, request, *a, **k)

        with mock.patch.object(sc.Scheduler, "_preempt_request", preempt):
            yield
    elif name == "abort-keeps-blocks":  # an aborted request's blocks are never freed (its index entry is dropped)
        real_finish = sc.Scheduler.finish_requests

        def finish(self: Any, ids: Any, status: Any) -> Any:
            manager = self.kv_cache_manager.coordinator.single_type_managers[0]
            drop = lambda req: manager.req_to_blocks.pop(req.request_id, None)  # noqa: E731
            with mock.patch.object(self, "_free_blocks", drop):
                return real_finish(self, ids, status)

        with mock.patch.object(sc.Scheduler, "finish_requests", finish):
            yield
    elif name == "free-head-first":  # a request's blocks freed head first: its prefix's head is evicted first
        with mock.patch.object(st, "reversed", lambda blocks: iter(list(blocks)), create=True):
            yield
    elif name == "cached-freed-to-head":  # a freed cached block goes to the free queue's head, not its tail
        def free_blocks(self: Any, blocks: Any) -> None:
            released = []
            for b in blocks:
                b.ref_cnt -= 1
                if b.ref_cnt == 0 and not b.is_null:
                    released.append(b)
            self.free_block_queue.prepend_n(released)

        with mock.patch.object(bp.BlockPool, "free_blocks", free_blocks):
            yield
    elif name == "lookup-newest-duplicate":  # of two blocks holding one hash, a lookup returns the last cached
        def get_one_block(self: Any, key: Any) -> Any:
            blocks = self._cache.get(key)
            if isinstance(blocks, dict):
                return list(blocks.values())[-1]
            return blocks

        with mock.patch.object(bp.BlockHashToBlockMap, "get_one_block", get_one_block):
            yield
    elif name == "eviction-unannounced":  # a block evicted for reuse publishes no BlockRemoved event
        with mock.patch.object(bp.BlockPool, "_emit_block_removed_events", lambda self, hashes: None):
            yield
    elif name == "swa-frees-window":  # the sliding window's blocks freed one block too early
        real_skipped = st.SlidingWindowManager.get_num_skipped_tokens

        def skipped(self: Any, num_computed_tokens: int) -> int:
            return int(real_skipped(self, num_computed_tokens)) + self.block_size

        with mock.patch.object(st.SlidingWindowManager, "get_num_skipped_tokens", skipped):
            yield
    elif name == "swa-hit-short":  # a sliding-window hit that needs one block fewer than the window spans
        real_need = st.SlidingWindowManager._contiguous_blocks_for_hit.__func__

        def need(cls: Any, window_size: int, block_size: int, use_eagle: bool) -> int:
            return max(1, int(real_need(cls, window_size, block_size, use_eagle)) - 1)

        with mock.patch.object(st.SlidingWindowManager, "_contiguous_blocks_for_hit", classmethod(need)):
            yield
    elif name == "preempt-other-policy":
        # preemption picks its victim by the other policy than the scheduler's (its waiting queue stays its own)
        from vllm.v1.core.sched.request_queue import SchedulingPolicy

        real_init = sc.Scheduler.__init__

        def init(self: Any, *a: Any, **k: Any) -> None:
            real_init(self, *a, **k)
            swap = {SchedulingPolicy.PRIORITY: SchedulingPolicy.FCFS, SchedulingPolicy.FCFS: SchedulingPolicy.PRIORITY}
            self.policy = swap[self.policy]

        with mock.patch.object(sc.Scheduler, "__init__", init):
            yield
    elif name == "connector-frees-held-blocks":  # the scheduler drops the connector's delay_free_blocks: a finished
        # request's blocks are freed at once while a remote decoder still reads them
        real_finished = sc.Scheduler._connector_finished

        def connector_finished(self: Any, request: Any) -> Any:
            _, params = real_finished(self, request)
            return False, params

        with mock.patch.object(sc.Scheduler, "_connector_finished", connector_finished):
            yield
    elif name == "connector-load-no-blocks":  # the connector counts a remote prefill's tokens as computed but hands
        # the worker no blocks to load them into
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler as nixl

        real_after = nixl.NixlPullConnectorScheduler.update_state_after_alloc

        def after_alloc(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
            real_after(self, request, blocks, num_external_tokens)
            got = self._reqs_need_recv.get(request.request_id)
            if got is not None:
                req, ids, cached, awaiting = got
                self._reqs_need_recv[request.request_id] = (req, tuple([] for _ in ids), cached, awaiting)

        with mock.patch.object(nixl.NixlPullConnectorScheduler, "update_state_after_alloc", after_alloc):
            yield
    elif name == "connector-hands-blocks-reversed":  # a finished request's blocks handed to its remote decoder in
        # reverse order: the right blocks, held as long as they should be, read as the wrong tokens
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler as nixl

        real_request_finished = nixl.NixlPullConnectorScheduler.request_finished

        def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
            delay, params = real_request_finished(self, request, block_ids)
            if delay and params:
                params["remote_block_ids"] = tuple(list(reversed(ids)) for ids in params["remote_block_ids"])
            return delay, params

        with mock.patch.object(nixl.NixlPullConnectorScheduler, "request_finished", request_finished):
            yield
    elif name == "connector-runs-before-load":  # a request leaves WAITING_FOR_REMOTE_KVS before finished_recving
        from vllm.v1.request import RequestStatus

        real_blocked = sc.Scheduler._handle_blocked_waiting_request

        def blocked(self: Any, request: Any) -> bool:
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(request.request_id)
            return bool(real_blocked(self, request))

        with mock.patch.object(sc.Scheduler, "_handle_blocked_waiting_request", blocked):
            yield
    else:
        raise SystemExit(f"unknown plant {name!r}")


@contextlib.contextmanager
def connector_counted(reached: Counter[str]) -> Iterator[None]:
    """Count, at vLLM's own functions, what the KV connector's branches reached (nothing without a connector)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler as nixl
    from vllm.v1.core.sched import scheduler as sc
    from vllm.v1.request import RequestStatus

    N, S = nixl.NixlPullConnectorScheduler, sc.Scheduler
    matched, after, finished = N.get_num_new_matched_tokens, N.update_state_after_alloc, N.request_finished
    promote, xfer, finish = S._update_waiting_for_remote_kv, S._update_from_kv_xfer_finished, S.finish_requests

    def matched_counted(self: Any, request: Any, num_computed_tokens: int) -> Any:
        count, load_async = matched(self, request, num_computed_tokens)
        reached["external"] += bool(count)
        reached["external_after_local_hit"] += bool(count) and num_computed_tokens > 0
        return count, load_async

    def after_counted(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        reached["allocated_for_external"] += num_external_tokens > 0
        return after(self, request, blocks, num_external_tokens)

    def finished_counted(self: Any, request: Any, block_ids: Any) -> Any:
        delay, params = finished(self, request, block_ids)
        reached["delayed_frees"] += bool(delay)
        return delay, params

    def promote_counted(self: Any, request: Any) -> Any:
        reached["loads_waited_on"] += 1
        return promote(self, request)

    def xfer_counted(self: Any, output: Any) -> Any:
        reached["freed_at_finished_sending"] += len(output.finished_sending or ())
        return xfer(self, output)

    def finish_counted(self: Any, ids: Any, status: Any) -> Any:
        for rid in [ids] if isinstance(ids, str) else list(ids or ()):
            req = self.requests.get(rid)
            reached["aborted_while_loading"] += req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        return finish(self, ids, status)

    with (
        mock.patch.object(N, "get_num_new_matched_tokens", matched_counted),
        mock.patch.object(N, "update_state_after_alloc", after_counted),
        mock.patch.object(N, "request_finished", finished_counted),
        mock.patch.object(S, "_update_waiting_for_remote_kv", promote_counted),
        mock.patch.object(S, "_update_from_kv_xfer_finished", xfer_counted),
        mock.patch.object(S, "finish_requests", finish_counted),
    ):
        yield


@contextlib.contextmanager
def counted(reached: Counter[str]) -> Iterator[None]:
    """Count, at vLLM's own functions, what the run reached."""
    from vllm.v1.core import block_pool as bp
    from vllm.v1.core import kv_cache_manager as km
    from vllm.v1.core.sched import scheduler as sc

    evict, preempt, computed = bp.BlockPool._maybe_evict_cached_block, sc.Scheduler._preempt_request, km.KVCacheManager.get_computed_blocks

    def evict_counted(self: Any, block: Any) -> bool:
        gone = evict(self, block)
        reached["evicted"] += bool(gone)
        return gone

    def preempt_counted(self: Any, *a: Any, **k: Any) -> Any:
        reached["preempted"] += 1
        return preempt(self, *a, **k)

    def computed_counted(self: Any, request: Any) -> Any:
        out = computed(self, request)
        reached["hits"] += out[1] > 0
        return out

    with (
        mock.patch.object(bp.BlockPool, "_maybe_evict_cached_block", evict_counted),
        mock.patch.object(sc.Scheduler, "_preempt_request", preempt_counted),
        mock.patch.object(km.KVCacheManager, "get_computed_blocks", computed_counted),
    ):
        yield


def main(target: str, plants: list[str], examples: int) -> None:
    for name in plants:
        reached: Counter[str] = Counter()
        with tempfile.TemporaryDirectory() as out, counted(reached), connector_counted(reached), planted(name):
            cert = certify(target, examples=examples, out_dir=Path(out))
        rules = sorted({f["invariant"] for c in cert.cells for f in c.failures})
        entries = sum(c.ops.get("kv:entries", 0) for c in cert.cells)
        ops: Counter[str] = Counter()
        for c in cert.cells:
            ops.update({k: v for k, v in c.ops.items() if k.startswith("connector:")})
        print(json.dumps({"plant": name, "passed": cert.passed, "rules": rules, "reached": dict(reached),
                          "kv_entries": entries, "ops": dict(ops), "not_checked": cert.not_checked,
                          "failures": [c.failure for c in cert.cells if c.failure]}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3:], int(sys.argv[2]))
