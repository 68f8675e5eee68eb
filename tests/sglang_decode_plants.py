"""SGLang 0.5.23's decode-side HiCache broken on purpose, the ways PR #26560's review found it broken (seed 003):
a lock leaked, a flag left set after its host copy was freed, a deferred prefetch never issued again. Each plant
changes SGLang's own code for the length of one certification of `kvcert.conformance.adapters.sglang.decode`
(tests/test_sglang_decode.py), and `counted` tallies, at SGLang's own functions, what the run reached.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from collections.abc import Iterator
from typing import Any
from unittest import mock

from kvcert.conformance.adapters.sglang import decode as sglang_decode  # noqa: F401  (SGLang's CPU shims before its imports)

_decode: Any = importlib.import_module("sglang.srt.disaggregation.decode")
_mixin: Any = importlib.import_module("sglang.srt.disaggregation.decode_hicache_mixin")
_urc: Any = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
_core: Any = importlib.import_module("sglang.srt.mem_cache.unified_cache.unified_tree_core")

PLANTS = ("commit-keeps-device-lock", "failed-restore-keeps-lock", "unevict-frees-host-copy", "prefetch-never-issued")
"""Every plant `planted` knows."""


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """SGLang with plant `name` ("none": unmodified) while the block runs."""
    mixin = _mixin.DecodeHiCacheTransferMixin
    if name == "none":
        yield
    elif name == "commit-keeps-device-lock":  # the restore's commit takes the restored lock and keeps the L1 one
        real_commit = mixin._commit_hicache_local_restore_to_req

        def commit(self: Any, decode_req: Any) -> None:
            with mock.patch.object(self.tree_cache, "unlock", lambda lock: None):
                real_commit(self, decode_req)

        with mock.patch.object(mixin, "_commit_hicache_local_restore_to_req", commit):
            yield
    elif name == "failed-restore-keeps-lock":  # a failed transfer's cleanup leaves the restored prefix locked
        real_clean = mixin._clean_hicache_prefetch_resources

        def clean(self: Any, decode_req: Any) -> None:
            with mock.patch.object(self.tree_cache, "unlock", lambda lock: None):
                real_clean(self, decode_req)

        with mock.patch.object(mixin, "_clean_hicache_prefetch_resources", clean):
            yield
    elif name == "unevict-frees-host-copy":  # PR #26560's insert(): an evicted node restored on insert frees its
        # host copy, and its backed-up flag (host_value: `backuped` is derived from it in 0.5.23) stays set
        owner: list[Any] = []
        real_insert, real_unevict = _urc.UnifiedRadixCache.insert, _core.UnifiedTreeCore._unevict_node_on_insert

        def insert(self: Any, *args: Any, **kwargs: Any) -> Any:
            owner.append(self)
            try:
                return real_insert(self, *args, **kwargs)
            finally:
                owner.pop()

        def unevict(self: Any, node: Any, *args: Any, **kwargs: Any) -> None:
            real_unevict(self, node, *args, **kwargs)
            host = node.component_data[_core.BASE_COMPONENT_TYPE].host_value
            controller = owner[-1].cache_controller if owner else None
            if host is not None and controller is not None:
                controller.mem_pool_host.free(host)

        with (
            mock.patch.object(_urc.UnifiedRadixCache, "insert", insert),
            mock.patch.object(_core.UnifiedTreeCore, "_unevict_node_on_insert", unevict),
        ):
            yield
    elif name == "prefetch-never-issued":  # a request admitted after waiting never has its L3 prefetch issued, yet
        # the prefill is still promised the storage span
        with mock.patch.object(_mixin.DecodeHiCachePreallocMixin, "_start_hicache_prefetch", lambda *a, **k: None):
            yield
    else:
        raise ValueError(f"no plant {name!r}")


@contextlib.contextmanager
def counted(reached: Counter[str]) -> Iterator[None]:
    """Count what the run reached: L1 and L2 prefix hits, restores committed, transfers failed with a restore lock
    held, evicted nodes restored on insert, L3 hits, L3 prefetches issued, tokens they brought to the host."""
    queue, mixin = _decode.DecodePreallocQueue, _mixin.DecodeHiCacheTransferMixin
    prealloc = _mixin.DecodeHiCachePreallocMixin
    real_start, real_result = prealloc._start_hicache_prefetch, _urc.UnifiedRadixCache._handle_prefetch_result
    real_match, real_commit = queue._match_prefix_and_lock, mixin._commit_hicache_local_restore_to_req
    real_clean, real_unevict = mixin._clean_hicache_prefetch_resources, _core.UnifiedTreeCore._unevict_node_on_insert

    def match(self: Any, req: Any) -> Any:
        out = real_match(self, req)
        reached["l1_hits"] += out.l1_prefix_len > 0
        reached["l2_hits"] += out.l2_host_hit_length > 0
        reached["l3_hits"] += out.l3_storage_hit_length > 0
        return out

    def commit(self: Any, decode_req: Any) -> None:
        pm = decode_req.prefix_match
        reached["restores"] += pm is not None and pm.needs_local_restore
        real_commit(self, decode_req)

    def clean(self: Any, decode_req: Any) -> None:
        reached["failed_with_restore_lock"] += decode_req.hicache_restore_lock is not None
        real_clean(self, decode_req)

    def unevict(self: Any, *args: Any, **kwargs: Any) -> None:
        reached["unevicted"] += 1
        real_unevict(self, *args, **kwargs)

    def start(self: Any, req: Any, prefix_match: Any) -> None:
        real_start(self, req, prefix_match)
        reached["l3_prefetches"] += prefix_match is not None and prefix_match.prefetch_registered

    def result(self: Any, operation: Any) -> None:
        reached["l3_tokens_loaded"] += int(operation.completed_tokens)
        real_result(self, operation)

    with (
        mock.patch.object(queue, "_match_prefix_and_lock", match),
        mock.patch.object(mixin, "_commit_hicache_local_restore_to_req", commit),
        mock.patch.object(mixin, "_clean_hicache_prefetch_resources", clean),
        mock.patch.object(_core.UnifiedTreeCore, "_unevict_node_on_insert", unevict),
        mock.patch.object(prealloc, "_start_hicache_prefetch", start),
        mock.patch.object(_urc.UnifiedRadixCache, "_handle_prefetch_result", result),
    ):
        yield
