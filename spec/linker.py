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

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvcert.spec.invariants import Violation

__all__ = ["FAULTS", "RULES", "LinkerLedger", "LinkerSide", "Offload", "check_pinned"]

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
    "INV-LINK-7": "every load and offload queued is resolved: once no request is left, no load is queued and no "
    "batch unfinished; an offload stays a pending copy of its locked node until its result is taken (INV-LIVE-1 once "
    "the client is done); a reset leaves no claim, queued load or offload behind",
    "INV-LINK-8": "(linker) a lookup reports only prefix lengths whose every page is resident in the store and claimed "
    "for that request's current attempt: a hint, a page still being fetched or stored, an older attempt's claim is "
    "never a hit",
    "INV-LINK-9": "(linker) offload results are published in queue order, each once every object of its offload "
    "completed, success iff the store stored every object of it",
    "INV-LINK-10": "(linker) a load batch completes its layer counter only once every byte landed (the slots hold "
    "what was offloaded under those keys); a batch with a failed object fails the counter instead; either happens "
    "within the store's operation timeout, and the batch is published once with its requests",
    "INV-LINK-11": "(linker) a deadline, a stale hint, a dead peer or a capacity eviction gives a smaller confirmed "
    "prefix or a miss, never a hang: a preparation is ready once its deadline passed",
    "INV-LINK-12": "(linker) every claim the store holds belongs to a live preparation of an open request's current "
    "attempt or to a load not finished; once nothing is in flight and no request is open, no claim, late operation, "
    "abandoned or in-flight byte is left (snapshot_stats)",
    "INV-LINK-13": "(linker) take_removed_page_hashes yields the event hash of every page the store reported evicted "
    "since the last call, in order, and nothing else",
    "INV-LINK-14": "(linker) a reset or close that cannot prove the store quiescent (operations in flight, or a close "
    "that failed) quarantines the store and its DRAM: never reused, the new store's DRAM disjoint from it; a "
    "quiescent one is closed; nothing queued before a reset is published after it",
}

FAULTS = ("load_fail", "load_refuse", "offload_fail", "offload_refuse", "offload_hold", "drop", "corrupt", "truncate")
"""What the trace may cue a linker's store to do (`LinkerFault`): fail the next started load batch (some of its
bytes land torn), refuse the next load, fail one page of the next offload, refuse the next offload, hold the next
offload's completion for a few scheduler steps, lose its oldest unclaimed page now (capacity, an external
eviction); damage one page the next load batch reads, at rest: a byte flipped (`corrupt`) or the page cut short
(`truncate`). A target maps each kind onto its own store and declares the kinds it takes; a correct linker reports
a batch over a damaged page failed, and never raises into the scheduler."""


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

    def idle(self) -> None:
        """No request is left on the cache's side (INV-LINK-7): no load may be queued or a batch unfinished, since
        every load belongs to a request. An offload left unresolved shows as a pending copy once the client is done
        (the request harness's INV-LIVE-1)."""
        if self.queued or self.started is not None:
            self._bad("INV-LINK-7", "no request is left, and a load is still queued or a batch unfinished")


def check_pinned(off: Offload, queued: Sequence[bytes], now: Sequence[bytes]) -> list[Violation]:
    """INV-LINK-5: `off`'s source slots read `now` what they held when it was queued."""
    bad = next((i for i, (a, b) in enumerate(zip(queued, now)) if a != b), None)
    if bad is None and len(queued) == len(now):
        return []
    slot = off.slots[bad] if bad is not None else "?"
    return [Violation("INV-LINK-5", f"offload {off.id}'s source slot {slot} changed before its result was taken: "
                      "the store would keep other KV under its key")]  # fmt: skip


# --------------------------------------------------------------------------- the linker's side (INV-LINK-8..14)


@dataclass
class _Queued:
    """One offload the linker accepted: the objects it owes the store, and what the store did with each."""

    id: int
    owed: list[str]
    """Object keys not yet seen in a store operation."""
    ops: set[int] = field(default_factory=set)
    results: dict[str, bool] = field(default_factory=dict)
    open_ops: set[int] = field(default_factory=set)


