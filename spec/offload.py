# Over 600 lines: the offload tier's core rules and both of vLLM's policies they pin (LRU, ARC), each a model and its CrossHair contracts over one shared key state; split, the rules would read a state defined elsewhere.
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
from collections.abc import Callable, Sequence
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
    "ArcLists",
    "StoreOutcome",
    "arc_victims",
    "check_capacity",
    "check_events",
    "check_kv",
    "check_load",
    "check_lookup",
    "check_store",
    "check_usage",
    "content",
    "ghost_target",
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
    "INV-OFF-ARC-1": "(profile, arc) the evicted keys are ARC's victims, in order (arc_victims): while T1 holds at least "
    "int(target) keys (its keys being written or pinned counted, its victims so far not) the least recent evictable "
    "T1 key, else T2's, else T1's; a T1 victim becomes B1's newest ghost, a T2 victim B2's, each ghost list then "
    "trimmed to num_chunks oldest first. An insert is T1's newest key and drops its ghost; a reuse moves a key to "
    "T2's newest: a touch of a ready key (pinned too; a touch takes its keys last to first) and a request's finish "
    "for each key it loaded or found ready at a store, unless it had inserted that key itself before; a touch of a "
    "key being written, and a finish for a key the "
    "request only inserted, make it its list's newest; a ghost hit (a touch of an absent key, or a request's first "
    "store miss of it, threshold passed, even if the store then fails) raises target by max(1, |B2|/|B1|) to at most "
    "num_chunks (B1) or lowers it by max(1, |B1|/|B2|) to at least 0 (B2) and makes the ghost its list's newest; a "
    "failed store drops its key with no ghost; a reset empties all four lists and sets target to 0; a load, a "
    "completion and a lookup change nothing",
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


def arc_victims(
    t1: Sequence[Key], t2: Sequence[Key], target: float, evictable: Sequence[Key], n: int
) -> Optional[list[tuple[Key, bool]]]:
    """ARC's `n` victims as vLLM 0.32's `ARCCachePolicy.evict` picks them, each with whether it came from T1, or None
    when fewer than `n` keys are evictable. `t1` and `t2` run least recent first. While T1 (every key in it, evictable
    or not, less the victims already taken from it) holds at least `int(target)` keys, the next victim is T1's least
    recent evictable key, else T2's, else T1's; each list is scanned once, never from its start again.

    pre: len(set(t1)) == len(t1)
    pre: len(set(t2)) == len(t2)
    pre: not set(t1) & set(t2)
    pre: 0 <= target <= 1 << 20
    post: __return__ is None or len(__return__) == max(n, 0)
    post: __return__ is None or all(k in evictable and (k in t1) == first for k, first in __return__)
    post: __return__ is None or len({k for k, _ in __return__}) == len(__return__)
    post: (__return__ is None) == (n > len([k for k in [*t1, *t2] if k in evictable]))
    """
    ok = set(evictable)
    ones = [k for k in t1 if k in ok]
    twos = [k for k in t2 if k in ok]
    i = j = 0
    size = len(t1)
    out: list[tuple[Key, bool]] = []
    for _ in range(max(n, 0)):
        if size >= int(target) and i < len(ones):
            out.append((ones[i], True))
            i, size = i + 1, size - 1
        elif j < len(twos):
            out.append((twos[j], False))
            j += 1
        elif i < len(ones):
            out.append((ones[i], True))
            i, size = i + 1, size - 1
        else:
            return None
    return out


def ghost_target(target: float, b1: int, b2: int, in_b1: bool, capacity: int) -> float:
    """ARC's target T1 size after a ghost hit in B1 (`in_b1`: recency paid, T1 may grow) or in B2 (frequency paid, T1
    shrinks), with `b1` and `b2` ghosts: by max(1, the other list over this one), within [0, capacity].

    pre: 0 <= target <= capacity <= 1 << 20
    pre: b1 >= 1 if in_b1 else b2 >= 1
    pre: 0 <= b1 <= capacity and 0 <= b2 <= capacity
    post: 0 <= __return__ <= capacity
    post: __return__ >= target if in_b1 else __return__ <= target
    post: __return__ != target or target in (0, capacity)
    """
    if in_b1:
        return min(target + max(1, b2 / b1), capacity)
    return max(target - max(1, b1 / b2), 0)


