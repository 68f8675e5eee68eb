"""The caches the simulator drives, each through its own API, and the two bounds.

The simulator never decides what a cache keeps: it asks the cache, as an engine's scheduler does.
Every driver answers the same calls (`admit`, `checkpoint`, `finish`, `end_session`):

* `ProtocolDriver`: any kvcert `Backend` (kvcert.gpu, the reference model, the RefAware fork's
  adapter). With `priority=True` it makes the proactive manager's cache calls (SPEC.md §11.1-§11.4):
  a session's path is registered at its priority after every turn and released after its last,
  and a low-priority request evicts only in its scope. Admission and retraction are the scheduler's,
  the same for every cache (`kvcert.sim.engine`): the driver never retracts a running request.
* `SGLangDriver`: SGLang 0.5.23's `UnifiedRadixCache` + HiCache through its native calls
  (`match_prefix`, `init_load_back`, `inc/dec_lock_ref`, `evict`, `insert` with
  `prev_prefix_len`), as its scheduler calls them: priority-blind.
* `InfiniteBound`: never evicts; every token computed before is a hit.
* `OfflineBound`: device + host pages as one pool that, knowing each session's next arrival,
  evicts the KV used furthest in the future first (Belady's rule, per session tail). Optimistic:
  its hits cost no load time and running requests take no room. It is a reference, not a proof
  of optimality for KV of unequal sizes.

Copies complete at once (`settle`): on a CPU the bytes move at submission; the simulator charges
their time through `Costs.load_token_s` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from kvcert.spec.invariants import check_snapshot
from kvcert.spec.types import CacheConfig, InsertOut, PoolExhausted, Snapshot

__all__ = ["CacheDriver", "Hold", "InfiniteBound", "OfflineBound", "ProtocolDriver", "SGLangDriver", "quiescent"]


@dataclass
class Hold:
    """What a running request holds: a lock on its cached prefix and the slots it owns."""

    lock: Any
    prefix: list[int]
    """Device slots of the cached prefix (the tree's)."""
    cached: int
    """Prompt pages served from cache (device hit + loaded back)."""
    loaded: int
    """Of those, pages loaded back from the host."""
    own: list[int] = field(default_factory=list)
    """Slots the request owns: its uncached prompt pages and its output pages."""
    reserved: int = 0
    """A bound's device room for the request, in pages (a bound has no slots to hand out)."""


class CacheDriver(Protocol):
    name: str
    priority: bool

    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
    ) -> Optional[Hold]:
        """Room for the request (prompt `key` + `out_pages`), its prefix locked; None: not now (nothing held)."""

    def checkpoint(self, key: Sequence[int], hold: Hold, session: str) -> None:
        """The prompt (`key`) is computed: it goes into the tree while the request decodes, its lock moves to
        the prompt's node and its prompt slots become the tree's (SGLang's `cache_unfinished_req`)."""

    def finish(self, key: Sequence[int], hold: Hold, session: str, prio: int) -> None:
        """The request ended: its prompt and output (`key`) go into the tree; its lock is returned."""

    def end_session(self, session: str) -> None: ...

    def counters(self) -> dict[str, int]: ...

    def check(self) -> list[str]:
        """End-of-run checks: the cache's own invariants, and nothing held after every request ended."""

    def close(self) -> None: ...


def quiescent(s: Snapshot) -> list[str]:
    """What must hold once every request has ended and every session is released: nothing locked,
    lent, pending, retracted or referenced, and every device slot free or the tree's (INV-ACCT-3)."""
    out = [f"{v.inv}: {v.message}" for v in check_snapshot(s)]
    locked = [n.id for n in s.nodes if n.id != s.root and n.lock_ref]
    if locked:
        out.append(f"nodes still locked after the run: {locked[:8]}")
    if s.protected_size:
        out.append(f"protected_size {s.protected_size} after the run")
    if s.lent_slots:
        out.append(f"{len(s.lent_slots)} slots still lent to requests")
    if s.pending or s.retractions or s.prefetches:
        out.append(f"{len(s.pending)} copies, {len(s.retractions)} retractions, {len(s.prefetches)} prefetches left")
    if s.sessions:
        out.append(f"{len(s.sessions)} sessions still registered")
    refs = [n.id for n in s.nodes if n.high_ref or n.low_ref]
    if refs:
        out.append(f"nodes still referenced: {refs[:8]}")
    return out


