"""The two bounds the simulator compares the caches with; each answers the calls of `kvcert.sim.caches.CacheDriver`.

* `InfiniteBound`: never evicts; every token computed before is a hit.
* `OfflineBound`: device + host pages as one pool that, knowing each session's next arrival,
  evicts the KV used furthest in the future first (Belady's rule, per session tail). Optimistic:
  its hits cost no load time and running requests take no room. It is a reference, not a proof
  of optimality for KV of unequal sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

from kvcert.sim.caches import Hold

__all__ = ["InfiniteBound", "OfflineBound"]


class InfiniteBound:
    """Never evicts: every page a request computed before is a hit. Running requests still need
    device room (`device_pages`, their cached prefix included), as on any GPU; it has nothing to evict,
    so its room is what they leave free."""

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

    def room(self) -> int:
        return self.device_pages - self.used

    def safe_room(self) -> int:
        return self.room()

    def high_evictable(self) -> int:
        return 0

    def admit(
        self,
        key: Sequence[int],
        out_pages: int,
        session: str,
        prio: int,
        high: bool,
        fits: Callable[[int], bool],
    ) -> Optional[Hold]:
        if not fits(len(key)):  # a bound keeps no tree: the whole context needs device room
            return None
        self.used += len(key)
        return Hold(None, [], self._hit(key), 0, reserved=len(key))

    def grow(self, needs: Sequence[tuple[Hold, int, bool]]) -> bool:
        total = sum(n for _, n, _ in needs)
        if total > self.room():
            return False
        self.used += total
        for hold, n, _ in needs:
            hold.reserved += n
        return True

    def release(self, hold: Hold, reclaim: int) -> None:
        self.used -= hold.reserved
        hold.reserved = 0

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