@dataclass
class ArcLists:
    """vLLM 0.32's ARC state (`ARCCachePolicy`): T1 (keys inserted and not reused since), T2 (keys reused), ghost lists
    B1 and B2 (keys evicted from T1 and T2), each least recent first, and the target size of T1. Kept by key: the
    owner knows which present keys are ready."""

    capacity: int
    t1: list[Key] = field(default_factory=list)
    t2: list[Key] = field(default_factory=list)
    b1: list[Key] = field(default_factory=list)
    b2: list[Key] = field(default_factory=list)
    target: float = 0.0
    hits: int = 0
    """Ghost hits so far (for counting what a run reached)."""

    @staticmethod
    def _newest(keys: list[Key], key: Key) -> None:
        keys.remove(key)
        keys.append(key)

    def ghost_hit(self, key: Key) -> None:
        """An access to an absent key: a ghost in B1 or B2 moves the target and becomes its list's newest."""
        for ghosts, in_b1 in ((self.b1, True), (self.b2, False)):
            if key in ghosts:
                self.target = ghost_target(self.target, len(self.b1), len(self.b2), in_b1, self.capacity)
                self._newest(ghosts, key)
                self.hits += 1
                return

    def insert(self, key: Key) -> None:
        self.t1.append(key)
        for ghosts in (self.b1, self.b2):
            if key in ghosts:
                ghosts.remove(key)

    def remove(self, key: Key) -> None:
        """A failed store: the key leaves its list and leaves no ghost."""
        for keys in (self.t1, self.t2):
            if key in keys:
                keys.remove(key)
                return

    def evicted(self, keys: Sequence[Key]) -> None:
        """Victims go to their list's ghost list; both ghost lists are then trimmed to the capacity, oldest first."""
        for k in keys:
            if k in self.t1:
                self.t1.remove(k)
                self.b1.append(k)
            elif k in self.t2:
                self.t2.remove(k)
                self.b2.append(k)
        if keys:
            for ghosts in (self.b1, self.b2):
                del ghosts[: max(0, len(ghosts) - self.capacity)]

    def touch(self, keys: Sequence[Key], ready: Callable[[Key], bool]) -> None:
        """A touch, last key first: a ready T1 key is reused (to T2), a T1 key being written only becomes T1's newest,
        a T2 key T2's newest, an absent key a ghost hit."""
        for k in reversed(keys):
            if k in self.t1:
                self.t1.remove(k)
                (self.t2 if ready(k) else self.t1).append(k)
            elif k in self.t2:
                self._newest(self.t2, k)
            else:
                self.ghost_hit(k)

    def finish(self, order: Sequence[Key], inserted_only: set[Key], reused: set[Key]) -> None:
        """A request's finish, last key first: a key it only inserted becomes its list's newest (a store is not a
        reuse), a key it reused moves to T2's newest; the rest are left alone."""
        for k in reversed(order):
            if k in inserted_only:
                for keys in (self.t1, self.t2):
                    if k in keys:
                        self._newest(keys, k)
                        break
            elif k in reused and k in self.t1:
                self.t1.remove(k)
                self.t2.append(k)
            elif k in reused and k in self.t2:
                self._newest(self.t2, k)

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target = 0.0

    def __str__(self) -> str:
        return f"T1 {self.t1}, T2 {self.t2}, B1 {self.b1}, B2 {self.b2}, target {self.target:g}"


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
    inserted: set[Key] = field(default_factory=set)
    """Keys its stores took (ARC: a store is not a reuse)."""
    reused: set[Key] = field(default_factory=set)
    """Keys it loaded or found ready at a store, unless it had inserted them first."""
    misses: set[Key] = field(default_factory=set)
    """Keys whose store miss ARC has seen for it (one ghost hit per key and request)."""


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
    arc: Optional[tuple[Key, ...]] = None
    """ARC's victims (None: not enough are evictable), and its lists when it picked them."""
    arc_state: str = ""

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
    arc: ArcLists = field(init=False)
    """ARC's lists, kept under either policy and judged under arc."""

    def __post_init__(self) -> None:
        self.arc = ArcLists(self.num_chunks)

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

    def _state(self, req: str) -> Access:
        """The request's accesses in this generation of the tier (a reset starts them over)."""
        state = self.requests.get(req)
        if state is None or state.generation != self.generation:
            state = self.requests[req] = Access(self.generation)
        return state

    def _access(self, req: str, keys: Sequence[Key], reused: Sequence[Key] = ()) -> None:
        state = self._state(req)
        for k in keys:
            if k not in state.seen:
                state.seen.append(k)
        state.reused.update(k for k in reused if k not in state.inserted)

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
        self.arc.finish(order, state.inserted - state.reused, state.reused)

    def touch(self, keys: Sequence[Key]) -> None:
        """A touch ranks its keys most recent, its first key most of all."""
        self._use(list(reversed(keys)))
        self.arc.touch(keys, lambda k: self.entries[k].ready)

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
        """A prepare_store's expectation. Like the tier, it counts the offer, lets ARC see the request's new store
        misses (each key once a request: a ghost hit moves ARC's target before the victims are picked) and notes the
        request's access, all before it knows whether the store fits."""
        if self.store_threshold >= 2:
            self._offered(asked)
        absent = [k for k in asked if k not in self.entries]
        new = [k for k in absent if self.store_threshold < 2 or self.counts.get(k, 0) >= self.store_threshold]
        ready = [k for k in asked if k in self.entries and self.entries[k].ready]
        state = self._state(req)
        misses = [k for k in new if k not in state.misses]
        for k in reversed(misses):
            self.arc.ghost_hit(k)
        state.misses.update(misses)
        self._access(req, [k for k in asked if k in new or k in ready], reused=ready)
        wanted = set(asked)
        candidates = [k for k, e in self.entries.items() if e.ready and e.pins == 0 and k not in wanted]
        need = shortfall(len(new), self.free())
        arc = arc_victims(self.arc.t1, self.arc.t2, self.arc.target, candidates, need) if need else []
        return Offer(
            tuple(asked),
            tuple(new),
            len(absent) - len(new),
            self.free(),
            tuple(candidates),
            tuple(self.ranks.get(k, 0) for k in candidates),
            None if arc is None else tuple(k for k, _ in arc),
            str(self.arc),
        )

    def apply_store(self, outcome: Optional[StoreOutcome], req: Optional[str] = None) -> None:
        """Take the tier's report: its evictions, then its new keys (writing, most recent; the inserts of `req`) in
        their chunks."""
        if outcome is None:
            return
        for k in outcome.evicted:
            self.entries.pop(k, None)
            self.ranks.pop(k, None)
        self.arc.evicted(outcome.evicted)
        if outcome.evicted:
            self.events.append((True, tuple(outcome.evicted)))
        for k, chunk in zip(outcome.stored, outcome.chunks):
            self.entries[k] = Entry(chunk)
            self._use([k])
            self.arc.insert(k)
            self.failed.discard(k)
        if req is not None:
            self._state(req).inserted.update(outcome.stored)

    def complete_store(self, keys: Sequence[Key], success: bool) -> list[Key]:
        """The keys still being written become ready (success) or absent (failure); returns them."""
        done = [k for k in keys if k in self.entries and not self.entries[k].ready]
        for k in done:
            if success:
                self.entries[k].ready = True
            else:
                del self.entries[k]
                self.ranks.pop(k, None)
                self.arc.remove(k)
                self.failed.add(k)
        if success and done:
            self.events.append((False, tuple(done)))
        return done

    def prepare_load(self, req: str, keys: Sequence[Key]) -> list[int]:
        """Pin ready keys for a load; returns the chunks it must name (INV-OFF-8). Not a use of them yet."""
        for k in keys:
            self.entries[k].pins += 1
        self._access(req, keys, reused=keys)
        return [self.entries[k].chunk for k in keys]

    def complete_load(self, keys: Sequence[Key]) -> None:
        for k in keys:
            if k in self.entries:
                self.entries[k].pins -= 1

    def reset(self) -> None:
        """Every key dropped and every chunk free, silently: the event queue and the threshold's tracker stay."""
        self.entries.clear()
        self.ranks.clear()
        self.arc.clear()
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
    """One prepare_store's report, before the model takes it (INV-OFF-2/3/4/5, and under vLLM's profile
    INV-OFF-LRU-1 under lru, INV-OFF-ARC-1 under arc)."""
    out = _store_fit(offer, outcome)
    if outcome is None:
        return out
    out += _store_keys(offer, outcome)
    out += _store_victims(model, offer, outcome)
    out += _store_chunks(model, outcome)
    if model.policy == "lru":
        out += _lru_order(offer, outcome)
    elif model.policy == "arc":
        out += _arc_order(offer, outcome)
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


def _arc_order(offer: Offer, outcome: StoreOutcome) -> list[Violation]:
    """(profile) vLLM's ARC: a victim from the other list, or promotion and adaptation skipped, is another engine.
    A store that should not have fit is INV-OFF-4's alone."""
    if offer.arc is None or list(outcome.evicted) == list(offer.arc):
        return []
    return [
        Violation(
            "INV-OFF-ARC-1",
            f"prepare_store evicted {list(outcome.evicted)}, ARC's victims are {list(offer.arc)} ({offer.arc_state})",
        )
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
