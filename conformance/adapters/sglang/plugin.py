"""kvcert's own cache as SGLang 0.5.23 runs it: `--radix-cache-backend kvcert`, judged through SGLang's scheduler.

    kvcert certify kvcert.conformance.adapters.sglang.plugin:factory            # device and host tiers, priorities
    kvcert certify kvcert.conformance.adapters.sglang.plugin:factory_sessions   # + --enable-session-radix-cache
    kvcert certify kvcert.conformance.adapters.sglang.plugin:factory_retention  # + KVCERT_RETENTION=1, clients' hints

The target is what a user runs: SGLang's plugin loader (`load_plugins`, as `run_scheduler_process` calls it)
imports kvcert's entry point, which registers the backend; SGLang's `create_tree_cache` picks it by
`--radix-cache-backend kvcert` and builds it from the same `TreeCacheBuildContext` `build_kv_cache` builds.
Everything after that is `sglang.requests`' request path: SGLang's own scheduler, `Req` objects and pools.
This module never imports kvcert's caches: the snapshot reads the object SGLang's registry returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from kvcert.conformance.adapters.kit.kv import read_pool, write_pool
from kvcert.conformance.adapters.sglang import env as _env
from kvcert.conformance.adapters.sglang import requests as _requests
from kvcert.conformance.adapters.sglang._events import Replay
from kvcert.conformance.adapters.sglang.radix import cpu_pools
from kvcert.spec.invariants import Violation
from kvcert.spec.types import POLICIES, CacheConfig, Capabilities, Snapshot

with _env.quiet_imports():
    from sglang.srt.mem_cache import registry as _registry
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.plugins import load_plugins

__all__ = ["KvcertPools", "factory", "factory_retention", "factory_sessions", "tree_context"]

BACKEND = "kvcert"
HIGH_PRIORITY_ENV = "KVCERT_HIGH_PRIORITY_THRESHOLD"
"""The backend's setting for §11's high-priority threshold (docs/sglang-plugin.md)."""
RETENTION_ENV = "KVCERT_RETENTION"
"""The backend's switch for clients' retention hints (docs/sglang-plugin.md, "Retention")."""


class KvcertPools:
    """SGLang's pools and allocator for the request path, and the cache SGLang's registry builds over them."""

    def __init__(self, config: CacheConfig, sessions: bool = False, retention: bool = False) -> None:
        self.config, self.page_size, self.sessions, self.retention = config, config.page_size, sessions, retention
        self._now = 0
        """The harness's clock: with retention, the backend's clock reads it as seconds (one op, one second)."""
        self.kv_pool, self.allocator = cpu_pools(config)
        self.cache: Any = None
        self.router = Replay()
        """A router's view of the cache, from its KV events alone."""

    def build_cache(self, req_pool: Any, tp_worker: Any, model_config: Any, server_args: Any) -> Any:
        """`load_plugins()`, then SGLang's `create_tree_cache` on the context `build_kv_cache` builds (one rank)."""
        load_plugins()
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.page_size,
            eviction_policy=server_args.radix_eviction_policy,
            eviction_policy_config=server_args.radix_eviction_policy_config,
            enable_session_radix_cache=self.sessions,
            enable_kv_cache_events=True,  # --kv-events-config: INV-EVENT-1 replays them (`observed`)
        )
        ctx = tree_context(
            params,
            server_args,
            tp_worker=tp_worker,
            model_config=model_config,
            enable_hierarchical_cache=bool(server_args.enable_hierarchical_cache),
        )
        # What an operator sets for §11's two ref classes (SGLang has no flag for it): the cell's threshold; and the
        # retention switch for a build that takes clients' hints.
        settings = {HIGH_PRIORITY_ENV: str(self.config.high_priority_threshold), RETENTION_ENV: str(int(self.retention))}
        saved = {k: os.environ.get(k) for k in settings}
        os.environ.update(settings)
        try:
            self.cache = _registry.create_tree_cache(ctx)
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        if self.retention:  # time is the harness's: the backend's clock reads its seconds
            self.cache.clock = lambda: float(self._now)
            self.cache.reset_clock_origin()
        return self.cache

    # ------------------------------------------------------------------ what sglang_requests reads

    def set_clock(self, now: int) -> None:
        """The backend keeps its own logical clock (a tick a call); the harness's is not pushed into it. With
        retention the backend's wall clock (`KvcertRadixCache.clock`) reads it."""
        self._now = now

    @contextlib.contextmanager
    def _in_engine(self) -> Iterator[None]:
        yield

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        write_pool(self.kv_pool, slots, entries, self.config.kv_layers)

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        return read_pool(self.kv_pool, slots, self.config.kv_layers)

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        return self.cache.cache.read_host_kv(host_slots)

    def observed(self) -> list[Violation]:
        """INV-EVENT-1 (`sglang._events`): the KV events the cache published since the last op, replayed, give the
        blocks it holds now, on each medium (GPU: device, CPU_PINNED: host)."""
        self.router.apply(self.cache.take_events())
        return self.router.agree(self.cache.cache.snapshot(), _parts)

    def snapshot(self) -> Snapshot:
        """The backend's own snapshot (its tree, and SGLang's allocator's free slots), namespaces as sent."""
        base = self.cache.cache.snapshot()
        nodes = tuple(dataclasses.replace(n, namespace=_sent(n.namespace)) for n in base.nodes)
        # retention deadlines in the harness's seconds (the backend's clock is microseconds of them)
        sessions = tuple(
            dataclasses.replace(x, retained_until=x.retained_until // 1_000_000) if x.retained_until is not None else x
            for x in base.sessions
        )
        ps = self.page_size
        return dataclasses.replace(
            base, nodes=nodes, sessions=sessions, capacity=self.config.capacity, slot_limit=self.config.capacity + ps
        )


def tree_context(params: Any, server_args: Any, **fields: Any) -> Any:
    """The `TreeCacheBuildContext` `build_kv_cache` passes the registry for a one-rank, full-attention model with no
    host tier; `fields` override any of its fields."""
    return _registry.TreeCacheBuildContext(
        **{
            "server_args": server_args,
            "params": params,
            "is_hybrid_swa": False,
            "is_hybrid_ssm": False,
            "enable_hierarchical_cache": False,
            "disable_radix_cache": False,
            "tp_worker": None,
            "model_config": None,
            "tp_size": 1,
            "tp_rank": 0,
            "tp_group": None,
        }
        | fields
    )


def _parts(namespace: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """The backend's tree namespace (JSON [extra_key, cache_salt]) as SGLang's key parts."""
    if namespace is None:
        return None, None
    extra, salt = json.loads(namespace)
    return extra, salt


def _sent(namespace: Any) -> Any:
    """The backend files a key under JSON [extra_key, cache_salt]; the suite's namespace is the extra_key."""
    if namespace is None:
        return None
    extra, salt = _parts(namespace)
    return extra if salt is None else namespace


class KvcertRequestPath(_requests.SGLangRequestPath):
    """SGLang's request path over the backend, with the backend's KV events judged after every op (INV-EVENT-1)."""

    def observed(self, profile: str) -> list[Violation]:
        return self.backend.observed()


def _capabilities(sessions: bool, retention: bool = False) -> Capabilities:
    version = _env.SGLANG_VERSION
    name = f"kvcert backend in sglang {version}, request path (--radix-cache-backend kvcert)"
    notes: tuple[str, ...] = _requests._NOTES + (
        "the cache is kvcert's KvcertRadixCache (kvcert.integrations.sglang) over kvcert.gpu, registered by SGLang's "
        "plugin loader from kvcert's entry point and built by SGLang's create_tree_cache; host cells run "
        "--enable-hierarchical-cache with the cell's --hicache-write-policy: kvcert's own host tier over SGLang's "
        "device buffers, its copies on the deferred engine (CUDA's on a GPU, not run here): a load-back lands within "
        "init_load_back, write-through backups at the next check_hicache_events",
        "a request's priority reaches the tree's insert (the priority policy's rank); --enable-session-radix-cache "
        "makes a request's session_id hold its path between turns at its priority (SPEC.md §11), released when SGLang "
        "closes the session",
    )
    sglang_tree = ("stand-in Scheduler", "clock: SGLang's tree counters", "eviction ties: SGLang's sets")
    deviations = tuple(d for d in _requests._DEVIATIONS if not d.startswith(sglang_tree)) + (
        "stand-in Scheduler: object.__new__(Scheduler) with __init__'s init_* methods run in its order; replaced: "
        "init_model_worker (no TpModelWorker), kv_cache_builder.build_kv_cache (pools and allocator built here with "
        "build_kv_cache's CacheInitParams fields for this configuration; the tree cache is SGLang's "
        "create_tree_cache(TreeCacheBuildContext) after load_plugins()), init_ipc_channels, the watchdog thread "
        "(none), init_rank_consensus_checker (not run)",
        "clock: the backend stamps its tree with its own logical clock (a tick a call), not the harness's"
        + ("; with retention, the harness's seconds (below) when they are further on" if retention else ""),
        "KV events: built with --kv-events-config's enable_kv_cache_events; the harness takes the cache's events "
        "after each op (take_events, as SGLang's publisher does each scheduler loop; the publisher itself, a ZMQ "
        "socket, is not started) and replays them (INV-EVENT-1) in SGLang's default format, no LoRA names",
    )
    notes += (
        "clients leave request ids to SGLang (CLIENT_RULES distinct-ids) and send no LoRA requests: SG-ABORT and "
        "SG-LORA are SGLang's scheduler's and tokenizer's, logged against sglang_requests, whatever the cache",
    )
    if sessions:
        name += ", radix-native sessions"
        notes += ("--enable-session-radix-cache: close_session = CloseSessionReqInput -> release_radix_session",)
    if retention:
        name += ", retention hints"
        notes += (
            "KVCERT_RETENTION=1: a session's turn may carry the client's retention hint (sampling_params.custom_params "
            "kvcert_retain_seconds, 1-6 s); a finished turn retains its session's path that long (SPEC.md §11.7), "
            "judged by INV-RP-6",
        )
        deviations += (
            "clock with retention: the backend's wall clock (KvcertRadixCache.clock, time.monotonic in a server) reads "
            "the harness's time, one op a second, so deadlines are reproducible; snapshots give deadlines in those "
            "seconds",
        )
    else:
        notes += ("no session refs in this build: a session is the client's conversation only",)
    return Capabilities(
        name=name,
        page_sizes=(1, 4),
        policies=tuple(p for p in POLICIES if p != "tlru"),  # SGLang admits tlru for UnifiedRadixCache only
        namespaces=True,
        strict_input=False,
        kv_reads=True,
        write_policies=("write_through", "write_through_selective", "write_back"),
        priority_refs=sessions,
        priority_parts=(("high", "move") if sessions else ()) + (("retain",) if retention else ()),
        profile="sglang-0.5.23",
        notes=notes,
        deviations=deviations,
        kind="request-path",
        loras=False,
        client=("distinct-ids",),
    )


def _make(sessions: bool, retention: bool = False) -> Any:
    name = "factory_retention" if retention else "factory_sessions" if sessions else "factory"

    def factory(config: CacheConfig) -> Any:
        pools = KvcertPools(config, sessions=sessions, retention=retention)
        return KvcertRequestPath(config, kind="kvcert", pools=pools)

    factory.__name__ = factory.__qualname__ = name
    factory.capabilities = _capabilities(sessions, retention)  # type: ignore[attr-defined]
    return factory


factory = _make(False)
factory_sessions = _make(True)
factory_retention = _make(True, retention=True)
