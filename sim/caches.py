"""The caches the simulator drives, each through its own API, and the two bounds.

The simulator never decides what a cache keeps: it asks the cache, as an engine's scheduler does.
Every driver answers the same calls (`room`, `admit`, `checkpoint`, `grow`, `finish`, `release`,
`end_session`); which request runs, waits or is retracted is the scheduler's (`kvcert.sim.engine`):

* `ProtocolDriver`: any kvcert `Backend` (kvcert.gpu, the reference model, the RefAware fork's
  adapter). With `priority=True` it makes the proactive manager's cache calls (SPEC.md §11.1-§11.4):
  a session's path is registered at its priority after every turn and released after its last,
  and a low-priority request evicts only in its scope.
* `SGLangDriver`: SGLang 0.5.23's `UnifiedRadixCache` + HiCache through its native calls
  (`match_prefix`, `init_load_back`, `inc/dec_lock_ref`, `evict`, `insert` with
  `prev_prefix_len`), as its scheduler calls them: priority-blind.
* The bounds, `InfiniteBound` and `OfflineBound`, are in `kvcert.sim.bounds`.

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

__all__ = ["CacheDriver", "Hold", "ProtocolDriver", "SGLangDriver", "quiescent"]


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

    def room(self) -> int:
        """Free plus evictable device pages, as SGLang's budget reads them (`available_size() +
        evictable_size()`)."""

    def safe_room(self) -> int:
        """Free plus evictable device pages outside the HIGH_REF tier (the fork's `_ref_aware_full_capacity`);
        `room()` for a cache without tiers."""

    def high_evictable(self) -> int:
        """Evictable pages in the HIGH_REF tier (0 without tiers)."""

    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
        fits: Callable[[int], bool],
    ) -> Optional[Hold]:
        """With the cached prefix locked, ask the scheduler's budget whether the request fits (`fits(uncached
        prompt pages)`); if so, load the host hit back and allocate the uncached prompt. None, and nothing held,
        when the budget refuses or the allocation fails."""

    def grow(self, needs: Sequence[tuple[Hold, int, bool]]) -> bool:
        """Decode: `(hold, pages, high)` more pages for each request, evicting as needed; False, and nothing
        allocated, when they do not all fit (SGLang's `check_decode_mem`)."""

    def release(self, hold: Hold, reclaim: int) -> None:
        """Retraction, preemption or abort (`release_req`): the request's own slots freed (not cached), its lock
        returned, and the tree evicted until `reclaim` pages are free."""

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

    def __init__(
        self,
        name: str,
        backend: Any,
        priority: bool,
        threshold: int,
        retain_slack: Optional[float] = None,
        retain_ttl: Optional[float] = None,
        scoped: bool = True,
        hold_waiting: bool = False,
    ) -> None:
        """`retain_slack`: with it, a session whose client pauses for `think` seconds is retained for `think +
        retain_slack` seconds (SPEC.md §11.7). `retain_ttl`: instead, a paused session is retained for exactly
        `retain_ttl` seconds whatever its think time (a client that knows it is pausing, for a tool call, but not
        for how long). With either, the cache's clock follows the simulated time in microseconds (each call still
        a tick later than the last, so stamps keep their order). ValueError for both, or a TTL that is not > 0.
        `scoped=False`: evictions run unscoped (every tier, in §11's order) as under an engine whose scheduler never
        tells the cache which request it makes room for (SGLang 0.5.23's `evict_for_alloc`). `hold_waiting`: the
        engine's half of retention (SPEC.md §11.7): when a paused session's next turn reaches the queue within its
        retention, `retain_waiting` keeps the retention until that turn registers, so the TTL need only cover the
        pause."""
        if retain_slack is not None and retain_ttl is not None:
            raise ValueError("retain_slack and retain_ttl are exclusive: a retention follows the think time or not")
        if retain_ttl is not None and not retain_ttl > 0:
            raise ValueError(f"retain_ttl must be > 0 seconds, got {retain_ttl!r}")
        self.name, self.c, self.priority, self.threshold = name, backend, priority, threshold
        self.retain_slack, self.retain_ttl = retain_slack, retain_ttl
        self.scoped, self.hold_waiting = scoped, hold_waiting
        self._retains = retain_slack is not None or retain_ttl is not None
        self._time = 0.0
        self.stats = {"evict_calls": 0, "evicted": 0, "loads": 0}
        self._sees_demotions = priority and hasattr(backend, "demotions")
        """kvcert.gpu and the model keep their demoted sessions in `demotions` and `sessions`; a cache that does not
        show them counts none."""
        if self._sees_demotions:
            self.stats["demotions"] = 0
        self._demoted: set[str] = set()
        self._registered: set[str] = set()
        self._now = 0
        self._until: dict[str, float] = {}
        """A paused session's retention deadline in simulated seconds, until its next turn is admitted (inf once
        `retain_waiting` holds it for that turn)."""

    def _tick(self) -> None:
        """Advance the cache's clock before each of the engine's calls: a kvcert backend stamps nodes from the
        clock it is given (`set_clock`), as SGLang's tree stamps them from its own counter; left alone it would
        stamp every node 0, and LRU would rank by node id."""
        self._now = max(self._now + 1, round(self._time * 1e6)) if self._retains else self._now + 1
        self.c.set_clock(self._now)

    def at(self, now: float) -> None:
        """The simulated time (seconds), which a retention's TTL is counted in."""
        self._time = now

    def pause(self, session: str, seconds: float) -> None:
        """The session's client comes back in `seconds` (its think time): with `retain_slack`, retain its path
        that long and the slack more; with `retain_ttl`, for the TTL, whatever `seconds` is."""
        if self._retains and session in self._registered:
            self._tick()
            ttl = self.retain_ttl if self.retain_ttl is not None else seconds + (self.retain_slack or 0.0)
            self.c.retain(session, max(1, round(ttl * 1e6)))
            self.stats["retained"] = self.stats.get("retained", 0) + 1
            self._until[session] = self._time + ttl

    def waits(self, session: str) -> None:
        """The engine received the session's next turn; with `hold_waiting`, a live retention holds until the turn
        registers (`retain_waiting`; a retention already run out stays out, as the cache rules)."""
        if not self.hold_waiting or session not in self._until:
            return
        if self._time >= self._until[session]:  # ran out before the engine had the turn (a client's own queue)
            self.stats["retention_ran_out_unreceived"] = self.stats.get("retention_ran_out_unreceived", 0) + 1
            return
        self._tick()
        self.c.retain_waiting(session)
        self.stats["held_waiting"] = self.stats.get("held_waiting", 0) + 1
        self._until[session] = math.inf

    def _count_retention(self, session: str, high: bool, cached: int, prompt: int) -> None:
        """At a turn's admission, whether its session's retention still held or had expired while the turn waited
        (counters `retention_{high|low}_{live|expired}_{admits|hit_pages|prompt_pages}`): a retention that ends
        before the turn is admitted leaves its path unretained, first to go, while the turn is the next one due."""
        until = self._until.pop(session, None)
        if until is None:
            return
        key = f"retention_{'high' if high else 'low'}_{'live' if self._time < until else 'expired'}"
        for what, n in (("admits", 1), ("hit_pages", cached), ("prompt_pages", prompt)):
            self.stats[f"{key}_{what}"] = self.stats.get(f"{key}_{what}", 0) + n

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
        sessions = self.c.sessions  # a demotion record may outlive its session's demotion (the model keeps them)
        now = {d for d in self.c.demotions if d in sessions and sessions[d].demoted}
        self.stats["demotions"] += len(now - self._demoted)
        self._demoted = now

    def _evict(self, n: int, high: bool) -> None:
        self.stats["evict_calls"] += 1
        got = self.c.evict(n, allow_low=True, allow_high=high) if self.priority and self.scoped else self.c.evict(n)
        self.stats["evicted"] += got
        self.settle()

    def _room(self, need: int, high: bool) -> bool:
        free = self._free()
        if free < need:
            self._evict(need - free, high)
        return self._free() >= need

    def _evictable(self) -> int:
        count = getattr(self.c, "evictable_count", None)
        if callable(count):
            return int(count())
        size = getattr(self.c, "evictable_size", None)
        return int(size) if isinstance(size, int) else int(self.c.snapshot().evictable_size)

    def _tiers(self) -> tuple[int, int, int]:
        tiers = getattr(self.c, "tier_evictable", None)
        return tuple(tiers) if tiers is not None else self.c.snapshot().tier_evictable  # type: ignore[return-value]

    # -- the calls the engine makes
    def room(self) -> int:
        return self._free() + self._evictable()

    def safe_room(self) -> int:
        return self.room() - self.high_evictable()

    def high_evictable(self) -> int:
        return int(self._tiers()[2]) if self.priority else 0

    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
        fits: Callable[[int], bool],
    ) -> Optional[Hold]:
        self._tick()
        m = self.c.match_prefix(None, key)
        self.c.inc_lock_ref(m.node)
        lock, dev = m.node, m.length
        host = m.host_length if m.host_node is not None and m.host_length >= self.threshold else 0
        extend = len(key) - dev
        if not fits(extend):
            self.c.dec_lock_ref(lock)
            return None
        if not self._room(extend, high):
            return self._refuse(lock)
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
            own = list(self.c.alloc(len(key) - m.length))
        except PoolExhausted:
            return self._refuse(lock)
        self._watch_demotions()
        if self._retains:
            self._count_retention(session, high, m.length, len(key))
        return Hold(lock, list(m.slots), m.length, loaded, own)

    def _refuse(self, lock: Any) -> Optional[Hold]:
        """The budget admitted what eviction in the request's scope cannot make room for (SGLang's prefill
        would fail its allocation here)."""
        self.stats["alloc_refused"] = self.stats.get("alloc_refused", 0) + 1
        self.c.dec_lock_ref(lock)
        self._watch_demotions()
        return None

    def grow(self, needs: Sequence[tuple[Hold, int, bool]]) -> bool:
        total = sum(n for _, n, _ in needs)
        if not total:
            return True
        self._tick()
        if self._free() < total:
            # a low-priority request's pages are made in its scope; a high one's may take HIGH_REF KV
            self._evict(total - self._free(), False)
            high = sum(n for _, n, h in needs if h)
            short = total - self._free()
            if short > 0 and high and self.priority:
                self._evict(min(short, high), True)
        if self._free() < total:
            return False
        for hold, n, _ in needs:
            hold.own += self.c.alloc(n)
        return True

    def release(self, hold: Hold, reclaim: int) -> None:
        self._tick()
        self.c.free(hold.own)
        hold.own = []
        self.c.dec_lock_ref(hold.lock)
        self.settle()
        if self._free() < reclaim:
            self._evict(reclaim - self._free(), False)  # on no request's behalf: never HIGH_REF KV

    def _insert(self, key: Sequence[int], hold: Hold, own: list[int]) -> InsertOut:
        """`key` into the tree over the held prefix and `own` (the request's slots for the rest); the pages
        another request inserted meanwhile are duplicates, so ours for them go back to the pool."""
        out: InsertOut = self.c.insert(None, key, hold.prefix + own)
        dup = out.prefix_len - hold.cached
        if dup > 0:
            self.c.free(own[:dup])
        return out

    def checkpoint(self, key: Sequence[int], hold: Hold, session: str) -> None:
        self._tick()
        n = len(key) - hold.cached
        self._insert(key, hold, hold.own[:n])
        m = self.c.match_prefix(None, key)
        self.c.inc_lock_ref(m.node)
        self.c.dec_lock_ref(hold.lock)
        self.settle()
        hold.lock, hold.prefix, hold.cached, hold.own = m.node, list(m.slots), m.length, hold.own[n:]

    def finish(self, key: Sequence[int], hold: Hold, session: str, prio: int) -> None:
        self._tick()
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
            self._tick()
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

    def room(self) -> int:
        return int(self.h.device_free()) + int(self.h.cache.evictable_size())

    def safe_room(self) -> int:
        return self.room()

    def high_evictable(self) -> int:
        return 0

    def _evict(self, n: int) -> None:
        """SGLang's `evict_to_free_tokens`: evict until `n` pages are free."""
        free = self.h.device_free()
        if free < n:
            self.stats["evict_calls"] += 1
            self.stats["evicted"] += self.h.evict(n - free)
            self.settle()

    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
        fits: Callable[[int], bool],
    ) -> Optional[Hold]:
        h = self.h
        m = h.match_prefix(None, key)
        lock, node, dev = h.inc_lock_ref(m.last_device_node), m.last_device_node, m.device_len
        host = m.host_hit_len if m.host_hit_len >= self.threshold else 0
        extend = len(key) - dev
        if not fits(extend):
            h.dec_lock_ref(lock)
            return None
        self._evict(extend)
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
            own = h.alloc(len(key) - len(prefix))
        except MemoryError:
            self.stats["alloc_refused"] = self.stats.get("alloc_refused", 0) + 1
            h.dec_lock_ref(lock)
            return None
        return Hold(lock, prefix, len(prefix), loaded, own)

    def grow(self, needs: Sequence[tuple[Hold, int, bool]]) -> bool:
        total = sum(n for _, n, _ in needs)
        if not total:
            return True
        self._evict(total)
        if self.h.device_free() < total:
            return False
        for hold, n, _ in needs:
            hold.own += self.h.alloc(n)
        return True

    def release(self, hold: Hold, reclaim: int) -> None:
        self.h.free(hold.own)
        hold.own = []
        self.h.dec_lock_ref(hold.lock)
        self.settle()
        self._evict(reclaim)

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
