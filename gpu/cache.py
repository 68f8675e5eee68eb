"""The production cache's one public class: `GpuCache`, a radix tree over torch KV pools with three tiers.

Written from SPEC.md alone (it shares no code with `kvcert.refimpl`, which the suite compares it
with). `GpuCache` is the facade: it checks the configuration, builds the pools and the copy
engine, wires the components together and carries both APIs —

- the **tensor API** an engine calls (`alloc_tensor`, `match_prefix_fast` -> `Matched`,
  `insert_fast` -> `Inserted`, `free_tensor`): int64 tensors, arrays or bytes in and out, no
  Python loop over tokens or slots;
- the **Backend protocol** the suite calls (`alloc`, `match_prefix`, `insert`, `free`, locks,
  eviction, copies, storage, sessions, admission, retraction, KV access, `snapshot`): thin
  wrappers converting tuples at the edge.

Both are the same internals; bad input to either raises the protocol's typed error before
anything changes. The components, each in its own module (docs/gpu.md has the table):

- `kvcert.gpu.tree.RadixTree` (subclassed here): the tree, the device tier, device eviction, copies;
- `kvcert.gpu.evict_index.EvictionIndex`: candidate sets and per-tier heaps (`refresh`);
- `kvcert.gpu.host.HostTier`: the host pool, backups, host eviction, load-back, retraction;
- `kvcert.gpu.storage.StorageTier`: store copies and prefetch;
- `kvcert.gpu.sessions.Sessions`: sessions and ref tiers;
- `kvcert.spec.admission.plan_admission` (the spec's, pure): admission plans from an `AdmissionCounters` record;
- `kvcert.gpu.run.Run` (keys and slot runs, counted in items) and `kvcert.gpu.node` (the records).

Time is the harness's logical clock (`set_clock`); nothing reads a wall clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch

from kvcert.gpu.agreement import Agreement
from kvcert.gpu.alloc import FREE, EngineSlots, PageAllocator, SlotSource, to_bytes, to_tuple
from kvcert.gpu.copy_engine import make_engine
from kvcert.gpu.host import HostTier
from kvcert.gpu.kv import KVGeometry, KVPool, make_pool
from kvcert.gpu.node import Prefetch, Retraction, Session, is_id
from kvcert.gpu.run import SlotRun, TokenKey, ints_run, key_run, slot_raw, slot_run, slots_of, tensor_of
from kvcert.gpu.sessions import Sessions
from kvcert.gpu.storage import StorageTier
from kvcert.gpu.tree import RadixTree
from kvcert.spec import storage as l3
from kvcert.spec.admission import AdmissionCounters, plan_admission
from kvcert.spec.types import (
    FAULTS,
    HIGH_REF,
    POLICIES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    InsertOut,
    InvalidCount,
    LengthMismatch,
    LockUnderflow,
    MatchOut,
    Namespace,
    NodeView,
    PendingCopy,
    PendingPrefetch,
    RetractionView,
    Running,
    SessionView,
    SlotNotOwned,
    Snapshot,
    StaleHandle,
    UnknownCopy,
    UnknownFault,
    UnknownRetraction,
    check_count,
    check_priority,
    check_scope,
    check_session,
    check_tokens,
    check_ttl,
)

__all__ = ["GpuCache", "Inserted", "Matched", "SlotRun", "TokenKey"]


class Matched(NamedTuple):
    """`match_prefix_fast`'s answer: SGLang's `MatchResult` (device indices, last device node, host hit)."""

    slots: torch.Tensor
    """int64, on the CPU: the device slots of the matched prefix (its length is the match length)."""
    node: int
    """The node where the device match ends (the root for none)."""
    host_length: int
    """Tokens after the device match that are on the host only (a load-back could restore them)."""
    host_node: int
    """The deepest node of the match with a host copy (the root for none): `load_back`'s argument."""


