"""Which SGLang 0.5.23 server options the kvcert backend runs under, checked when SGLang builds its tree cache.

An option the backend does not implement stops the server at startup with `UnsupportedOption`, whose
message names the option, instead of serving with a cache that ignores it. Everything here reads SGLang's
`TreeCacheBuildContext` and `ServerArgs`; nothing is patched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvcert.gpu.copy_engine import ENGINES
from kvcert.integrations.sglang.kv import geometry_of
from kvcert.spec.types import POLICIES, InvalidPolicyConfig, policy_params

__all__ = [
    "COPY_ENGINE_ENV",
    "HIGH_PRIORITY_ENV",
    "RETAIN_PARAM",
    "RETENTION_ENV",
    "BackendOptions",
    "UnsupportedOption",
    "backend_options",
]

HIGH_PRIORITY_ENV = "KVCERT_HIGH_PRIORITY_THRESHOLD"
"""Session priorities at or above this are high (SPEC.md §11.1); SGLang has no flag for it. Default 1. With
`--schedule-low-priority-values-first` the direction is SGLang's: priorities at or below it are high."""
COPY_ENGINE_ENV = "KVCERT_COPY_ENGINE"
"""The host tier's copy engine (`kvcert.gpu.copy_engine.ENGINES`); default `cuda` over a CUDA device pool, else
`deferred`."""

RETENTION_ENV = "KVCERT_RETENTION"
"""`1`: a session's finished turn that carries `RETAIN_PARAM` retains the session's path that many seconds (SPEC.md
§11.7). Unset or `0`: the hint is ignored and the tree's clock is a tick a call. Needs `--enable-session-radix-cache`
(retention holds a session's path) and one tensor-parallel rank (a deadline is wall time, which ranks do not share:
their trees would expire a retention at different iterations and evict differently)."""
RETAIN_PARAM = "kvcert_retain_seconds"
"""The client's hint, in the request's `sampling_params.custom_params`: seconds until its session's next turn (a
tool call's expected length). SGLang 0.5.23 carries `custom_params` to the scheduler's `Req` unchanged and has no
request field of its own for retention."""


class UnsupportedOption(ValueError):
    """A server option (or a model property) the kvcert backend does not implement; raised at startup."""


@dataclass(frozen=True)
class BackendOptions:
    """What the backend takes from the server: the eviction policy and its parameters, §11's threshold, switches."""

    policy: str = "lru"
    policy_config: tuple[tuple[str, int], ...] = ()
    """The policy's parameters, sorted (key, value) pairs: `CacheConfig.policy_config`."""
    high_priority_threshold: int = 1
    low_values_first: bool = False
    """`--schedule-low-priority-values-first`: SGLang schedules smaller priority values first, so a smaller value
    is the more important one; the backend flips priorities (and its threshold) to keep what SGLang favours."""
    sessions: bool = False
    """`--enable-session-radix-cache`: a request's `session_id` holds its path between turns (SPEC.md §11)."""
    metrics: bool = False
    host_capacity: int = 0
    """Host slots (`--enable-hierarchical-cache`, sized as SGLang sizes its host pool); 0 for device only."""
    write_policy: str = "write_through"
    """`--hicache-write-policy`."""
    copy_engine: str = "deferred"
    """What moves the host tier's bytes (`COPY_ENGINE_ENV`)."""
    retention: bool = False
    """`RETENTION_ENV`: finished turns' `RETAIN_PARAM` hints retain their sessions; the clock follows wall time."""


def _arg(server_args: Any, name: str, default: Any = None) -> Any:
    return getattr(server_args, name, default)


def _refuse(option: str, why: str) -> UnsupportedOption:
    return UnsupportedOption(f"--radix-cache-backend kvcert does not support {option}: {why}")


