"""The reference engine with a direct linker (SPEC.md §14): kvcert's plain scheduler keeping the linker tier's rules.

It is the positive control of the linker rules, as `conformance.reference.engine` is of the request path's: the textbook
way a cache drives a direct linker, over the reference model or `kvcert.gpu`, with the harness's store
(`conformance.reference.linker.LinkerStore`) behind it.

- **Match.** A request admitted with a device prefix asks the store about the page keys of the rest of its prompt
  (`kvcert.spec.storage.page_keys`: a key names its page and everything before it) and queues a load of the
  longest prefix the store reports into the first of its own slots.
- **Load.** The step's loads start once admission is done and finish before any forward: a request whose load
  landed skips computing those tokens; one whose load failed is aborted (its slots freed, nothing cached).
- **Offload.** A finished request's pages, once in the tree, are offloaded when the store holds no successful
  copy and no offload of them is in flight; the node stays locked until the result is taken (taken in order, at
  the top of each step). A page is *stored* once an offload of it succeeded or a load of it landed.

The bytes move between the cache's device slots (`read_kv`/`write_kv`) and the store: with `kvcert.gpu`, between
its device pool tensors and the store.

    kvcert certify kvcert.conformance.reference.engine_linker:factory        # over the reference model
    kvcert certify kvcert.conformance.reference.engine_linker:factory_gpu    # over kvcert.gpu
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from kvcert.conformance.reference import engine as _engine
from kvcert.conformance.reference.linker import LinkerStore
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.invariants import Violation
from kvcert.spec.linker import FAULTS
from kvcert.spec.types import CacheConfig, PendingCopy, Snapshot

__all__ = ["LinkedEngine", "factory", "factory_gpu"]

STORE_PAGES = 2
"""The store holds this many times the device's pages (as `sglang.linker`'s)."""


class LinkedEngine(_engine.ReferenceEngine):
    """`ReferenceEngine` over a device-only protocol cache, linked to the harness's store."""

    def __init__(self, cache: Any, config: CacheConfig, priority_refs: Optional[bool] = None) -> None:
        if config.host_capacity:
            raise ValueError("a direct linker has no host tier: host_capacity must be 0")
        super().__init__(cache, config, priority_refs)
        self.digest = l3.canonical_digest(config.page_size, config.model_id)
        self.store = LinkerStore(
            page_size=self.ps,
            capacity=STORE_PAGES * config.capacity // self.ps,
            read=lambda slots: list(cache.read_kv(slots)),
            write=lambda slots, entries: cache.write_kv(list(slots), list(entries)),
            free_slots=lambda: cache.snapshot().free_slots,
            cached_slots=self._cached_slots,
        )
        self.loading: dict[str, int] = {}
        """Requests whose load is queued this step -> the tokens it fills."""
        self.offloads: list[tuple[int, tuple[str, ...]]] = []
        """Offloads in flight or published, in queue order: (the node locked for it, its page keys)."""
        self.stored: set[str] = set()
        self.flying: set[str] = set()

    def _cached_slots(self) -> set[int]:
        return {s for n in self.cache.snapshot().nodes if n.slots for s in n.slots}

    def _keys(self, ns: Any, tokens: list[int], upto: int) -> list[str]:
        return list(l3.page_keys(ns, tuple(tokens[:upto]), self.ps, self.digest))

    # ------------------------------------------------------------------ the linker's hooks

    def _admitted(self, r: Any) -> None:
        cap = pages.page_floor(len(r.tokens) - 1, self.ps)
        if r.computed >= cap:
            return
        tail = self._keys(r.namespace, r.tokens, cap)[r.computed // self.ps :]
        hits = self.store.lookup(r.id, tail)
        n = max(hits, default=0)
        if n and self.store.load(r.id, tail[:n], r.row[r.computed : r.computed + n * self.ps]):
            self.loading[r.id] = n * self.ps

    def _loaded(self) -> None:
        if not self.loading:
            self.store.start()
            return
        batch = self.store.start()
        landed = self.store.finish(batch)
        loading, self.loading = self.loading, {}
        for r in list(self.running):
            if r.id not in loading:
                continue
            if landed:
                r.computed += loading[r.id]
            else:
                self._end(r, "aborted")

    def _cached(self, r: Any, node: int) -> None:
        aligned = pages.page_floor(r.computed, self.ps)
        keys = self._keys(r.namespace, r.tokens, aligned)
        new = [i for i, k in enumerate(keys) if k not in self.stored and k not in self.flying]
        if not new:
            return
        got = self.cache.match_prefix(r.namespace, tuple(r.tokens[:aligned]))
        if got.length < aligned:  # pragma: no cover - an insert leaves its key cached
            return
        slots = [s for i in new for s in got.slots[i * self.ps : (i + 1) * self.ps]]
        picked = tuple(keys[i] for i in new)
        self.cache.inc_lock_ref(got.node)
        if not self.store.offload(list(picked), slots):
            self.cache.dec_lock_ref(got.node)
            return
        self.offloads.append((got.node, picked))
        self.flying |= set(picked)

    def _take_results(self) -> None:
        for _ in range(self.store.completed()):
            node, keys = self.offloads.pop(0)
            if self.store.pop():
                self.stored |= set(keys)
            self.flying -= set(keys)
            self.cache.dec_lock_ref(node)

    # ------------------------------------------------------------------ the protocol

    def step(self) -> None:
        self.store.tick()
        self._take_results()
        super().step()

    def abort(self, request: str) -> None:
        super().abort(request)
        self.store.release(request)

    def linker_fault(self, kind: str) -> None:
        self.store.arm(kind)

    def flush(self) -> None:
        self.inbox.append(("flush",))

    def _take(self, message: tuple[Any, ...]) -> None:
        if message[0] != "flush":
            super()._take(message)
            return
        if self.waiting or self.running:
            return  # refused: requests in flight (as SGLang's flush_cache)
        for held, _ in self.offloads:  # their results will never be taken: the store forgets them
            self.cache.dec_lock_ref(held)
        self.offloads.clear()
        self.flying.clear()
        self.stored.clear()
        self.store.reset()
        if self.priority_refs:
            for s in self.cache.snapshot().sessions:
                self.cache.release_ref(s.id)
        self.cache.evict(self.config.capacity)

    def failed_loads(self) -> set[str]:
        return set(self.store.ledger.failed)

    def reached(self) -> dict[str, int]:
        return dict(self.store.reached)

    def observed(self, profile: str) -> list[Violation]:
        """The store's judgements of this engine's calls, INV-LINK-6 over the pages it counts as stored, and
        INV-LINK-7 once no request is left."""
        self.store.ledger.marks("engine", sorted(self.stored))
        if not self.waiting and not self.running:
            self.store.ledger.idle()
        return self.store.violations()

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        pending = tuple(
            PendingCopy(off.id, "offload", (node,), off.result is not None)
            for off, (node, _) in zip(self.store.ledger.offloads, self.offloads)
        )
        return dataclasses.replace(snap, pending=pending)

    def bookkeeping(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        out = super().bookkeeping()
        out["offloads in flight"] = (len(self.offloads), tuple(sorted({n for n, _ in self.offloads})))
        out["loads queued"] = (len(self.loading), ())
        return out


def _linked(make: Callable[[CacheConfig], Any], name: str) -> Callable[[CacheConfig], LinkedEngine]:
    return _engine._variant(
        make,
        name,
        LinkedEngine,
        " + direct linker",
        f"direct linker: the harness's store ({STORE_PAGES} x the device's pages) looked up at admission, loads "
        "landing before the step's forwards (a failed one aborts its requests), offloads of newly cached pages "
        "taken in order at the next step, their nodes locked meanwhile; device only; a flush (when no request is in "
        "flight) unlocks the offloads in flight, resets the store, releases every session and evicts everything",
        write_policies=(),
        linker_faults=FAULTS,
        flushes=True,
    )


factory = _linked(_engine._refimpl, "factory")
"""`kvcert certify kvcert.conformance.reference.engine_linker:factory`: the reference engine over the model, linked."""
factory_gpu = _linked(_engine._gpu, "factory_gpu")
"""`...:factory_gpu`: the reference engine over kvcert.gpu, linked: bytes between its device tensors and the store."""
