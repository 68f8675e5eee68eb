"""The linker tier: a cache's device pool linked straight to an external KV store, with no host tier between them
(SPEC.md §14; SGLang's `UnifiedCacheLinker`, the seed's direct linkers).

Two parties keep the contract. The *linker* moves pages between device slots and its store: it answers a lookup
with the page-prefix lengths it can restore (each page resident and claimed for the request), copies a queued
load into the slots it was handed when the batch starts, and reports the batch landed only once every byte did;
it persists an offload's pages and publishes the offloads' results in the order they were queued, success only
when every page was stored. The *cache* drives it: it loads only what the last lookup for that request reported,
into slots nothing else holds, finishes every batch it started before it uses a slot of it, keeps an offload's
source pages unchanged until the offload's result is taken, consumes no more results than are published, and
marks a node stored only on its offload's success.

`LinkerLedger` watches the calls between the two, whichever side is the engine under test, and judges each against
the rules below. It sees slots and page keys only; the bytes are compared by whoever holds them (`check_pinned`).
Rules marked (profile) are one engine's choices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvcert.spec.invariants import Violation

__all__ = ["FAULTS", "RULES", "LinkerLedger", "Offload", "check_pinned"]

RULES: dict[str, str] = {
    "INV-LINK-1": "a load names a page prefix of the request's last lookup whose length that lookup reported "
    "restorable, once: a hint or an older lookup is never a hit",
    "INV-LINK-2": "a load lands in slots private to its request: one per token of its pages, distinct, allocated, "
    "and held by no tree node and no other load, from the time it is queued to the time its batch finishes",
    "INV-LINK-3": "every batch started with loads in it is finished, once, before the next batch starts; a request "
    "whose load is queued and not started is cancelled before its slots are freed",
    "INV-LINK-4": "a request whose load failed never serves KV from those slots: it fails (profile: SGLang aborts "
    "it) or recomputes; an engine abort of any other request is still INV-RP-5",
    "INV-LINK-5": "an offload's source slots hold the same bytes from the time it is queued until its result is "
    "taken: the cache keeps its pages locked until then",
    "INV-LINK-6": "results are taken in the order offloads were queued, never more than were published; a node is "
    "marked stored only when an offload of all its pages succeeded (or its pages were loaded back whole)",
    "INV-LINK-7": "every offload queued is resolved: its result taken, or the cache reset; a reset leaves no claim, "
    "queued load or offload behind",
}

FAULTS = ("load_fail", "load_refuse", "offload_fail", "offload_refuse", "offload_hold", "drop")
"""What the harness's store does on the trace's cue (`LinkerFault`): fail the next started load batch (some of its
bytes land torn), refuse the next load, fail one page of the next offload, refuse the next offload, hold the next
offload's completion for a few scheduler steps, lose its oldest unclaimed page now (capacity, an external
eviction)."""


@dataclass
class Offload:
    """One offload the cache queued: its page keys and source slots, in queue order."""

    id: int
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    result: Optional[bool] = None
    """Published: None while in flight."""


@dataclass
class LinkerLedger:
    """The calls between a cache and its linker, judged as they happen (RULES). Violations collect in `found`."""

    page_size: int
    found: list[Violation] = field(default_factory=list)
    lookups: dict[str, tuple[tuple[str, ...], frozenset[int]]] = field(default_factory=dict)
    """rid -> (the keys its last lookup asked about, the page counts the linker reported restorable)."""
    queued: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = field(default_factory=dict)
    """Loads queued and not started: rid -> (keys, slots)."""
    started: Optional[tuple[int, dict[str, tuple[tuple[str, ...], tuple[int, ...]]]]] = None
    """The batch started with loads in it and not finished: (its index, its loads)."""
    failed: set[str] = field(default_factory=set)
    """Requests whose load failed: the engine may fail them (INV-LINK-4)."""
    offloads: list[Offload] = field(default_factory=list)
    """Offloads whose result was not taken, in queue order."""
    stored: set[str] = field(default_factory=set)
    """Page keys some offload stored with success, or some load restored whole."""
    next_offload: int = 0

    def _bad(self, inv: str, message: str) -> None:
        self.found.append(Violation(inv, message))

    # ------------------------------------------------------------------ loads

    def lookup(self, rid: str, keys: Sequence[str], restorable: Collection[int]) -> None:
        self.lookups[rid] = (tuple(keys), frozenset(int(n) for n in restorable))

    def load(
        self, rid: str, keys: Sequence[str], slots: Sequence[int], free: Collection[int], cached: Collection[int]
    ) -> None:
        """The cache queues a load; `free` and `cached` are the allocator's free slots and the tree's slots now."""
        keys, slots = tuple(keys), tuple(int(s) for s in slots)
        said = self.lookups.pop(rid, None)
        if said is None:
            self._bad("INV-LINK-1", f"request {rid} loads {len(keys)} pages with no lookup of its own before")
        elif keys != said[0][: len(keys)] or len(keys) not in said[1]:
            self._bad(
                "INV-LINK-1",
                f"request {rid} loads {len(keys)} pages; its lookup reported {sorted(said[1]) or 'none'} restorable "
                + ("" if keys == said[0][: len(keys)] else "under other keys"),
            )
        self._private(rid, slots, len(keys), free, cached)
        if rid in self.queued or (self.started is not None and rid in self.started[1]):
            self._bad("INV-LINK-2", f"request {rid} queues a second load while its first is not finished")
        self.queued[rid] = (keys, slots)

    def _private(
        self, rid: str, slots: tuple[int, ...], pages: int, free: Collection[int], cached: Collection[int]
    ) -> None:
        if len(slots) != pages * self.page_size or len(set(slots)) != len(slots):
            self._bad("INV-LINK-2", f"request {rid}'s load of {pages} pages targets {len(slots)} slots, not one "
                      "distinct slot per token")  # fmt: skip
        shared = sorted(set(slots) & (set(free) | set(cached)))
        others = {s for r, (_, sl) in self.queued.items() if r != rid for s in sl}
        if self.started is not None:
            others |= {s for r, (_, sl) in self.started[1].items() if r != rid for s in sl}
        shared += sorted(set(slots) & others)
        if shared:
            self._bad("INV-LINK-2", f"request {rid}'s load writes slots {shared[:4]} that are free, cached in the "
                      "tree or another load's: another request's KV would be overwritten")  # fmt: skip

    def cancel(self, rid: str, cancelled: bool) -> None:
        if cancelled:
            self.queued.pop(rid, None)

    def start(self, index: int, free: Collection[int], cached: Collection[int]) -> None:
        """A batch starts: its queued loads are copied now. Their slots must still be private (INV-LINK-2/3)."""
        if self.started is not None:
            self._bad("INV-LINK-3", f"batch {index} starts while batch {self.started[0]}'s loads were never finished")
            self.started = None
        for rid, (_keys, slots) in self.queued.items():
            freed = sorted(set(slots) & set(free))
            if freed:
                self._bad("INV-LINK-3", f"request {rid}'s queued load starts into slots {freed[:4]} freed since it "
                          "was queued: it was not cancelled when its request let them go")  # fmt: skip
            taken = sorted(set(slots) & set(cached))
            if taken:
                self._bad("INV-LINK-2", f"request {rid}'s load starts into slots {taken[:4]} the tree holds")
        if self.queued:
            self.started, self.queued = (index, self.queued), {}

    def finish(self, index: int, landed: bool) -> set[str]:
        """The cache finishes batch `index`; returns the requests whose load failed in it."""
        if self.started is None or self.started[0] != index:
            self._bad("INV-LINK-3", f"batch {index} is finished and no batch with loads is in flight under it")
            return set()
        loads, self.started = self.started[1], None
        if landed:
            self.stored |= {k for keys, _ in loads.values() for k in keys}
            return set()
        self.failed |= set(loads)
        return set(loads)

    # ------------------------------------------------------------------ offloads

    def offload(self, keys: Sequence[str], slots: Sequence[int]) -> Offload:
        off = Offload(self.next_offload, tuple(keys), tuple(int(s) for s in slots))
        self.next_offload += 1
        self.offloads.append(off)
        return off

    def published(self, off: Offload, success: bool) -> None:
        off.result = success

    def taken(self) -> Optional[Offload]:
        """The cache takes the oldest published result (INV-LINK-6)."""
        if not self.offloads or self.offloads[0].result is None:
            self._bad("INV-LINK-6", "the cache takes an offload result that was not published")
            return None
        off = self.offloads.pop(0)
        if off.result:
            self.stored |= set(off.keys)
        return off

    def marks(self, node: str, keys: Sequence[str]) -> None:
        """The cache holds node `node`, whose pages are `keys`, marked stored in the external store (INV-LINK-6)."""
        missing = [k for k in keys if k not in self.stored]
        if missing:
            self._bad("INV-LINK-6", f"node {node} is marked stored, and {len(missing)} of its {len(keys)} pages were "
                      "never stored by an offload that succeeded nor loaded back whole")  # fmt: skip

    def reset(self) -> None:
        """The cache resets its linker: nothing it queued is owed any more."""
        self.lookups.clear()
        self.queued.clear()
        self.started = None
        self.offloads.clear()

    def idle(self, pending: int) -> None:
        """Nothing is in flight on the cache's side (no request): INV-LINK-7 once the linker published everything."""
        if self.queued or self.started is not None:
            self._bad("INV-LINK-7", "the engine is idle with a load queued or a batch unfinished")
        if pending == 0 and self.offloads:
            self._bad("INV-LINK-7", f"the engine is idle with {len(self.offloads)} offload results published and "
                      "never taken: their pages stay locked on the device")  # fmt: skip


def check_pinned(off: Offload, queued: Sequence[bytes], now: Sequence[bytes]) -> list[Violation]:
    """INV-LINK-5: `off`'s source slots read `now` what they held when it was queued."""
    bad = next((i for i, (a, b) in enumerate(zip(queued, now)) if a != b), None)
    if bad is None and len(queued) == len(now):
        return []
    slot = off.slots[bad] if bad is not None else "?"
    return [Violation("INV-LINK-5", f"offload {off.id}'s source slot {slot} changed before its result was taken: "
                      "the store would keep other KV under its key")]  # fmt: skip
