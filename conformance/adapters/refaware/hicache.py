"""The priority-aware ("ref-aware") SGLang fork's `RefAwareHiRadixCache` (base 0.5.10): host tier + SPEC.md §11.

    .venv-refaware/bin/kvcert certify kvcert.conformance.adapters.refaware.hicache:factory --policy lru
    .venv-refaware/bin/kvcert certify kvcert.conformance.adapters.refaware.hicache:factory_priority --policy lru
    .venv-refaware/bin/kvcert certify kvcert.conformance.adapters.refaware.hicache:factory_priority_flow

Runs only in the fork's own environment (`.venv-refaware`, `scripts/install_refaware.sh`). Host-tier cells
(`host_capacity > 0`) build a real `RefAwareHiRadixCache` over real CPU pools (`MHATokenToKVPool` +
`(Paged)TokenToKVPoolAllocator`, an unpinned `MHATokenToKVPoolHost`, `direct` io, `layer_first`) with a
one-rank gloo group; device-only cells build what the fork's scheduler builds without
`enable_hierarchical_cache`, its `RefAwareRadixCache`, through `refaware_radix.RefAwareRadixBackend`.
The adapter only translates; no input checking (`strict_input=False`). Where the fork and SPEC.md
differ is recorded in docs/calibration/refaware.md ("RefAwareHiRadixCache", H1-H11), not translated away,
except by the `*_load_locked` factories, which translate H1 (below) so that generation gets past it.

Mapping (SPEC.md §9, §11):

* host pool: 0.5.10 sizes it `(int(capacity * hicache_ratio) // P + 1) * P` (`memory_pool_host.py`
  `HostKVCache.__init__`), every slot usable; `hicache_ratio = (H - P + 0.5) / capacity` makes it exactly
  `config.host_capacity`. `config.load_back_threshold` is written to `cache.load_back_threshold` (10 in
  the fork). Write policies: all three, as `hicache_write_policy`.
* insert / match / locks: the fork's own calls. 0.5.10's `HiRadixCache.insert` leaves duplicate slots to
  the caller and restores host-only nodes with the request's slots (SPEC.md §9.6 as written).
* copies: 0.5.10's controller submits every write at once (`HiCacheController.write` → `start_writing`,
  one `CacheOperation` per node) and every load at `ready_to_load_host_cache` (called right after
  `init_load_back`, as the scheduler does). Each ack's `finish_event` is held (`_HeldEvent`) until the
  harness `complete`s that copy; `poll` is the scheduler's `writing_check()` + `loading_check()`, which
  consume ready acks front to back. A write-back eviction's blocking `synchronize()` completes its acks
  at once (SPEC.md §9.2: write-back waits). A copy's nodes: the acked node, plus the nodes a split later
  put above it (`_segment`: a split keeps the deeper half's id); a load's nodes are the host-only part of the path
  it moved.
* `evict(n, allow_low, allow_high)`: the fork's `evict` inside `scoped_evict(allow_low, allow_high)`
  (`factory_priority`; the fork's plain evict is `(True, False)`, calibration R3) or the plain evict
  (`factory`: no session, so every scope is the same).
* `evict_host(n)`: the fork's `evict_host(n, allow_high=True)` under `factory_priority` (SPEC.md §11.4's
  host eviction: UNUSED and LOW_REF leaves, then adaptive demotion of idle high rids), the plain
  `evict_host(n)` under `factory`.
* `load_back(node)`: `init_load_back(InitLoadBackParams(node, host_len, mem_quota=None, req=None))` +
  `ready_to_load_host_cache()`. With no request the fork evicts for room in scope `(True, False)`
  (`ref_aware_hiradix_cache.py:511-519`: the requester's class decides): calibration H7.
* §11 (`factory_priority`): `register_ref` / `update_ref` / `release_ref` are the fork's by rid (the
  `RefAwareHiRadixCache` overrides: demotion records, restore on release, the idle-high heap); a
  re-registration of a registered session is `release_ref` then `register_ref`, as
  `refaware.radix`'s `moves="all"` does, because of R1/R2. The rids are never marked generating
  (`mark_rid_generating` is the scheduler's, for a running batch; the harness's sessions are idle between
  turns), so every high rid registered is queued as a demotion candidate, as the fork queues a rid on
  every `register_ref`. Sessions: each rid ends at the deepest node it tracks (R7), `priority` its
  `RefInfo.priority`, `high` its `RefInfo.is_high`, `demoted` whether it is in `_adaptively_demoted_rids`;
  listed in the order of the adapter's own (re-)registrations (R9: the fork's demotion tie-break reads
  `(cached_tokens, rid)`, not that order, so the listing hides nothing).
* `plan_admission`: SPEC.md §11.5 (`kvcert.spec.admission`) over the fork's counters (R8).
* `factory_priority_flow`: `factory_priority` driven only as the fork's own scheduler drives it: no lock on a
  host-only node (`Capabilities.locks_host_only = False`: its scheduler locks `req.last_node`, a device node;
  H3 is what such a lock does to its counters) and no write-back cells (H2: the fork's write-back host
  eviction reclaims no duplicate backup). The fork itself is unchanged; the certificate lists both as not
  checked. This is the target that certifies the fork's host tier with §11 (demotion, restore, scoped
  eviction) for what its flow sends.
* `factory_load_locked` / `factory_priority_load_locked`: as `factory` / `factory_priority`, but a pending
  load's anchor (and the halves a split cut from it) is reported host-locked, as SPEC.md §9.1 has it; the
  fork releases that protection before `load_back` returns (H1, an engine choice: no fork path can free
  the host copy of a node that is on the device and locked). Snapshots only; the fork is driven the same.

Not declared, because the fork has no call for them (the certificate lists them as not checked):
retraction (`retraction_backup` / `_restore` / `_discard`: 0.5.10 has no `backup_kv_cache`), storage
(L3, not driven on CPU here), injected faults, a running request's checkpoint (0.5.10 has none: the
harness composes it). Without retraction an admission plan keeps no retracted request on the host
(SPEC.md §11.5): the plan's retractions are discarded, so the adapter plans with no host room (H10).

Determinism. While (and only while) a call into the fork runs, the adapter swaps the `time` globals of
`radix_cache` and `hiradix_cache` (node stamps) for its logical clock, `TreeNode.counter` and
`CacheOperation.counter` (process-wide ids) for its own counters, and `ref_aware_cache_core.RefInfo` for a
subclass whose `nodes` is an insertion-ordered `OrderedSet` (`release_ref` / `update_ref` /
`_adaptive_demote` / `_adaptive_restore` walk it, which decides the order leaves re-enter the tier sets).
The five leaf sets (`evictable_leaves`, `unused/low_ref/high_ref_evictable_leaves`,
`evictable_host_leaves`) become `OrderedSet`s at construction: the fork heapifies them in set order, so
ties between equal ranks depended on addresses. `_idle_hp_rids` and `TreeNode.tracked_rids` (sets of rid
strings) stay sets: only membership is read, or each rid's own set gets one node, where order does not
matter; the idle-high heap orders `(cached_tokens, rid)` tuples by value. The gloo group (world size 1)
is process-wide and started once. Not thread-safe: one call into the fork at a time.

KV bytes (SPEC.md §9.12): device and host pools have the spec's geometry (`kit.kv`); the harness
writes each request's KV and reads every settled slot of both pools back after every step.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.kit.cpu import OrderedSet
from kvcert.conformance.adapters.kit.kv import (
    entries_of,
)
from kvcert.conformance.adapters.kit.radix import LogicalTime, radix_capabilities
from kvcert.conformance.adapters.refaware.env import (
    HOST_BUDGET_DEVIATION,
    REFAWARE_SGLANG_VERSION,
    import_refaware,
    install_host_cpu_shims,
)
from kvcert.conformance.adapters.refaware.radix import (
    FORK,
    RefAwareAdapter,
    RefAwareRadixBackend,
    _OrderedRefInfo,
    device_pools,
    tier_counters,
)
from kvcert.spec.types import (
    WRITE_POLICIES,
    CacheConfig,
    InsertOut,
    PendingCopy,
    Snapshot,
    UnknownCopy,
)

__all__ = [
    "RefAwareHiRadixBackend",
    "factory",
    "factory_load_locked",
    "factory_priority",
    "factory_priority_flow",
    "factory_priority_load_locked",
]

RA = import_refaware()
"""The fork's classes; importing this module fails here, with an install hint, outside `.venv-refaware`."""