def _config(costs: Any) -> CacheConfig:
    return CacheConfig(
        page_size=1,
        capacity=costs.device_pages,
        host_capacity=costs.host_pages,
        write_policy="write_through",
        load_back_threshold=costs.load_back_threshold,
        kv_layers=1,
    )


class ProtocolDriver:
    """A kvcert `Backend`, driven as an engine drives it; `priority`: with §11's session refs and scopes."""

    def __init__(self, name: str, backend: Any, priority: bool, threshold: int) -> None:
        self.name, self.c, self.priority, self.threshold = name, backend, priority, threshold
        self.stats = {"evict_calls": 0, "evicted": 0, "loads": 0}
        self._sees_demotions = priority and hasattr(backend, "demotions")
        """kvcert.gpu keeps its demoted sessions in `demotions`; a cache that does not show them counts none."""
        if self._sees_demotions:
            self.stats["demotions"] = 0
        self._demoted: set[str] = set()
        self._registered: set[str] = set()

    # -- plumbing
    def _free(self) -> int:
        count = getattr(self.c, "free_count", None)
        return int(count()) if callable(count) else len(self.c.snapshot().free_slots)

    def settle(self) -> None:
        in_flight = getattr(self.c, "in_flight", None)
        ids = in_flight() if callable(in_flight) else [p.id for p in self.c.snapshot().pending if not p.finished]
        for copy in ids:
            self.c.complete(copy)
        self.c.poll()

    def _watch_demotions(self) -> None:
        """Count sessions found demoted after a call that were not before it (one demoted and restored within
        a single call goes uncounted)."""
        if not self._sees_demotions:
            return
        now = set(self.c.demotions)
        self.stats["demotions"] += len(now - self._demoted)
        self._demoted = now

    def _evict(self, n: int, high: bool) -> None:
        self.stats["evict_calls"] += 1
        got = self.c.evict(n, allow_low=True, allow_high=high) if self.priority else self.c.evict(n)
        self.stats["evicted"] += got
        self.settle()

    def _room(self, need: int, high: bool) -> bool:
        free = self._free()
        if free < need:
            self._evict(need - free, high)
        return self._free() >= need

    # -- the calls the engine makes
    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
    ) -> Optional[Hold]:
        m = self.c.match_prefix(None, key)
        self.c.inc_lock_ref(m.node)
        lock, dev = m.node, m.length
        host = m.host_length if m.host_node is not None and m.host_length >= self.threshold else 0
        need = len(key) - dev + out_pages
        if not self._room(need, high):
            self.c.dec_lock_ref(lock)
            return None
        loaded = 0
        if host:
            loaded = self.c.load_back(m.host_node)
            self.settle()
            if loaded:
                self.stats["loads"] += 1
                m = self.c.match_prefix(None, key)
                self.c.inc_lock_ref(m.node)
                self.c.dec_lock_ref(lock)
                lock, loaded = m.node, m.length - dev
        try:
            own = list(self.c.alloc(len(key) - m.length + out_pages))
        except PoolExhausted:
            self.c.dec_lock_ref(lock)
            return None
        self._watch_demotions()
        return Hold(lock, list(m.slots), m.length, loaded, own)

    def _insert(self, key: Sequence[int], hold: Hold, own: list[int]) -> InsertOut:
        """`key` into the tree over the held prefix and `own` (the request's slots for the rest); the pages
        another request inserted meanwhile are duplicates, so ours for them go back to the pool."""
        out: InsertOut = self.c.insert(None, key, hold.prefix + own)
        dup = out.prefix_len - hold.cached
        if dup > 0:
            self.c.free(own[:dup])
        return out

    def checkpoint(self, key: Sequence[int], hold: Hold, session: str) -> None:
        n = len(key) - hold.cached
        self._insert(key, hold, hold.own[:n])
        m = self.c.match_prefix(None, key)
        self.c.inc_lock_ref(m.node)
        self.c.dec_lock_ref(hold.lock)
        self.settle()
        hold.lock, hold.prefix, hold.cached, hold.own = m.node, list(m.slots), m.length, hold.own[n:]

    def finish(self, key: Sequence[int], hold: Hold, session: str, prio: int) -> None:
        out = self._insert(key, hold, hold.own)
        self.c.dec_lock_ref(hold.lock)
        self.settle()
        if self.priority:
            self.c.register_ref(session, out.node, prio)
            self._registered.add(session)
        self._watch_demotions()

    def end_session(self, session: str) -> None:
        if session in self._registered:  # a session whose first turn never ran holds nothing
            self._registered.discard(session)
            self.c.release_ref(session)
            self._watch_demotions()

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def check(self) -> list[str]:
        self.settle()
        return quiescent(self.c.snapshot())

    def close(self) -> None:
        close = getattr(self.c, "close", None)
        if callable(close):
            close()