class Inserted(NamedTuple):
    """`insert_fast`'s answer."""

    prefix_len: int
    """Tokens of the key already cached: `slots[:prefix_len]` stay the caller's to free."""
    node: int
    """The node ending exactly at the key."""


_tuple_new = tuple.__new__
"""`Matched(...)` / `Inserted(...)` without the generated `__new__`'s Python frame (~120 ns a call): the same tuple."""


def _free_slots_of(alloc: PageAllocator) -> int:
    """Free slots: whole free pages, plus free slots of pages a caller tore (`mixed`, almost always empty)."""
    torn = alloc.mixed
    return alloc.available + (sum(states.count(FREE) for states in torn.values()) if torn else 0)


class GpuCache(RadixTree):
    """Device, host and storage tiers over torch pools, with priority tiers (SPEC.md §4, §9, §10, §11)."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        layout: str = "layer_first",
        host_layout: str = "layer_first",
        geometry: Optional[KVGeometry] = None,
        engine: str = "deferred",
        device: Optional[torch.device] = None,
        agreement: Optional[Agreement] = None,
        engine_slots: Optional[SlotSource] = None,
        kv: Optional[KVPool] = None,
        demote: str = "idle_fewest",
    ) -> None:
        """`demote`: DEMOTE's order, `Sessions.demote`. `engine_slots`: an engine allocates the device slots and gets evicted ones back (`EngineSlots`); the
        tree then holds the engine's slot ids, and `alloc` / `free` refuse. `kv`: the device pool, when an engine
        owns it (its geometry is the cache's; host copies move its bytes)."""
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}")
        ps = config.page_size
        if ps < 1 or config.capacity % ps or config.host_capacity % ps:
            raise ValueError("capacities must be whole pages")
        if config.host_capacity and config.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {config.write_policy!r}")
        if config.prefetch_policy and (config.prefetch_policy not in PREFETCH_POLICIES or not config.host_capacity):
            raise ValueError(f"prefetch policy {config.prefetch_policy!r} needs a host tier")
        cuda = torch.cuda.is_available()
        self.device = device if device is not None else torch.device("cuda" if cuda else "cpu")
        self.geometry = geometry if geometry is not None else KVGeometry(layers=config.kv_layers)
        if self.geometry.layers != config.kv_layers:
            raise ValueError("geometry.layers must equal config.kv_layers")
        self.config = config
        self.host_capacity, self.kv_layers = config.host_capacity, config.kv_layers
        self.write_policy = config.write_policy if config.host_capacity else ""
        if kv is None:
            kv = make_pool(layout, config.capacity, ps, self.geometry, self.device)
        elif kv.capacity != config.capacity or kv.geometry != self.geometry:
            raise ValueError("an engine's device pool must have the config's capacity and the cache's geometry")
        host_kv = None
        if config.host_capacity:  # both pools before the engine (a threaded one starts a thread)
            host_kv = make_pool(host_layout, config.host_capacity, ps, self.geometry, torch.device("cpu"), cuda)
        write_back = self.write_policy == "write_back"
        alloc_dev = None if engine_slots is None else EngineSlots(config.capacity, ps, engine_slots)
        super().__init__(
            ps,
            config.policy,
            config.capacity,
            kv,
            make_engine(engine),
            write_back,
            host_kv is not None,
            alloc_dev,
            config.policy_params(),
        )
        self.agreement = agreement if agreement is not None else Agreement()
        """Tensor-parallel ranks agree (MIN) on the acks they consume and the pages a prefetch keeps."""
        self.host = None if host_kv is None else HostTier(self, host_kv, self.write_policy, config.load_back_threshold)
        self.stores = StorageTier(self, config)
        self.refs = Sessions(self, config.high_priority_threshold, demote)

    # ------------------------------------------------------------------ the components' state, by its old names

    @property
    def host_kv(self) -> Optional[KVPool]:
        return self.host.kv if self.host is not None else None

    @property
    def alloc_host(self) -> Optional[PageAllocator]:
        return self.host.alloc if self.host is not None else None

    @property
    def threshold(self) -> Optional[int]:
        return self.host.threshold if self.host is not None else None

    @property
    def load_back_threshold(self) -> int:
        return self.host.load_back_threshold if self.host is not None else self.config.load_back_threshold

    @property
    def storage(self) -> Optional[l3.StorageBackend]:
        return self.stores.storage

    @property
    def prefetches(self) -> dict[int, Prefetch]:
        return self.stores.prefetches

    @property
    def retractions(self) -> dict[int, Retraction]:
        return self.host.retractions if self.host is not None else {}

    @property
    def sessions(self) -> dict[str, Session]:
        return self.refs.sessions

    @property
    def demotions(self) -> dict[str, None]:
        return self.refs.demotions

    @property
    def high_threshold(self) -> int:
        return self.refs.high_threshold

    # ------------------------------------------------------------------ device tier (SPEC.md §4)

    def set_clock(self, now: int) -> None:
        self.now = now
        self.refs.expire(now)  # retentions whose deadline has come end before anything ranks (SPEC.md §11.7)
        self.chosen.clear()  # a report covers one step (the harness sets the clock before each)

    def free_count(self) -> int:
        """Free device slots, in O(1): what a scheduler reads before it allocates (not in the protocol)."""
        return self.alloc_dev.available

    def host_free_count(self) -> int:
        """Free host slots (0 without a host tier): what an engine's metrics report as the host pool's room."""
        return _free_slots_of(self.host.alloc) if self.host is not None else 0

    # The wrappers convert at the edge and hand the internals `Run`s with their token counts (one `len` per
    # call); what goes straight between C and the caller — a lent or freed slot run, a match's joined
    # slots — stays bytes, and the two result tuples are built without their generated `__new__`'s frame.

    def alloc(self, n: int) -> tuple[int, ...]:
        return to_tuple(self._lend_raw(n))

    def free(self, slots: Sequence[int]) -> None:
        self._give_back_raw(to_bytes(slots), slots)

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchOut:
        key = ints_run(check_tokens(tokens))
        device, length, node, host_length, host_node = self._match(namespace, key, len(key))
        slots = to_tuple(b"".join([n.slots.raw for n in device]))  # type: ignore[union-attr]  # (on device)
        return MatchOut(length, slots, node.id, host_length, host_node.id)

    def insert(self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int], priority: int = 0) -> InsertOut:
        key = ints_run(check_tokens(tokens))
        size = len(key)
        run = slots_of(slots) if len(slots) == size else None
        pages = self._check_insert(size, len(slots), run, priority, namespace, key)
        assert run is not None
        prefix_len, node = self._insert(namespace, key, size, run, priority, pages)
        return InsertOut(prefix_len, node.id)

    def alloc_tensor(self, n: int) -> torch.Tensor:
        """`n` device slots (whole pages) as an int64 CPU tensor: `alloc` without a Python int per slot."""
        return tensor_of(self._lend_raw(n))

    def free_tensor(self, slots: SlotRun) -> None:
        """Give lent slots back (e.g. `slots[:prefix_len]` after `insert_fast`); `SlotNotOwned` changes nothing."""
        self._give_back_raw(slot_raw(slots)[1], slots)

    def match_prefix_fast(self, namespace: Namespace, key: TokenKey) -> Matched:
        """`match_prefix` for an engine: the key as int64 bytes/array/tensor, the slots back as one int64 tensor.

        Same walk, same splits and stamps as the protocol's `match_prefix` (both wrap `_match`); only
        the conversions at the edge differ.
        """
        run = key_run(key)
        device, _, node, host_length, host_node = self._match(namespace, run, len(run))
        slots = tensor_of(bytearray().join([n.slots.raw for n in device]))  # type: ignore[union-attr]  # (on device)
        return _tuple_new(Matched, (slots, node.id, host_length, host_node.id))

    def insert_fast(self, namespace: Namespace, key: TokenKey, slots: SlotRun, priority: int = 0) -> Inserted:
        """`insert` for an engine: key and slots as int64 tensors/arrays/bytes, checked as the protocol checks them.

        A rejected call raises the protocol's error (InvalidToken, UnalignedKey, LengthMismatch,
        InvalidCount, SlotNotOwned, in that order) and changes nothing.
        """
        key_r = key_run(key)
        size = len(key_r)
        count, run = slot_run(slots)
        pages = self._check_insert(size, count, run, priority, namespace, key_r)
        assert run is not None
        prefix_len, node = self._insert(namespace, key_r, size, run, priority, pages)
        return _tuple_new(Inserted, (prefix_len, node.id))

    def path_slots(self, node: int) -> torch.Tensor:
        """The device slots of the path from the root to `node`, as an int64 CPU tensor (an engine's row of a
        prefix it holds a lock on). Refuses a node with a part off the device."""
        n, parts = self._live(node), []
        while n.parent is not None:
            if n.slots is None:
                raise StaleHandle(f"node {node}'s path is not all on the device")
            parts.append(n.slots.raw)
            n = n.parent
        parts.reverse()
        return tensor_of(bytearray().join(parts))

    def inc_lock_ref(self, node: int) -> None:
        n = self._live(node)
        n.own_locks += 1
        self.lock_path(n, +1)

    def dec_lock_ref(self, node: int) -> None:
        n = self._live(node)
        if n.own_locks == 0:
            raise LockUnderflow(f"node {node} holds no lock of its own")
        n.own_locks -= 1
        self.lock_path(n, -1)

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:
        """Free at least `n` device tokens, touching only the ref tiers the scope allows (SPEC.md §4.5, §11.3).

        The scope is this call's: a parameter of `evict_device`, never state, so it cannot outlive the call,
        and the evictions the cache makes for itself (load-back's room) use the full scope.
        """
        check_count(n)
        allow_low, allow_high = check_scope(allow_low, allow_high)
        freed = self.evict_device(n, allow_low, allow_high)
        self.compact()
        return freed

    # ------------------------------------------------------------------ host tier and copies (SPEC.md §9)

    def evict_host(self, n: int) -> int:
        check_count(n)
        assert self.host is not None  # (as before the split: a device-only cache asserts here)
        freed = self.host.evict(n)
        self.compact()
        return freed

    def load_back(self, node: int) -> int:
        n = self._live(node)
        return self.host.load_back(n) if self.host is not None else 0  # a device-only tree has no host-only node

    def in_flight(self) -> list[int]:
        """Ids of the copies issued and not finished yet, oldest first: what an engine's step completes.

        O(copies awaiting their ack); not in the protocol (a harness reads them off the snapshot).
        """
        return [c.id for c in self.copies.values() if not c.finished]

    def complete(self, copy: int) -> None:
        c = self.copies.get(copy) if is_id(copy) else None
        if c is None or c.finished:
            raise UnknownCopy(f"no pending copy {copy!r}")
        ok = self.engine.finish(c.ticket)
        if not ok and c.kind != "store":
            return  # retried: stays pending and unfinished, both ends pinned (SPEC.md §10.5)
        c.finished = True
        if ok and c.kind == "store":
            self.stores.write(c.nodes)

    def poll(self) -> int:
        consumed = 0
        kinds = ("write", "load", "store")
        local = []
        for kind in kinds:
            ready = 0
            for c in self.queues[kind]:
                if not c.finished:
                    break
                ready += 1
            local.append(ready)
        agreed = self.agreement.agree(local)  # every rank consumes the same acks
        for kind, count in zip(kinds, agreed):
            q = self.queues[kind]
            for _ in range(count):
                c = q.popleft()
                del self.copies[c.id]
                for n in c.nodes:
                    n.copies.remove(c)
                    self.refresh(n)
                for a in c.anchors:
                    self.lock_path(a, -1)
                self.host_unlock_all(c)
                consumed += 1
                if kind == "write" and self.stores.storage is not None:
                    for n in sorted(c.nodes, key=lambda n: n.end):
                        self.stores.store([n])  # one store copy per node, shallowest first (D7)
        self.compact()
        return consumed

    def inject_fault(self, kind: str) -> None:
        if not isinstance(kind, str) or kind not in FAULTS:
            raise UnknownFault(f"no fault kind {kind!r}; this cache has {FAULTS}")
        if kind == "copy":
            self.engine.arm_failure()
        elif self.host is not None:
            self.host.alloc.failures += 1
        # a device-only cache has no host allocation for the fault to hit: armed, it never fires

    # ------------------------------------------------------------------ retraction (SPEC.md §9.11)

    def retraction_backup(self, slots: Sequence[int]) -> Optional[int]:
        if not isinstance(slots, Sequence) or isinstance(slots, (str, bytes)) or not slots:
            raise InvalidCount(f"a retraction backs up at least one slot, got {slots!r}")
        if any(not is_id(x) or not 0 <= x < self.capacity for x in slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: not device slot ids")
        if len(set(slots)) != len(slots) or any(self.alloc_dev.is_free(x) for x in slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: repeated or free")
        return self.host.retraction_backup(slots) if self.host is not None else None

    def _host_for(self, backup: object) -> HostTier:
        if self.host is None:
            raise UnknownRetraction(f"no retraction backup {backup!r}")
        return self.host

    def retraction_restore(self, backup: int, slots: Sequence[int]) -> int:
        self._host_for(backup).retraction_restore(backup, slots)
        self.root.own_locks += 1  # the resumed request's last node, locked on its behalf
        return self.root.id

    def retraction_discard(self, backup: int) -> None:
        self._host_for(backup).retraction_discard(backup)

    # ------------------------------------------------------------------ storage tier (SPEC.md §10)

    def attach_storage(self, storage: l3.StorageBackend) -> None:
        self.stores.storage = storage

    def prefetch(self, node: int, namespace: Namespace, tokens: Sequence[int]) -> int:
        return self.stores.prefetch(self._live(node), namespace, tokens)

    def fetch(self, prefetch: int) -> None:
        self.stores.fetch(prefetch)

    def check_prefetch(self, prefetch: int) -> Optional[int]:
        return self.stores.check(prefetch)

    def abort_prefetch(self, prefetch: int) -> None:
        self.stores.end(self.stores.get(prefetch), 0)
        self.compact()

    # ------------------------------------------------------------------ sessions and admission (SPEC.md §11)

    def register_ref(self, session: str, node: int, priority: int) -> None:
        """`session` holds the path to `node` at `priority`; again: moved there, to the end of the order, undemoted."""
        check_session(session)
        n = self._live(node)
        check_priority(priority)
        self.refs.register(session, n, priority)
        self.compact()

    def update_ref(self, session: str, priority: int) -> None:
        """A new priority for the session's path; clears an adaptive demotion (SPEC.md §11.4)."""
        check_priority(priority)
        self.refs.update(session, priority)
        self.compact()

    def retain(self, session: str, ttl: int) -> None:
        """The session will come back: its path is retained for `ttl` time units (SPEC.md §11.7)."""
        check_ttl(ttl)
        self.refs.retain(session, ttl, self.now)
        self.compact()

    def retain_waiting(self, session: str) -> None:
        """The session's next turn has arrived and waits: a live retention lasts until that turn registers, ranked as
        back now (SPEC.md §11.7, the engine's half); one already run out stays out."""
        self.refs.retain_waiting(session, self.now)
        self.compact()

    def release_ref(self, session: str) -> None:
        """The session holds nothing any more; a high one restores the latest demotion still in force."""
        self.refs.release(session)
        self.compact()

    @property
    def tier_evictable(self) -> tuple[int, int, int]:
        """Device tokens of unlocked nodes per tier (UNUSED, LOW_REF, HIGH_REF), read in O(1) (SPEC.md §11.2)."""
        return self.refs.tier_evictable(self.evictable_size)

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        """What admitting a request of `tokens` new device tokens at `priority` takes (SPEC.md §11.5, §11.6).

        A value computed from the counters and the arguments (`kvcert.spec.admission`); it changes nothing.
        """
        counters = AdmissionCounters(
            page_size=self.page_size,
            layers=self.kv_layers,
            high_threshold=self.refs.high_threshold,
            free=_free_slots_of(self.alloc_dev),
            evictable=self.evictable_size,
            held_high=self.held_sizes[HIGH_REF],
            host_free=_free_slots_of(self.host.alloc) if self.host is not None else 0,
        )
        return plan_admission(counters, tokens, priority, running, profile)

    # ------------------------------------------------------------------ KV access (SPEC.md §9.12)

    def _check_slots(self, slots: Sequence[int], limit: int) -> None:
        if not slots or (set(map(type, slots)) == {int} and min(slots) >= 0 and max(slots) < limit):
            return  # the common case, in C; anything else gets the exact test
        if any(not is_id(s) or not 0 <= s < limit for s in slots):
            raise SlotNotOwned(f"slots {tuple(slots)[:8]} are not slot ids of this pool")

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        self._check_slots(slots, self.capacity)
        if len(slots) != len(entries):
            raise LengthMismatch(f"{len(slots)} slots but {len(entries)} entries")
        try:
            self.kv.write_entries(list(slots), list(entries))
        except ValueError as err:
            raise LengthMismatch(str(err)) from err

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        self._check_slots(slots, self.capacity)
        return self.kv.read_entries(list(slots))

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        self._check_slots(host_slots, self.host_capacity)
        if self.host is None:
            return []
        return self.host.kv.read_entries(list(host_slots))

    # ------------------------------------------------------------------ observation

    def snapshot(self) -> Snapshot:
        """The whole state as the protocol's values: O(tree + pools), observation only."""
        tlru = self.policy == "tlru"  # the only policy whose nodes keep a history (SPEC.md §4.7)
        views = tuple(
            NodeView(
                id=n.id,
                parent=n.parent.id if n.parent is not None else None,
                namespace=n.ns,
                key=n.key.to_tuple(),
                slots=None if n.slots is None else n.slots.to_tuple(),
                lock_ref=n.lock_ref,
                host_slots=None if n.host_slots is None else n.host_slots.to_tuple(),
                host_lock_ref=n.host_lock_ref,
                high_ref=n.high_ref,
                low_ref=n.low_ref,
                meta=(n.last_access, n.hit_count, n.creation, n.priority),
                history=n.history if tlru else None,
            )
            for n in self.nodes.values()
        )
        ps = self.page_size
        return Snapshot(
            page_size=ps,
            capacity=self.capacity,
            slot_limit=self.capacity,
            root=self.root.id,
            nodes=views,
            free_slots=self.alloc_dev.free_slots(),
            evictable_size=self.evictable_size,
            protected_size=self.protected_size,
            host_capacity=self.host_capacity,
            host_free_slots=self.host.alloc.free_slots() if self.host is not None else (),
            write_policy=self.write_policy,
            pending=tuple(
                PendingCopy(c.id, c.kind, tuple(n.id for n in c.nodes), c.finished) for c in self.copies.values()
            ),
            prefetches=tuple(
                PendingPrefetch(p.id, p.anchor.id, len(p.keys) * ps, p.published * ps, p.failed, p.host_slots)
                for p in self.stores.prefetches.values()
            ),
            retractions=tuple(RetractionView(r.id, r.tokens, r.host_slots) for r in self.retractions.values()),
            sessions=tuple(
                SessionView(x.id, x.node.id, x.priority, x.high, x.demoted, x.until, x.waiting)
                for x in self.sessions.values()
            ),
            tier_evictable=self.tier_evictable,
            high_priority_threshold=self.refs.high_threshold,
            choices=tuple(self.chosen),
        )

    def close(self) -> None:
        self.engine.close()
