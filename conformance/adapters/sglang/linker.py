"""SGLang 0.5.23's direct external linker path, judged through its own scheduler (SPEC.md §14).

    kvcert certify kvcert.conformance.adapters.sglang.linker:factory

`--enable-unified-cache-external-linker` links a `UnifiedRadixCache`'s device pool straight to an external KV
store, with no host tier: SGLang's `UnifiedCacheLinkerWrapper` probes the store at match, queues the hit into
request-private slots at `init_load_back`, starts the loads with the batch and finishes them after its forward
(aborting the requests whose bytes did not land), and offloads every inserted node through the write-through
chain, holding a lock on it until the store publishes the result. An out-of-tree store plugs in through the
`dynamic` backend (`linker_factory.create_unified_cache_linker`): here that store is the harness's
(`KvcertLinker` over `kvcert.conformance.reference.linker.LinkerStore`), which moves real bytes between SGLang's device pool
and itself, fails on the trace's cue (`LinkerFault`), and judges every call SGLang makes to it
(`kvcert.spec.linker`). Everything else is the request path of `sglang.requests`: SGLang's own Scheduler, real
requests, the harness's model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from kvcert.conformance.adapters.kit.kv import free_slots, read_pool, write_pool
from kvcert.conformance.adapters.sglang import env as _env
from kvcert.conformance.adapters.sglang import requests as _rq  # installs SGLang's CPU shims before the imports below
from kvcert.conformance.reference.linker import LinkerStore
from kvcert.spec.invariants import Violation
from kvcert.spec.linker import FAULTS, LinkerLedger
from kvcert.spec.types import CacheConfig, PendingCopy, Snapshot

with _env.quiet_imports():
    from sglang.srt.managers.io_struct import FlushCacheReqInput
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.linker_factory import (
        create_unified_cache_linker,
        get_startup_linker_config,
    )
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
        UnifiedCacheLinker,
    )
    from sglang.srt.runtime_context import get_memory

__all__ = ["KvcertLinker", "SGLangLinkerPath", "factory", "factory_rust", "kv_transfer"]

STORE_PAGES = 2
"""The store holds this many times the device's pages: more than the device, so what the device evicts can come
back from it, and fewer than the traffic offloads, so it evicts (capacity) as a real one does."""


def kv_transfer(transfers: Sequence[Any]) -> Any:
    """The full-attention KV pool's transfer among a call's `PoolTransfer`s."""
    return next(t for t in transfers if t.name == PoolName.KV)


class KvcertLinker(UnifiedCacheLinker):
    """The harness's store as a `UnifiedCacheLinker`, built by SGLang's own `dynamic` factory. It translates
    SGLang's `PoolTransfer`s into page keys and device slots and completes the layer counter the forward waits on:
    all layers when the batch's bytes landed, failed when they did not (`LayerWiseLoadCounter`, SGLang's own)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: Optional[dict[str, Any]] = None,
        forward_stream: Any = None,
    ) -> None:
        self.forward_stream = forward_stream
        self.kv_pool = params.token_to_kv_pool_allocator.get_kvcache()
        self.allocator = params.token_to_kv_pool_allocator
        self.layers = int(self.kv_pool.layer_num)
        self.pools = {PoolName.KV: self.kv_pool}
        self.layer_done_counter = LayerWiseLoadCounter(self.layers)
        self.page_size = int(params.page_size)
        self.cached: Any = lambda: ()
        """The device slots the tree holds now (set by the adapter, which sees the tree)."""
        self.store = LinkerStore(
            page_size=self.page_size,
            capacity=int((extra_config or {})["capacity_pages"]),
            read=lambda slots: read_pool(self.kv_pool, slots, self.layers),
            write=lambda slots, entries: write_pool(self.kv_pool, slots, entries, self.layers),
            free_slots=lambda: free_slots(self.allocator, self.page_size),
            cached_slots=lambda: self.cached(),
        )
        self._batches: dict[int, int] = {}
        """Layer-counter index -> the store's batch."""

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        return self.store.lookup(rid, list(kv_transfer(transfers).keys or ()))

    def load(self, rid: str, transfers: list[Any]) -> bool:
        kv = kv_transfer(transfers)
        return self.store.load(rid, list(kv.keys or ()), [int(s) for s in kv.device_indices.tolist()])

    def start_layer_wise_loading(self) -> int:
        loads = bool(self.store.loads)
        batch = self.store.start()
        if not loads:
            return -1
        index = self.layer_done_counter.update_producer()
        self._batches[index] = batch
        if self.store.batches[batch]:
            for layer in range(self.layers):
                self.layer_done_counter.complete(index, layer)
        else:
            self.layer_done_counter.fail(index, RuntimeError("kvcert: the store failed this load batch"))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        batch = self._batches.pop(counter_index, -1 - counter_index)
        counted = self.layer_done_counter.finish(counter_index)
        return self.store.finish(batch) and counted

    def cancel_queued_load(self, rid: str) -> bool:
        return self.store.cancel(rid)

    def offload(self, transfers: list[Any], session_id: Optional[str] = None) -> bool:
        kv = kv_transfer(transfers)
        return self.store.offload(list(kv.keys or ()), [int(s) for s in kv.device_indices.tolist()])

    def num_completed_offloads(self) -> int:
        return self.store.completed()

    def pop_completed_offload(self) -> bool:
        return self.store.pop()

    def reset(self) -> None:
        self.store.reset()
        self._batches.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()