class SGLangDriver:
    """SGLang 0.5.23's UnifiedRadixCache + HiCache (LRU, write-through), through its native calls.

    Built by kvcert's certified target (`sglang_hicache_backend:factory`, for its CPU shims and its
    snapshot at the end); every call of the run goes to SGLang's driver (`adapter.h`) directly.
    """

    name = "SGLang 0.5.23 UnifiedRadixCache+HiCache (LRU)"
    priority = False

    def __init__(self, adapter: Any, costs: Any) -> None:
        self.adapter = adapter
        self.h = self.adapter.h
        self.threshold = costs.load_back_threshold
        self.stats = {"evict_calls": 0, "evicted": 0, "loads": 0}

    def settle(self) -> None:
        for op in self.h.pending():
            self.h.complete(op, poll=False)
        self.h.poll()

    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
    ) -> Optional[Hold]:
        h = self.h
        m = h.match_prefix(None, key)
        lock, node, dev = h.inc_lock_ref(m.last_device_node), m.last_device_node, m.device_len
        host = m.host_hit_len if m.host_hit_len >= self.threshold else 0
        need = len(key) - dev + out_pages
        free = h.device_free()
        if free < need:
            self.stats["evict_calls"] += 1
            self.stats["evicted"] += h.evict(need - free)
            self.settle()
        if h.device_free() < need:
            h.dec_lock_ref(lock)
            return None
        loaded = 0
        if host:
            loaded, node = h.init_load_back(m.last_host_node, host, last_device=m.last_device_node)
            self.settle()
            if loaded:
                self.stats["loads"] += 1
                new = h.inc_lock_ref(node)
                h.dec_lock_ref(lock)
                lock = new
        prefix = h.device_slots(node) if dev + loaded else []
        try:
            own = h.alloc(len(key) - len(prefix) + out_pages)
        except MemoryError:
            h.dec_lock_ref(lock)
            return None
        return Hold(lock, prefix, len(prefix), loaded, own)

    def checkpoint(self, key: Sequence[int], hold: Hold, session: str) -> None:
        # cache_unfinished_req: the prompt goes in with prev_prefix_len; the request's lock moves to its new node.
        n = len(key) - len(hold.prefix)
        _, node = self.h.insert(None, key, hold.prefix + hold.own[:n], len(hold.prefix))
        new = self.h.inc_lock_ref(node)
        self.h.dec_lock_ref(hold.lock)
        self.settle()
        prefix = self.h.device_slots(node)
        hold.lock, hold.prefix, hold.cached, hold.own = new, prefix, len(prefix), hold.own[n:]

    def finish(self, key: Sequence[int], hold: Hold, session: str, prio: int) -> None:
        # cache_finished_req: insert with prev_prefix_len = the request's prefix; SGLang frees the duplicates.
        self.h.insert(None, key, hold.prefix + hold.own, len(hold.prefix))
        self.h.dec_lock_ref(hold.lock)
        self.settle()

    def end_session(self, session: str) -> None:
        pass

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def check(self) -> list[str]:
        self.settle()
        out = []
        try:
            self.h.sanity_check()  # SGLang's own
        except Exception as e:  # noqa: BLE001 - its assertion is the finding
            out.append(f"SGLang sanity_check: {type(e).__name__}: {e}")
        return out + quiescent(self.adapter.snapshot())

    def close(self) -> None:
        self.adapter.close()


