# Over 600 lines: one adapter (SGLang's HiCache behind the host-tier protocol); its capability blocks, a third of it, are not yet shared with the fork's.
"""SGLang's UnifiedRadixCache with HiCache (0.5.23) behind kvcert's HostTierBackend protocol.

    kvcert certify kvcert.conformance.adapters.sglang.hicache_backend:factory             # Python core
    kvcert certify kvcert.conformance.adapters.sglang.hicache_backend:factory_rust        # Rust core
    kvcert certify kvcert.conformance.adapters.sglang.hicache_backend:factory_page_first  # page_first_direct
    kvcert certify kvcert.conformance.adapters.sglang.hicache_backend:factory_storage     # + L3 storage (§10)
    kvcert certify kvcert.conformance.adapters.sglang.hicache_backend:factory_storage_seaweedfs  # L3 on S3 (moto)

A translation layer over the deterministic CPU driver in `sglang_hicache.py`
(copies deferred until `complete`). Each factory fixes the tree core (``tree_core_backend``
"python" or "rust", the compiled default) and the host layout (``layer_first`` or
``page_first_direct``); :func:`make_factory` builds the other combinations.
No input checking (`strict_input=False`): the suite judges SGLang, not this file.

Mapping (SPEC.md §9):

* host pool: SGLang sizes it as ``(int(device_tokens * hicache_ratio) // P + 1) * P``
  (`mem_cache/pool_host/base.py:224-228`), every slot usable; the adapter picks
  ``hicache_ratio = (host_capacity - P + 0.5) / capacity`` so that this is exactly
  ``config.host_capacity``. ``config.load_back_threshold`` is written to
  ``cache.load_back_threshold`` (SGLang's default is 10, `URC:576`).
* ``host_capacity == 0`` builds a device-only UnifiedRadixCache (no ``init_hicache``).
* insert: the unified cache frees the duplicate prefix slots itself (`URC:1402-1405`),
  whereas the harness, following RadixCache's contract, frees ``slots[:prefix_len]``
  afterwards: after an insert every request slot is SGLang's (adopted or already freed), so
  the caller's later free of them is a no-op. SGLang's ``prefix_len`` also counts the
  host-only tokens it restored with the request's slots; the adapter reports the spec's
  ``prefix_len`` (device duplicates) as SGLang's minus the request slots the tree adopted
  inside it (see docs/calibration/hicache.md, D1).
* locks: the unified tree wants its lock receipt back; the adapter keeps a stack of
  receipts per node id.
* match_prefix: ``MatchOut(device_prefix_len, path slots, last_device_node,
  host_hit_length, last_host_node)``.
* load_back(node): ``init_load_back(best_match_node=node, host_hit_length=<host-only
  tokens on node's path>, req.last_node=<its deepest device ancestor>)``, then the loads
  are submitted (``ready_to_load_host_cache``) as the scheduler does.
* copies: one pending copy per SGLang ack (a merged ``CacheOperation``), ids are the
  driver's op ids in issue order; ``complete`` releases the held finish event,
  ``poll`` runs ``check_hicache_events``. A copy's nodes: for a write, SGLang's own
  ``publish_node_ids`` of each write-through ack id in the ack (split fragments included);
  for a load, the transfer's ``nodes_to_load`` plus later split fragments (the ack names
  only the anchor; ``SGLangHiCache.copies``).
* time: SGLang stamps nodes from its own strictly increasing access counter (swapped
  per driver); ``set_clock`` has nothing to set.
* snapshots: Python core, read off the node objects; Rust core, read through the tree-core
  interface (``SGLangHiCache._snapshot_interface``). The Rust core does not expose
  ``host_lock_ref``: it comes from the driver's ledger of SGLang's own
  ``inc/dec_host_lock_ref`` calls (``HostLockLedger``; docs/calibration/sglang_hicache_notes.md §8).
* layout: ``page_first_direct`` changes only where host bytes live; the driver's
  ``read_host_kv`` reads both layouts.
* storage (``factory_storage``, ``factory_rust_storage``; SPEC.md §10): SGLang's L3 path with its
  threads stepped by the harness (``sglang_hicache_storage.py``). Store copies are SGLang's
  ``StorageOperation``s (one per backed-up node), prefetches its ``ongoing_prefetch`` entries;
  ``prefetch`` is the scheduler's ``_prefetch_kvcache`` (only from a backed-up anchor or the root).
  Inserts write the spec's synthetic KV into the request's device slots, so stored and fetched
  bytes are checked (INV-STORE-1). Calibration: docs/calibration/hicache.md D7-D15.
* SGLang's own L3 backends: ``store="file"`` (HiCacheFile in a temporary directory) and ``store="seaweedfs"``
  (SeaweedFSStore over a real S3 server, moto's on loopback, ``sglang_s3_store.py``) run unpatched; the harness's
  store views their files or objects (publish, corrupt, drop, INV-STORE-1), docs/storage.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Sequence
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.kit.kv import HEAD_DIM, HEAD_NUM, entries_of, free_slots, write_pool
from kvcert.conformance.adapters.sglang.env import INSERTION_ORDERED_TIES, SGLANG_VERSION
from kvcert.conformance.adapters.sglang.hicache import (
    CORES,
    HOST_BUDGET_DEVIATION,
    LAYOUTS,
    HiCacheConfig,
    SGLangHiCache,
    _root_path,
    _Segment,
)
from kvcert.conformance.adapters.sglang.storage.file_store import SGLangFileStore
from kvcert.conformance.adapters.sglang.storage.s3_store import (
    SGLangS3Store,
    attach_seaweedfs,
    new_prefix,
    shared_server,
)
from kvcert.conformance.adapters.sglang.storage.stepped import CLOCK, sglang_page_keys
from kvcert.spec import pages
from kvcert.spec.storage import StorageBackend
from kvcert.spec.types import (
    PREFETCH_POLICIES,
    CacheConfig,
    Capabilities,
    InsertOut,
    LockUnderflow,
    MatchOut,
    NodeView,
    PendingCopy,
    PendingPrefetch,
    PoolExhausted,
    RetractionView,
    Snapshot,
    StaleHandle,
    UnknownCopy,
    UnknownPrefetch,
    UnknownRetraction,
)

STORES = ("bridge", "file", "seaweedfs")
"""The L3 store a storage target runs on: the checksumming bridge to the harness's store, or SGLang's own `file` or
`seaweedfs` backend (S3 through boto3, against moto's server on loopback: `sglang_s3_store.py`)."""

__all__ = [
    "SGLangHiCacheBackend",
    "factory",
    "factory_page_first",
    "factory_rust",
    "factory_rust_page_first",
    "factory_rust_storage",
    "factory_storage",
    "factory_storage_file",
    "factory_storage_seaweedfs",
    "factory_storage_seaweedfs_drops",
    "factory_page_first_storage_seaweedfs",
    "host_ratio_for",
    "make_factory",
]


def host_ratio_for(capacity: int, host_capacity: int, page_size: int) -> float:
    """The hicache_ratio for which SGLang's host pool holds exactly `host_capacity` slots.

    `pool_host/base.py:224-228`: size = (int(capacity * ratio) // P + 1) * P. With
    ratio = (H - P + 0.5) / capacity, int(capacity * ratio) = H - P (the +0.5 absorbs
    float rounding), so size = H.
    """
    if host_capacity < page_size or host_capacity % page_size:
        raise ValueError(f"host_capacity {host_capacity} must be a positive multiple of page size {page_size}")
    return (host_capacity - page_size + 0.5) / capacity


class SGLangHiCacheBackend:
    """One UnifiedRadixCache (+ HiCache when host_capacity > 0); node handles are SGLang NodeIds."""

    def __init__(
        self,
        config: CacheConfig,
        core: str = "python",
        layout: str = "layer_first",
        store: str = "bridge",
        endpoint: Optional[str] = None,
        prefix: Optional[str] = None,
        kv_events: bool = False,
    ) -> None:
        """`endpoint`, `prefix`: the `seaweedfs` store's S3 server (default: the process's own moto server on
        loopback) and object prefix (default: one of its own, cleared at close; a given one is left as it is).
        `kv_events`: built as with --kv-events-config (the request path replays them)."""
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}")
        if config.capacity % config.page_size:
            raise ValueError("capacity must be whole pages")
        self.config = config
        self.core, self.layout = core, layout
        self.page_size = ps = config.page_size
        self.host = config.host_capacity > 0
        self.storage = bool(config.prefetch_policy) and self.host
        CLOCK.now = 0.0  # process-global (the timeout policy's PollTimer reads it): nothing carries over
        # One (token, layer, K|V) element = the spec's 8 bytes of synthetic KV (SPEC.md §9.12, §10.1).
        geometry: dict[str, Any] = {"layer_num": config.kv_layers, "head_num": HEAD_NUM, "head_dim": HEAD_DIM}
        if self.storage:
            geometry |= {
                "stepped_storage": True,
                "prefetch_policy": config.prefetch_policy,
                "prefetch_timeout": (float(config.prefetch_timeout_base), float(config.prefetch_timeout_per_page)),
                "model_id": config.model_id,
                "file_backend": store != "bridge",
            }
        self.store = store
        self.files: Optional[SGLangFileStore] = None
        """The `file` store's view of HiCacheFile's directory, once the harness attached its store."""
        self.objects: Optional[SGLangS3Store] = None
        """The `seaweedfs` store's view of SeaweedFSStore's bucket, once the harness attached its store."""
        self.s3_backend: Any = None
        """SGLang's SeaweedFSStore (the `seaweedfs` store), its objects under `s3_prefix`."""
        self.s3_prefix = prefix or ""
        self._own_prefix = prefix is None
        self.h = SGLangHiCache(
            HiCacheConfig(
                page_size=ps,
                device_pages=config.capacity // ps,
                host_ratio=host_ratio_for(config.capacity, config.host_capacity, ps) if self.host else 2.0,
                write_policy=config.write_policy if self.host else "write_through",
                core=core,
                layout=layout,
                eviction_policy=config.policy,
                eviction_policy_config=tuple(config.policy_params().items()),
                host_tier=self.host,
                kv_events=kv_events,
                **geometry,
            )
        )
        assert self.h.is_rust == (core == "rust"), f"asked for the {core} tree core, SGLang built another"
        if store == "seaweedfs" and self.storage:
            if self._own_prefix:
                self.s3_prefix = new_prefix()
            self.s3_backend = attach_seaweedfs(self.h.cc, endpoint or shared_server().endpoint, self.s3_prefix)
        if self.host:
            self.h.cache.load_back_threshold = config.load_back_threshold
            pool = self.h.host_pool.anchor_entry.host_pool
            assert pool.logical_size == config.host_capacity, (pool.logical_size, config.host_capacity)
            self._host_pool = pool
        self._receipts: dict[int, list[int]] = {}
        """node id -> driver lock handles (receipts) taken on it, last first out."""
        self._returned: set[int] = set()
        """Request slots SGLang freed itself during an insert; the caller's free of them is a no-op."""
        self._retractions: dict[int, tuple[int, Any]] = {}
        """Retraction id -> (tokens, SGLang's RetractionBackup): SPEC.md §9.11."""
        self._next_retraction = 0
        self._req_pool: Any = None
        self._store_segments: dict[int, _Segment] = {}
        """Store copy id -> the host-lock segment of its node (a split while it is pending adds the new half)."""

    # ------------------------------------------------------------------ plumbing

    def _tree(self) -> dict[int, dict[str, Any]]:
        return self.h.nodes()

    def _device_free(self) -> set[int]:
        return free_slots(self.h.allocator, self.page_size)

    def _live(self, node: int) -> dict[int, dict[str, Any]]:
        tree = self._tree()
        if not isinstance(node, int) or node not in tree:
            raise StaleHandle(f"no node {node!r} in SGLang's tree")
        return tree

    # ------------------------------------------------------------------ Backend

    def set_clock(self, now: int) -> None:
        """SGLang stamps nodes from its own counter; the timeout policy's PollTimer reads this clock."""
        CLOCK.now = float(now)

    def alloc(self, n: int) -> tuple[int, ...]:
        out = self.h.allocator.alloc(n)
        if out is None:
            raise PoolExhausted(f"SGLang allocator returned None for {n} slots")
        slots = tuple(int(x) for x in out.tolist())
        self._returned.difference_update(slots)
        return slots

    def free(self, slots: Sequence[int]) -> None:
        mine = [int(s) for s in slots if s not in self._returned]
        self._returned.difference_update(slots)
        if mine:
            self.h.allocator.free(torch.tensor(mine, dtype=torch.int64))

    def match_prefix(self, namespace: Optional[str], tokens: Sequence[int]) -> MatchOut:
        m = self.h.match_prefix(namespace, list(tokens))
        slots = self.h.device_slots(m.last_device_node)[: m.device_len]
        return MatchOut(
            length=m.device_len,
            slots=tuple(slots),
            node=m.last_device_node,
            host_length=m.host_hit_len,
            host_node=m.last_host_node if self.host else None,
        )

    def insert(
        self, namespace: Optional[str], tokens: Sequence[int], slots: Sequence[int], priority: int = 0
    ) -> InsertOut:
        if self.storage:  # the harness wrote the request's KV (write_kv); the key translation learns its pages' paths
            assert self.h.l3 is not None
            for learn in self.h.l3.learners:
                learn(namespace, tokens)
        # A head of slots the tree already holds is a running request's protected prefix (SPEC.md §4.8):
        # SGLang's checkpoint passes it as `prev_prefix_len`, so the insert does not free it as duplicates.
        # A prompt's re-insert after it holds only those and the duplicates SGLang freed at the first insert:
        # none of them is freed again (SGLang passes the prompt's length).
        held = {x for view in self._tree().values() for x in view["device"] or ()}
        protected = next((i for i, x in enumerate(slots) if x not in held and x not in self._returned), len(slots))
        matched, node = self.h.insert(namespace, list(tokens), list(slots), protected)
        # SGLang's prefix_len is every token the walk matched, host-only ones included: those it restores
        # with the request's slots (`_unevict_node_on_insert`, UTC:1300-1308, `record_adopted_range`). The
        # duplicates (the device part, spec's prefix_len) it frees itself (FreeDeviceKV, URC:1402-1405).
        owned = {x for view in self._tree().values() for x in view["device"] or ()}
        adopted = sum(1 for x in slots[protected:matched] if x in owned)
        # Every request slot is SGLang's now (adopted, or freed by the insert): the caller's free is a no-op.
        self._returned |= set(slots)
        return InsertOut(prefix_len=matched - adopted, node=node)

    def inc_lock_ref(self, node: int) -> None:
        self._live(node)
        self._receipts.setdefault(node, []).append(self.h.inc_lock_ref(node))

    def dec_lock_ref(self, node: int) -> None:
        stack = self._receipts.get(node)
        if not stack:
            raise LockUnderflow(f"node {node!r} holds no lock taken through this adapter")
        self.h.dec_lock_ref(stack.pop())

    def evict(self, n: int) -> int:
        return self.h.evict(n)

    # ------------------------------------------------------------------ KVBackend (SPEC.md §9.12)

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        """The forward pass: each entry into the device K and V buffers of every layer at its slot."""
        write_pool(self.h.kv_pool, slots, entries, self.config.kv_layers)

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        return entries_of(self.h.read_device_kv(slots))

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        if not self.host:
            return []
        return entries_of(self.h.read_host_kv(host_slots))

    # ------------------------------------------------------------------ RetractionBackend (SPEC.md §9.11)

    def _request(self, slots: Sequence[int]) -> Any:
        """A request whose `req_to_token` row holds `slots`: what backup/restore_kv_cache read (seqlen - 1 tokens)."""
        if self._req_pool is None:  # the unified cache was built without one (only request-level helpers read it)
            from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

            self._req_pool = ReqToTokenPool(
                size=1, max_context_len=self.config.capacity + self.page_size, device="cpu", enable_memory_saver=False
            )
            self.h.cache.req_to_token_pool = self._req_pool
        row = 1  # row 0 is the pool's padding row
        self._req_pool.req_to_token[row, : len(slots)] = torch.tensor(list(slots), dtype=torch.int32)
        kv = types.SimpleNamespace(req_pool_idx=row, mamba_pool_idx=None)
        return types.SimpleNamespace(rid="kvcert-retracted", seqlen=len(slots) + 1, kv=kv)

    def retraction_backup(self, slots: Sequence[int]) -> Optional[int]:
        """SGLang's `backup_kv_cache`: host slots for the request's row (reclaiming by host eviction), synchronous."""
        if not self.host or not slots:
            return None
        with self.h._in_sglang():
            backup = self.h.cache.backup_kv_cache(self._request(slots))
        if backup is None:
            return None
        rid = self._next_retraction
        self._next_retraction += 1
        self._retractions[rid] = (len(slots), backup)
        return rid

    def retraction_restore(self, backup: int, slots: Sequence[int]) -> int:
        """SGLang's `restore_kv_cache` into the resumed request's slots; then what its decode path does since
        the seed-003 fix: the request's last node is the root, locked once (its final unlock balances)."""
        if backup not in self._retractions:
            raise UnknownRetraction(f"no retraction backup {backup!r}")
        _, saved = self._retractions.pop(backup)
        with self.h._in_sglang():
            self.h.cache.restore_kv_cache(self._request(slots), saved)
        root = int(self.h.cache.root_node_handle())
        self.inc_lock_ref(root)
        return root

    def retraction_discard(self, backup: int) -> None:
        if backup not in self._retractions:
            raise UnknownRetraction(f"no retraction backup {backup!r}")
        _, saved = self._retractions.pop(backup)
        with self.h._in_sglang():
            self.h.cache.discard_kv_cache_backup(saved)

    # ------------------------------------------------------------------ HostTierBackend

    def evict_host(self, n: int) -> int:
        return self.h.evict_host(n) if self.host else 0

    def load_back(self, node: int) -> int:
        tree = self._live(node)
        host_len, cur = 0, node
        while tree[cur]["parent"] is not None and tree[cur]["device"] is None:
            host_len += len(tree[cur]["key"])
            cur = tree[cur]["parent"]
        loaded, _ = self.h.init_load_back(node, host_len, last_device=cur)
        return loaded

    def complete(self, copy: int) -> None:
        if self.h.l3 is not None and isinstance(copy, int) and not isinstance(copy, bool):
            store = self.h.l3.store_of(copy)
            if store is not None:
                with self.h._in_sglang():
                    self.h.l3.complete_store(store)
                return
        op = self.h.ops.get(copy) if isinstance(copy, int) else None
        if op is None or op.released or copy not in self.h.pending():
            raise UnknownCopy(f"no pending unfinished copy {copy!r}")
        self.h.complete(copy, poll=False)

    def poll(self) -> int:
        before = self._pending_ids()
        self.h.poll()
        return len(before - self._pending_ids())

    def _pending_ids(self) -> set[int]:
        ids = set(self.h.pending())
        if self.h.l3 is not None:
            ids |= {cid for cid, _, _ in self.h.l3.pending_stores()}
        return ids

    # ------------------------------------------------------------------ StorageTierBackend

    def attach_storage(self, storage: StorageBackend) -> None:
        """The bridge forwards SGLang's calls to `storage`. SGLang's `file` backend keeps its own files: the harness's
        store (a `FaultyStorage`) is pointed at them, so what the harness publishes, damages and reads is those."""
        if self.h.l3 is None:
            raise ValueError("this cache was built without storage (CacheConfig.prefetch_policy)")
        if self.h.l3.bridge is not None:
            self.h.l3.bridge.store = storage
            return
        if not hasattr(storage, "inner"):
            raise ValueError("SGLang's own backend takes the harness's FaultyStorage: it views the engine's pages")
        view: SGLangFileStore | SGLangS3Store
        if self.s3_backend is not None:
            view = self.objects = SGLangS3Store(
                self.s3_backend,
                self.page_size,
                self.config.kv_layers,
                self.config.model_id,
                self.layout,
                sglang_page_keys,
            )
        else:
            view = self.files = SGLangFileStore(
                self.h.cc.storage_backend, self.page_size, self.config.model_id, sglang_page_keys
            )
        storage.inner = view  # type: ignore[attr-defined]
        self.h.l3.learners.append(view.learn)

    def prefetch(self, node: int, namespace: Optional[str], tokens: Sequence[int]) -> int:
        """The scheduler's `_prefetch_kvcache` for a request whose match ended at `node`.

        `node`'s path must be a prefix of the request; the pages after it are asked for. As the
        scheduler does, only a backed-up anchor or the root is prefetched from (cache mode: an
        unbacked anchor is "a guaranteed storage miss", scheduler.py `_prefetch_kvcache`).
        """
        tree = self._live(node)
        assert self.h.l3 is not None
        path: list[int] = []
        cur: Optional[int] = node
        while cur is not None and tree[cur]["parent"] is not None:
            path[:0] = tree[cur]["key"]
            cur = tree[cur]["parent"]
        key = [int(t) for t in tokens][: pages.page_floor(len(tokens), self.page_size)]
        is_root = tree[node]["parent"] is None
        if key[: len(path)] != path or len(key) <= len(path):
            return 0
        if not is_root and tree[node]["namespace"] != namespace:
            return 0
        if not is_root and not tree[node]["backed_up"]:
            return 0
        with self.h._in_sglang():
            last_hash = None if is_root else self.h.cache.get_last_hash_value(node)
            return self.h.l3.prefetch(node, namespace, path, key[len(path) :], last_hash)

    def _prefetching(self, prefetch: Any) -> int:
        ok = isinstance(prefetch, int) and not isinstance(prefetch, bool)
        if self.h.l3 is None or not ok or prefetch not in self.h.l3.prefetches:
            raise UnknownPrefetch(f"no running prefetch {prefetch!r}")
        return int(prefetch)

    def fetch(self, prefetch: int) -> None:
        pid = self._prefetching(prefetch)
        assert self.h.l3 is not None
        with self.h._in_sglang():
            if not self.h.l3.fetch(pid):
                raise UnknownPrefetch(f"prefetch {pid} has no page left to fetch")

    def check_prefetch(self, prefetch: int) -> Optional[int]:
        pid = self._prefetching(prefetch)
        assert self.h.l3 is not None
        with self.h._in_sglang():
            return self.h.l3.check(pid)

    def abort_prefetch(self, prefetch: int) -> None:
        pid = self._prefetching(prefetch)
        assert self.h.l3 is not None
        with self.h._in_sglang():
            self.h.l3.abort(pid)

    # ------------------------------------------------------------------ observation

    def _pending(self, tree: dict[int, dict[str, Any]]) -> tuple[PendingCopy, ...]:
        if not self.host:
            return ()
        parents = {nid: v["parent"] for nid, v in tree.items() if v["parent"] is not None}
        copies = [PendingCopy(*copy) for copy in self.h.copies(parents)]
        if self.h.l3 is not None:
            live = set()
            for cid, node, finished in self.h.l3.pending_stores():
                live.add(cid)
                segment = self._store_segments.get(cid)
                if segment is None:
                    segment = _Segment(node, [node], _root_path(self.h.cache.tree_core, node))
                    self._store_segments[cid] = segment
                copies.append(PendingCopy(cid, "store", tuple(segment.update(parents)), finished))
            self._store_segments = {c: s for c, s in self._store_segments.items() if c in live}
        return tuple(sorted(copies, key=lambda c: c.id))

    def _prefetches(self) -> tuple[PendingPrefetch, ...]:
        if self.h.l3 is None:
            return ()
        out = []
        for pid, p in self.h.l3.prefetches.items():
            info = self.h.cache.ongoing_prefetch.get(p.request)
            if info is None:
                continue
            requested, fetched, failed = self.h.l3.progress(pid)
            slots = tuple(int(x) for x in info.host_indices.tolist()) if info.host_indices is not None else ()
            out.append(PendingPrefetch(pid, int(info.anchor_node_id), requested, fetched, failed, slots))
        return tuple(out)

    def snapshot(self) -> Snapshot:
        ps = self.page_size
        tree = self._tree()
        root = int(self.h.cache.root_node_handle())
        views = []
        for nid, v in tree.items():
            if v["parent"] is None:
                views.append(NodeView(nid, None, None, (), (), v["lock_ref"]))
                continue
            views.append(
                NodeView(
                    id=nid,
                    parent=v["parent"],
                    namespace=v["namespace"],
                    key=v["key"],
                    slots=None if v["device"] is None else tuple(v["device"]),
                    lock_ref=v["lock_ref"],
                    host_slots=None if v["host"] is None else tuple(v["host"]),
                    host_lock_ref=v["host_lock_ref"],
                    meta=_meta(v),
                    history=v["tlru_history_len"] if self.config.policy == "tlru" else None,
                )
            )
        host_free: tuple[int, ...] = ()
        if self.host:
            used = self._host_pool.slot_used
            host_free = tuple(int(i) for i in (~used).nonzero().flatten().tolist())
        return Snapshot(
            page_size=ps,
            capacity=self.config.capacity,
            slot_limit=self.config.capacity + ps,  # slot 0 / page 0 is SGLang's padding
            root=root,
            nodes=tuple(views),
            free_slots=tuple(sorted(self._device_free())),
            evictable_size=int(self.h.cache.evictable_size()),
            protected_size=int(self.h.cache.protected_size()),
            host_capacity=self.config.host_capacity,
            host_free_slots=host_free,
            write_policy=self.config.write_policy if self.host else "",
            pending=self._pending(tree),
            prefetches=self._prefetches(),
            retractions=tuple(
                RetractionView(rid, tokens, tuple(int(x) for x in saved.host_indices.tolist()))
                for rid, (tokens, saved) in sorted(self._retractions.items())
            ),
        )

    def close(self) -> None:
        self.h.close()
        if self.s3_backend is not None and self._own_prefix:
            backend, self.s3_backend = self.s3_backend, None
            # SGLang's own clear: every object under this backend's prefix (moto keeps them process-wide). A server
            # a test stopped has nothing left to clear.
            with contextlib.suppress(Exception):
                backend.clear()