def check_supported(ctx: Any) -> None:
    """Raise `UnsupportedOption` for the first option or model property the backend cannot serve."""
    args = ctx.server_args
    params = ctx.params
    model = (
        (ctx.is_hybrid_swa, "a sliding-window attention model (hybrid SWA pools)"),
        (ctx.is_hybrid_ssm, "a Mamba / linear-attention model (hybrid SSM pools)"),
        (getattr(ctx, "is_dsa", False), "a DSA sparse-attention model"),
    )
    for present, what in model:
        if present:
            raise _refuse(what, "kvcert's tree keeps full-attention KV only; serve it without --radix-cache-backend")
    flags: tuple[tuple[bool, str, str], ...] = (
        (ctx.disable_radix_cache, "--disable-radix-cache", "the backend is a prefix cache; drop one of the two"),
        (
            _arg(args, "hicache_host_memory_mode", "cache") == "buffer_only",
            "--hicache-host-memory-mode buffer_only",
            "the host tier is a cache tier",
        ),
        (bool(_arg(args, "hicache_storage_backend")), "--hicache-storage-backend", "no storage tier through SGLang"),
        (
            bool(_arg(args, "enable_unified_cache_external_linker")),
            "--enable-unified-cache-external-linker",
            "a linker needs SGLang's UnifiedRadixCache",
        ),
        (bool(_arg(args, "enable_lmcache")), "--enable-lmcache", "LMCache needs SGLang's UnifiedRadixCache"),
        (bool(_arg(args, "enable_flexkv")), "--enable-flexkv", "FlexKV is its own radix cache"),
        (bool(_arg(args, "enable_hisparse")), "--enable-hisparse", "hierarchical sparse attention is not supported"),
        (
            _arg(args, "disaggregation_decode_retraction_backup") == "host_pool",
            "--disaggregation-decode-retraction-backup host_pool",
            "it needs a host tier through SGLang's HiCache controller",
        ),
        (
            bool(params.is_eagle) or _arg(args, "speculative_algorithm") is not None,
            "--speculative-algorithm",
            "speculative decoding keys the tree by token pairs (EAGLE) and adds draft pools",
        ),
        ((_arg(args, "dcp_size", 1) or 1) > 1, "--dcp-size > 1", "decode context parallelism widens pages"),
        ((_arg(args, "pp_size", 1) or 1) > 1, "--pp-size > 1", "pipeline parallelism is not tested"),
        (
            _arg(args, "schedule_policy") == "dfs-weight",
            "--schedule-policy dfs-weight",
            "it walks SGLang's own tree nodes",
        ),
        (
            ctx.enable_hierarchical_cache
            and _arg(args, "disaggregation_mode", "null") == "decode"
            and bool(_arg(args, "disaggregation_decode_enable_radix_cache")),
            "--disaggregation-mode decode with --disaggregation-decode-enable-radix-cache and "
            "--enable-hierarchical-cache",
            "SGLang's decode worker drives HiCache's own load-back queue and tree core (is_load_back_event_done, "
            "has_free_load_back_slot, tree_core, is_backuped), which the backend does not have",
        ),
        (
            ctx.enable_hierarchical_cache and not hasattr(params.token_to_kv_pool_allocator.get_kvcache(), "k_buffer"),
            "--enable-hierarchical-cache with this model's KV pool (MLA: one latent buffer a layer, no k_buffer)",
            "the host tier copies per-layer K and V buffers",
        ),
    )
    for present, option, why in flags:
        if present:
            raise _refuse(option, why)
    if params.page_size != params.token_to_kv_pool_allocator.page_size:
        raise _refuse("a tree page size unlike the allocator's", "the tree holds the allocator's pages")
    policy, config = _policy(params)
    if policy == "tlru":
        raise _refuse(
            "--radix-eviction-policy tlru",
            "SGLang 0.5.23 admits T-LRU only for its UnifiedRadixCache (create_tree_cache checks the class)",
        )
    if policy not in POLICIES:
        raise _refuse(f"--radix-eviction-policy {policy}", f"kvcert implements {', '.join(POLICIES)}")
    try:
        policy_params(policy, params.page_size, config)
    except InvalidPolicyConfig as e:
        raise _refuse(f"--radix-eviction-policy-config {params.eviction_policy_config!r}", str(e)) from None


