"""Page-granular slot allocators for the device and host pools.

Slots are handed out a whole page at a time from a stack of free pages, so every page a
caller or the tree holds is one aligned device page (INV-SLOT-4). A page goes back on the
stack only when all its slots are free again, so a caller that frees part of a page never
makes the allocator hand out a torn page.

Slot runs travel as `bytes` of little-endian int64 (8 bytes a slot: `array("q")`'s layout,
which `torch.frombuffer` reads without a copy). Ownership is kept *per page* (a page is named
by its first slot) whenever a page is uniform: wholly free (on the stack), wholly lent to a
caller, wholly held by the cache, or mixed (`mixed`: a state byte per slot, only for pages a
caller split, e.g. by freeing half of one). The cost of a call is O(pages) in C, not O(slots)
in Python:

- the run `lend_raw` handed out last is remembered with its pages (`_memo_raw`, `_memo_pages`): the calls that
  follow it in a scheduler's step — the insert that checks the whole run and adopts its tail,
  the free of the duplicates at its head — are recognised with one `startswith` (a memcmp) and
  move an interval, not a set of pages;
- any other run of whole aligned pages is checked with one join and one comparison of bytes
  and moved with a few set operations;
- anything else (a partial page, a permutation inside a page, a bad id) takes the per-slot
  path, which is exact.

The tuple methods (`lend`, `are_lent`, `give_back`, ...) are the same operations over tuples
of ints, for callers that hold Python sequences.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Optional, Protocol

import numpy as np

FREE, LENT, HELD = 0, 1, 2


def to_bytes(slots: Sequence[object]) -> Optional[bytes]:
    """Slot ids as int64 bytes; None unless every item is an int (never a bool) that fits int64."""
    if set(map(type, slots)) - {int} and not all(isinstance(s, int) and not isinstance(s, bool) for s in slots):
        return None
    try:
        return array("q", slots).tobytes()  # type: ignore[arg-type,type-var]
    except OverflowError:
        return None


def to_tuple(raw: bytes) -> tuple[int, ...]:
    """The inverse of `to_bytes`."""
    return tuple(array("q", raw))


class PageAllocator:
    """Free pages on a stack; per-page ownership (per-slot for mixed pages); an armable allocation failure."""

    def __init__(self, capacity: int, page_size: int) -> None:
        if page_size < 1 or capacity % page_size:
            raise ValueError("capacity must be whole pages")
        self.capacity, self.page_size = capacity, page_size
        self._width = 8 * page_size
        """Bytes of one page of a run."""
        self._stack = array("q", range(capacity - page_size, -1, -page_size))  # pop() hands out low pages first
        """First slots of wholly free pages."""
        self.lent: set[int] = set()
        """First slots of pages wholly lent to a caller (but those of the memo's live interval)."""
        self.held: set[int] = set()
        """First slots of pages wholly held by the cache."""
        self.mixed: dict[int, bytearray] = {}
        """Pages whose slots are not all in one state: a state byte per slot."""
        self._run: dict[int, bytes] = {}
        """First slot -> the page's slot run as bytes (page sizes above 1): builds and checks runs in C."""
        if page_size > 1:
            every = array("q", range(capacity)).tobytes()
            width = self._width
            self._run = {f: every[8 * f : 8 * f + width] for f in range(0, capacity, page_size)}
        self._memo_raw = b""
        self._memo_pages = array("q")
        self._lo = self._hi = 0
        """The last lent run and its pages; pages `[_lo, _hi)` of it are lent (and in no set)."""
        self.failures = 0
        """Armed allocation failures (`inject_fault("host_alloc")`): the next `take`s fail."""

    @property
    def available(self) -> int:
        """Slots an allocation can get now (whole free pages)."""
        return len(self._stack) * self.page_size

    # ------------------------------------------------------------------ pages of a run

    def pages(self, raw: bytes) -> Optional[Sequence[int]]:
        """First slots of the pages of `raw` if it is whole aligned pages in slot order, else None.

        Says nothing about duplicates or ownership: callers test those on the page ids.
        """
        ids = memoryview(raw).cast("q")  # a view: no copy of the run
        ps = self.page_size
        if ps == 1:
            return ids
        if len(ids) % ps:
            return None
        firsts = ids[::ps]
        try:
            expected = b"".join(map(self._run.__getitem__, firsts))
        except KeyError:  # a first slot that is not a page start of this pool
            return None
        return firsts if expected == raw else None

    def _memo_head(self, raw: bytes) -> int:
        """Pages of `raw` if it is the head of the memo's live interval (-1 if not)."""
        width = self._width
        if (
            len(raw) % width
            or len(raw) > (self._hi - self._lo) * width
            or not self._memo_raw.startswith(raw, self._lo * width)
        ):
            return -1
        return len(raw) // width

    def _flush(self) -> None:
        """Forget the memo: its live pages join the `lent` set."""
        if self._lo < self._hi:
            self.lent.update(self._memo_pages[self._lo : self._hi])
        self._memo_raw, self._memo_pages = b"", array("q")
        self._lo = self._hi = 0

    def _state(self, slot: int) -> int:
        first = slot - slot % self.page_size
        states = self.mixed.get(first)
        if states is not None:
            return states[slot - first]
        if first in self.lent or first in self._memo_pages[self._lo : self._hi]:
            return LENT
        return HELD if first in self.held else FREE

    def _uniform(self, state: int) -> set[int]:
        return self.lent if state == LENT else self.held

    # ------------------------------------------------------------------ bytes API (the hot path)

    def _pop(self, n: int) -> tuple[bytes, array[int]]:
        k = n // self.page_size
        if not k:
            return b"", array("q")
        got = self._stack[-k:]
        del self._stack[-k:]
        got.reverse()
        if self.page_size == 1:
            return got.tobytes(), got
        return b"".join(map(self._run.__getitem__, got)), got

    def lend_raw(self, n: int) -> bytes:
        """`n` slots (whole pages, checked by the caller, as is availability) lent to a caller."""
        if self._lo < self._hi:
            self._flush()
        raw, got = self._pop(n)
        self._memo_raw, self._memo_pages, self._lo, self._hi = raw, got, 0, len(got)
        return raw

    def take_raw(self, n: int) -> bytes:
        """`n` slots held by the cache itself (no caller in between)."""
        raw, got = self._pop(n)
        self.held.update(got)
        return raw

    def lent_pages(self, raw: bytes) -> Optional[Sequence[int]]:
        """The page ids of `raw` if it is whole, distinct pages all lent to the caller (the fast cases), else None.

        None says only that no fast case applies: `are_lent_raw` decides the rest exactly.
        """
        k = self._memo_head(raw)
        if k >= 0:
            return self._memo_pages[self._lo : self._lo + k]
        if self._lo < self._hi:
            self._flush()
        firsts = self.pages(raw)
        if firsts is not None:
            distinct = set(firsts)
            if len(distinct) == len(firsts) and distinct <= self.lent:
                return firsts
        return None

    def are_lent_raw(self, raw: bytes) -> bool:
        """Distinct slot ids of this pool, every one lent to the caller."""
        return self.lent_pages(raw) is not None or self._are_lent_slow(array("q", raw))

    def _are_lent_slow(self, ids: Iterable[int]) -> bool:
        seen: set[int] = set()
        for s in ids:
            if not 0 <= s < self.capacity or s in seen or self._state(s) != LENT:
                return False
            seen.add(s)
        return True

    def give_back_checked(self, raw: bytes) -> bool:
        """`give_back_raw` if `are_lent_raw`, looking at the run once; False (and nothing moved) otherwise."""
        k = self._memo_head(raw)
        if k >= 0:  # the head of the last lent run: the duplicates an insert left to the caller
            lo = self._lo
            self._stack.extend(self._memo_pages[lo : lo + k])
            self._lo = lo + k
            return True
        firsts = self.lent_pages(raw)
        if firsts is not None:
            self.lent.difference_update(firsts)
            self._stack.extend(firsts)
            return True
        if not self._are_lent_slow(array("q", raw)):
            return False
        self._move(raw, LENT, FREE)
        return True

    def adopt_pages(self, firsts: Sequence[int]) -> None:
        """The cache takes over whole lent pages that `lent_pages` returned (or a part of them)."""
        k = len(firsts)
        lo, hi = self._lo, self._hi
        if k <= hi - lo and self._memo_pages[hi - k : hi] == firsts:  # the tail of the last lent run
            self._hi = hi - k
        else:
            self._flush()
            self.lent.difference_update(firsts)
        self.held.update(firsts)

    def _move(self, raw: bytes, src: int, dst: int) -> None:
        """Slots of `raw` (distinct, all in state `src`: the caller checked) go to state `dst`."""
        if src == LENT:
            self._flush()
        firsts = self.pages(raw)
        whole = self._uniform(src)
        if firsts is not None and whole.issuperset(firsts):
            whole.difference_update(firsts)
            if dst == FREE:
                self._stack.extend(firsts)
            else:
                self._uniform(dst).update(firsts)
            return
        ps = self.page_size
        touched: dict[int, bytearray] = {}
        for s in array("q", raw):
            first = s - s % ps
            states = self.mixed.get(first)
            if states is None:
                states = self.mixed[first] = bytearray([self._state(first)]) * ps
                if first in self.lent:
                    self.lent.discard(first)
                else:
                    self.held.discard(first)
            states[s - first] = dst
            touched[first] = states
        for first, states in touched.items():  # a page whose slots agree again is uniform again
            if states.count(states[0]) == ps:
                del self.mixed[first]
                if states[0] == FREE:
                    self._stack.append(first)
                else:
                    self._uniform(states[0]).add(first)

    def give_back_raw(self, raw: bytes) -> None:
        """A caller frees lent slots (checked by the caller)."""
        self._move(raw, LENT, FREE)

    def adopt_raw(self, raw: bytes) -> None:
        """The cache takes lent slots over."""
        self._move(raw, LENT, HELD)

    def release_raw(self, raw: bytes) -> None:
        """The cache drops slots it held."""
        self._move(raw, HELD, FREE)

    def consume_failure(self) -> bool:
        """True (and disarmed) if an injected allocation failure was armed."""
        if self.failures:
            self.failures -= 1
            return True
        return False

    def is_free(self, slot: int) -> bool:
        return self._state(slot) == FREE

    def free_slots(self) -> tuple[int, ...]:
        """Observation only: O(capacity), from ownership (a page nobody owns is free), not from the free stack."""
        ps = self.page_size
        whole = set(range(0, self.capacity, ps))
        whole -= self.lent
        whole -= self.held
        whole.difference_update(self._memo_pages[self._lo : self._hi], self.mixed)
        firsts = sorted(whole)
        out = array("q", b"".join(map(self._run.__getitem__, firsts))) if ps > 1 else firsts
        if not self.mixed:
            return tuple(out)
        part = [first + i for first, states in self.mixed.items() for i, st in enumerate(states) if st == FREE]
        return tuple(sorted([*out, *part]))

    # ------------------------------------------------------------------ tuple API

    def lend(self, n: int) -> tuple[int, ...]:
        return to_tuple(self.lend_raw(n))

    def take(self, n: int) -> tuple[int, ...]:
        return to_tuple(self.take_raw(n))

    def are_lent(self, slots: Sequence[object]) -> bool:
        raw = to_bytes(slots)
        return raw is not None and self.are_lent_raw(raw)

    def give_back(self, slots: Sequence[int]) -> None:
        self.give_back_raw(array("q", slots).tobytes())

    def adopt(self, slots: Sequence[int]) -> None:
        self.adopt_raw(array("q", slots).tobytes())

    def release(self, slots: Sequence[int]) -> None:
        self.release_raw(array("q", slots).tobytes())


class SlotSource(Protocol):
    """An engine's own device-slot allocator, as `EngineSlots` needs it."""

    def available(self) -> int:
        """Slots the engine could allocate now."""
        ...

    def release(self, raw: bytes) -> None:
        """Take back slots the tree held (int64 bytes): the tree evicted them."""
        ...

    def take(self, n: int) -> bytes:
        """`n` slots (whole pages) for the tree itself (a load-back's destination), as int64 bytes."""
        ...

    def free_slots(self) -> tuple[int, ...]:
        """Observation only: the engine's free slots."""
        ...


class EngineSlots(PageAllocator):
    """The device allocator of a tree whose slots an engine allocates (SGLang's `token_to_kv_pool_allocator`).

    The engine lends slots to its requests itself; the tree only records which slots it holds (a byte per slot),
    so an insert can still refuse a slot the tree already holds, and gives a slot back to the engine when it
    evicts it. A slot the tree does not hold counts as the caller's. Lending slots to callers (`lend_raw`) is the
    engine's job: it refuses; the tree's own slots (`take_raw`, a load-back's) come from the engine too.
    """

    def __init__(self, capacity: int, page_size: int, source: SlotSource) -> None:
        if page_size < 1 or capacity % page_size:
            raise ValueError("capacity must be whole pages")
        self.capacity, self.page_size = capacity, page_size
        self._width = 8 * page_size
        self.source = source
        self._held = np.zeros(capacity, dtype=np.bool_)
        self.lent, self.held = set(), set()  # (unused: ownership is `_held`)
        self.mixed = {}
        self.failures = 0

    def _ids(self, raw: bytes) -> Optional[np.ndarray]:
        ids = np.frombuffer(raw, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.capacity):
            return None
        return ids

    @property
    def available(self) -> int:
        return self.source.available()

    def lend_raw(self, n: int) -> bytes:
        raise NotImplementedError("the engine allocates device slots")

    def take_raw(self, n: int) -> bytes:
        """`n` slots the engine allocates for the tree itself (a load-back): held from here on."""
        raw = self.source.take(n)
        self.adopt_raw(raw)
        return raw

    def lent_pages(self, raw: bytes) -> Optional[Sequence[int]]:
        return None  # no fast case: `are_lent_raw` decides

    def are_lent_raw(self, raw: bytes) -> bool:
        ids = self._ids(raw)
        return ids is not None and len(np.unique(ids)) == ids.size and not self._held[ids].any()

    def give_back_checked(self, raw: bytes) -> bool:
        return False  # the engine frees its requests' slots itself

    def adopt_pages(self, firsts: Sequence[int]) -> None:
        ps = self.page_size
        for f in firsts:
            self._held[f : f + ps] = True

    def adopt_raw(self, raw: bytes) -> None:
        self._held[np.frombuffer(raw, dtype=np.int64)] = True

    def release_raw(self, raw: bytes) -> None:
        self._held[np.frombuffer(raw, dtype=np.int64)] = False
        self.source.release(raw)

    def is_free(self, slot: int) -> bool:
        return not self._held[slot] and slot in self.source.free_slots()

    def free_slots(self) -> tuple[int, ...]:
        return self.source.free_slots()