def _meta(node: dict[str, Any]) -> Optional[tuple[int, int, int, int]]:
    """The Python core's policy metadata as `NodeView.meta` (INV-META-1 compares only its order). Its stamps come
    from a counter of its own, a match stepping each node above the leaf back by 1e-5; scaled to integers they keep
    that order exactly. It keeps no creation time or priority (it runs LRU alone): those read 0. None from the
    Rust core, which exposes no metadata."""
    if node.get("last_access_time") is None:
        return None
    return round(node["last_access_time"] * 100_000), int(node["hit_count"]), 0, 0


def make_factory(
    core: str = "python",
    layout: str = "layer_first",
    storage: bool = False,
    store: str = "bridge",
    endpoint: Optional[str] = None,
    faults: Optional[tuple[str, ...]] = None,
) -> Any:
    """A kvcert factory for one tree core ("python" | "rust") and host layout ("layer_first" | "page_first_direct").

    `storage`: also declare the L3 tier (every prefetch stop policy): storage cells run SGLang's
    storage path stepped by the harness, over a bridge to its store (`sglang_hicache_storage.py`), with
    `store="file"` over SGLang's own `file` backend (`sglang_file_store.py`), or with `store="seaweedfs"` over
    SGLang's own `seaweedfs` backend talking S3 to `endpoint` (default: a moto server kvcert starts on loopback
    and stops at exit; `sglang_s3_store.py`). `faults`: the storage faults an engine-owned store declares (default
    corrupt and drop, every one the harness can apply to its pages).
    """
    if core not in CORES or layout not in LAYOUTS or store not in STORES:
        raise ValueError(f"core must be one of {CORES}, layout one of {LAYOUTS}, store one of {STORES}")
    file = storage and store == "file"
    s3 = storage and store == "seaweedfs"

    def factory(config: CacheConfig) -> SGLangHiCacheBackend:
        return SGLangHiCacheBackend(config, core=core, layout=layout, store=store, endpoint=endpoint)

    factory.__name__ = factory.__qualname__ = (
        "factory"
        + {
            ("python", "layer_first"): "",
            ("rust", "layer_first"): "_rust",
            ("python", "page_first_direct"): "_page_first",
            ("rust", "page_first_direct"): "_rust_page_first",
        }[core, layout]
        + ("_storage" if storage else "")
        + (f"_{store}" if file or s3 else "")
    )
    factory.__doc__ = f"SGLang UnifiedRadixCache + HiCache, {core} tree core, {layout} host layout."
    snapshot_note = (
        "snapshots read off the Python node objects"
        if core == "python"
        else "snapshots read through the Rust core's interface; host_lock_ref from the ledger of SGLang's own "
        "inc/dec_host_lock_ref calls (the Rust core has no accessor for it)"
    )
    factory.capabilities = Capabilities(  # type: ignore[attr-defined]
        name=f"sglang.UnifiedRadixCache+HiCache {SGLANG_VERSION} ({core} tree core, {layout})",
        page_sizes=(1, 4),
        policies=("lru", "slru", "tlru"),
        namespaces=True,
        strict_input=False,
        write_policies=("write_through", "write_through_selective", "write_back"),
        prefetch_policies=PREFETCH_POLICIES if storage else (),
        retraction=True,
        kv_reads=True,
        aligns_keys=True,
        profile="sglang-0.5.23",
        reports_metadata=core == "python",
        notes=(
            f"{core} tree core, {layout} host layout; copies held until complete()",
            "host pool sized exactly to host_capacity through hicache_ratio; load_back_threshold set on the cache",
            snapshot_note,
        )
        + (("L3: SGLang's storage threads stepped by the harness (sglang_hicache_storage.py)",) if storage else ()),
        deviations=(
            INSERTION_ORDERED_TIES,
            "clock: the tree's access-time, node-id, uuid and operation counters are the adapter's during each call",
            "host transfers: torch index-copy stand-ins for sgl_kernel's transfer kernels (direct io on CPU), host "
            "pools unpinned",
            HOST_BUDGET_DEVIATION,
            "retraction_restore locks the resumed request's root on the scheduler's behalf (its half of a resume): "
            "a resume path that forgets that lock is not seen",
            "requests: the API is driven by calls the suite composes in the scheduler's place; the scheduler's own "
            "request path (match_kv_cache, alloc_for_extend, checkpoint and release_kv_cache with a Req) does not run",
        )
        + (
            (
                "host_lock_ref: the Rust core has no accessor; counts are derived from the ledger of SGLang's own "
                "inc/dec_host_lock_ref calls, so the core's own counts are not read",
            )
            if core == "rust"
            else ()
        )
        + (
            (
                "L3: a checksumming bridge to the harness's store replaces SGLang's own `file` backend (which serves "
                "a corrupt page as KV: F-L3-1); `...:factory_storage_file` certifies that backend",
            )
            if storage and not (file or s3)
            else ()
        ),
        storage_faults=(faults or ("corrupt", "drop")) if file or s3 else Capabilities.storage_faults,
    )
    if file:
        caps: Capabilities = factory.capabilities  # type: ignore[attr-defined]
        factory.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
            caps,
            name=caps.name + " + L3 file backend",
            notes=caps.notes
            + (
                "L3: SGLang's own `file` backend (HiCacheFile) in a temporary directory: SGLang writes and reads its "
                "page files itself; the harness publishes a peer's pages, damages pages and reads what was stored "
                "through those files (sglang_file_store.py)",
            ),
        )
    if s3:
        caps = factory.capabilities  # type: ignore[attr-defined]
        factory.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
            caps,
            name=caps.name + " + L3 seaweedfs backend (S3, moto server)",
            notes=caps.notes
            + (
                "L3: SGLang's own `seaweedfs` backend (SeaweedFSStore, zero-copy batch_get_v1/batch_set_v1) with its "
                "own boto3 client, against a real S3 server: moto's, on 127.0.0.1, started and stopped by kvcert "
                "(or the endpoint given); each backend's objects under a prefix of its own, cleared at close; the "
                "harness publishes a peer's pages, damages pages and reads what was stored through the bucket "
                "(sglang_s3_store.py)",
            )
            + (
                (
                    "L3 seaweedfs: `corrupt` not declared, so the walk goes on past a corrupt object served as KV "
                    "(F-L3-1's class), which `...:factory_storage_seaweedfs` declares",
                )
                if faults is not None and "corrupt" not in faults
                else ()
            ),
            deviations=caps.deviations
            + (
                "L3 seaweedfs: SGLang's init builds its `file` backend (the driver's config names no other); the "
                "adapter swaps in `seaweedfs` from SGLang's StorageBackendFactory and selects the zero-copy page "
                "functions as attach_storage_backend does for that name",
                "L3 seaweedfs: its 16-worker thread pool runs each task inline, in submission order (pages of a batch "
                "are read and written one after another): races between a batch's pages are not seen",
                "L3 seaweedfs: moto's S3 server stands in for SeaweedFS's S3 gateway: the S3 API SGLang calls is "
                "checked, SeaweedFS's own storage (filer, volumes, replication, its consistency) is not",
                "L3 seaweedfs: failed and refused S3 requests (a stopped server, AccessDenied) and truncated objects "
                "are checked by tests/test_sglang_seaweedfs.py, not by the harness's call faults",
            ),
        )
    return factory