from sglang.srt.managers import cache_controller as _cc  # noqa: E402
from sglang.srt.mem_cache import hiradix_cache as _hiradix  # noqa: E402
from sglang.srt.mem_cache import radix_cache as _radix_cache  # noqa: E402
from sglang.srt.mem_cache import ref_aware_cache_core as _core  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InitLoadBackParams,
    InsertParams,
)


def _start_gloo() -> None:
    """`HiRadixCache.__init__` reads the world size of its tp group: a one-rank gloo group, once per process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="kvcert-gloo-"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def host_ratio_for(capacity: int, host_capacity: int, page_size: int) -> float:
    """The hicache_ratio for which 0.5.10's host pool holds exactly `host_capacity` slots:
    size = (int(capacity * ratio) // P + 1) * P, and int(capacity * ratio) = H - P here."""
    if host_capacity <= capacity or host_capacity % page_size:
        raise ValueError(f"host_capacity {host_capacity} must be whole pages and exceed the device's {capacity}")
    return (host_capacity - page_size + 0.5) / capacity


# --------------------------------------------------------------------------- held acks


@dataclass
class _Copy:
    """One ack the fork's controller queued: a write (one node) or a load (its anchor)."""

    id: int
    kind: str
    anchor: int
    nodes: list[int]
    """The nodes it moves, anchor first (deepest), at issue time."""
    chain: set[int]
    """Ids on the anchor's root path at issue time (to tell a split off the top from an old ancestor)."""
    released: bool = False
    forced: bool = False


class _HeldEvent:
    """A finish_event that reports done only once the harness (or a blocking synchronize) releases it."""

    def __init__(self, real: Any, copy: _Copy) -> None:
        self._real, self._copy = real, copy

    def query(self) -> bool:
        return self._copy.released

    def synchronize(self) -> None:
        if not self._copy.released:  # a blocking wait (write-back eviction): done once the copy is
            self._copy.released = self._copy.forced = True
        self._real.synchronize()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _AckQueue(list):  # type: ignore[type-arg]
    """Stands in for `ack_write_queue` / `ack_load_queue`: every appended ack gets a held finish_event."""

    def __init__(self, owner: RefAwareHiRadixBackend, kind: str) -> None:
        super().__init__()
        self._owner, self._kind = owner, kind

    def append(self, ack: Any) -> None:
        copy = self._owner._new_copy(self._kind, ack.node_ids)
        super().append(ack._replace(finish_event=_HeldEvent(ack.finish_event, copy)))


@dataclass
class _Ledger:
    """Copies issued and not consumed, by id."""

    copies: dict[int, _Copy] = field(default_factory=dict)
    next_id: int = 0


# --------------------------------------------------------------------------- the backend


class RefAwareHiRadixBackend(RefAwareAdapter):
    """One `RefAwareHiRadixCache` over real CPU device and host pools; node handles are `TreeNode.id`."""

    ALLOCATOR = "the fork's allocator"

    def __init__(self, config: CacheConfig, priority_refs: bool = False, load_host_lock: bool = False) -> None:
        if config.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        _start_gloo()
        install_host_cpu_shims()
        self.config = config
        self.page_size = ps = config.page_size
        self.priority_refs = priority_refs
        self.load_host_lock = load_host_lock
        """Report a pending load's anchor (and the halves a split cut from it) as host-locked, as SPEC.md §9.1 has
        it; the fork keeps no host lock past `load_back` (calibration H1). Only the `*_load_locked` factories."""
        self._now = 0
        self._next_node_id = 0
        self._next_op_id = 0
        self._nodes: dict[int, Any] = {}
        self._registered: dict[str, None] = {}
        """Session ids in (re-)registration order (see `_sessions`)."""
        self._ledger = _Ledger()
        self._loading: Optional[tuple[list[int], set[int]]] = None
        """The nodes (deepest first) and root path of the load `load_back` is about to queue."""
        self.kv_pool, self.allocator, params = device_pools(config)
        # What RefAwareHiRadixCache / HiRadixCache read off ServerArgs (docs/calibration/refaware_notes.md "Constructors").
        server_args = SimpleNamespace(
            enable_priority_scheduling=True,
            high_priority_threshold=config.high_priority_threshold,
            hicache_ratio=host_ratio_for(config.capacity, config.host_capacity, ps),
            hicache_size=0,
            hicache_mem_layout="layer_first",
            hicache_write_policy=config.write_policy,
            hicache_io_backend="direct",
            hicache_storage_backend=None,
            hicache_storage_backend_extra_config=None,
            hicache_storage_prefetch_policy="best_effort",
            served_model_name="kvcert-synthetic",
            extra_metric_labels=None,
        )
        with self._in_engine():
            self.cache = RA.RefAwareHiRadixCache(params, server_args)
        c = self.cache
        atexit.unregister(c.shutdown)  # registered by HiRadixCache.__init__: it would pin every cache for the process
        for name in (
            "evictable_leaves",
            "unused_evictable_leaves",
            "low_ref_evictable_leaves",
            "high_ref_evictable_leaves",
            "evictable_host_leaves",
        ):
            setattr(c, name, OrderedSet(getattr(c, name)))
        c.load_back_threshold = config.load_back_threshold
        self.host_pool = c.token_to_kv_pool_host
        assert self.host_pool.size == config.host_capacity, (self.host_pool.size, config.host_capacity)
        self.cc = c.cache_controller
        self.cc.ack_write_queue = _AckQueue(self, "write")
        self.cc.ack_load_queue = _AckQueue(self, "load")
        self._remember(c.root_node)

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _in_engine(self) -> Iterator[None]:
        """Run fork code on this adapter's logical clock, id counters and ordered RefInfo."""
        node_cls, op_cls = _radix_cache.TreeNode, _cc.CacheOperation
        clock = LogicalTime(self._now)
        saved = (_radix_cache.time, _hiradix.time, node_cls.counter, op_cls.counter, _core.RefInfo)
        _radix_cache.time, _hiradix.time = clock, clock
        node_cls.counter, op_cls.counter, _core.RefInfo = self._next_node_id, self._next_op_id, _OrderedRefInfo
        try:
            yield
        finally:
            self._next_node_id, self._next_op_id = node_cls.counter, op_cls.counter
            _radix_cache.time, _hiradix.time, node_cls.counter, op_cls.counter, _core.RefInfo = saved

    def _root_path(self, node: Any) -> list[Any]:
        """`node` and its ancestors below the root, deepest first."""
        out = []
        while node is not None and node is not self.cache.root_node:
            out.append(node)
            node = node.parent
        return out

    def _new_copy(self, kind: str, node_ids: Sequence[int]) -> _Copy:
        assert len(node_ids) == 1, f"0.5.10 submits one node per {kind} ack, got {node_ids}"
        anchor = int(node_ids[0])
        if kind == "load":
            assert self._loading is not None, "a load was queued outside load_back"
            nodes, chain = self._loading
            self._loading = None
        else:
            node = self._node(anchor)  # queued before ongoing_write_through records it
            nodes, chain = [anchor], {int(n.id) for n in self._root_path(node)}
        copy = _Copy(self._ledger.next_id, kind, anchor, nodes, chain)
        self._ledger.next_id += 1
        self._ledger.copies[copy.id] = copy
        return copy

    def _live_copies(self) -> list[tuple[_Copy, Any]]:
        """(copy, its ack) for every ack the fork has not consumed, in issue order."""
        acks = [*self.cc.ack_write_queue, *self.cc.ack_load_queue]
        live = sorted(((ack.finish_event._copy, ack) for ack in acks), key=lambda pair: pair[0].id)
        self._ledger.copies = {c.id: c for c, _ in live}
        return live

    # ------------------------------------------------------------------ Backend

    def _host_match(self, res: Any) -> dict[str, int]:
        return dict(host_length=int(res.host_hit_length), host_node=self._remember(res.last_host_node))

    def insert(
        self, namespace: Optional[str], tokens: Sequence[int], slots: Sequence[int], priority: int = 0
    ) -> InsertOut:
        params = InsertParams(
            key=self._key(namespace, tokens), value=torch.tensor(list(slots), dtype=torch.int64), priority=priority
        )
        with self._in_engine():
            res = self.cache.insert(params)
        return InsertOut(prefix_len=int(res.prefix_len), node=self._remember(res.last_node))

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:
        with self._in_engine():
            if not self.priority_refs:  # no session: every node is UNUSED, any scope is the same
                res = self.cache.evict(EvictParams(num_tokens=n))
            else:
                with self.cache.scoped_evict(allow_low=allow_low, allow_high=allow_high):
                    res = self.cache.evict(EvictParams(num_tokens=n))
        return int(res.num_tokens_evicted)

    # ------------------------------------------------------------------ HostTierBackend (SPEC.md §9)

    def evict_host(self, n: int) -> int:
        with self._in_engine():
            if self.priority_refs:
                return int(self.cache.evict_host(n, allow_high=True))
            return int(self.cache.evict_host(n))

    def load_back(self, node: int) -> int:
        target = self._node(node)
        path = self._root_path(target)
        moving = []
        for n in path:
            if not n.evicted:
                break
            moving.append(n)
        host_len = sum(len(n.host_value) for n in moving if n.host_value is not None)
        self._loading = ([int(n.id) for n in moving], {int(n.id) for n in path})
        try:
            with self._in_engine():
                values, _ = self.cache.init_load_back(
                    InitLoadBackParams(last_host_node=target, host_hit_length=host_len, mem_quota=None, req=None)
                )
                if len(values):
                    self.cache.ready_to_load_host_cache()
        finally:
            self._loading = None
        return int(len(values))

    def complete(self, copy: int) -> None:
        live = {c.id: c for c, _ in self._live_copies()}
        got = live.get(copy) if isinstance(copy, int) and not isinstance(copy, bool) else None
        if got is None or got.released:
            raise UnknownCopy(f"no pending unfinished copy {copy!r}")
        got.released = True

    def in_flight(self) -> list[int]:
        """Pending copies not yet finished, oldest first (what `Snapshot.pending` lists, without a tree walk)."""
        return [c.id for c, _ in self._live_copies() if not c.released]

    def free_count(self) -> int:
        """Free device slots (`Snapshot.free_slots`' length, without listing them)."""
        return int(len(self.allocator.free_pages) + len(self.allocator.release_pages)) * self.page_size

    def evictable_count(self) -> int:
        """The fork's own `evictable_size()` (`Snapshot.evictable_size`, without a tree walk)."""
        return int(self.cache.evictable_size())

    @property
    def tier_evictable(self) -> tuple[int, int, int]:
        """The fork's own tier counters (`Snapshot.tier_evictable`, without a tree walk)."""
        return tier_counters(self.cache)

    def poll(self) -> int:
        before = {c.id for c, _ in self._live_copies()}
        with self._in_engine():
            self.cache.writing_check()
            self.cache.loading_check()
        return len(before - {c.id for c, _ in self._live_copies()})

    # ------------------------------------------------------------------ SPEC.md §11 (factory_priority)

    def _released_first(self, priority: int, info: Any) -> bool:
        return True  # a move: release, then register (R1, R2)

    # ------------------------------------------------------------------ KVBackend (SPEC.md §9.12)

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        idx = torch.tensor(list(host_slots), dtype=torch.int64)
        return entries_of(self.host_pool.kv_buffer[:, :, idx].clone())  # layer_first: [2, L, size, H, D]

    # ------------------------------------------------------------------ observation

    def _pending(self, parents: dict[int, int]) -> tuple[PendingCopy, ...]:
        out = []
        for copy, _ in self._live_copies():
            out.append(PendingCopy(copy.id, copy.kind, tuple(self._segment(copy, parents)), copy.released))
        return tuple(out)

    @staticmethod
    def _segment(copy: _Copy, parents: dict[int, int]) -> list[int]:
        """The copy's nodes now: anchor up to its top, plus nodes a split put above the top (a split keeps the
        deeper half's id and puts a fresh node above it, with the same state)."""
        if copy.anchor not in parents:
            return list(copy.nodes)
        top, nodes, cur = copy.nodes[-1], [copy.anchor], copy.anchor
        while cur != top and cur in parents:
            cur = parents[cur]
            nodes.append(cur)
        while cur in parents and parents[cur] in parents and parents[cur] not in copy.chain:
            cur = parents[cur]
            nodes.append(cur)
        return nodes

    def _load_locks(self, parents: dict[int, int]) -> dict[int, int]:
        """H1's translation: +1 host lock on each pending load's anchor and on the nodes a split put directly
        above it (a split copies a host lock to the new prefix: SPEC.md §9.1's segment)."""
        out: dict[int, int] = {}
        for copy, _ in self._live_copies():
            if copy.kind != "load" or copy.anchor not in parents:
                continue
            cur = copy.anchor
            out[cur] = out.get(cur, 0) + 1
            while parents.get(cur) in parents and parents[cur] not in copy.chain:
                cur = parents[cur]
                out[cur] = out.get(cur, 0) + 1
        return out

    def snapshot(self) -> Snapshot:
        walked = self._walk()
        parents = {int(node.id): int(parent.id) for node, parent in walked if parent is not None}
        load_locks = self._load_locks(parents) if self.load_host_lock else {}
        return self._snapshot(
            walked,
            lambda node: int(node.host_ref_counter) + load_locks.get(int(node.id), 0),
            host_capacity=self.config.host_capacity,
            host_free_slots=tuple(sorted(int(x) for x in self.host_pool.free_slots.tolist())),
            write_policy=self.config.write_policy,
            pending=self._pending(parents),
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cache.shutdown()


def factory(config: CacheConfig) -> Any:
    """`kvcert certify kvcert.conformance.adapters.refaware.hicache:factory`: the host tier, plain ops."""
    if not config.host_capacity:
        return RefAwareRadixBackend(config)
    return RefAwareHiRadixBackend(config)


def factory_priority(config: CacheConfig) -> Any:
    """`... refaware_hicache:factory_priority`: the host tier and SPEC.md §11 on the fork's calls, a
    re-registration composed as release_ref + register_ref (R1, R2)."""
    if not config.host_capacity:
        return RefAwareRadixBackend(config, priority_refs=True, moves="all")
    return RefAwareHiRadixBackend(config, priority_refs=True)


def factory_load_locked(config: CacheConfig) -> Any:
    """`... refaware_hicache:factory_load_locked`: as `factory`, with H1 translated (a pending load's anchor is
    reported host-locked) so that generation gets past it to what follows."""
    if not config.host_capacity:
        return RefAwareRadixBackend(config)
    return RefAwareHiRadixBackend(config, load_host_lock=True)


def factory_priority_load_locked(config: CacheConfig) -> Any:
    """`... refaware_hicache:factory_priority_load_locked`: as `factory_priority`, with H1 translated."""
    if not config.host_capacity:
        return RefAwareRadixBackend(config, priority_refs=True, moves="all")
    return RefAwareHiRadixBackend(config, priority_refs=True, load_host_lock=True)


factory.capabilities = radix_capabilities(  # type: ignore[attr-defined]
    f"refaware.RefAwareHiRadixCache {REFAWARE_SGLANG_VERSION} ({FORK})",
    write_policies=WRITE_POLICIES,
    aligns_keys=False,  # 0.5.10's insert does not page-align a key: its callers do
    checkpoints=False,  # 0.5.10 has no checkpoint: the harness composes it
    profile="refaware-0.5.10",  # its own design pinned: BATCH H11, DEMOTE H4/H6/H8/H9, LOAD_LOCK H1, LOAD_ROOM H7/H13, ROOM H12
    notes=(
        "host cells: real MHATokenToKVPool + (Paged)TokenToKVPoolAllocator + unpinned MHATokenToKVPoolHost on CPU, "
        "direct io, layer_first; one-rank gloo group; host pool sized exactly to host_capacity",
        "device-only cells: the fork's RefAwareRadixCache (refaware_radix), what its scheduler builds without HiCache",
        "acks held until complete(); poll = writing_check() + loading_check(); loads submitted after init_load_back",
        "not declared (no fork call): retraction, storage, faults, checkpoint",
    ),
    deviations=(
        "eviction ties: the fork's leaf sets and RefInfo.nodes are insertion-ordered, so equally ranked leaves leave in insertion order; as shipped a set orders them by memory address, which differs from run to run",
        "clock: time.monotonic, TreeNode.counter and CacheOperation.counter are the adapter's during each call",
        "host transfers: torch index-copy stand-ins for sgl_kernel's kernels (direct io on CPU), host pools unpinned",
        HOST_BUDGET_DEVIATION,
        "requests: the API is driven by calls the suite composes in the scheduler's place; the fork's request path "
        "(its PrefillAdder admission, cache_finished_req and the finish path that registers refs) does not run",
    ),
)

factory_priority.capabilities = replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=f"refaware.RefAwareHiRadixCache {REFAWARE_SGLANG_VERSION} ({FORK}), priority refs, re-register = "
    "release + register",
    priority_refs=True,
    notes=factory.capabilities.notes  # type: ignore[attr-defined]
    + (
        "evict(n, allow_low, allow_high) runs the fork's evict inside scoped_evict(allow_low, allow_high)",
        "evict_host(n) is the fork's evict_host(n, allow_high=True): adaptive demotion under host pressure",
    ),
    deviations=factory.capabilities.deviations  # type: ignore[attr-defined]
    + (
        "register_ref: the adapter builds the request it registers; the fork's scheduler registers what its own "
        "finish path left in the request",
        "a registered session registered again is released first, then registered (the fork's own "
        "re-registration keeps refs on the path it left: R2)",
        "load_back passes no request: the fork evicts for its room in scope (True, False)",
        "plan_admission: kvcert's planner (SPEC.md §11.5, kvcert.spec.admission) over the fork's counters; the fork's "
        "own admission (its PrefillAdder) is not run",
    ),
)

_H1_NOTE = "H1 translated: a pending load's anchor (and the halves a split cut from it) reported host-locked"
_H1_DEVIATION = (
    "pending loads reported host-locked: the adapter reports a host lock the fork does not take (H1), so the "
    "fork can be explored under a profile that pins SGLang's LOAD_LOCK; judged by the core"
)
factory_load_locked.capabilities = replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=factory.capabilities.name + ", pending loads reported host-locked (H1)",  # type: ignore[attr-defined]
    profile="core",
    notes=factory.capabilities.notes + (_H1_NOTE,),  # type: ignore[attr-defined]
    deviations=factory.capabilities.deviations + (_H1_DEVIATION,),  # type: ignore[attr-defined]
)
factory_priority_load_locked.capabilities = replace(  # type: ignore[attr-defined]
    factory_priority.capabilities,  # type: ignore[attr-defined]
    name=factory_priority.capabilities.name + ", pending loads reported host-locked (H1)",  # type: ignore[attr-defined]
    profile="core",
    notes=factory_priority.capabilities.notes + (_H1_NOTE,),  # type: ignore[attr-defined]
    deviations=factory_priority.capabilities.deviations + (_H1_DEVIATION,),  # type: ignore[attr-defined]
)


def factory_priority_flow(config: CacheConfig) -> Any:
    """`... refaware_hicache:factory_priority_flow`: as `factory_priority`, driven only as the fork's own scheduler
    drives it: no lock on a host-only node (its scheduler locks device nodes; H3 is what such a lock does) and
    no write-back cells (H2: its write-back host eviction reclaims no duplicate backup)."""
    return factory_priority(config)


factory_priority_flow.capabilities = replace(  # type: ignore[attr-defined]
    factory_priority.capabilities,  # type: ignore[attr-defined]
    name=factory_priority.capabilities.name + ", the fork's flow (no host-only locks, write-through)",  # type: ignore[attr-defined]
    write_policies=tuple(w for w in WRITE_POLICIES if w != "write_back"),
    locks_host_only=False,
    notes=factory_priority.capabilities.notes  # type: ignore[attr-defined]
    + (
        "no lock on a host-only node: the fork's scheduler locks req.last_node, a device node (H3: such a lock "
        "drives evictable_size_ negative)",
        "write_back not declared: H2 (no duplicate reclaim) fails every write-back cell",
    ),
)
