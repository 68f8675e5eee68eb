# Over 600 lines: the state machine's rules, one per op kind, each read beside its neighbours; the generator's other parts live in draws, runner and queries.
"""The state machine: random traces over the op vocabulary, shrunk on failure.

Every rule only chooses an `Op`; `Harness.step` runs and checks it. The machine remembers the
last harness it built, so after Hypothesis has replayed a failing example, `last_trace()` is its
trace (then shrunk as a list of ops, `conformance.generation.shrink`).

Its rules run on Hypothesis's choices through `conformance.generation.runner` (one rule per step, drawn among
those whose preconditions hold, a swarm of rules off per example). Rules decide from the harness's
queries (`conformance.harness.queries`: positions a trace can name, a few counts), never from the
oracle's private state, and draw through `conformance.generation.draws`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from kvcert.conformance.backend import Factory
from kvcert.conformance.generation import interrupt
from kvcert.conformance.generation.determinism import StepDigest
from kvcert.conformance.generation.draws import MAX_PAGES, Draws, booleans, draws, integers, sampled_from, tokens_of
from kvcert.conformance.generation.race_rules import RaceRules
from kvcert.conformance.generation.runner import initialize, precondition, rule
from kvcert.conformance.generation.running_rules import RunningRules
from kvcert.conformance.harness.driver import Harness
from kvcert.spec.ops import (
    AbortPrefetch,
    Admit,
    CheckPrefetch,
    Complete,
    Discard,
    Evict,
    EvictHost,
    Fetch,
    InjectFault,
    Insert,
    LoadBack,
    Lock,
    Match,
    Op,
    Poll,
    Prefetch,
    Publish,
    RegisterRef,
    ReleaseRef,
    Restore,
    Retain,
    RetainWaiting,
    Retract,
    StorageFault,
    Unlock,
    UpdateRef,
)
from kvcert.spec.pages import page_ceil
from kvcert.spec.types import STORAGE_FAULTS, BadInput, CacheConfig, Capabilities, KVCertError

NAMESPACES: tuple[Optional[str], ...] = (None, "lora-a")
"""A fresh key's namespace, usually: the default one and a LoRA id."""
ODD_NAMESPACES: tuple[Optional[str], ...] = ("None", "", "lora-a\x00")
"""And one fresh key in four: names a cache that folds a namespace into a string or a truthiness test
confuses with the default (`str(None)`, `""`), or that a C string cuts short (SPEC.md §1)."""
SWARM_RULES = (
    "lock",
    "evict",
    "evict_host",
    "load_back",
    "publish",
    "pressure",
    "malformed",
    "alloc_fault",
    "copy_fault",
    "retract",
    "abort",
    "requests",
    "race",
)
"""Rules a storage run may switch off (swarm testing): with fewer kinds of step, each run goes
deeper into the ones it keeps (Groce et al., "Swarm Testing", ISSTA 2012)."""
SESSIONS = ("a", "b", "c", "d")
"""Session ids a priority run registers (SPEC.md §11): few, so they share paths and re-register."""
SCOPES = ((True, True), (True, False), (False, False))
"""Eviction scopes (allow_low, allow_high): a high-priority requester's, a low one's, the UNUSED tier only."""


@dataclass
class RunStats:
    """Steps executed across every example of a run (for steps/s)."""

    steps: int = 0
    examples: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    """Steps per op kind, plus "Prefetch>0" (prefetches that asked storage for something), "<Op>:error" (steps
    the backend rejected) and "<Op>:bad" (of those, rejected as bad input), "kv:entries" (KV entries read back
    and compared) and "namespace:named" (accepted ops in a namespace other than the default): what a run
    actually exercised."""
    digest: StepDigest = field(default_factory=StepDigest)
    """Every op the run's rules executed, in order: equal digests, same run (SPEC.md §3, INV-DET-1)."""
    on_example: Optional[Callable[[RunStats], None]] = None
    """Called as each example starts, with the counts so far: progress inside a cell."""


