"""vLLM 0.32's CPU offloading manager broken on purpose, certified at its API: run in `.venv-vllm` by
tests/test_vllm_offload.py as `python tests/vllm_offload_plants.py EXAMPLES PLANT...` (or `... same EXAMPLES` to
certify the unmodified manager in two processes under other hash seeds and print both digests).

Each plant is one bug of a class real offload tiers have had, put into vLLM's own manager or policy code for the
length of one certification; the script prints one JSON line per plant: the rules the certificate's failures name
(per cell), and what the run reached in vLLM (evictions, failed stores, pending lookups, evictions and resets with
copies in flight), counted at vLLM's own functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any
from unittest import mock

from kvcert.conformance.adapters.vllm import env as _vllm_env  # noqa: F401  (VLLM_TARGET_DEVICE before vLLM imports)
from kvcert.conformance.certification.certify import certify

TARGET = "kvcert.conformance.adapters.vllm.offload:factory"


def _chunks(policy: Any) -> Iterator[Any]:
    """Every chunk a policy holds (LRU keeps one dict, ARC two lists)."""
    if hasattr(policy, "chunks"):
        return iter(policy.chunks.values())
    return chain(policy.t1.values(), policy.t2.values())


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    from vllm.v1.kv_offload.cpu import manager as mg
    from vllm.v1.kv_offload.cpu.policies import arc, lru

    M = mg.CPUOffloadingManager
    if name == "none":
        yield
    elif name == "arc-evicts-loading":  # ARC takes a chunk a load still reads as idle
        real_arc = arc.ARCCachePolicy.evict

        def arc_evict(self: Any, n: int, protected: set[Any]) -> Any:
            pinned = [(c, c.ref_cnt) for c in _chunks(self) if c.ref_cnt > 0]
            for c, _ in pinned:
                c.ref_cnt = 0
            try:
                return real_arc(self, n, protected)
            finally:
                for c, r in pinned:
                    c.ref_cnt = r

        with mock.patch.object(arc.ARCCachePolicy, "evict", arc_evict):
            yield
    elif name == "lru-evicts-asked":  # LRU's eviction ignores the keys the store was asked for
        real_lru = lru.LRUCachePolicy.evict
        with mock.patch.object(lru.LRUCachePolicy, "evict", lambda self, n, protected: real_lru(self, n, set())):
            yield
    elif name == "fail-keeps-key":  # a failed store is never cleaned up: its key stays pending with no deadline
        real_complete = M.complete_store

        def keep(self: Any, keys: Any, ctx: Any, success: bool = True) -> None:
            if success:
                real_complete(self, keys, ctx, success)

        with mock.patch.object(M, "complete_store", keep):
            yield
    elif name == "fail-leaks-chunk":  # a failed store drops its key but never frees its chunk
        real_complete = M.complete_store

        def leak(self: Any, keys: Any, ctx: Any, success: bool = True) -> None:
            if success:
                return real_complete(self, keys, ctx, success)
            with mock.patch.object(self, "_free_chunk", lambda chunk: None):
                return real_complete(self, keys, ctx, success)

        with mock.patch.object(M, "complete_store", leak):
            yield
    elif name == "hit-while-pending":  # lookup answers HIT while the store's copy is still in flight
        from vllm.v1.kv_offload.base import LookupResult

        real_lookup = M.lookup

        def early(self: Any, key: Any, ctx: Any) -> Any:
            got = real_lookup(self, key, ctx)
            return LookupResult.HIT if got == LookupResult.HIT_PENDING else got

        with mock.patch.object(M, "lookup", early):
            yield
    elif name == "load-wrong-chunk":  # prepare_load names the next chunk over
        real_load = M.prepare_load

        def shifted(self: Any, keys: Any, ctx: Any) -> Any:
            spec = real_load(self, keys, ctx)
            spec.block_ids = (spec.block_ids + 1) % self._num_chunks
            return spec

        with mock.patch.object(M, "prepare_load", shifted):
            yield
    elif name == "lru-touch-reversed":  # LRU's touch ranks its last key most recent instead of its first
        with mock.patch.object(lru.LRUCachePolicy, "touch", lambda self, keys, ctx: self._update_recency(list(keys))):
            yield
    elif name == "events-miss-removal":  # an eviction is never announced
        real_store = M.prepare_store

        def silent(self: Any, keys: Any, ctx: Any) -> Any:
            n = len(self.events) if self.events is not None else 0
            out = real_store(self, keys, ctx)
            if self.events is not None:
                self.events[n:] = [e for e in self.events[n:] if not e.removed]
            return out

        with mock.patch.object(M, "prepare_store", silent):
            yield
    elif name == "free-count-short":  # the pool counts one free chunk too few, so a store evicts one key too many
        real_free = M._get_num_free_chunks
        with mock.patch.object(M, "_get_num_free_chunks", lambda self: real_free(self) - 1):
            yield
    elif name == "evict-double-free":  # a chunk evicted by a store goes back to the free list twice
        real_store = M.prepare_store

        def double(self: Any, keys: Any, ctx: Any) -> Any:
            twice = lambda chunk: self._free_list.extend([chunk.chunk_id] * 2)  # noqa: E731
            with mock.patch.object(self, "_free_chunk", twice):
                return real_store(self, keys, ctx)

        with mock.patch.object(M, "prepare_store", double):
            yield
    elif name == "threshold-first-offer":  # the admission tracker counts a new key's first offer as enough
        real_record = M._record_accesses

        def eager(self: Any, keys: Any) -> None:
            real_record(self, keys)
            for key in keys:
                self.counts[key] = max(self.counts[key], self.store_threshold)

        with mock.patch.object(M, "_record_accesses", eager):
            yield
    elif name == "arc-touch-no-promotion":  # ARC's touch keeps a ready T1 key in T1 (its newest), not to T2

        def touch(self: Any, keys: Any, ctx: Any) -> None:
            for key in reversed(list(keys)):
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
                else:
                    self._adapt_to_ghost_hit(key)

        with mock.patch.object(arc.ARCCachePolicy, "touch", touch):
            yield
    elif name == "arc-ghost-no-adapt":  # a ghost hit refreshes its ghost but leaves target_t1_size where it was
        real_adapt = arc.ARCCachePolicy._adapt_to_ghost_hit

        def adapt(self: Any, key: Any) -> bool:
            target = self.target_t1_size
            try:
                return bool(real_adapt(self, key))
            finally:
                self.target_t1_size = target

        with mock.patch.object(arc.ARCCachePolicy, "_adapt_to_ghost_hit", adapt):
            yield
    elif name == "arc-t2-first":  # ARC's eviction ignores its target: T2's keys go before T1's
        real_evict = arc.ARCCachePolicy.evict

        def t2_first(self: Any, n: int, protected: set[Any]) -> Any:
            target = self.target_t1_size
            self.target_t1_size = len(self.t1) + 1.0
            try:
                return real_evict(self, n, protected)
            finally:
                self.target_t1_size = target

        with mock.patch.object(arc.ARCCachePolicy, "evict", t2_first):
            yield
    elif name == "arc-finish-promotes-inserted":  # a request's finish counts the keys it only stored as reuses (to T2)
        real_finish = arc.ARCCachePolicy.on_request_finished

        def finish(self: Any, groups: Any, inserted_only: set[Any], reused: set[Any], ctx: Any) -> None:
            real_finish(self, groups, set(), reused | inserted_only, ctx)

        with mock.patch.object(arc.ARCCachePolicy, "on_request_finished", finish):
            yield
    else:
        raise SystemExit(f"unknown plant {name!r}")


@contextlib.contextmanager
def counted(reached: Counter[str]) -> Iterator[None]:
    """Count, at vLLM's own functions, what the run reached."""
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.cpu import manager as mg

    M = mg.CPUOffloadingManager
    store, complete, lookup, reset = M.prepare_store, M.complete_store, M.lookup, M.reset_cache

    def store_counted(self: Any, keys: Any, ctx: Any) -> Any:
        loading = any(c.ref_cnt > 0 for c in _chunks(self._policy))
        out = store(self, keys, ctx)
        if out is None:
            reached["store_refused"] += 1
        elif out.evicted_keys:
            reached["evicted"] += len(out.evicted_keys)
            reached["evicted_with_loads_in_flight"] += loading
        return out

    def complete_counted(self: Any, keys: Any, ctx: Any, success: bool = True) -> Any:
        reached["failed_stores"] += not success
        return complete(self, keys, ctx, success)

    def lookup_counted(self: Any, key: Any, ctx: Any) -> Any:
        got = lookup(self, key, ctx)
        reached["pending_lookups"] += got == LookupResult.HIT_PENDING
        return got

    def reset_counted(self: Any) -> Any:
        reached["resets_with_copies_in_flight"] += any(c.ref_cnt != 0 for c in _chunks(self._policy))
        return reset(self)

    with (
        mock.patch.object(M, "prepare_store", store_counted),
        mock.patch.object(M, "complete_store", complete_counted),
        mock.patch.object(M, "lookup", lookup_counted),
        mock.patch.object(M, "reset_cache", reset_counted),
    ):
        yield


def main(plants: list[str], examples: int) -> None:
    for name in plants:
        reached: Counter[str] = Counter()
        with tempfile.TemporaryDirectory() as out, counted(reached), planted(name):
            cert = certify(TARGET, examples=examples, out_dir=Path(out))
        cells = {name: sorted({f["invariant"] for f in c.failures}) for name, c in zip(cert.planned, cert.cells)}
        ops: Counter[str] = Counter()
        for c in cert.cells:
            ops.update(c.ops)
        print(json.dumps({"plant": name, "passed": cert.passed, "rules": sorted(set(chain(*cells.values()))),
                          "cells": cells, "reached": dict(reached), "ops": dict(ops), "not_checked": cert.not_checked,
                          "digests": [c.digest for c in cert.cells], "failures": [c.failure for c in cert.cells if c.failure]}))  # fmt: skip


def same(examples: int) -> None:
    """The unmodified manager certified in two fresh processes under other hash seeds: their digests and verdicts."""
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, __file__, str(examples), "none"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        )
        print(next(ln for ln in done.stdout.splitlines() if ln.startswith("{")))


if __name__ == "__main__":
    if sys.argv[1] == "same":
        same(int(sys.argv[2]))
    else:
        main(sys.argv[2:], int(sys.argv[1]))