def _policy(params: Any) -> tuple[str, tuple[tuple[str, int], ...]]:
    """The eviction policy and its parameters as (key, value) pairs sorted by key (`CacheConfig.policy_config`)."""
    return (params.eviction_policy or "lru").lower(), tuple(sorted((params.eviction_policy_config or {}).items()))


def _threshold() -> int:
    raw: Optional[str] = os.environ.get(HIGH_PRIORITY_ENV)
    if raw is None:
        return 1
    try:
        return int(raw)
    except ValueError:
        raise UnsupportedOption(f"{HIGH_PRIORITY_ENV}={raw!r} is not an integer") from None


def _copy_engine(ctx: Any) -> str:
    """`COPY_ENGINE_ENV`, else `cuda` when SGLang's KV lives on a CUDA device and `deferred` otherwise."""
    on_cuda = torch.device(ctx.params.token_to_kv_pool_allocator.device).type == "cuda"
    raw = os.environ.get(COPY_ENGINE_ENV)
    if raw is None:
        return "cuda" if on_cuda else "deferred"
    if raw not in ENGINES:
        raise UnsupportedOption(f"{COPY_ENGINE_ENV}={raw!r}: not one of {sorted(ENGINES)}")
    if raw.startswith("cuda") and not on_cuda:
        raise UnsupportedOption(f"{COPY_ENGINE_ENV}={raw!r} needs SGLang's KV on a CUDA device")
    return raw


def _retention(ctx: Any) -> bool:
    """`RETENTION_ENV`, checked against what retention needs."""
    raw = os.environ.get(RETENTION_ENV, "0")
    if raw not in ("0", "1"):
        raise UnsupportedOption(f"{RETENTION_ENV}={raw!r}: 1 (on) or 0 (off)")
    if raw == "0":
        return False
    if not ctx.params.enable_session_radix_cache:
        raise _refuse(f"{RETENTION_ENV}=1 without --enable-session-radix-cache", "retention holds a session's path")
    if (_arg(ctx.server_args, "tp_size", 1) or 1) > 1:
        raise _refuse(
            f"{RETENTION_ENV}=1 with --tp-size > 1", "a retention's deadline is wall time, which the ranks do not share"
        )
    return True


def host_slots(ctx: Any) -> int:
    """The host pool SGLang would build (`pool_host/base.py`): `--hicache-size` GB of this model's KV, else
    `--hicache-ratio` (default 2.0) of the device pool, plus SGLang's padding page; 0 without HiCache."""
    if not ctx.enable_hierarchical_cache:
        return 0
    args, allocator, ps = ctx.server_args, ctx.params.token_to_kv_pool_allocator, ctx.params.page_size
    size_gb = _arg(args, "hicache_size", 0) or 0
    if size_gb > 0:
        g = geometry_of(allocator.get_kvcache())
        tokens = int(size_gb * 1e9 // (2 * g.layers * g.width))  # K and V of every layer, `width` bytes each
    else:
        tokens = int(allocator.size * (_arg(args, "hicache_ratio") or 2.0))
    return (tokens // ps + 1) * ps


def backend_options(ctx: Any) -> BackendOptions:
    """Check the context (`check_supported`) and read the backend's options from it."""
    check_supported(ctx)
    params = ctx.params
    policy, config = _policy(params)
    return BackendOptions(
        policy=policy,
        policy_config=config,
        high_priority_threshold=_threshold(),
        low_values_first=bool(_arg(ctx.server_args, "schedule_low_priority_values_first", False)),
        sessions=bool(params.enable_session_radix_cache),
        metrics=bool(params.enable_metrics),
        host_capacity=host_slots(ctx),
        write_policy=_arg(ctx.server_args, "hicache_write_policy", "write_through") or "write_through",
        copy_engine=_copy_engine(ctx),
        retention=_retention(ctx),
    )