class InfiniteBound:
    """Never evicts: every page a request computed before is a hit. Running requests still need
    device room (`device_pages`, their cached prefix included), as on any GPU."""

    name = "bound: infinite cache"
    priority = False

    def __init__(self, device_pages: int) -> None:
        self.seen: set[int] = set()
        self.device_pages, self.used = device_pages, 0

    @staticmethod
    def _chain(key: Sequence[int]) -> list[int]:
        h, out = 0, []
        for t in key:
            h = hash((h, t))
            out.append(h)
        return out

    def _hit(self, key: Sequence[int]) -> int:
        n = 0
        for h in self._chain(key):
            if h not in self.seen:
                break
            n += 1
        return n

    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
    ) -> Optional[Hold]:
        need = len(key) + out_pages
        if self.used + need > self.device_pages:
            return None
        self.used += need
        return Hold(None, [], self._hit(key), 0, reserved=need)

    def checkpoint(self, key: Sequence[int], hold: Hold, session: str) -> None:
        self._keep(key, session)

    def finish(self, key: Sequence[int], hold: Hold, session: str, prio: int) -> None:
        self.used -= hold.reserved
        self._keep(key, session)

    def _keep(self, key: Sequence[int], session: str) -> None:
        self.seen.update(self._chain(key))

    def end_session(self, session: str) -> None:
        pass

    def counters(self) -> dict[str, int]:
        return {"pages": len(self.seen)}

    def check(self) -> list[str]:
        return [f"{self.used} device pages still held after the run"] if self.used else []

    def close(self) -> None:
        pass


class OfflineBound(InfiniteBound):
    """Device + host pages as one pool; evicts the session tail (or shared prefix) used furthest ahead.

    `next_use(session)` is the simulator's knowledge of the future: the time of the session's next
    arrival (now, when it is queued or running; inf after its last turn). A session's KV is one
    item (the pages after its shared prefix, if any); a shared prefix is another, used next when
    the first of its group's sessions is. Evicting an item drops pages from its tail, so what
    stays is still a prefix.
    """

    name = "bound: offline (Belady, device+host)"

    def __init__(
        self,
        device_pages: int,
        capacity_pages: int,
        next_use: Callable[[str], float],
        groups: dict[str, str],
        prefix_pages: dict[str, int],
    ) -> None:
        super().__init__(device_pages)
        self.capacity, self.next_use = capacity_pages, next_use
        self.groups, self.prefix_pages = groups, prefix_pages
        self.members: dict[str, list[str]] = {}
        for s, g in groups.items():
            self.members.setdefault(g, []).append(s)
        self.items: dict[str, list[int]] = {}
        """item -> chain hashes kept (a prefix of its pages): 'g:<group>' or 's:<session>'."""
        self.size = 0
        self.stats = {"evicted": 0}

    def _keep(self, key: Sequence[int], session: str) -> None:
        chain = self._chain(key)
        group = self.groups.get(session)
        cut = self.prefix_pages.get(group, 0) if group is not None else 0
        if group is not None:
            self._put(f"g:{group}", chain[:cut])
        self._put(f"s:{session}", chain[cut:])
        self._fit()

    def _put(self, item: str, chain: list[int]) -> None:
        old = self.items.pop(item, [])
        self.size -= len(old)
        self.seen.difference_update(old)
        self.items[item] = chain
        self.size += len(chain)
        self.seen.update(chain)

    def _use(self, item: str) -> float:
        if item.startswith("s:"):
            return self.next_use(item[2:])
        group = item[2:]
        return min((self.next_use(s) for s in self.members.get(group, ())), default=math.inf)

    def _fit(self) -> None:
        if self.size <= self.capacity:
            return
        for item in sorted(self.items, key=self._use, reverse=True):
            over = self.size - self.capacity
            if over <= 0:
                break
            chain = self.items[item]
            cut = max(0, len(chain) - over)
            self._put(item, chain[:cut])
            self.stats["evicted"] += len(chain) - cut

    def end_session(self, session: str) -> None:
        self._fit()

    def counters(self) -> dict[str, int]:
        return {"pages": self.size, **self.stats}
