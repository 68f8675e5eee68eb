"""The production cache: torch KV pools, a pinned host pool, copy engines, incremental metadata.

`kvcert certify kvcert.gpu:factory` certifies it (layer-first pools, the deterministic CPU copy
engine); `factory_page_first` uses the page-first device layout. `make_factory(...)` builds a
factory for any layout, geometry and copy engine. Design and complexity: docs/gpu.md.

An engine calls the tensor API (`GpuCache.alloc_tensor`, `match_prefix_fast` -> `Matched`,
`insert_fast` -> `Inserted`, `free_tensor`); the suite calls the Backend protocol (`alloc`,
`match_prefix`, `insert`, `free`, ...). Both are the same internals.

`GpuCache` (`cache`) is the one public class, a facade over components, a module each:

| module | owns |
|---|---|
| `cache` | `GpuCache`: the facade, both APIs, admission plans (`kvcert.spec.admission.plan_admission`) |
| `tree` | `RadixTree`, the radix tree and the device tier (walk, split, match, insert, locks, device eviction, the copy registry); `GpuCache` subclasses it |
| `evict_index` | `EvictionIndex`, the candidate sets and per-tier heaps (`refresh`, `pop_*`, `compact`) |
| `tiers` | `TierTree`, the protocol the tiers reach their tree through (never `tree` or `cache` by import) |
| `host` | `HostTier`, the host pool, backups, host eviction, load-back, retraction |
| `storage` | `StorageTier`, store copies and prefetch |
| `sessions` | `Sessions`, the session registry, ref counts along paths, demotion under host pressure |
| `run` | `Run`: keys and slot runs as int64 bytes, counted and cut in items |
| `node` | the records the components share: nodes, pending copies, prefetches, sessions, retractions |
| `kv` | KV pools as torch tensors in real engine layouts, and the spec's synthetic KV as bytes |
| `alloc` | page-granular slot allocators for the device and host pools |
| `copy_engine` | copy engines: how bytes move between the device and host pools |
| `agreement` | tensor-parallel ranks: every rank consumes the same acks and pages |
| `watch` | `Watch`, told of every node's pages arriving on or leaving a tier (`GpuCache.watch`: an engine's KV events) |

This package imports only `kvcert.spec`, torch and the standard library: the suite compares it
with `kvcert.refimpl`, so it must share none of the model's code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Optional

import torch

from kvcert.gpu.cache import GpuCache, Inserted, Matched
from kvcert.gpu.kv import KVGeometry
from kvcert.spec.types import FAULTS, POLICIES, PREFETCH_POLICIES, WRITE_POLICIES, CacheConfig, Capabilities

__all__ = [
    "CAPABILITIES",
    "GpuCache",
    "Inserted",
    "KVGeometry",
    "Matched",
    "factory",
    "factory_page_first",
    "factory_queued",
    "factory_threaded",
    "make_factory",
]

CAPABILITIES = Capabilities(
    name="kvcert.gpu",
    page_sizes=(1, 2, 4, 8, 16),
    policies=POLICIES,
    namespaces=True,
    strict_input=True,
    write_policies=WRITE_POLICIES,
    prefetch_policies=PREFETCH_POLICIES,
    faults=FAULTS,
    retraction=True,
    kv_reads=True,
    priority_refs=True,
    priority_parts=("high", "scope", "update", "admission", "move", "retain"),
    still_between_calls=True,
    profile="sglang-0.5.23",
    reports_choices=True,
    reports_metadata=True,
    metadata_exact=True,
    kind="native",
)


def make_factory(
    *,
    layout: str = "layer_first",
    host_layout: str = "layer_first",
    heads: int = 1,
    head_dim: int = 2,
    dtype: torch.dtype = torch.float32,
    engine: str = "deferred",
    device: Optional[torch.device] = None,
    demote: str = "idle_fewest",
) -> Callable[[CacheConfig], GpuCache]:
    """A factory (with `capabilities`) for caches of this layout, per-layer geometry, copy engine and demotion order
    (`demote`: "queued" is the RefAware fork's DEMOTE order; that cache declares the profile `kvcert-queued`)."""

    def build(config: CacheConfig) -> GpuCache:
        geometry = KVGeometry(layers=config.kv_layers, heads=heads, head_dim=head_dim, dtype=dtype)
        return GpuCache(
            config, layout=layout, host_layout=host_layout, geometry=geometry, engine=engine, device=device, demote=demote
        )

    f: Any = build
    # A worker thread moves copies between calls: the harness reads every snapshot afresh.
    f.capabilities = CAPABILITIES if engine == "deferred" else replace(CAPABILITIES, still_between_calls=False)
    if demote != "idle_fewest":  # the profile that pins this order (kvcert.spec.profiles.KVCERT_QUEUED)
        f.capabilities = replace(f.capabilities, name=f"kvcert.gpu (demote={demote})", profile=f"kvcert-{demote}")
    return build


factory = make_factory()
"""`kvcert certify kvcert.gpu:factory`: layer-first pools, deterministic CPU copy engine."""
factory_page_first = make_factory(layout="page_first", host_layout="page_first")
"""The page-first layout on both tiers."""
factory_threaded = make_factory(engine="threaded")
"""Copies moved by a worker thread as soon as they are issued (soak runs); acks still wait for `complete`."""
factory_queued = make_factory(demote="queued")
"""Host pressure demotes in the RefAware fork's queue order (DEMOTE "queued"), not SGLang's idle-fewest: profile
`kvcert-queued`, measured in docs/bench_policy.md ("What the gap is made of")."""
