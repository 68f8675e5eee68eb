"""Client traffic for request-path targets (SPEC.md §12), and the run that sends it.

`RequestMachine` generates what clients send an engine: one-shot requests and multi-turn sessions (a next turn's
prompt is the last turn's prompt and output plus new tokens, at any priority), bursts of short questions with
long answers, scheduler steps, and closes, priority changes and aborts arriving at any point, mid-turn included.
`conformance.harness.requests.RequestHarness` sends it and judges the engine after every op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Optional

from kvcert.conformance.backend import Backend
from kvcert.conformance.generation import interrupt
from kvcert.conformance.generation.draws import MAX_PAGES, Draws, draws, tokens_of
from kvcert.conformance.generation.machine import NAMESPACES, RunStats
from kvcert.conformance.generation.runner import precondition, rule
from kvcert.conformance.harness.requests import RequestHarness
from kvcert.spec.ops import AbortRequest, CloseSession, Flush, LinkerFault, Op, PeerFault, Reprioritize, Step, Submit
from kvcert.spec.types import CLIENT_RULES, CacheConfig, Capabilities

__all__ = ["RequestMachine", "request_cells", "request_scope_gaps", "run_requests"]

IN_FLIGHT = 3
"""Requests the generator keeps in flight at most: each holds KV of its own, and the device is small."""
SESSIONS = ("s0", "s1", "s2")
LORAS: tuple[Optional[tuple[str, str]], ...] = (None, ("adapter-a", "/adapters/a"))
"""A fresh conversation's adapter, for a target that declares LoRA (`Capabilities.loras`): the base model or one."""


