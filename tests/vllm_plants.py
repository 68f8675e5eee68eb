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

from kvcert.conformance.adapters import _vllm_env  # noqa: F401  (VLLM_TARGET_DEVICE before vLLM imports)
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
    else:
        raise SystemExit(f"unknown plant {name!r}")


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
        with tempfile.TemporaryDirectory() as out, counted(reached), planted(name):
            cert = certify(target, examples=examples, out_dir=Path(out))
        rules = sorted({f["invariant"] for c in cert.cells for f in c.failures})
        entries = sum(c.ops.get("kv:entries", 0) for c in cert.cells)
        print(json.dumps({"plant": name, "passed": cert.passed, "rules": rules, "reached": dict(reached),
                          "kv_entries": entries, "not_checked": cert.not_checked}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3:], int(sys.argv[2]))