FLUSH_TIMEOUT_S = 3600.0
"""The client's flush waits this long for idle: far past any run, so the wall clock never decides a verdict."""


class SGLangLinkerPath(_rq.SGLangRequestPath):
    """`sglang_requests.SGLangRequestPath` over a device-only UnifiedRadixCache with the harness's store linked."""

    def __init__(self, config: CacheConfig, core: str = "python") -> None:
        if config.host_capacity:
            raise ValueError("a direct linker has no host tier: host_capacity must be 0")
        self.linker: Any = None
        super().__init__(config, kind="unified", core=core)

    def _server_args(self) -> dict[str, Any]:
        return super()._server_args() | {
            "enable_unified_cache_external_linker": True,
            "unified_cache_external_linker_backend": "dynamic",
            "unified_cache_external_linker_config": {
                "linker": KvcertLinker.__name__,
                "linker_module_path": __name__,
                "linker_extra_config": {"capacity_pages": STORE_PAGES * self.config.capacity // self.page_size},
            },
        }

    def _build_scheduler(self) -> Any:
        """The linker as `registry.create_unified_radix_cache` makes and attaches it, then the Scheduler."""
        cache = self._driver.cache
        linker = create_unified_cache_linker(
            self.args,
            self._driver.params,
            backend=get_memory().unified_cache_external_linker_backend,
            config=get_startup_linker_config(),
            components=set(cache.components),
            forward_stream=None,
        )
        cache.init_cache_linker(linker)
        self.linker = linker
        linker.cached = self._cached_slots
        return super()._build_scheduler()

    def _cached_slots(self) -> set[int]:
        return {int(s) for v in self._driver.nodes().values() if v["device"] for s in v["device"]}

    # ------------------------------------------------------------------ the store's side

    def linker_fault(self, kind: str) -> None:
        self.linker.store.arm(kind)

    def flush(self) -> None:
        """SGLang's FlushCacheReqInput (`/flush_cache`) with a timeout, so SGLang defers it until the scheduler is
        fully idle (`SchedulerFlushWrapper`; without one it refuses while the batch that just finished is still
        filtered out): then `Scheduler.flush_cache` resets the tree cache, and the wrapper resets the linker and
        releases the offloads it still waits on."""
        self._send(FlushCacheReqInput(timeout_s=FLUSH_TIMEOUT_S))

    def owes(self) -> bool:
        """A flush SGLang deferred until idle and has not run yet: the harness steps until it has."""
        return self.scheduler.flush_wrapper._pending is not None

    def reached(self) -> dict[str, int]:
        """What SGLang's calls reached in the store (lookup hits, loads landed and failed, offloads...)."""
        return dict(self.linker.store.reached)

    def _ledger(self) -> LinkerLedger:
        """The ledger that judges SGLang's calls to its linker (here the harness's store keeps it)."""
        return self.linker.store.ledger  # type: ignore[no-any-return]

    def failed_loads(self) -> set[str]:
        return set(self._ledger().failed)

    def step(self) -> None:
        """One scheduler step of the store's time (offloads due complete), then SGLang's iteration."""
        self.linker.store.tick()
        super().step()

    def observed(self, profile: str) -> list[Violation]:
        """The ledger's judgements of SGLang's calls since the last op, INV-LINK-6 over the tree's stored marks, and
        INV-LINK-7 once no request is left."""
        ledger = self._ledger()
        if not self._driver.is_rust:
            core = self.cache.tree_core
            for nid in self._driver.nodes():
                node = core.node_by_id(nid)
                if getattr(node, "external_cache_stored", False):
                    ledger.marks(str(nid), list(node.hash_value or ()))
        if not self._live_reqs():
            ledger.idle()
        found, ledger.found = ledger.found, []
        return found

    def snapshot(self) -> Snapshot:
        """The request path's snapshot, with the offloads whose result SGLang has not taken (in flight or published)
        as pending copies of the nodes it locked for them."""
        snap = super().snapshot()
        locked = [p.lock_node_id for p in self.cache.linker.pending_offloads]
        pending = tuple(
            PendingCopy(off.id, "offload", (int(locked[i]),) if i < len(locked) else (), off.result is not None)
            for i, off in enumerate(self._ledger().offloads)
        )
        return dataclasses.replace(snap, pending=pending)

    def bookkeeping(self) -> dict[str, tuple[Any, ...]]:
        out = super().bookkeeping()
        w = self.cache.linker
        out["linker.hit_markers"] = (len(w.hit_markers), (), None)
        out["linker.inflight_load_rids"] = (len(w.inflight_load_rids), (), None)
        out["linker.private_load_indices"] = (len(w.private_load_indices), (), None)
        out["linker.pending_offloads"] = (
            len(w.pending_offloads),
            tuple(sorted({int(p.lock_node_id) for p in w.pending_offloads})),
            None,
        )
        return out


def factory(config: CacheConfig) -> SGLangLinkerPath:
    return SGLangLinkerPath(config)


def factory_rust(config: CacheConfig) -> SGLangLinkerPath:
    return SGLangLinkerPath(config, core="rust")


_base = _rq.factory.capabilities  # type: ignore[attr-defined]
factory.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
    _base,
    name=f"sglang {_rq._env.SGLANG_VERSION} request path, UnifiedRadixCache + direct external linker "
    "(Python tree core)",
    write_policies=(),
    linker_faults=FAULTS,
    flushes=True,
    loras=False,
    client=("distinct-ids",),
    notes=_rq._NOTES
    + (
        "clients leave request ids to SGLang (CLIENT_RULES distinct-ids) and send no LoRA requests, so the walk goes "
        "on past SG-ABORT and SG-LORA (sglang_requests:factory finds both)",
        "a client's flush is FlushCacheReqInput(timeout_s=3600): SGLang defers it until the scheduler is fully idle, "
        "then resets the tree cache and its linker, offloads in flight or not",
        "--enable-unified-cache-external-linker with --unified-cache-external-linker-backend dynamic: SGLang's "
        "create_unified_cache_linker imports the harness's KvcertLinker (this module) and init_cache_linker wraps it "
        "in UnifiedCacheLinkerWrapper; device only (no host tier, as the flag requires)",
        f"the store (kvcert.conformance.reference.linker.LinkerStore) holds {STORE_PAGES} x the device's pages, claims a lookup's pages for its "
        "request, copies loads into the slots at start_layer_wise_loading and offloads out of them one scheduler step "
        "after they are queued (offload_hold: 3), publishing results in queue order; faults on the trace's cue: "
        + ", ".join(FAULTS),
    ),
    deviations=_rq._DEVIATIONS
    + (
        "tree core: Python (tree_core_backend=python); SGLang's default is the Rust core (factory_rust)",
        "layer-wise loading: the store's loads land inside start_layer_wise_loading and the scripted forward does not "
        "wait on the layer counter, so a forward that reads a layer before it landed is not seen",
    ),
)
factory.__doc__ = "SGLang's request path over UnifiedRadixCache with the harness's store as its direct linker."
factory_rust.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=factory.capabilities.name.replace("Python tree core", "Rust tree core"),  # type: ignore[attr-defined]
    deviations=tuple(
        d
        for d in factory.capabilities.deviations  # type: ignore[attr-defined]
        if not d.startswith("tree core: Python")
    )
    + (
        "stored marks: the Rust core exposes no external_cache_stored, so INV-LINK-6 is judged on the results taken only",
    ),
)
factory_rust.__doc__ = "`factory` on SGLang's default tree core, the compiled Rust one."