@dataclass
class LinkerSide:
    """A linker judged by what its store did (INV-LINK-8..14): the walk reports the linker's answers and the
    store's facts (which objects it stored, claimed, evicted; which operations are in flight), this judges them.
    Keys are opaque strings; violations collect in `found`."""

    found: list[Violation] = field(default_factory=list)
    queued: list[_Queued] = field(default_factory=list)
    """Offloads accepted and not published, in queue order."""
    ops: dict[int, _Queued] = field(default_factory=dict)
    next_id: int = 0
    removed: list[int] = field(default_factory=list)
    """Event hashes of evictions the store announced and the linker has not yielded yet."""

    def _bad(self, inv: str, message: str) -> None:
        self.found.append(Violation(inv, message))

    def lookup(self, rid: str, asked: int, reported: Sequence[int], confirmed: int) -> None:
        """The linker answered `reported` for `asked` pages; the store holds the first `confirmed` resident and
        claimed for this attempt (INV-LINK-8)."""
        bad = [n for n in reported if not 1 <= n <= min(asked, confirmed)]
        if bad:
            self._bad("INV-LINK-8", f"lookup of {rid} reports {sorted(reported)} of {asked} pages; only the first "
                      f"{confirmed} are resident and claimed for it: a load of {max(bad)} would read pages it does "
                      "not hold")  # fmt: skip

    def offload(self, keys: Sequence[str]) -> None:
        self.queued.append(_Queued(self.next_id, list(keys)))
        self.next_id += 1

    def submitted(self, op: int, keys: Sequence[str]) -> None:
        """The store received write `op` of `keys`: it belongs to the oldest offload that still owes them."""
        for q in self.queued:
            if all(k in q.owed for k in keys):
                for k in keys:
                    q.owed.remove(k)
                q.ops.add(op)
                q.open_ops.add(op)
                self.ops[op] = q
                return
        self._bad("INV-LINK-9", f"the store was asked to write {len(keys)} objects no queued offload owes")

    def stored(self, op: int, results: Mapping[str, bool]) -> None:
        q = self.ops.pop(op, None)
        if q is not None:
            q.open_ops.discard(op)
            q.results.update(results)

    def published(self, success: bool) -> None:
        """The linker hands over its next offload result (INV-LINK-9)."""
        if not self.queued:
            self._bad("INV-LINK-9", "an offload result is published with no offload queued")
            return
        q = self.queued.pop(0)
        if q.open_ops:
            self._bad("INV-LINK-9", f"offload {q.id}'s result is published while {len(q.open_ops)} of its writes are "
                      "still in flight: results out of queue order or early")  # fmt: skip
        want = not q.owed and not q.open_ops and all(q.results.values())
        if success and not want:
            self._bad("INV-LINK-9", f"offload {q.id} is published stored, and the store did not store every object of "
                      "it: the cache would mark pages stored that a later lookup cannot restore")  # fmt: skip
        if not success and want and q.results:
            self._bad("INV-LINK-9", f"offload {q.id} is published failed, and the store stored every object of it "
                      "(a result of another offload?)")  # fmt: skip

    def load(self, batch: int, completed: bool, failed_objects: int, wrong: Sequence[str]) -> None:
        """Batch `batch`'s counter `completed` (else failed); the store failed `failed_objects` of its objects, and
        the slots of pages `wrong` do not hold what was offloaded (INV-LINK-10)."""
        if completed and failed_objects:
            self._bad("INV-LINK-10", f"load batch {batch} completes its layer counter although the store failed "
                      f"{failed_objects} of its objects: the forward reads uncertain KV")  # fmt: skip
        elif completed and wrong:
            self._bad("INV-LINK-10", f"load batch {batch} completes its layer counter before every byte landed: "
                      f"pages {list(wrong)[:3]} do not hold what was offloaded (wrong KV)")  # fmt: skip

    def hung(self, what: str) -> None:
        self._bad("INV-LINK-10" if what.startswith("load") else "INV-LINK-11", f"{what} never resolves: the "
                  "scheduler would wait forever")  # fmt: skip

    def stray_claims(self, stray: Sequence[str]) -> None:
        if stray:
            self._bad("INV-LINK-12", f"the store holds {len(stray)} claims no open request's preparation or "
                      f"unfinished load owns ({stray[0]}): they pin pages forever")  # fmt: skip

    def idle(self, stats: Mapping[str, float], store_claims: int) -> None:
        """Nothing is in flight and no request is open (INV-LINK-12)."""
        left = {k: stats.get(k, 0) for k in ("outstanding_claims", "abandoned_bytes", "prepare_inflight_bytes",
                                             "offload_inflight_bytes", "kvcr_pending_ops", "preparations_tracked")}  # fmt: skip
        left = {k: v for k, v in left.items() if v}
        if store_claims:
            left["claims held in the store"] = store_claims
        if left:
            self._bad("INV-LINK-12", f"the linker is idle and still accounts {left}: late work never drained")

    def evicted(self, hashes: Sequence[int]) -> None:
        self.removed.extend(hashes)

    def taken_removed(self, got: Sequence[int]) -> None:
        want, self.removed = self.removed, []
        if list(got) != want:
            self._bad("INV-LINK-13", f"take_removed_page_hashes yields {len(got)} hashes, the store evicted "
                      f"{len(want)} pages since the last call: the router keeps routing to pages that are gone"
                      if len(got) != len(want) else "take_removed_page_hashes yields other hashes or another order "
                      "than the store's evictions")  # fmt: skip

    def reset(self, in_flight: int, closed: bool, quarantined: bool, dram_shared: bool) -> None:
        """A reset (or close) of a store with `in_flight` operations (INV-LINK-14)."""
        if in_flight and not quarantined:
            self._bad("INV-LINK-14", f"a reset with {in_flight} store operations in flight does not quarantine the "
                      "store: late copies land in memory that is reused")  # fmt: skip
        if not in_flight and not closed and not quarantined:
            self._bad("INV-LINK-14", "a quiescent store is neither closed nor quarantined at reset")
        if dram_shared:
            self._bad("INV-LINK-14", "the new store's DRAM overlaps a quarantined store's: late copies overwrite it")
        self.queued.clear()
        self.ops.clear()