class RequestMachine:
    """Client traffic for a request-path target: the rules, one example per fresh engine (`runner.run_machine`)."""

    factory: Callable[[CacheConfig], Backend]
    config: CacheConfig
    capabilities: Capabilities
    stats: RunStats
    last: Optional[RequestHarness] = None

    @classmethod
    def bind(
        cls, factory: Any, config: CacheConfig, capabilities: Capabilities, bad_input: Optional[bool] = None
    ) -> type[RequestMachine]:
        attrs = {"factory": staticmethod(factory), "config": config, "capabilities": capabilities,
                 "stats": RunStats(), "last": None}  # fmt: skip
        return type("RequestMachine", (cls,), attrs)

    @classmethod
    def last_trace(cls) -> list[Op]:
        return list(cls.last.ops) if cls.last is not None else []

    def __init__(self) -> None:
        self.h = RequestHarness(type(self).factory(type(self).config), type(self).config, type(self).capabilities)
        type(self).last = self.h
        stats = type(self).stats
        stats.examples += 1
        stats.digest.example()
        if stats.on_example is not None:
            stats.on_example(stats)
        self.failed = False
        self.requests = 0
        self.seen: list[tuple[Optional[str], tuple[int, ...]]] = []
        self.seen_loras: list[Optional[tuple[str, str]]] = []
        self.namespaces = NAMESPACES if self.capabilities.namespaces else (None,)
        self.counted: set[str] = set()
        self.priority: dict[str, int] = {}
        """Each session's priority as its client last set it (a turn's, or a change's)."""

    def keeps(self, rule: str) -> bool:
        """Whether the target's clients keep `rule` (`Capabilities.client`)."""
        return rule in self.capabilities.client

    def changeable(self) -> list[str]:
        """Sessions a close or a priority change may reach now: every open one, or the idle ones where clients change
        a session between its turns only."""
        sessions = self.h.open_sessions()
        if self.keeps("idle-changes"):
            busy = self.h.busy_sessions()
            sessions = [s for s in sessions if s not in busy]
        return sessions

    def do(self, op: Op) -> None:
        interrupt.check()  # a Ctrl-C pressed since the last step stops the walk here
        stats = type(self).stats
        stats.steps += 1
        stats.digest.step(op)
        stats.ops[type(op).__name__] += 1
        read, held, waiting = self.h.checks.kv_entries_read, self.h.retained_seen, self.h.waiting_seen
        try:
            self.h.step(op)
        except BaseException:
            self.failed = True
            raise
        if self.h.retained_seen > held:
            stats.ops["retain:held"] += self.h.retained_seen - held
        if self.h.waiting_seen > waiting:
            stats.ops["retain:waiting"] += self.h.waiting_seen - waiting
        if self.h.checks.kv_entries_read > read:
            stats.ops["kv:entries"] += self.h.checks.kv_entries_read - read
        if getattr(op, "namespace", None) is not None:
            stats.ops["namespace:named"] += 1
        if getattr(op, "retain", None) is not None:
            stats.ops["retain:sent"] += 1
        if getattr(op, "lora", None) is not None:
            stats.ops["lora:sent"] += 1
        for r in self.h.finished:
            if r not in self.counted:
                self.counted.add(r)
                stats.ops["event:finished"] += 1

    def _room(self) -> int:
        """The most tokens one turn (prompt and output) may take: half the device, so an engine that reserves room
        for a request's whole length (SGLang: the pool less a few tokens) takes every request the client sends."""
        return max(self.config.page_size, self.config.capacity // 2)

    @precondition(lambda self: len(self.h.in_flight()) < IN_FLIGHT)
    @rule(data=draws())
    def submit(self, data: Draws) -> None:
        """A request arrives: a session's next turn (its conversation plus new tokens), a new session, or a one-shot
        request, sharing prefixes with earlier prompts often."""
        ps = self.config.page_size
        output = data.integer(1, 4, "output tokens")
        priority = data.integer(0, 2, "priority")
        busy = self.h.busy_sessions()
        idle = [s for s in SESSIONS if s not in busy]
        if self.keeps("sessions-only") and not idle:
            self.do(Step())
            return
        turn = self.keeps("sessions-only") or data.boolean("a session's turn")
        session = data.choice(idle, "session") if idle and turn else None
        if session is not None and self.keeps("idle-changes") and session in self.priority:
            priority = self.priority[session]  # its clients change a class with a priority change, between turns
        said = self.h.conversation
        lora: Optional[tuple[str, str]] = None
        if session is not None and session in said and data.integer(0, 3, "a new conversation unless 0"):
            (ns, lora), prompt = said[session]
            prompt += tokens_of(data.codes(1, 2, "new pages"), ps, data.integer(0, ps - 1, "partial page"))
        else:
            ns = data.choice(self.namespaces, "namespace")
            if self.capabilities.loras:
                lora = data.choice(LORAS, "LoRA adapter")
            if self.seen and data.boolean("shares a prefix"):
                (ns, lora), base = self._earlier(data)
                prompt = base[: data.integer(0, len(base), "cut")]
            else:
                prompt = ()
            prompt += tokens_of(data.codes(1, MAX_PAGES, "pages"), ps, data.integer(0, ps - 1, "partial page"))
        if len(prompt) + output > self._room():
            prompt = prompt[-(self._room() - output) :]  # too long a conversation: the client starts afresh
        if session is not None and not self.h.continues(session, (ns, lora), prompt) and not self.h.moves():
            # A turn that does not continue the conversation moves the session (SPEC.md §11.1): to an engine that
            # does not declare moves, the client ends the old conversation first, as the API machine does.
            self.do(CloseSession(session))
        self._saw(ns, lora, prompt)
        self.requests += 1
        rid = f"r{self.requests}"
        flying = self.h.in_flight()
        if self.keeps("distinct-ids"):
            rid = f"r{self.requests:06d}"  # fixed width: no id starts with another, as uuid4 rids do not
        elif flying and data.integer(0, 15, "an id of its own unless 0") == 0:
            rid = f"{data.choice(flying, 'an id in flight')}.{self.requests}"  # ids are opaque: one may extend another
        if session is not None:
            self.priority[session] = priority
        hint = None
        if session is not None and "retain" in self.capabilities.priority_parts:  # no draw for other targets
            hint = data.integer(0, 6, "retention hint in seconds unless 0") or None  # a tool call's length
        self.do(Submit(rid, ns, prompt, priority, output, session, lora, hint))

    @precondition(lambda self: not self.keeps("sessions-only") and len(self.h.in_flight()) < IN_FLIGHT)
    @rule(data=draws())
    def burst(self, data: Draws) -> None:
        """Short questions with long answers arrive together: their decodes outgrow what an engine that admits on
        an estimate of the output set aside, and it retracts a running request and resumes it later."""
        ps = self.config.page_size
        for _ in range(IN_FLIGHT - len(self.h.in_flight())):
            ns = data.choice(self.namespaces, "namespace")
            prompt = tokens_of(data.codes(1, 1, "pages"), ps, 0)
            output = data.integer(self._room() * 2 // 3, self._room() - len(prompt), "long output tokens")
            self._saw(ns, None, prompt)
            self.requests += 1
            rid = f"r{self.requests:06d}" if self.keeps("distinct-ids") else f"r{self.requests}"
            self.do(Submit(rid, ns, prompt, data.integer(0, 2, "priority"), output, None))

    @precondition(
        lambda self: bool(self.capabilities.linker_faults or self.capabilities.peer_faults)
        and len(self.h.in_flight()) < IN_FLIGHT
    )
    @rule(data=draws())
    def flood(self, data: Draws) -> None:
        """A long fresh prompt arrives (an engine with a direct linker, a decode server): the device evicts what it
        cached, which the linker offloaded or the host tier keeps, so the next prompt sharing a prefix with an earlier
        one loads it back (SPEC.md §14, §15). For a client that may send one (`Capabilities.never_fit`), one draw in
        four is instead a request that can never fit the device (INV-DEC-6)."""
        if self.capabilities.never_fit and self.h.in_flight() and not data.integer(0, 3, "never-fit unless >0"):
            self._never_fit(data)
            return
        ps, output = self.config.page_size, data.integer(1, 2, "output tokens")
        ns = data.choice(self.namespaces, "namespace")
        pages = max(1, (self._room() - output) // ps)
        prompt = tokens_of(data.codes(pages, pages, "pages"), ps, 0)
        self._saw(ns, None, prompt)
        self.requests += 1
        rid = f"r{self.requests:06d}" if self.keeps("distinct-ids") else f"r{self.requests}"
        self.do(Submit(rid, ns, prompt, data.integer(0, 2, "priority"), output, None))

    def _never_fit(self, data: Draws) -> None:
        """A prompt longer than half the device (up to a page past all of it) with an output past the device."""
        cap, ps = self.config.capacity, self.config.page_size
        prompt_len = data.integer(cap // 2 + 1, cap + ps, "never-fit prompt tokens")
        prompt = (tokens_of(data.codes(1, 1, "pages"), ps, 0) * (prompt_len // ps + 1))[:prompt_len]
        output = cap + ps - prompt_len + data.integer(0, 2, "output past the device")
        self.requests += 1
        rid = f"r{self.requests:06d}" if self.keeps("distinct-ids") else f"r{self.requests}"
        type(self).stats.ops["never-fit:sent"] += 1
        self.do(Submit(rid, data.choice(self.namespaces, "namespace"), prompt, 0, max(1, output), None))

    def _saw(self, ns: Optional[str], lora: Optional[tuple[str, str]], prompt: tuple[int, ...]) -> None:
        self.seen.append((ns, prompt))
        self.seen_loras.append(lora)

    def _earlier(self, data: Draws) -> tuple[tuple[Optional[str], Optional[tuple[str, str]]], tuple[int, ...]]:
        """An earlier prompt, with the (namespace, adapter) it was sent under."""
        i = data.choice(range(len(self.seen)), "earlier prompt")  # the draw `choice(self.seen, ...)` would make
        ns, prompt = self.seen[i]
        return (ns, self.seen_loras[i]), prompt

    @rule()
    def step(self) -> None:
        self.do(Step())

    @rule(data=draws())
    def steps(self, data: Draws) -> None:
        """A few scheduler iterations with nothing sent: prefill chunks and decode steps run, turns finish."""
        for _ in range(data.integer(1, 4, "steps")):
            self.do(Step())

    @precondition(lambda self: self.capabilities.priority_refs and bool(self.changeable()))
    @rule(data=draws())
    def close(self, data: Draws) -> None:
        """A client ends a session: between turns, or while a turn of it is still running."""
        name = data.choice(self.changeable(), "session")
        self.do(CloseSession(name))

    @precondition(
        lambda self: (
            self.capabilities.priority_refs and "update" in self.capabilities.priority_parts and bool(self.changeable())
        )
    )
    @rule(data=draws())
    def reprioritize(self, data: Draws) -> None:
        """A client changes a session's priority: between turns, or mid-turn."""
        name, priority = data.choice(self.changeable(), "session"), data.integer(0, 2, "priority")
        self.priority[name] = priority
        self.do(Reprioritize(name, priority))

    @precondition(lambda self: bool(self.h.in_flight()) and not self.keeps("no-aborts"))
    @rule(data=draws())
    def abort(self, data: Draws) -> None:
        """A client gives up on a request, now and then: one draw in three (most requests run to their end)."""
        if data.integer(0, 2, "abort unless >0"):
            self.do(Step())
        else:
            self.do(AbortRequest(data.choice(self.h.in_flight(), "request")))

    @precondition(lambda self: bool(self.capabilities.linker_faults or self.capabilities.peer_faults))
    @rule(data=draws())
    def linker_fault(self, data: Draws) -> None:
        """The world beneath the engine fails, one draw in three (most loads, offloads and transfers go through):
        the store behind its direct linker, now or at its next call of a kind (SPEC.md §14), or a decode server's
        prefill peer, a transfer in flight (§15). One rule for both, so a target with neither draws as before."""
        if data.integer(0, 2, "fault unless >0"):
            self.do(Step())
        elif self.capabilities.peer_faults:
            self.do(PeerFault(data.choice(list(self.capabilities.peer_faults), "peer fault")))
        elif self.capabilities.flushes and not data.integer(0, 2, "flush unless >0"):
            self.do(Flush())  # a client's flush: refused or deferred while requests run, else offloads may still fly
            for _ in range(3 if not self.h.in_flight() else 0):  # (INV-LINK-7) and the engine takes it when idle
                self.do(Step())
        else:
            self.do(LinkerFault(data.choice(list(self.capabilities.linker_faults), "linker fault")))

    def teardown(self) -> None:
        try:
            if not self.failed:
                self.h.quiesce()
        finally:
            reached = getattr(self.h.backend, "reached", None)  # what the engine's calls reached in a linker's store
            if reached is not None:
                for what, n in reached().items():
                    type(self).stats.ops[what if ":" in what else f"linker:{what}"] += n
            self.h.close()


def request_cells(configs: list[CacheConfig], capabilities: Capabilities) -> list[CacheConfig]:
    """A request-path target's cells: the same coordinates, with a device that holds a few turns at once."""
    if capabilities.kind != "request-path":
        return configs
    out = []
    for c in configs:
        if c.prefetch_policy:
            continue  # no storage tier on a request path yet
        pages = max(REQUEST_DEVICE_PAGES, -(-REQUEST_DEVICE_TOKENS // c.page_size))
        out.append(
            replace(c, capacity=pages * c.page_size, host_capacity=2 * pages * c.page_size if c.host_capacity else 0)
        )
    return out


REQUEST_DEVICE_PAGES = 24
"""Device pages of a request-path cell, at least: a few turns fit at once, so the engine admits, chunks and evicts."""
REQUEST_DEVICE_TOKENS = 64
"""Device tokens of a request-path cell, at least: at page size 1, 24 pages would hold one short turn."""


def request_scope_gaps(capabilities: Capabilities, cells: Sequence[Any]) -> list[str]:
    """What a request-path certificate does not cover (SPEC.md §12.3), and what its cells did not exercise."""
    ops: Counter[str] = Counter()
    for c in cells:
        ops.update(c.ops)
    out = [
        "the reference model beside the engine (SPEC.md §12.3): not run on a request path; eviction victims, copy "
        "cuts and the exact tree after each step are judged by the state invariants only, and the profile's choices "
        f"({capabilities.profile}) not at all: the engine's API-level target compares them",
    ]
    parts = [
        ("KV bytes (INV-KV-1/2, INV-REQ-2: every cached slot and every request's row read back)", capabilities.kv_reads,
         ops["kv:entries"] > 0),
        ("finished turns (requests the engine finished and released)", True, ops["event:finished"] > 0),
        ("aborted requests", True, ops["AbortRequest"] > 0),
        ("namespaces (INV-NS-*)", capabilities.namespaces, ops["namespace:named"] > 0),
        ("LoRA adapters (a request's adapter changes its KV: pages kept apart from the base model's)",
         capabilities.loras, ops["lora:sent"] > 0),
        ("linker faults (SPEC.md §14: failed, refused and held loads and offloads, pages lost)",
         bool(capabilities.linker_faults), ops["LinkerFault"] > 0),
        ("linker loads that landed (a store hit loaded back into private slots, INV-LINK-1/2/3)",
         bool(capabilities.linker_faults), ops["linker:load batch landed"] > 0),
        ("linker load batches that failed (INV-LINK-4: the request aborted, never served)",
         bool({"load_fail", "corrupt", "truncate"} & set(capabilities.linker_faults)),
         ops["linker:load batch failed"] > 0),
        ("linker offloads that failed (INV-LINK-6: the node not marked stored)",
         "offload_fail" in capabilities.linker_faults, ops["linker:offload failed"] > 0),
        ("peer faults (SPEC.md §15: a decode transfer failed, INV-DEC-5)", bool(capabilities.peer_faults),
         ops["decode:transfer failed"] > 0),
        ("decode transfers committed with a restored span (INV-DEC-4)", bool(capabilities.peer_faults),
         ops["decode:commit with a restore"] > 0),
        ("requests that can never fit the device (INV-DEC-6)", capabilities.never_fit, ops["never-fit:sent"] > 0),
        ("cache flushes with the linker's work in flight (INV-LINK-7's reset)", capabilities.flushes,
         ops["linker:reset"] > 0),
        ("sessions closed by the client (INV-RP-3)", capabilities.priority_refs, ops["CloseSession"] > 0),
        ("priority changes (INV-RP-4)", capabilities.priority_refs and "update" in capabilities.priority_parts,
         ops["Reprioritize"] > 0),
    ]  # fmt: skip
    for what, declared, exercised in parts:
        if not declared:
            out.append(f"{what}: not declared by the target")
        elif not exercised:
            out.append(f"{what}: declared, but no step of this run exercised it")
    if not capabilities.priority_refs:
        out.append("priority tiers and session refs (SPEC.md §11, INV-RP-2/3/4): not declared by the target")
    out += [f"traffic outside a client rule the target declares ({r}): {CLIENT_RULES[r]}" for r in capabilities.client]
    out += [
        f"adapter deviation (the engine as certified differs from the engine as shipped): {d}"
        for d in capabilities.deviations
    ]
    return out


def run_requests(
    backend: Any,
    config: CacheConfig,
    capabilities: Capabilities,
    ops: Sequence[Op],
    hook: Optional[Callable[[int, Op, None], None]] = None,
    quiesce: bool = True,
) -> RequestHarness:
    """Replay a request-path trace; raises ConformanceFailure at the first broken rule (`driver.run_trace`'s twin)."""
    h = RequestHarness(backend, config, capabilities)
    try:
        for i, op in enumerate(ops):
            h.step(op)
            if hook is not None:
                hook(i, op, None)
        if quiesce:
            h.quiesce()
    finally:
        h.close()
    return h
