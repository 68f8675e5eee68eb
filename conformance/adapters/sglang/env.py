"""SGLang 0.5.23's environment for its adapters: the pinned version, its install hint, and its mem_cache classes
imported behind the kit's CPU shims (`kit.cpu`, ../shared/SGLANG_ON_CPU.md).
"""

from __future__ import annotations

import types
import warnings

from kvcert.conformance.adapters.kit.cpu import (
    InterpolationMode,
    OrderedSet,
    install_finder,
    install_shims,
    platform_stubs,
    quiet_imports,
)

__all__ = [
    "INSERTION_ORDERED_TIES",
    "INSTALL_HINT",
    "SGLANG_VERSION",
    "InterpolationMode",
    "OrderedSet",
    "import_sglang",
    "install_finder",
    "install_shims",
    "platform_stubs",
    "quiet_imports",
]

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = "install the pinned set with `scripts/install_sglang.sh` (see requirements/sglang.txt)"

INSERTION_ORDERED_TIES = (
    "eviction ties: SGLang's sets of candidate leaves are insertion-ordered, so equally ranked leaves leave in "
    "insertion order; as shipped a set orders them by memory address, which differs from run to run (F-9)"
)
"""The deviation of every SGLang 0.5.23 adapter whose cache keeps its candidate leaves in a set."""


def import_sglang() -> types.SimpleNamespace:
    """Install the shims and import the SGLang classes the adapter drives.

    Raises ImportError with an install hint when sglang (or one of its pinned
    hard imports) is missing.
    """
    try:
        install_shims()
        with quiet_imports():
            from sglang.srt.mem_cache import radix_cache
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams, TreeLock
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
            from sglang.version import __version__
    except ImportError as exc:
        raise ImportError(f"cannot import sglang's mem_cache ({exc}); {INSTALL_HINT}") from exc
    if __version__ != SGLANG_VERSION:
        warnings.warn(f"kvcert's SGLang adapter targets {SGLANG_VERSION}, found {__version__}", stacklevel=2)
    return types.SimpleNamespace(
        version=__version__,
        radix_cache=radix_cache,
        RadixCache=radix_cache.RadixCache,
        RadixKey=radix_cache.RadixKey,
        TreeNode=radix_cache.TreeNode,
        CacheInitParams=CacheInitParams,
        MatchPrefixParams=MatchPrefixParams,
        InsertParams=InsertParams,
        EvictParams=EvictParams,
        TreeLock=TreeLock,
        MHATokenToKVPool=MHATokenToKVPool,
        ReqToTokenPool=ReqToTokenPool,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
    )
