"""Page-granular slot allocators for the device and host pools.

Slots are handed out a whole page at a time from a stack of free pages, so every page a
caller or the tree holds is one aligned device page (INV-SLOT-4) and alloc/free cost
O(slots moved), independent of the pool size. A per-slot state byte says who holds each
slot (free, lent to a caller, or held by the cache), which makes ownership checks O(1) per
slot. A page goes back on the stack only when all its slots are free again, so a caller that
frees part of a page never makes the allocator hand out a torn page.
"""

from __future__ import annotations

from collections.abc import Sequence

FREE, LENT, HELD = 0, 1, 2


class PageAllocator:
    """Free pages on a stack; per-slot ownership; an armable allocation failure (SPEC.md §10.5)."""

    def __init__(self, capacity: int, page_size: int) -> None:
        if page_size < 1 or capacity % page_size:
            raise ValueError("capacity must be whole pages")
        self.capacity, self.page_size = capacity, page_size
        pages = capacity // page_size
        self._pages: list[int] = list(range(pages - 1, -1, -1))  # pop() hands out low pages first
        self._page_free = [page_size] * pages
        self.state = bytearray(capacity)
        self.failures = 0
        """Armed allocation failures (`inject_fault("host_alloc")`): the next `take`s fail."""

    @property
    def available(self) -> int:
        """Slots an allocation can get now (whole free pages)."""
        return len(self._pages) * self.page_size

    def _pop(self, n: int, state: int) -> tuple[int, ...]:
        out: list[int] = []
        ps = self.page_size
        for _ in range(n // ps):
            page = self._pages.pop()
            self._page_free[page] = 0
            out.extend(range(page * ps, page * ps + ps))
        for s in out:
            self.state[s] = state
        return tuple(out)

    def _push(self, slots: Sequence[int]) -> None:
        ps = self.page_size
        for s in slots:
            self.state[s] = FREE
            page = s // ps
            self._page_free[page] += 1
            if self._page_free[page] == ps:
                self._pages.append(page)

    def lend(self, n: int) -> tuple[int, ...]:
        """`n` slots (whole pages, checked by the caller, as is availability) lent to a caller."""
        return self._pop(n, LENT)

    def take(self, n: int) -> tuple[int, ...]:
        """`n` slots held by the cache itself (no caller in between)."""
        return self._pop(n, HELD)

    def consume_failure(self) -> bool:
        """True (and disarmed) if an injected allocation failure was armed."""
        if self.failures:
            self.failures -= 1
            return True
        return False

    def are_lent(self, slots: Sequence[object]) -> bool:
        """Distinct ints, every one lent to the caller."""
        seen: set[int] = set()
        for s in slots:
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < self.capacity:
                return False
            if s in seen or self.state[s] != LENT:
                return False
            seen.add(s)
        return True

    def give_back(self, slots: Sequence[int]) -> None:
        """A caller frees lent slots."""
        self._push(slots)

    def adopt(self, slots: Sequence[int]) -> None:
        """The cache takes lent slots over."""
        for s in slots:
            self.state[s] = HELD

    def release(self, slots: Sequence[int]) -> None:
        """The cache drops slots it held."""
        self._push(slots)

    def is_free(self, slot: int) -> bool:
        return self.state[slot] == FREE

    def free_slots(self) -> tuple[int, ...]:
        """Observation only: O(capacity)."""
        return tuple(i for i, st in enumerate(self.state) if st == FREE)
