"""kvcert's production cache as an SGLang 0.5.23 radix-cache backend: `--radix-cache-backend kvcert`.

SGLang's plugin loader (`sglang.srt.plugins.load_plugins`) calls `register` once per process, through
the entry point `kvcert = "kvcert.integrations.sglang:register"` of the group `sglang.srt.plugins`.
`register` names the factory in SGLang's radix-cache registry; the factory checks the server's options
(`kvcert.integrations.sglang.options`) and builds `KvcertRadixCache` (`...cache`) over `kvcert.gpu`.
Nothing in SGLang is patched. This module imports SGLang only when called, so kvcert imports without it.

| module | owns |
|---|---|
| `cache` | `KvcertRadixCache`: SGLang's `BasePrefixCache` over `kvcert.gpu.GpuCache`, retention hints included |
| `options` | which server options the backend runs under, checked at startup (`UnsupportedOption`), and its settings |
| `kv` | `EnginePool`: SGLang's per-layer K and V buffers as a `kvcert.gpu` pool, so host copies move SGLang's bytes |
| `events` | `EventWatch`: the tree's residency watch feeding SGLang's own KV event recorder, for a router |
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "factory", "register"]

BACKEND = "kvcert"
"""The name `--radix-cache-backend` selects."""


def register() -> None:
    """The entry point: register the backend with SGLang's registry (once; a second call is a no-op)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, factory)


def factory(ctx: Any) -> Any:
    """SGLang's `RadixCacheFactory`: a `TreeCacheBuildContext` in, a `BasePrefixCache` out.

    Runs while the scheduler builds its tree cache, so an option the backend does not support stops
    the server at startup (`UnsupportedOption`, naming the option).
    """
    from kvcert.integrations.sglang.cache import KvcertRadixCache
    from kvcert.integrations.sglang.options import backend_options

    return KvcertRadixCache(ctx.params, backend_options(ctx))
