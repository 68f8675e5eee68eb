"""The contract of an offload host tier: a pool of `num_chunks` host chunks that a serving engine's scheduler fills
with copies of device KV blocks and reads back (vLLM's `OffloadingManager`, its CPU tier first).

The tier is seen only through its API, one key (a block hash and its KV-cache group) at a time. A key is *absent*,
*writing* (a store was prepared and not completed: its copy is in flight) or *ready* (its store completed with
success), and a ready key may be *pinned* by loads in flight. `OffloadModel` keeps that state, driven by what the
tier itself reports (which keys a store takes, which chunks it names, which keys it evicts), and checks each report
against the rules below before taking it. The model's keys are small ints; a target maps them onto its own keys.

Rules marked (profile) pin the choices of one engine (`vllm-0.32`) that the core leaves open.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvcert.spec.invariants import Violation

__all__ = [
    "HIT",
    "HIT_PENDING",
    "MISS",
    "RULES",
    "Entry",
    "Offer",
    "OffloadModel",
    "StoreOutcome",
    "check_capacity",
    "check_events",
    "check_kv",
    "check_load",
    "check_lookup",
    "check_store",
    "check_usage",
    "content",
    "lru_victims",
    "shortfall",
]

Key = int
Event = tuple[bool, tuple[int, ...]]
"""(removed, keys): one event of the tier's stream; removed False is a store."""

HIT = "HIT"
HIT_PENDING = "HIT_PENDING"
MISS = "MISS"

RULES: dict[str, str] = {
    "INV-OFF-1": "lookup is the model's: HIT iff the key's store completed with success and it was not evicted or "
    "reset since, HIT_PENDING iff a store of it is prepared and not completed, MISS otherwise (never RETRY)",
    "INV-OFF-2": "prepare_store stores exactly the asked keys that are absent (and, with store_threshold t >= 2, "
    "offered t times in the tracker), in the asked order, each once",
    "INV-OFF-3": "prepare_store evicts only ready keys no load pins and that it was not asked to store, each once, "
    "and drops no key it does not report",
    "INV-OFF-4": "prepare_store returns None iff the new keys exceed the free chunks plus the evictable ones it was "
    "not asked to store; otherwise it evicts exactly the shortfall (new keys - free chunks, if positive)",
    "INV-OFF-5": "a store names one chunk per stored key, distinct, in [0, num_chunks), held by no other present "
    "key: present keys <= num_chunks, every present key one chunk, no chunk owned twice",
    "INV-OFF-6": "the tier's occupancy (get_stats): chunks in use = keys being written + pinned ready keys, write "
    "usage = keys being written, stores skipped = new keys the threshold held back",
    "INV-OFF-7": "complete_store(success=True) makes the keys still being written ready; success=False drops them "
    "(MISS) and frees their chunks",
    "INV-OFF-8": "prepare_load names exactly the chunks the keys were stored in, in key order, and pins them until "
    "as many complete_loads",
    "INV-OFF-9": "every chunk a load names holds its key's KV when the load is prepared and when it completes",
    "INV-OFF-10": "take_events yields, in order, a stored event for the keys each successful complete_store made "
    "ready and a removed event for the keys each prepare_store evicted, nothing else (a failed store and "
    "reset_cache add none; reset_cache keeps the queue)",
    "INV-OFF-LRU-1": "(profile, lru) the evicted keys are the shortfall's count of least recently used candidates, "
    "oldest first; use is an insert, a touch (its first key ends most recent) and a request's finish (the keys it "
    "stored or loaded, its first key most recent); a load, a completion and a lookup are not uses",
}
"""Every rule of the tier, by stable ID: what a certificate prints."""


def content(key: Key) -> bytes:
    """The KV the harness's copy engine writes for `key`: a function of the key alone, so a chunk read back under
    another key (a slot restored from the wrong place) never matches.

    post: len(__return__) == 16
    """
    return hashlib.blake2b(b"kvcert-offload-v1\x00" + str(key).encode(), digest_size=16).digest()


