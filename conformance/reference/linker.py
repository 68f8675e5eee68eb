"""The harness's external store behind a direct linker (SPEC.md §14): a correct linker in a faulty world.

`LinkerStore` is what an engine's linker class delegates to (SGLang's `UnifiedCacheLinker` subclass is
`conformance/adapters/sglang/linker.py`). It keeps pages by key with claims and a capacity, copies real bytes
between the engine's device slots and itself through the `read`/`write` callables it is given, publishes offload
results in queue order, and fails only on the trace's cue (`arm`, the `LinkerFault` op): a started load batch
that fails (half its pages land, the rest torn), a refused load or offload, an offload with one page failed, an
offload held for some scheduler steps, a page lost from the store. Time is the harness's: `tick()` is one
scheduler step. Every call the engine makes is judged by a `kvcert.spec.linker.LinkerLedger` on the way in.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvcert.spec.invariants import Violation
from kvcert.spec.linker import FAULTS, LinkerLedger, Offload, check_pinned

__all__ = ["HOLD_STEPS", "FaultCues", "LinkerStore"]

HOLD_STEPS = 3
"""Scheduler steps an `offload_hold` keeps the next offload in flight (others complete at the next step)."""

Read = Callable[[Sequence[int]], list[bytes]]
Write = Callable[[Sequence[int], Sequence[bytes]], None]


@dataclass
class FaultCues:
    """The faults a trace armed, each taken by the first call it is timed to. One of a kind at a time: faults piled
    up would starve every call of theirs. `log` says what fired, for a trace's reader."""

    kinds: tuple[str, ...] = FAULTS
    armed: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def check(self, kind: str) -> None:
        if kind not in self.kinds:
            raise ValueError(f"unknown linker fault {kind!r}; this store takes {self.kinds}")

    def arm(self, kind: str) -> None:
        self.check(kind)
        if kind not in self.armed:
            self.armed.append(kind)

    def take(self, kind: str) -> bool:
        if kind in self.armed:
            self.armed.remove(kind)
            self.log.append(kind)
            return True
        return False


@dataclass
class _InFlight:
    off: Offload
    queued: list[bytes]
    """Its source slots' bytes when it was queued (INV-LINK-5)."""
    due: int
    fail_page: Optional[int]