class CacheMachine(RunningRules, RaceRules):
    """Drives one backend per example; configured by `bind`. The running-request rule is `RunningRules`', the
    race-window rule `RaceRules`'."""

    factory: Factory
    config: CacheConfig
    capabilities: Capabilities
    stats: RunStats
    last: Optional[Harness] = None

    def __init__(self) -> None:
        # A Harness whose first check fails closes its backend: teardown never runs for this machine then.
        self.h = Harness(type(self).factory(type(self).config), type(self).config, type(self).capabilities)
        self.h.count_windows = True  # the certificate reports, per cell, the race windows its steps entered
        type(self).last = self.h
        stats = type(self).stats
        stats.examples += 1
        stats.digest.example()
        if stats.on_example is not None:
            stats.on_example(stats)
        self.namespaces = NAMESPACES if self.capabilities.namespaces else (None,)
        self.failed = False
        self.seen: list[tuple[Optional[str], list[int]]] = []
        self.faults: list[str] = []
        self.off: set[str] = set()
        self.published: list[tuple[Optional[str], list[int]]] = []
        self.sessions_on = False

    bad_input: bool = False

    @classmethod
    def bind(
        cls, factory: Factory, config: CacheConfig, capabilities: Capabilities, bad_input: Optional[bool] = None
    ) -> type[CacheMachine]:
        """A fresh subclass for one (backend, config) cell; bad input follows `strict_input` unless forced."""
        attrs = {
            "factory": staticmethod(factory),
            "config": config,
            "capabilities": capabilities,
            "stats": RunStats(),
            "last": None,
            "bad_input": capabilities.strict_input if bad_input is None else bad_input,
        }
        return type("CacheMachine", (cls,), attrs)

    @classmethod
    def last_trace(cls) -> list[Op]:
        return list(cls.last.ops) if cls.last is not None else []

    def do(self, op: Op) -> None:
        interrupt.check()  # a Ctrl-C pressed since the last step stops the walk here
        stats = type(self).stats
        stats.steps += 1
        stats.digest.step(op)
        name = type(op).__name__
        stats.ops[name] += 1
        read = self.h.checks.kv_entries_read
        try:
            got = self.h.step(op)
        except BaseException:
            self.failed = True
            raise
        if self.h.checks.kv_entries_read > read:  # KV bytes the step's checks read back and compared
            stats.ops["kv:entries"] += self.h.checks.kv_entries_read - read
        if getattr(op, "namespace", None) is not None and not isinstance(got, KVCertError):
            stats.ops["namespace:named"] += 1  # a namespace other than the default, accepted
        for window in self.h.windows:
            stats.ops[f"window:{window}"] += 1
        for event in self.h.events:
            stats.ops[f"event:{event}"] += 1
        if isinstance(op, (InjectFault, StorageFault)):
            stats.ops[f"{name}:{op.kind}"] += 1  # which faults fired: the certificate's scope says
        if isinstance(got, KVCertError):
            stats.ops[f"{name}:error"] += 1
            if isinstance(got, BadInput):  # rejected as bad input, not for want of room
                stats.ops[f"{name}:bad"] += 1
        elif isinstance(op, (Prefetch, LoadBack)) and isinstance(got, int) and got > 0:
            stats.ops[f"{name}>0"] += 1

    @initialize(data=draws())
    def start(self, data: Draws) -> None:
        """Pick this run's fault kinds, and whether it uses the priority rules: a few kinds often beat all
        kinds always (swarm testing), and most runs keep every step for the tiers below §11."""
        if self.capabilities.priority_refs:
            # One run in four in the host-tier cells, whose copy-ack races need every step they can get;
            # one in two elsewhere.
            odds = 3 if self.host() and not self.storage() else 1
            self.sessions_on = data.integer(0, odds, "priority rules") == 0
        if self.storage():
            # Of the storage fault kinds the backend's store takes, each run switches a random subset on (swarm testing).
            kinds = tuple(k for k in STORAGE_FAULTS if k in self.capabilities.storage_faults)
            self.faults = sorted(data.subset(kinds, "fault kinds")) if kinds else []
            self.off = set(data.subset(SWARM_RULES, "rules switched off"))

    def on(self, rule: str) -> bool:
        """Whether this run uses `rule` (every rule is on outside the storage cells)."""
        return rule not in self.off

    # ----------------------------------------------------------------- valid traffic

    def draw_key(self, data: Draws, remember: bool) -> tuple[Optional[str], list[int]]:
        """(namespace, page codes): often a cut of an inserted key plus a little, so prefixes recur.

        Inserts (`remember`) reuse half the time and usually add pages, so they make new nodes and
        copies; lookups reuse three times in four and often ask for a whole earlier key, so they
        touch leaves and find host hits.
        """
        reuse = data.integer(0, 1 if remember else 3, "reuse unless 0")
        if self.seen and reuse:
            ns, base = data.choice(self.seen, "earlier key")
            codes = base[: data.cut(len(base), "cut")]
            if remember:  # the simplest choice extends an insert's key, and leaves a lookup's as it is
                codes += [] if data.boolean("no extension") else data.codes(1, 2, "extension")
            else:
                codes += data.codes(1, 2, "extension") if data.boolean("extension?") else []
        else:
            ns = data.choice(self.namespaces, "namespace")
            if len(self.namespaces) > 1 and data.integer(0, 3, "odd namespace unless >0") == 0:
                ns = data.choice(ODD_NAMESPACES, "odd namespace")
            codes = data.codes(0, MAX_PAGES, "pages")
        codes = codes[: self.config.capacity // self.config.page_size]  # longer never fits: a wasted step
        if remember and codes and (ns, codes) not in self.seen:
            self.seen.append((ns, codes))
        return ns, codes

    # Hypothesis orders rules by argument count, then name, and its simplest draw is the first
    # rule: `insert` takes one argument so that the simplest trace builds a tree.
    @rule(data=draws())
    def insert(self, data: Draws) -> None:
        """A request finishes and caches its key; with a host tier the scheduler often makes room first.

        Without that, most inserts into a 6-page device meet a pool full of KV locked by pending
        write-through copies, and change nothing.
        """
        priority = data.integer(0, 2, "priority")
        ns, codes = self.draw_key(data, remember=True)
        tail = 0
        if self.capabilities.aligns_keys and self.config.page_size > 1:  # SGLang's callers' keys end anywhere
            tail = data.integer(0, self.config.page_size - 1, "partial page")
        tokens = tokens_of(codes, self.config.page_size, tail)
        if self.host() and len(tokens) > self.h.free_tokens():
            if data.boolean("make room"):
                self.make_room(len(tokens))
        self.do(Insert(ns, tokens, priority))

    def make_room(self, tokens: int) -> None:
        """The scheduler waits for the oldest copies while locked KV fills the device, then evicts."""
        h = self.h
        while h.evictable_tokens() + h.free_tokens() < tokens and h.open_copies():
            self.do(Complete(h.open_copies()[0]))
            self.do(Poll())
        short = tokens - h.free_tokens()
        if short > 0:
            self.do(Evict(short))

    @rule(data=draws())
    def match(self, data: Draws) -> None:
        ns, codes = self.draw_key(data, remember=False)
        tail = data.integer(0, self.config.page_size - 1, "unaligned tail")
        self.do(Match(ns, tokens_of(codes, self.config.page_size, tail)))

    @precondition(lambda self: self.on("lock") and bool(self.h.lockable_handles()))
    @rule(data=draws())
    def lock(self, data: Draws) -> None:
        self.do(Lock(data.choice(self.h.lockable_handles(), "handle")))

    @precondition(lambda self: bool(self.h.locked_handles()))
    @rule(data=draws())
    def unlock(self, data: Draws) -> None:
        self.do(Unlock(data.choice(self.h.locked_handles(), "handle")))

    @precondition(lambda self: self.on("evict"))
    @rule(data=draws(), small=booleans())
    def evict(self, data: Draws, small: bool) -> None:
        high = 2 * self.config.page_size if small else self.config.capacity
        n = data.integer(1 if small else 0, high, "tokens")
        scope = data.choice(SCOPES, "scope") if self.priority() and self.part("scope") else (True, True)
        self.do(Evict(n, *scope))

    # ----------------------------------------------------------------- priority tiers (SPEC.md §11)

    def priority(self) -> bool:
        return self.capabilities.priority_refs and self.sessions_on

    def part(self, name: str) -> bool:
        """Whether the backend offers this part of §11 (PRIORITY_PARTS)."""
        return name in self.capabilities.priority_parts

    @precondition(lambda self: self.priority() and bool(self.h.live_handles()))
    @rule(data=draws(), action=sampled_from(["register", "register", "fork", "update", "release"]))
    def session(self, data: Draws, action: str) -> None:
        """A conversation's turn ends and it holds its path (again), forks (a rollout group sharing its
        prefix: a second session on the same node), changes priority, or ends; with part `retain`, half the time
        a turn ends on a tool call instead (`tool_call`: drawn only for such backends, so others' runs are as
        before)."""
        if self.part("retain") and data.boolean("a tool call"):
            self.tool_call(data)
            return
        registered = self.h.sessions()
        priority = data.integer(0, 2, "priority")
        if action == "fork" and registered:
            same = self.h.session_handles(data.choice(registered, "forked"))
            if same:
                self.register(data.choice(SESSIONS, "session"), same[0], priority)
                return
        if action == "update" and not self.part("update"):
            action = "register"  # no update_ref: a new priority comes with the session's next registration
        if action in ("register", "fork") or not registered:
            name = data.choice(SESSIONS, "session")
            self.register(name, data.choice(self.h.live_handles(), "handle"), priority)
        elif action == "update":
            self.do(UpdateRef(data.choice(registered, "session"), priority))
        else:
            high = self.h.high_sessions()
            if high and self.h.any_demoted() and data.boolean("high ends"):
                registered = high  # a high-priority session ending is what gives a demoted one back its tier
            self.do(ReleaseRef(data.choice(registered, "session")))

    def tool_call(self, data: Draws) -> None:
        """An agent's turn ends on a tool call (SPEC.md §11.7): its path cached and held by its session (a new turn,
        or one already holding KV), and its client says it comes back within `ttl` steps. Meanwhile another
        session's turn of the same class may cache its own path, and other traffic may need room: all of the tiers
        below the paused session's and a little of its own, where retention decides what goes; and host room, where
        it decides which idle high session is demoted."""
        priority = data.integer(0, 2, "priority")
        holding = self.h.holding_sessions()
        if holding and data.boolean("an earlier turn"):
            paused = data.choice(holding, "paused")
        else:
            paused = data.choice(SESSIONS, "paused")
            if not self.turn(data, paused, priority):
                return
        ttl = data.integer(2, 24, "ttl")
        self.do(Retain(paused, ttl))
        waits = data.boolean("its next turn waits")  # the engine's half: held until the turn registers
        if waits:
            self.do(RetainWaiting(paused))
            for _ in range(data.integer(0, ttl, "steps it waits")):  # past its deadline: a waiting turn keeps it
                self.do(Poll())
        if data.boolean("another turn meanwhile"):
            self.turn(data, data.choice([s for s in SESSIONS if s != paused], "other"), priority)
        if data.boolean("pressure meanwhile"):
            below = self.h.tier_tokens()
            tiers = 2 if paused in self.h.high_sessions() else 1
            self.do(Evict(sum(below[:tiers]) + data.integer(1, 4 * self.config.page_size, "tokens")))
        if self.host() and data.boolean("host pressure meanwhile"):  # idle high sessions demoted: retained last
            if data.boolean("all idle"):  # the backups land, then every session's KV leaves the device: all idle
                for copy in self.h.open_copies():
                    self.do(Complete(copy))
                self.do(Poll())
                self.do(Evict(sum(self.h.tier_tokens())))
            self.do(EvictHost(data.integer(1, self.config.host_capacity, "host tokens")))
        if waits and paused in self.h.sessions() and data.boolean("its turn admitted"):  # its retention ends
            same = self.h.session_handles(paused)
            if same:
                self.register(paused, same[0], priority)

    def turn(self, data: Draws, session: str, priority: int) -> bool:
        """A session's turn caches a fresh path and the session holds it; False if the insert left no node."""
        ns, codes = self.draw_key(data, remember=True)
        tokens = tokens_of(codes, self.config.page_size, 0)
        if self.host() and len(tokens) > self.h.free_tokens():
            self.make_room(len(tokens))
        self.do(Insert(ns, tokens, priority))
        handle = len(self.h.ops) - 1
        if handle not in self.h.live_handles():
            return False
        self.register(session, handle, priority)
        return True

    def register(self, name: str, handle: int, priority: int) -> None:
        """Register `name` on `handle`'s node; a backend without moves first releases a session registered
        elsewhere than at or below that node (its old conversation ends, a new one takes the id)."""
        if not self.part("move") and name in self.h.sessions() and handle not in self.h.continuations(name):
            self.do(ReleaseRef(name))
        self.do(RegisterRef(name, handle, priority))

    @precondition(lambda self: self.priority() and self.part("admission") and self.part("scope"))
    @rule(data=draws(), profiled=booleans())
    def admit(self, data: Draws, profiled: bool) -> None:
        """A request asks for room while others decode: plan (evict, retract, fewer layers), then apply it."""
        ps = self.config.page_size
        free = self.h.free_tokens() // ps
        running = []
        for _ in range(data.integer(0, 3, "running requests")):
            pages = data.integer(0, min(2, free), "pages held")
            free -= pages
            running.append((data.integer(0, 2, "its priority"), pages * ps))
        pages = data.integer(1, self.config.capacity // ps + 1, "pages asked")
        tokens = pages * ps - data.integer(0, ps - 1, "short of a page")
        profile = None
        if profiled:
            profile = tuple(data.integer(0, high, k) for k, high in self.PROFILE)
        self.do(Admit(tokens, data.integer(0, 2, "priority"), tuple(running), profile))

    PROFILE = (("load", 1), ("store", 1), ("step", 8), ("target", 64))
    """Ranges of the drawn profile: streaming one layer of a few pages lands on either side of the target."""

    # ----------------------------------------------------------------- host tier (SPEC.md §9)

    def host(self) -> bool:
        return self.config.host_capacity > 0

    @precondition(lambda self: self.host() and bool(self.h.open_copies()))
    @rule(data=draws(), oldest=booleans())
    def complete(self, data: Draws, oldest: bool) -> None:
        """Finish a copy: the oldest one, or a later one, so acks also finish out of order."""
        open_copies = self.h.open_copies()
        later = open_copies[1:] or open_copies
        self.do(Complete(open_copies[0] if oldest else data.choice(later, "copy")))

    @precondition(lambda self: self.host())
    @rule(data=draws(), settle=sampled_from([False, False, False, True]))
    def poll(self, data: Draws, settle: bool) -> None:
        """One tick of ack handling; `settle` (one poll in four) first finishes every open copy.

        Settling rarely keeps several copies open at once, so acks finish out of order often.
        """
        if settle:
            self.settle()
        self.do(Poll())

    def settle(self) -> None:
        """The engine goes idle: every copy lands, including stores issued by write acks, and its ack is consumed."""
        while self.h.open_copies():
            for k in self.h.open_copies():
                self.do(Complete(k))
            self.do(Poll())

    @precondition(lambda self: self.host() and self.on("evict_host"))
    @rule(data=draws(), small=booleans())
    def evict_host(self, data: Draws, small: bool) -> None:
        high = 2 * self.config.page_size if small else self.config.host_capacity
        self.do(EvictHost(data.integer(1 if small else 0, high, "host tokens")))

    @precondition(lambda self: self.host() and self.on("load_back") and bool(self.h.host_hits()))
    @rule(data=draws())
    def load_back(self, data: Draws) -> None:
        self.do(LoadBack(data.choice(self.h.host_hits(), "match")))

    @precondition(lambda self: self.host() and self.on("load_back") and bool(self.seen))
    @rule(data=draws(), land=booleans())
    def readmit(self, data: Draws, land: bool) -> None:
        """An earlier conversation comes back: match its key and, when the host holds the rest, load it back,
        often letting the load land at once (the scheduler's admission of a request with a host hit).

        A host hit lives from a demotion to the next host eviction; waiting for `load_back` to pick one
        up loaded back about one step in a hundred (none in 100 examples of SGLang's P=4 host cell),
        so a wrong slot in a load was seldom read. After a lull the conversation's KV was demoted."""
        ns, codes = data.choice(self.seen, "earlier key")
        if data.boolean("after a lull"):  # while it was idle its copies landed, its KV was demoted
            self.settle()
            self.do(Evict(self.config.capacity))
        at = len(self.h.ops)
        self.do(Match(ns, tokens_of(codes, self.config.page_size)))
        if at not in self.h.host_hits():
            return
        issued = len(self.h.copies)
        self.do(LoadBack(at))
        if not land and len(self.h.copies) > issued:  # while the load is in flight, the request runs on it
            race = data.integer(0, 2, "then")
            if race == 1:  # it matches again (the loading nodes are its device prefix now) and locks that
                again = len(self.h.ops)
                self.do(Match(ns, tokens_of(codes, self.config.page_size)))
                self.do(Lock(again))
            elif race == 2:
                self.split_moving(data, ("load",))
        if land and len(self.h.copies) > issued:
            for k in range(issued, len(self.h.copies)):
                if k in self.h.open_copies():
                    self.do(Complete(k))
            self.do(Poll())

    @precondition(
        lambda self: (
            self.storage()
            and "host_alloc" in self.capabilities.faults
            and self.on("alloc_fault")
            and not self.h.host_alloc_armed()
        )
    )
    @rule()
    def host_alloc_fault(self) -> None:
        """The next host allocation fails: no backup, a write-back victim dropped, a prefetch declined.

        Storage cells only (they run every write policy too): there, swarm testing keeps the
        extra rule from diluting the host-tier traffic the plain host cells are tuned for. One
        fault at a time: an argument-free rule is cheap for Hypothesis to repeat, and a stack of
        armed faults would starve every later allocation.
        """
        self.do(InjectFault("host_alloc"))

    @precondition(
        lambda self: (
            self.storage()
            and "copy" in self.capabilities.faults
            and self.on("copy_fault")
            and bool(self.h.open_copies())
        )
    )
    @rule(data=draws())
    def copy_fault(self, data: Draws) -> None:
        """The copy engine fails one copy: a write or load is retried (stays pending), a store writes nothing."""
        self.do(InjectFault("copy"))
        self.do(Complete(data.choice(self.h.open_copies(), "failed copy")))

    # ----------------------------------------------------------------- retraction (SPEC.md §9.11)

    def retraction(self) -> bool:
        """A retraction backs a request up to the host (SPEC.md §9.11): every cell with a host tier."""
        return self.host() and self.capabilities.retraction

    @precondition(lambda self: self.retraction() and self.on("retract") and bool(self.h.live_handles()))
    @rule(data=draws(), tail=integers(1, 2))
    def retract(self, data: Draws, tail: int) -> None:
        """Decode runs out of KV: a running request (its prefix, and `tail` pages it decoded) is retracted to host.

        A running request has decoded at least one token (SGLang asserts `seqlen > 1`), so the
        tail is never empty; an empty retraction is bad input (the `malformed` rule)."""
        k = data.choice(self.h.live_handles(), "request")
        self.do(Retract(k, tail * self.config.page_size))

    @precondition(lambda self: self.retraction() and bool(self.h.open_retractions()))
    @rule(data=draws(), resume=booleans())
    def resume(self, data: Draws, resume: bool) -> None:
        """A retracted request resumes (after the scheduler evicts for its KV), or is aborted for good."""
        k = data.choice(self.h.open_retractions(), "retraction")
        if not resume:
            self.do(Discard(k))
            return
        self.make_room(page_ceil(self.h.retraction_tokens(k), self.config.page_size))
        self.do(Restore(k))

    @precondition(lambda self: self.storage() and self.on("abort") and bool(self.h.handles))
    @rule(data=draws())
    def abort(self, data: Draws) -> None:
        """A request is aborted wherever it stands: prefetching, retracted, or holding locks while its
        load-back is still in flight. It gives back everything it holds; its copies finish on their own."""
        k = data.choice(sorted(self.h.handles), "request")
        prefetches, backups, locks = self.h.held_by(k)
        for p in prefetches:
            self.do(AbortPrefetch(p))
        for b in backups:
            self.do(Discard(b))
        for _ in range(locks):
            self.do(Unlock(k))

    # ----------------------------------------------------------------- storage tier (SPEC.md §10)

    def storage(self) -> bool:
        return bool(self.config.prefetch_policy)

    @precondition(lambda self: self.storage())
    @rule(data=draws(), fresh=booleans())
    def prefetch(self, data: Draws, fresh: bool) -> None:
        """A request prefetches what follows its host hit from storage: a new request (match, then
        prefetch), or one matched earlier that the scheduler deferred until now."""
        earlier = self.h.prefetch_anchors()
        if fresh or not earlier:
            ns, codes = self.draw_request(data)
            self.do(Match(ns, tokens_of(codes, self.config.page_size)))
            if len(self.h.ops) - 1 in self.h.anchors:  # the match names an anchor (SPEC.md §10.4)
                self.do(Prefetch(len(self.h.ops) - 1))
        else:
            self.do(Prefetch(data.choice(earlier, "deferred match")))

    def draw_request(self, data: Draws) -> tuple[Optional[str], list[int]]:
        """A request's key: often one a peer published (a warm L3 hit), else as `draw_key` draws.

        Without this most prefetches find storage empty: the engine's own pages reach it only
        after a write ack and a store copy both complete, and leave the memory tiers rarely.
        """
        if self.published and data.boolean("warm"):
            ns, codes = data.choice(self.published, "published key")
            return ns, codes + data.codes(0, 1, "extension")
        return self.draw_key(data, remember=True)

    @precondition(lambda self: self.storage())
    @rule(data=draws())
    def request(self, data: Draws) -> None:
        """A whole cold request in one step: match, prefetch, every page arrives, check, then insert."""
        ns, codes = self.draw_request(data)
        tokens = tokens_of(codes, self.config.page_size)
        self.do(Match(ns, tokens))
        started = len(self.h.prefetches)
        if len(self.h.ops) - 1 in self.h.anchors:  # the match names an anchor (SPEC.md §10.4)
            self.do(Prefetch(len(self.h.ops) - 1))
        k = len(self.h.prefetches) - 1
        if k >= started and k in self.h.open_prefetches():
            while k in self.h.fetchable():
                self.do(Fetch(k))
            self.do(CheckPrefetch(k))
        if data.boolean("then insert"):
            self.do(Insert(ns, tokens))

    @precondition(lambda self: self.storage() and self.on("publish"))
    @rule(data=draws())
    def publish(self, data: Draws) -> None:
        """A peer engine sharing the store (a prefill node, say) writes a prefix's pages to L3."""
        ns, codes = self.draw_key(data, remember=True)
        if codes and (ns, codes) not in self.published:
            self.published.append((ns, codes))
        self.do(Publish(ns, tokens_of(codes, self.config.page_size)))

    @precondition(lambda self: (self.storage() or (self.host() and self.priority())) and self.on("pressure"))
    @rule(data=draws())
    def pressure(self, data: Draws) -> None:
        """A load spike empties both memory tiers; only storage keeps the pages (and locks keep theirs).

        With priority rules on, host pressure demotes idle high-priority sessions (SPEC.md §11.4), and
        often a high-priority conversation ends right after, which gives the latest demoted one its tier back.
        """
        self.do(Evict(self.config.capacity))
        self.do(EvictHost(self.config.host_capacity))
        high = self.h.high_sessions()
        if self.priority() and high and self.h.any_demoted():
            if data.boolean("a high session ends"):
                self.do(ReleaseRef(data.choice(high, "session")))

    @precondition(lambda self: self.storage() and bool(self.h.fetchable()))
    @rule(data=draws(), pages=integers(1, 3), stop=booleans())
    def fetch(self, data: Draws, pages: int, stop: bool) -> None:
        """Storage delivers one or a few pages of one prefetch; with `stop` the scheduler checks it right
        after, so a best-effort or timed-out prefetch often ends with pages still on their way."""
        k = data.choice(self.h.fetchable(), "prefetch")
        damage = [f for f in self.faults if f in ("corrupt", "drop")]
        for i in range(pages):
            if k not in self.h.fetchable():
                break
            if i and damage and data.boolean("the next page is damaged"):  # a prefetch that keeps part of its pages
                at = self.h.next_page_at(k)
                if at >= 0:
                    self.do(StorageFault(data.choice(damage, "damage"), at))
            self.do(Fetch(k))
        if stop:
            self.do(CheckPrefetch(k))

    @precondition(lambda self: self.storage() and bool(self.h.open_prefetches()))
    @rule(data=draws(), abort=booleans())
    def end_prefetch(self, data: Draws, abort: bool) -> None:
        """check_prefetch_progress, or the request is aborted; often the scheduler then evicts for the pages
        it admits, so eviction ranks the nodes the prefetch's end touched against the rest."""
        k = data.choice(self.h.open_prefetches(), "prefetch")
        self.do(AbortPrefetch(k) if abort else CheckPrefetch(k))
        if data.boolean("then evict"):
            self.do(Evict(data.integer(1, 2 * self.config.page_size, "tokens")))

    @precondition(lambda self: self.storage() and bool(self.faults))
    @rule(data=draws())
    def storage_fault(self, data: Draws) -> None:
        kind = data.choice(self.faults, "fault")
        self.do(StorageFault(kind, data.integer(0, 7, "at")))

    # ----------------------------------------------------------------- bad input (strict backends)

    def strict(self) -> bool:
        return self.bad_input

    @precondition(lambda self: self.strict() and self.on("malformed"))
    @rule(data=draws(), kind=sampled_from(["insert", "match", "handle", "evict", "host", "session"]))
    def malformed(self, data: Draws, kind: str) -> None:
        """One rule for every kind of bad input, so valid traffic keeps most of the steps."""
        ps = self.config.page_size
        if kind == "session" and self.priority() and self.part("retain") and data.boolean("bad retention"):
            # a retention of no registered session, or a TTL that is no int >= 1 (SPEC.md §11.7)
            bad = data.choice(["unknown", "zero", "bool", "float"], "retain defect")
            ttl = {"unknown": 3, "zero": 0, "bool": True, "float": 2.5}[bad]
            if bad == "unknown" and data.boolean("a waiting turn"):
                self.do(RetainWaiting("nobody"))
                return
            self.do(Retain("nobody" if bad == "unknown" else data.choice(SESSIONS, "session"), ttl))
            return
        if kind == "session" and self.priority():
            bad = data.choice(["id", "unknown", "priority", "scope", "handle", "plan"], "session defect")
            if bad == "plan":
                self.do(Admit(data.choice([-1, 2.5], "bad tokens"), 1, (), None))
            elif bad == "id":
                self.do(RegisterRef(7, 10_000, 1))
            elif bad == "unknown":
                self.do(ReleaseRef("nobody") if data.boolean("release?") else UpdateRef("nobody", 1))
            elif bad == "priority":
                self.do(UpdateRef(data.choice(SESSIONS, "session"), 1.5))
            elif bad == "scope":
                self.do(Evict(ps, *data.choice([(False, True), (1, False), (True, None)], "scope")))
            else:
                self.do(RegisterRef("a", 10_000, 1))
            return
        if kind == "host" and self.host():
            defects = ["copy", "evict_host", "load_back"] + (["prefetch"] if self.storage() else [])
            defects += ["fault"] if self.storage() and self.capabilities.faults else []
            defects += ["retraction"] if self.retraction() else []
            bad = data.choice(defects, "host defect")
            if bad == "retraction":
                used = [k for k in range(len(self.h.retractions)) if k not in self.h.open_retractions()]
                k = data.choice([10_000, -1, *used], "retraction")
                which = data.choice(["restore", "discard", "empty"], "retraction defect")
                if which == "empty":  # nothing to back up: no device prefix, no decoded tail
                    self.do(Retract(10_000, 0))
                else:
                    self.do(Restore(k) if which == "restore" else Discard(k))
            elif bad == "fault":
                self.do(InjectFault("disk_full"))
            elif bad == "prefetch":
                self.do(Fetch(10_000) if data.boolean("fetch?") else CheckPrefetch(-1))
            elif bad == "copy":
                self.do(Complete(data.choice([10_000, -1, *self.h.finished_copies()], "copy")))
            elif bad == "evict_host":
                self.do(EvictHost(data.choice([-1, 2.5], "bad count")))
            else:
                self.do(LoadBack(10_000))
            return
        if kind == "insert":
            tokens = tokens_of(data.codes(1, 3, "pages"), ps)
            defect = data.choice(["unaligned", "mismatch", "token"], "defect")
            if defect == "unaligned" and ps > 1:
                self.do(Insert(None, tokens + (0,), value_len=len(tokens)))
            elif defect in ("unaligned", "mismatch"):
                delta = data.choice([-ps, ps], "value_len delta")
                self.do(Insert(None, tokens, value_len=max(0, len(tokens) + delta)))
            else:
                token = data.choice([-1, 1.5, "7", True], "bad token")
                self.do(Insert(None, tokens[:-1] + (token,)))
        elif kind == "match":
            self.do(Match(None, (0, data.choice([-3, 2.5, "x"], "bad token"))))
        elif kind == "handle":
            live = self.h.live_handles()
            stale = [k for k in self.h.handles if k not in live]
            unlocked = [k for k in live if self.h.own_locks(k) == 0]
            k = data.choice([10_000, *stale, *unlocked], "handle")
            lock = k in stale and data.boolean("lock?")
            self.do(Lock(k) if lock else Unlock(k))
        else:  # "evict", and "host" on a device-only cache
            self.do(Evict(data.choice([-1, -8, 1.5, "4"], "bad count")))

    def teardown(self) -> None:
        try:
            if not self.failed:  # after a failure, the first broken rule is the report
                self.h.quiesce()
        finally:
            self.h.close()