def shortfall(new: int, free: int) -> int:
    """Chunks a store of `new` keys must evict when `free` are free: evicting more wastes ready copies.

    post: __return__ >= 0
    post: __return__ >= new - free
    post: __return__ == 0 or __return__ == new - free
    """
    return max(0, new - free)


def lru_victims(candidates: Sequence[Key], ranks: Sequence[int], n: int) -> list[Key]:
    """The `n` candidates of lowest rank, lowest first: LRU's victims (ranks distinct, one per candidate).

    pre: len(candidates) == len(ranks)
    pre: len(set(ranks)) == len(ranks)
    post: len(__return__) == min(max(n, 0), len(candidates))
    post: all(k in candidates for k in __return__)
    """
    order = sorted(range(len(candidates)), key=lambda i: ranks[i])
    return [candidates[i] for i in order[: max(n, 0)]]


@dataclass
class Entry:
    """A present key: the chunk its store named, whether its copy is in, and the loads that pin it."""

    chunk: int
    ready: bool = False
    pins: int = 0


@dataclass
class Access:
    """What a request has stored or loaded, in first-seen order, for the recency its finish gives: a tier reset
    starts it over (the tier forgets a request's accesses with its chunks)."""

    generation: int
    seen: list[Key] = field(default_factory=list)
    finished: bool = False


@dataclass(frozen=True)
class StoreOutcome:
    """What a prepare_store reported when it did not return None."""

    stored: tuple[Key, ...]
    chunks: tuple[int, ...]
    evicted: tuple[Key, ...]


@dataclass(frozen=True)
class Offer:
    """The model's expectation for one prepare_store, fixed before the tier answers."""

    asked: tuple[Key, ...]
    new: tuple[Key, ...]
    """keys_to_store as the rules require it."""
    held: int
    """Absent keys the threshold held back."""
    free: int
    candidates: tuple[Key, ...]
    """Ready keys no load pins and not asked: what may be evicted."""
    ranks: tuple[int, ...]
    """Each candidate's LRU rank (larger is more recent)."""

    @property
    def need(self) -> int:
        return shortfall(len(self.new), self.free)

    @property
    def fits(self) -> bool:
        return self.need <= len(self.candidates)