@dataclass
class LinkerStore:
    """Pages under their keys, claimed per request; loads and offloads in flight; faults armed by the trace."""

    page_size: int
    capacity: int
    """Pages the store holds at most: an offload past it evicts the oldest unclaimed page, or fails."""
    read: Read
    write: Write
    free_slots: Callable[[], Collection[int]]
    cached_slots: Callable[[], Collection[int]]
    ledger: LinkerLedger = field(init=False)
    pages: OrderedDict[str, list[bytes]] = field(default_factory=OrderedDict)
    """key -> one entry per token of the page, oldest use first."""
    claims: dict[str, set[str]] = field(default_factory=dict)
    """rid -> the keys its lookup claimed: they stay until its load starts or it is released."""
    cues: FaultCues = field(default_factory=FaultCues)
    loads: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = field(default_factory=dict)
    batches: dict[int, bool] = field(default_factory=dict)
    """Started batch -> whether every byte landed."""
    next_batch: int = 0
    inflight: list[_InFlight] = field(default_factory=list)
    results: list[_InFlight] = field(default_factory=list)
    """Published and not taken, oldest first."""
    now: int = 0
    reached: Counter[str] = field(default_factory=Counter)
    """What the engine's calls reached: hits, loads landed and failed, offloads stored and failed, pages lost."""

    def __post_init__(self) -> None:
        self.ledger = LinkerLedger(self.page_size)

    # ------------------------------------------------------------------ the trace's side

    def arm(self, kind: str) -> None:
        if kind == "drop":
            self.cues.check(kind)
            self._drop_oldest("dropped")
        else:
            self.cues.arm(kind)

    def _drop_oldest(self, why: str) -> bool:
        held = {k for keys in self.claims.values() for k in keys}
        victim = next((k for k in self.pages if k not in held), None)
        if victim is None:
            return False
        del self.pages[victim]
        self.cues.log.append(f"{why} {victim[:8]}")
        self.reached[f"page {why}"] += 1
        return True

    def tick(self) -> None:
        """One scheduler step passes: offloads that are due complete, and results publish in queue order."""
        self.now += 1
        for f in self.inflight:
            if f.due <= self.now and f.off.result is None:
                self._complete(f)
        while self.inflight and self.inflight[0].off.result is not None:
            self.results.append(self.inflight.pop(0))

    def violations(self) -> list[Violation]:
        found, self.ledger.found = self.ledger.found, []
        return found

    # ------------------------------------------------------------------ loads (the engine's calls)

    def lookup(self, rid: str, keys: Sequence[str]) -> list[int]:
        """Every restorable page count: the leading run of present keys, claimed for `rid` (its older claims go)."""
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        self.claims[rid] = set(keys[:n])
        out = list(range(1, n + 1))
        self.reached["lookup hit" if n else "lookup miss"] += 1
        self.ledger.lookup(rid, keys, out)
        return out

    def load(self, rid: str, keys: Sequence[str], slots: Sequence[int]) -> bool:
        self.ledger.load(rid, keys, slots, self.free_slots(), self.cached_slots())
        refused = self.cues.take("load_refuse")
        if refused or any(k not in self.claims.get(rid, ()) or k not in self.pages for k in keys):
            self.claims.pop(rid, None)  # a lookup-less load has no claim; a claimed page is never lost
            self.ledger.cancel(rid, True)
            self.reached["load refused"] += 1
            return False
        self.loads[rid] = (tuple(keys), tuple(int(s) for s in slots))
        self.reached["load queued"] += 1
        return True

    def cancel(self, rid: str) -> bool:
        cancelled = self.loads.pop(rid, None) is not None
        self.reached["load cancelled"] += cancelled
        self.ledger.cancel(rid, cancelled)
        self.claims.pop(rid, None)
        return cancelled

    def release(self, rid: str) -> None:
        self.claims.pop(rid, None)

    def start(self) -> int:
        """Copy every queued load into its slots now; a failed batch lands its first half and tears the rest."""
        index, self.next_batch = self.next_batch, self.next_batch + 1
        self.ledger.start(index, self.free_slots(), self.cached_slots())
        loads, self.loads = self.loads, {}
        # A page damaged at rest is caught by the store's own check of what it reads: the batch fails, as a load
        # failure does (a correct linker never serves it, nor raises).
        fail = bool(loads) and (self.cues.take("load_fail") | self.cues.take("corrupt") | self.cues.take("truncate"))
        for rid, (keys, slots) in loads.items():
            entries = [e for k in keys for e in self.pages[k]]
            if fail:
                half = len(keys) // 2 * self.page_size
                entries = entries[:half] + [bytes(len(e)) for e in entries[half:]]
            self.write(slots, entries)
            for k in keys:
                self.pages.move_to_end(k)
            self.claims.pop(rid, None)
        self.batches[index] = not fail
        if loads:
            self.reached["load batch failed" if fail else "load batch landed"] += 1
        return index

    def finish(self, index: int) -> bool:
        landed = self.batches.pop(index, True)
        self.ledger.finish(index, landed)
        return landed

    # ------------------------------------------------------------------ offloads (the engine's calls)

    def offload(self, keys: Sequence[str], slots: Sequence[int]) -> bool:
        if self.cues.take("offload_refuse"):
            self.reached["offload refused"] += 1
            return False
        off = self.ledger.offload(keys, slots)
        hold = HOLD_STEPS if self.cues.take("offload_hold") else 1
        fail = len(keys) // 2 if self.cues.take("offload_fail") else None
        self.inflight.append(_InFlight(off, self.read(off.slots), self.now + hold, fail))
        return True

    def _complete(self, f: _InFlight) -> None:
        """The copy out of the device happens now, as an asynchronous transfer would; all pages or no success."""
        now = self.read(f.off.slots)
        self.ledger.found += check_pinned(f.off, f.queued, now)
        ok = f.fail_page is None
        ps = self.page_size
        for i, key in enumerate(f.off.keys):
            if i == f.fail_page:
                continue
            if key not in self.pages and len(self.pages) >= self.capacity and not self._drop_oldest("evicted"):
                ok = False
                continue
            self.pages[key] = now[i * ps : (i + 1) * ps]
            self.pages.move_to_end(key)
        self.ledger.published(f.off, ok)
        self.reached["offload stored" if ok else "offload failed"] += 1

    def completed(self) -> int:
        return len(self.results)

    def pop(self) -> bool:
        """The oldest published result; its source slots must still hold what they held when it was queued."""
        self.ledger.taken()
        if not self.results:
            return False
        f = self.results.pop(0)
        self.ledger.found += check_pinned(f.off, f.queued, self.read(f.off.slots))
        return bool(f.off.result)

    def reset(self) -> None:
        """Quiesce: every in-flight copy completes (the host waits for it), then the store forgets everything."""
        self.reached["reset"] += 1
        self.reached["reset with offloads in flight"] += bool(self.inflight or self.results)
        for f in self.inflight:
            if f.off.result is None:
                self._complete(f)
        self.inflight.clear()
        self.results.clear()
        self.loads.clear()
        self.claims.clear()
        self.batches.clear()
        self.pages.clear()
        self.ledger.reset()

    def pending(self) -> int:
        """Offloads in flight or published and not taken."""
        return len(self.inflight) + len(self.results)