factory = make_factory("python", "layer_first")
"""`kvcert certify kvcert.conformance.adapters.sglang.hicache_backend:factory`: Python core, layer_first."""
factory_rust = make_factory("rust", "layer_first")
"""`...:factory_rust`: the compiled Rust tree core (SGLang's default), layer_first."""
factory_page_first = make_factory("python", "page_first_direct")
"""`...:factory_page_first`: Python core, page_first_direct host layout."""
factory_rust_page_first = make_factory("rust", "page_first_direct")
"""`...:factory_rust_page_first`: Rust core, page_first_direct host layout."""
factory_storage = make_factory("python", "layer_first", storage=True)
"""`...:factory_storage`: Python core, layer_first, with the L3 storage tier (SPEC.md §10)."""
factory_rust_storage = make_factory("rust", "layer_first", storage=True)
"""`...:factory_rust_storage`: Rust core, layer_first, with the L3 storage tier."""
factory_storage_file = make_factory("python", "layer_first", storage=True, store="file")
"""`...:factory_storage_file`: Python core, layer_first, with the L3 tier on SGLang's own `file` backend."""
factory_storage_seaweedfs = make_factory("python", "layer_first", storage=True, store="seaweedfs")
"""`...:factory_storage_seaweedfs`: Python core, layer_first, the L3 tier on SGLang's own `seaweedfs` backend (S3)."""
factory_page_first_storage_seaweedfs = make_factory("python", "page_first_direct", storage=True, store="seaweedfs")
"""`...:factory_page_first_storage_seaweedfs`: as above with the page_first_direct host layout."""
factory_storage_seaweedfs_drops = make_factory(
    "python", "layer_first", storage=True, store="seaweedfs", faults=("drop",)
)
"""`...:factory_storage_seaweedfs_drops`: `factory_storage_seaweedfs` whose pages are dropped, never corrupted, so the walk
goes on past a corrupt object served as KV (F-L3-1's class); its certificate lists `corrupt` as not checked."""
factory_storage_seaweedfs_drops.__name__ = factory_storage_seaweedfs_drops.__qualname__ = (
    "factory_storage_seaweedfs_drops"
)