@dataclass
class OffloadModel:
    """The observable state of an offload host tier, and what it must answer next."""

    num_chunks: int
    policy: str = "lru"
    store_threshold: int = 1
    max_tracker_size: int = 64_000
    groups: int = 1
    """KV-cache groups: key `k` is in group `k % groups` (a request's keys finish group by group)."""
    entries: dict[Key, Entry] = field(default_factory=dict)
    ranks: dict[Key, int] = field(default_factory=dict)
    """LRU recency of every present key: the rank of its last use."""
    next_rank: int = 0
    counts: dict[Key, int] = field(default_factory=dict)
    """store_threshold >= 2: offers per key, oldest first (a bounded tracker that a reset does not clear)."""
    events: list[Event] = field(default_factory=list)
    """Events the tier owes since the last take_events."""
    requests: dict[str, Access] = field(default_factory=dict)
    generation: int = 0
    failed: set[Key] = field(default_factory=set)
    """Keys whose last store failed (for counting what a run reached)."""

    # ----------------------------------------------------------------- queries

    def lookup(self, key: Key) -> str:
        """What lookup must answer (INV-OFF-1)."""
        entry = self.entries.get(key)
        if entry is None:
            return MISS
        return HIT if entry.ready else HIT_PENDING

    def free(self) -> int:
        return self.num_chunks - len(self.entries)

    def writing(self) -> int:
        return sum(1 for e in self.entries.values() if not e.ready)

    def pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.ready and e.pins > 0)

    # ----------------------------------------------------------------- recency

    def _use(self, keys: Sequence[Key]) -> None:
        """Make `keys` the most recent present keys, the last one most recent."""
        for k in keys:
            if k in self.entries:
                self.next_rank += 1
                self.ranks[k] = self.next_rank

    def _access(self, req: str, keys: Sequence[Key]) -> None:
        state = self.requests.get(req)
        if state is None or state.generation != self.generation:
            state = self.requests[req] = Access(self.generation)
        for k in keys:
            if k not in state.seen:
                state.seen.append(k)

    # ----------------------------------------------------------------- operations

    def open(self, req: str) -> None:
        self.requests[req] = Access(self.generation)

    def finish(self, req: str) -> None:
        """A request's finish is one use of every key it stored or loaded: group by group, each in first-seen order,
        its first key ending most recent."""
        state = self.requests.get(req)
        if state is None or state.generation != self.generation or state.finished:
            return
        state.finished = True
        order = sorted(state.seen, key=lambda k: k % max(self.groups, 1))
        self._use(list(reversed(order)))

    def touch(self, keys: Sequence[Key]) -> None:
        """A touch ranks its keys most recent, its first key most of all."""
        self._use(list(reversed(keys)))

    def _offered(self, keys: Sequence[Key]) -> None:
        """Count an offer in the tracker: known keys move to its newest end, new ones enter it, the oldest key not
        in this offer leaving when it is full."""
        seen = [k for k in keys if k in self.counts]
        for k in seen:
            self.counts[k] = self.counts.pop(k) + 1
        unprotected = len(self.counts) - len(set(seen))
        for k in keys:
            if k in self.counts:
                continue
            if len(self.counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                del self.counts[next(iter(self.counts))]
                unprotected -= 1
            self.counts[k] = 1

    def offer(self, req: str, asked: Sequence[Key]) -> Offer:
        """A prepare_store's expectation. Like the tier, it counts the offer and notes the request's access before
        it knows whether the store fits."""
        if self.store_threshold >= 2:
            self._offered(asked)
        absent = [k for k in asked if k not in self.entries]
        new = [k for k in absent if self.store_threshold < 2 or self.counts.get(k, 0) >= self.store_threshold]
        ready = [k for k in asked if k in self.entries and self.entries[k].ready]
        self._access(req, [k for k in asked if k in new or k in ready])
        wanted = set(asked)
        candidates = [k for k, e in self.entries.items() if e.ready and e.pins == 0 and k not in wanted]
        return Offer(
            tuple(asked),
            tuple(new),
            len(absent) - len(new),
            self.free(),
            tuple(candidates),
            tuple(self.ranks.get(k, 0) for k in candidates),
        )

    def apply_store(self, outcome: Optional[StoreOutcome]) -> None:
        """Take the tier's report: its evictions, then its new keys (writing, most recent) in their chunks."""
        if outcome is None:
            return
        for k in outcome.evicted:
            self.entries.pop(k, None)
            self.ranks.pop(k, None)
        if outcome.evicted:
            self.events.append((True, tuple(outcome.evicted)))
        for k, chunk in zip(outcome.stored, outcome.chunks):
            self.entries[k] = Entry(chunk)
            self._use([k])
            self.failed.discard(k)

    def complete_store(self, keys: Sequence[Key], success: bool) -> list[Key]:
        """The keys still being written become ready (success) or absent (failure); returns them."""
        done = [k for k in keys if k in self.entries and not self.entries[k].ready]
        for k in done:
            if success:
                self.entries[k].ready = True
            else:
                del self.entries[k]
                self.ranks.pop(k, None)
                self.failed.add(k)
        if success and done:
            self.events.append((False, tuple(done)))
        return done

    def prepare_load(self, req: str, keys: Sequence[Key]) -> list[int]:
        """Pin ready keys for a load; returns the chunks it must name (INV-OFF-8). Not a use of them yet."""
        for k in keys:
            self.entries[k].pins += 1
        self._access(req, keys)
        return [self.entries[k].chunk for k in keys]

    def complete_load(self, keys: Sequence[Key]) -> None:
        for k in keys:
            if k in self.entries:
                self.entries[k].pins -= 1

    def reset(self) -> None:
        """Every key dropped and every chunk free, silently: the event queue and the threshold's tracker stay."""
        self.entries.clear()
        self.ranks.clear()
        self.next_rank = 0
        self.generation += 1

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out


# --------------------------------------------------------------------------- checkers


def check_lookup(model: OffloadModel, key: Key, got: str, rule: str = "INV-OFF-1") -> list[Violation]:
    """A lookup answer the model does not give is a scheduler told to wait for a copy that never comes (a pending
    answer after a failed store), to load one not yet written (a HIT before completion), or to recompute KV the tier
    holds."""
    want = model.lookup(key)
    if got == want:
        return []
    entry = model.entries.get(key)
    state = "absent" if entry is None else ("ready" if entry.ready else "being written")
    return [Violation(rule, f"lookup({key}) answered {got}, the key is {state}: {want} expected")]


def check_store(model: OffloadModel, offer: Offer, outcome: Optional[StoreOutcome]) -> list[Violation]:
    """One prepare_store's report, before the model takes it (INV-OFF-2/3/4/5, and INV-OFF-LRU-1 under lru)."""
    out = _store_fit(offer, outcome)
    if outcome is None:
        return out
    out += _store_keys(offer, outcome)
    out += _store_victims(model, offer, outcome)
    out += _store_chunks(model, outcome)
    if model.policy == "lru":
        out += _lru_order(offer, outcome)
    return out


def _store_fit(offer: Offer, outcome: Optional[StoreOutcome]) -> list[Violation]:
    """A store that fails where it fits loses an offload for nothing; one that goes on where it does not must have
    evicted something it may not."""
    room = f"{len(offer.new)} new key(s), {offer.free} free chunk(s), {len(offer.candidates)} evictable"
    if outcome is None:
        return [Violation("INV-OFF-4", f"prepare_store returned None with {room}")] if offer.fits else []
    if not offer.fits:
        return [Violation("INV-OFF-4", f"prepare_store stored {list(outcome.stored)} with {room}")]
    if len(outcome.evicted) != offer.need:
        return [Violation("INV-OFF-4", f"prepare_store evicted {len(outcome.evicted)} key(s) with {room}")]
    return []


def _store_keys(offer: Offer, outcome: StoreOutcome) -> list[Violation]:
    """A key stored twice takes two chunks for one copy; one skipped is KV the tier will not have."""
    if list(outcome.stored) == list(offer.new):
        return []
    return [
        Violation(
            "INV-OFF-2", f"prepare_store({list(offer.asked)}) stores {list(outcome.stored)}, {list(offer.new)} expected"
        )
    ]


def _store_victims(model: OffloadModel, offer: Offer, outcome: StoreOutcome) -> list[Violation]:
    """A victim being loaded is read after its chunk is reused; one being written completes into a reused chunk;
    one asked for is a block the caller was just told is cached."""
    out: list[Violation] = []
    if len(set(outcome.evicted)) != len(outcome.evicted):
        out.append(Violation("INV-OFF-3", f"prepare_store evicted a key twice: {list(outcome.evicted)}"))
    for k in outcome.evicted:
        entry = model.entries.get(k)
        why = ""
        if entry is None:
            why = "absent"
        elif not entry.ready:
            why = "being written"
        elif entry.pins > 0:
            why = f"pinned by {entry.pins} load(s) in flight"
        elif k in offer.asked:
            why = "one of the keys it was asked to store"
        if why:
            out.append(Violation("INV-OFF-3", f"prepare_store evicted key {k}, {why}"))
    return out


def _store_chunks(model: OffloadModel, outcome: StoreOutcome) -> list[Violation]:
    """A chunk named twice, out of the pool, or still another key's is two copies in one place."""
    out: list[Violation] = []
    chunks = list(outcome.chunks)
    if len(chunks) != len(outcome.stored):
        out.append(Violation("INV-OFF-5", f"{len(outcome.stored)} key(s) stored into {len(chunks)} chunk(s)"))
    if len(set(chunks)) != len(chunks):
        out.append(Violation("INV-OFF-5", f"a store names one chunk twice: {chunks}"))
    out += [
        Violation("INV-OFF-5", f"chunk {c} outside [0, {model.num_chunks})")
        for c in chunks
        if not 0 <= c < model.num_chunks
    ]
    gone = set(outcome.evicted)
    held = {e.chunk: k for k, e in model.entries.items() if k not in gone}
    out += [Violation("INV-OFF-5", f"chunk {c} is still key {held[c]}'s") for c in chunks if c in held]
    return out


def _lru_order(offer: Offer, outcome: StoreOutcome) -> list[Violation]:
    """(profile) vLLM's LRU evicts least recently used first: another order is another engine."""
    want = lru_victims(offer.candidates, offer.ranks, offer.need)
    if list(outcome.evicted) == want:
        return []
    return [
        Violation("INV-OFF-LRU-1", f"prepare_store evicted {list(outcome.evicted)}, the least recently used are {want}")
    ]


def check_capacity(model: OffloadModel) -> list[Violation]:
    """The pool the model holds from the tier's reports: more keys than chunks, or a chunk under two keys, is KV
    overwritten under a key that still claims it."""
    out: list[Violation] = []
    if len(model.entries) > model.num_chunks:
        out.append(Violation("INV-OFF-5", f"{len(model.entries)} keys present in {model.num_chunks} chunks"))
    owners: dict[int, Key] = {}
    for k, e in model.entries.items():
        if e.chunk in owners:
            out.append(Violation("INV-OFF-5", f"chunk {e.chunk} owned by keys {owners[e.chunk]} and {k}"))
        owners[e.chunk] = k
    return out


def check_usage(model: OffloadModel, used: int, writing: int, skipped: int, held: int) -> list[Violation]:
    """A chunk the tier counts in use that no key holds is a leak: the pool shrinks until every store fails."""
    out: list[Violation] = []
    want_used, want_writing = model.writing() + model.pinned(), model.writing()
    if used != want_used:
        out.append(
            Violation(
                "INV-OFF-6", f"{used} chunk(s) in use, {want_writing} being written + {model.pinned()} pinned expected"
            )
        )
    if writing != want_writing:
        out.append(Violation("INV-OFF-6", f"{writing} chunk(s) being written, {want_writing} expected"))
    if skipped != held:
        out.append(Violation("INV-OFF-6", f"{skipped} store(s) skipped, the threshold held back {held}"))
    return out


def check_load(model: OffloadModel, keys: Sequence[Key], chunks: Sequence[int], want: Sequence[int]) -> list[Violation]:
    """A load naming another chunk copies another block's KV into the request (INV-OFF-8)."""
    if list(chunks) == list(want):
        return []
    return [
        Violation(
            "INV-OFF-8", f"prepare_load({list(keys)}) names chunks {list(chunks)}, they were stored in {list(want)}"
        )
    ]


def check_kv(keys: Sequence[Key], chunks: Sequence[int], read: Sequence[Optional[bytes]], when: str) -> list[Violation]:
    """The bytes the copy engine reads are what the request gets: another key's, or a torn copy's, is wrong output."""
    out: list[Violation] = []
    for k, c, got in zip(keys, chunks, read):
        if got != content(k):
            what = "nothing" if got is None else "other bytes"
            out.append(Violation("INV-OFF-9", f"{when}: chunk {c} holds {what}, not key {k}'s KV"))
    return out


def check_events(want: Sequence[Event], got: Sequence[Event]) -> list[Violation]:
    """A removal missing keeps a router sending requests to KV that is gone; a store announced before (or without)
    its copy sends them to KV that never arrives."""
    if list(got) == list(want):
        return []
    return [Violation("INV-OFF-10", f"take_events yielded {list(got)}, {list(want)} expected")]
