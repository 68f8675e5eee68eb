# Over 600 lines: the client's model of every request and session, which INV-RP-1..6 and the liveness rules all read.
"""Request-path targets (SPEC.md §12): an engine driven through its own scheduler code, judged after every op.

The API-level harness (`conformance.harness.driver`) composes a cache's calls in the scheduler's place and compares the
cache with the reference model step by step. Here the engine's scheduler makes every call: the harness only sends
what clients send (`Submit`, `Step`, `CloseSession`, `Reprioritize`, `AbortRequest`), plays the model
(`ModelPlayer`: the spec's KV bytes and output tokens) and observes. After every op it judges the engine's
snapshot by the state invariants and every KV byte, each request in flight by the bytes its row reads, and the
engine's request handling by §12's rules: a finished turn registered as far as it is cached (INV-RP-2), a close
that stays closed (INV-RP-3), a priority change that reaches the session (INV-RP-4), an exception out of the
scheduler (INV-RP-1: the serving process exits), bookkeeping that names live nodes and is back to where it
started once the client is done (INV-LIVE-2), and every request finishing (INV-LIVE-3).

The traffic comes from `conformance.generation.request_machine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.conformance.backend import close_backend
from kvcert.conformance.harness.checks import Checks, _read_flat
from kvcert.conformance.harness.driver import ConformanceFailure
from kvcert.conformance.harness.ledger import Ledger
from kvcert.conformance.harness.running import TraceInvalid
from kvcert.conformance.harness.side import KVModel
from kvcert.spec import contracts, pages
from kvcert.spec.invariants import Violation, check_snapshot
from kvcert.spec.ops import (
    AbortRequest,
    CloseSession,
    Flush,
    LinkerFault,
    Op,
    PeerFault,
    Reprioritize,
    Step,
    Submit,
)
from kvcert.spec.page_table import PageTable, check_pages, holders_exact
from kvcert.spec.profiles import profile
from kvcert.spec.requests import RequestView, kv_namespace, output_token
from kvcert.spec.types import CacheConfig, Capabilities, Snapshot

__all__ = ["ModelPlayer", "RequestHarness", "tree_prefix_len", "turn_tokens"]


class ModelPlayer:
    """The model a request-path target's forward pass runs (`conformance.backend.Model`): the spec's KV entries
    (SPEC.md §9.12) and output tokens (`output_token`)."""

    def __init__(self, kv: KVModel) -> None:
        self._kv = kv

    def kv(self, namespace: Optional[str], tokens: Sequence[int], start: int, count: int) -> list[bytes]:
        return list(self._kv.entries(namespace, tuple(tokens))[start : start + count])

    def next_token(self, namespace: Optional[str], tokens: Sequence[int]) -> int:
        return output_token(namespace, tuple(tokens))


def turn_tokens(namespace: Optional[str], prompt: Sequence[int], output: int) -> tuple[int, ...]:
    """A turn's whole conversation once it has decoded `output` tokens: its prompt, then what the model sampled."""
    tokens = tuple(prompt)
    for _ in range(output):
        tokens += (output_token(namespace, tokens),)
    return tokens


NEVER_FIT_IDLE = 32
"""Steps in a row in which no request moves, with the client done, after which a request that can never fit and is
still in flight is judged left waiting (INV-DEC-6), instead of running the liveness bound out."""


@dataclass
class _Sent:
    """A request as the client sent it."""

    op: Submit
    at: int
    done: bool = False
    """Its finish or abort has been seen."""
    max_output: Optional[int] = None
    """Its output length as the engine set it on arrival (RequestView.max_output); None: as the client asked."""

    @property
    def output(self) -> int:
        """The most output tokens the engine will decode for it: the engine's own figure where it gave one."""
        return _int(self.op.output) if self.max_output is None else self.max_output


@dataclass
class _Session:
    """A session as the client sees it."""

    closed_at: Optional[int] = None
    """The op index of its close, while no turn was sent after it."""
    close_taken: bool = False
    """A step ran after the close: the engine has taken it."""
    priority: Optional[int] = None
    """The priority it is registered at, as the client expects: its last finished turn's, or a later change's."""
    turn: Optional[int] = None
    """The priority its turn in flight will register at: the turn's own, or a change sent since."""
    priority_taken: bool = True
    """A step ran since the latest change."""
    aborted_turns: frozenset[int] = frozenset()
    """Priorities of its turns aborted since its last finished turn or change: each one it may hold (INV-RP-4)."""
    retained_until: Optional[int] = None
    """Its latest finished turn's finish time plus that turn's retention hint, in the harness's seconds; None when
    that turn had no hint, or the session was closed since (INV-RP-6)."""
    retained_before: Optional[int] = None
    """What it was retained until when its turn in flight was sent: the engine may keep that until the turn's first
    checkpoint registers it again, or until it takes a close sent before the turn."""
    sent_at: int = 0
    """The harness's time when its latest turn was sent: an engine that keeps a waiting turn's retention
    (`retain_waiting`, SPEC.md §11.7) shows the retention as from the turn's arrival, no earlier."""


@dataclass
class RequestHarness:
    """A request-path target, the client's record of what it sent, and the checks of SPEC.md §12."""

    backend: Any
    config: CacheConfig
    capabilities: Capabilities
    ops: list[Op] = field(default_factory=list)
    clock: int = 0
    rejected: list[int] = field(default_factory=list)
    """Steps the oracle rejected as bad input: none here (a client's message is never bad input to a scheduler)."""
    count_windows: bool = False
    windows: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    ignore: frozenset[str] = frozenset()
    closed: bool = False
    sent: dict[str, _Sent] = field(default_factory=dict)
    sessions: dict[str, _Session] = field(default_factory=dict)
    finished: dict[str, RequestView] = field(default_factory=dict)
    """Each request the engine reported finished, as it reported it."""
    aborted: set[str] = field(default_factory=set)
    """The requests the client aborted."""
    retained_seen: int = 0
    """Retained sessions seen across the snapshots judged (INV-RP-6): how much the run exercised retention."""
    waiting_seen: int = 0
    """Of those, the ones held for a waiting turn (`SessionView.waiting`, §11.7's engine half)."""
    conversation: dict[str, tuple[Any, tuple[int, ...]]] = field(default_factory=dict)
    """Per open session: its (namespace, LoRA adapter) and its conversation so far (its last finished turn, prompt and
    output)."""

    def moves(self) -> bool:
        """Whether the target moves a session registered again anywhere (`PRIORITY_PARTS["move"]`)."""
        return self.capabilities.priority_refs and "move" in self.capabilities.priority_parts

    def continues(self, session: str, key: Any, tokens: Sequence[Any]) -> bool:
        """Whether a turn of `session` under `key` ((namespace, LoRA adapter)) with this prompt continues its
        conversation (or the session has none open)."""
        if session not in self.conversation:
            return True
        said_key, said = self.conversation[session]
        return key == said_key and tuple(tokens[: len(said)]) == said

    def __post_init__(self) -> None:
        try:
            self.model = KVModel(self.config.kv_layers)
            self.backend.attach_model(ModelPlayer(self.model))
            self.checks = Checks(
                self.backend,
                self.config,
                self.capabilities,
                Ledger(),
                self.model,
                profile(self.capabilities.profile).load_host_lock,
            )
            self.baseline = {k: v[0] for k, v in self.backend.bookkeeping().items()}
            self._check(0, None)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        close_backend(self.backend)

    # ------------------------------------------------------------------ queries the generator asks

    def in_flight(self) -> list[str]:
        """Requests sent and neither finished nor aborted, in the order they were sent."""
        return [r for r, s in self.sent.items() if not s.done]

    def busy_sessions(self) -> set[str]:
        return {s.op.session for s in self.sent.values() if not s.done and s.op.session is not None}

    def open_sessions(self) -> list[str]:
        return [s for s, st in self.sessions.items() if st.closed_at is None]

    # ------------------------------------------------------------------ one op

    def step(self, op: Op) -> None:
        if isinstance(op, Submit) and (op.request in self.sent or op.session in self.busy_sessions()):
            # No client does this (SPEC.md §12.1): only shrinking makes such a trace, and it is not kept.
            raise TraceInvalid(f"{op.request}: a request id sent twice, or a second turn of a session in flight")
        if isinstance(op, Submit) and op.session is not None and not self.moves():
            if not self.continues(op.session, (op.namespace, op.lora), op.tokens):
                # A turn elsewhere moves its session; the client of an engine without moves closes it first.
                raise TraceInvalid(f"{op.request}: a turn of {op.session} that does not continue its conversation")
        broken = self._outside_client_rules(op)
        if broken:  # the target's clients never send it (a logged trace of another target, or a shrink candidate)
            raise TraceInvalid(f"outside this target's client rules: {broken}")
        index = len(self.ops)
        self.ops.append(op)
        self.clock += 1
        self.backend.set_clock(self.clock)
        try:
            self._send(op)
        except Exception as err:  # out of the engine's own code: in a server, the scheduler process dies
            raise ConformanceFailure(
                index,
                op,
                [Violation("INV-RP-1", f"the engine raised {type(err).__name__}: {err} (the serving process exits)")],
            ) from err
        self._record(index, op)
        self._check(index, op)

    def _outside_client_rules(self, op: Op) -> str:
        """The client rule (`Capabilities.client`, CLIENT_RULES) `op` breaks, or ""."""
        rules = self.capabilities.client
        if "no-aborts" in rules and isinstance(op, AbortRequest):
            return "no-aborts"
        if isinstance(op, LinkerFault) and op.kind not in self.capabilities.linker_faults:
            return f"no linker fault {op.kind!r} (Capabilities.linker_faults)"
        if isinstance(op, Flush) and not self.capabilities.flushes:
            return "no cache flushes (Capabilities.flushes)"
        if isinstance(op, PeerFault) and op.kind not in self.capabilities.peer_faults:
            return f"no peer fault {op.kind!r} (Capabilities.peer_faults)"
        if isinstance(op, Submit) and self.never_fits(op) and not self.capabilities.never_fit:
            return "no request that can never fit the device (Capabilities.never_fit)"
        if isinstance(op, Submit) and op.lora is not None and not self.capabilities.loras:
            return "no LoRA adapters (Capabilities.loras)"
        if isinstance(op, Submit) and op.retain is not None and "retain" not in self.capabilities.priority_parts:
            return "no retention hints (Capabilities.priority_parts has no 'retain')"
        if "sessions-only" in rules and isinstance(op, Submit) and op.session is None:
            return "sessions-only"
        if "idle-changes" in rules and isinstance(op, (CloseSession, Reprioritize)):
            if op.session in self.busy_sessions():
                return "idle-changes"
        if "idle-changes" in rules and isinstance(op, Submit) and op.session is not None:
            st = self.sessions.get(op.session)  # a turn keeps the priority its client last set (a closed one: any)
            if st is not None and st.closed_at is None and st.turn is not None and op.priority != st.turn:
                return "idle-changes"
        if "distinct-ids" in rules and isinstance(op, Submit):
            rid = str(op.request)
            if any(rid.startswith(str(other)) or str(other).startswith(rid) for other in self.sent):
                return "distinct-ids"
        return ""

    def _send(self, op: Op) -> None:
        b = self.backend
        if isinstance(op, Submit):  # `lora`, `retain` only when set: a target without them takes no such argument
            adapter: dict[str, Any] = {"lora": op.lora} if op.lora is not None else {}
            if op.retain is not None:
                adapter["retain"] = op.retain
            b.submit(op.request, op.session, op.namespace, op.tokens, op.priority, op.output, **adapter)
        elif isinstance(op, Step):
            b.step()
        elif isinstance(op, CloseSession):
            b.close_session(op.session)
        elif isinstance(op, Reprioritize):
            b.reprioritize(op.session, op.priority)
        elif isinstance(op, AbortRequest):
            b.abort(op.request)
        elif isinstance(op, LinkerFault):
            b.linker_fault(op.kind)
        elif isinstance(op, PeerFault):
            b.peer_fault(op.kind)
        elif isinstance(op, Flush):
            b.flush()
        else:
            raise TypeError(f"{type(op).__name__} is not a request-path op (SPEC.md §12)")

    def _record(self, index: int, op: Op) -> None:
        """What the client now expects, from what it sent."""
        if isinstance(op, Submit):
            self.sent[op.request] = _Sent(op, index)
            if op.session is not None:  # a new turn reopens a closed session; its priority counts once it finishes
                old = self.sessions.get(op.session)
                kept = (old.priority, old.aborted_turns) if old else (None, frozenset[int]())
                before = old.retained_until if old else None
                self.sessions[op.session] = _Session(
                    priority=kept[0],
                    turn=op.priority,
                    aborted_turns=kept[1],
                    retained_until=before if old is not None and old.closed_at is None else None,
                    retained_before=before,
                    sent_at=self.clock,
                )
        elif isinstance(op, AbortRequest):
            self.aborted.add(op.request)
        elif isinstance(op, CloseSession) and op.session in self.sessions:
            self.conversation.pop(op.session, None)
            self.sessions[op.session].closed_at, self.sessions[op.session].close_taken = index, False
        elif isinstance(op, Reprioritize) and op.session in self.sessions:
            st = self.sessions[op.session]
            st.priority, st.turn, st.priority_taken = op.priority, op.priority, False
            st.aborted_turns = frozenset()
        elif isinstance(op, Step):
            for s in self.sessions.values():
                s.close_taken = s.close_taken or s.closed_at is not None
                s.priority_taken = True

    def _snapshot(self, index: int, op: Optional[Op]) -> tuple[Any, tuple[RequestView, ...]]:
        try:
            snap, views = self.backend.snapshot(), tuple(self.backend.requests())
        except Exception as err:
            raise ConformanceFailure(
                index, op, [Violation("INV-ERR-3", f"reading the engine raised {type(err).__name__}: {err}")]
            ) from err
        for v in views:  # what the engine made of the request on arrival, judged from then on
            sent = self.sent.get(v.id)
            if sent is not None and v.max_output is not None:
                sent.max_output = v.max_output
        return snap, views

    def _check(self, index: int, op: Optional[Op]) -> None:
        snap, views = self._snapshot(index, op)
        if isinstance(snap, PageTable):  # a block-hash engine: the page-level core (SPEC.md §13)
            violations = check_pages(snap)
            if not violations:
                violations += self.checks.kv_pages(snap)
                violations += self._rows(views)
                violations += holders_exact(snap, views)
        else:
            violations = check_snapshot(snap, self.checks.load_host_lock)
            if not violations:  # KV is judged on a sound tree
                violations += self.checks.kv(snap)
                violations += self._rows(views)
        observe = getattr(self.backend, "observed", None)
        if observe is not None:  # what the engine's own outputs and calls showed (its events, its pool's calls)
            violations += observe(self.capabilities.profile)
        violations += self._turns(snap, views)
        violations += self._bookkeeping(snap)
        if self.ignore:
            violations = [v for v in violations if v.inv not in self.ignore]
        if violations:
            raise ConformanceFailure(index, op, violations)

    def _rows(self, views: tuple[RequestView, ...]) -> list[Violation]:
        """INV-REQ-2: every request in flight reads, through its row, the KV of its own tokens."""
        if not self.capabilities.kv_reads:
            return []
        checks = []
        failed = self._failed_loads()  # condemned (SGLang aborts them after the forward) or recomputing: INV-LINK-4
        for v in views:
            if v.state != "running" or not v.computed or v.id in failed:
                continue
            want = self.model.content(v.namespace, tuple(v.tokens))
            if want is not None:
                checks.append((v, v.row[: v.computed], want[: v.computed]))
        flat = _read_flat(self.backend.read_kv, [c[1] for c in checks])
        self.checks.kv_entries_read += len(flat)
        out, at = [], 0
        for v, slots, want in checks:
            got = flat[at : at + len(slots)]
            at += len(slots)
            if list(got) != list(want):
                bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), len(got))
                out.append(
                    Violation(
                        "INV-REQ-2",
                        f"request {v.id}: its row's slot {slots[bad] if bad < len(slots) else '?'} (token {bad}) holds "
                        "other KV than its own: a slot it still reads was freed or reused, or filled with other bytes",
                    )
                )
        return out

    def _turns(self, snap: Any, views: tuple[RequestView, ...]) -> list[Violation]:
        """INV-RP-2/3/4 (a priority-aware engine): what finished turns, closes and priority changes left registered."""
        out: list[Violation] = []
        registered = {s.id: s for s in snap.sessions}
        for v in views:
            sent = self.sent.get(v.id)
            if sent is None or sent.done or v.state not in ("finished", "aborted"):
                continue
            sent.done = True
            excused = v.id in self._failed_loads() or self._unfit(v.id)  # INV-LINK-4, INV-DEC-6
            never = [r for r in self.in_flight() if r != v.id and self._unfit(r)]
            if v.state == "aborted" and v.id not in self.aborted and not excused and never:
                out.append(Violation("INV-DEC-6", f"request {v.id} was aborted, and no client asked, while request "
                                     f"{never[0]}, which can never fit the device, was still in flight, not refused: "
                                     "it took room the requests the engine admitted needed"))  # fmt: skip
            elif v.state == "aborted" and v.id not in self.aborted and not excused:
                out.append(
                    Violation(
                        "INV-RP-5",
                        f"request {v.id} was aborted, and no client asked: the client aborted only "
                        f"{sorted(self.aborted) or 'nothing'}",
                    )
                )
            if (
                v.state == "finished"
                and v.id in self._failed_loads()
                and profile(self.capabilities.profile).aborts_failed_loads
            ):
                out.append(Violation("INV-LINK-4", f"request {v.id} finished normally after its load failed: its "
                                     "output was computed over slots the store did not fill"))  # fmt: skip
            if v.state == "aborted" and sent.op.session is not None:
                st = self.sessions.get(sent.op.session)
                if st is not None and st.closed_at is None and st.turn is not None:
                    st.aborted_turns |= {st.turn}
            if v.state == "finished":
                self.finished[v.id] = v
                st = self.sessions.get(sent.op.session) if sent.op.session is not None else None
                if st is not None and st.closed_at is None:  # a closed session's next turn starts afresh
                    ns = kv_namespace(sent.op.namespace, sent.op.lora)
                    turn = turn_tokens(ns, sent.op.tokens, sent.output)
                    self.conversation[sent.op.session] = ((sent.op.namespace, sent.op.lora), turn)
                st = self.sessions.get(sent.op.session) if sent.op.session is not None else None
                if st is not None and st.closed_at is None:
                    st.priority = st.turn  # the turn registered its session at its priority
                    st.aborted_turns = frozenset()
                    hint = sent.op.retain
                    st.retained_until = self.clock + _int(hint) if hint is not None else None
                out += self._registered_turn(snap, sent, v, registered)
        if not self.capabilities.priority_refs:
            return out
        flying = self.busy_sessions()
        if "retain" in self.capabilities.priority_parts:
            out += self._retained(registered, flying)
        holds_priority = "update" in self.capabilities.priority_parts  # an engine with no session priority: no INV-RP-4
        for name, st in self.sessions.items():
            if st.closed_at is not None and st.close_taken and name in registered:
                out.append(
                    Violation(
                        "INV-RP-3",
                        f"session {name} holds refs after the engine took its close (op {st.closed_at}): nothing the "
                        "client sends will release them",
                    )
                )
            elif (
                holds_priority
                and st.priority is not None
                and st.priority_taken
                and name not in flying
                and name in registered
            ) and registered[name].priority not in {st.priority, *st.aborted_turns}:
                out.append(
                    Violation(
                        "INV-RP-4",
                        f"session {name} is registered at priority {registered[name].priority}; the client set "
                        f"{st.priority} and the engine has taken it"
                        + (f" (an aborted turn's: {sorted(st.aborted_turns)})" if st.aborted_turns else ""),
                    )
                )
        return out

    def _retained(self, registered: dict[str, Any], flying: set[str]) -> list[Violation]:
        """INV-RP-6: each registered session is retained as its latest finished turn's hint says. While a turn of it
        is in flight, or after one was aborted, the old retention may stand or have ended (a turn's checkpoint
        registers the session again), or be held for that turn from its arrival, if it arrived within the retention
        (`retain_waiting`); past its deadline it may still show until the engine's clock next moves (expiry is lazy,
        and §11.7 judges it at the cache's own API)."""
        out = []
        for name, view in registered.items():
            st = self.sessions.get(name)
            if st is None or st.closed_at is not None:  # closed: INV-RP-3 judges it once the engine takes the close
                continue
            got, want = view.retained_until, st.retained_until
            self.retained_seen += got is not None
            self.waiting_seen += got is not None and view.waiting
            allowed = {want}
            if name in flying:
                allowed |= {None, st.retained_before}
            if st.aborted_turns:  # an aborted turn may have registered what it cached, which ends a retention
                allowed.add(None)
            if (name in flying or st.aborted_turns) and view.waiting and got is not None and st.retained_before:
                if st.sent_at <= got < st.retained_before:  # held from the turn's arrival, within the retention
                    allowed.add(got)  # (§11.7: until the turn registers; an aborted one's until the next turn's)
            if want is not None and self.clock >= want:
                allowed.add(None)
            if got not in allowed:
                said = f"a hint to {want}" if want is not None else "no hint"
                out.append(
                    Violation(
                        "INV-RP-6",
                        f"session {name} is retained until {got}; its latest finished turn gave {said} (now {self.clock})",
                    )
                )
        return out

    def never_fits(self, op: Submit, output: Optional[int] = None) -> bool:
        """INV-DEC-6: the request's prompt and output (`output`, else what the client asked) can never fit the device,
        whatever else it holds."""
        want = _int(op.output) if output is None else output
        return pages.page_ceil(len(op.tokens) + want, self.config.page_size) > self.config.capacity

    def _unfit(self, request: str) -> bool:
        """INV-DEC-6 for a request sent: judged by the output the engine will decode for it, not what the client
        asked (an engine that clips a request's output to its pool on arrival has made it fit)."""
        sent = self.sent[request]
        return self.never_fits(sent.op, sent.output)

    def _failed_loads(self) -> set[str]:
        """Requests whose external load the harness's store failed: the engine may fail them (INV-LINK-4)."""
        failed = getattr(self.backend, "failed_loads", None)
        return set(failed()) if failed is not None else set()

    def _registered_turn(
        self, snap: Snapshot, sent: _Sent, v: RequestView, registered: dict[str, Any]
    ) -> list[Violation]:
        """INV-RP-2: a finished turn of an open session leaves the session holding its cached tokens, exactly."""
        name = sent.op.session
        st = self.sessions.get(name) if name is not None else None
        if not self.capabilities.priority_refs or st is None or st.closed_at is not None:
            return []
        # The turn's own KV: every token but the last it sampled, which no forward pass computed.
        cached = tree_prefix_len(snap, v.namespace, tuple(v.tokens[: len(v.tokens) - 1]))
        if name not in registered:
            if cached == 0:
                return []
            return [Violation("INV-RP-2", f"turn {v.id} of session {name} finished with {cached} tokens cached; the "
                              "session holds nothing")]  # fmt: skip
        ns, path = snap.path_of(registered[name].node)
        if ns == v.namespace and path == tuple(v.tokens[:cached]):
            return []
        return [
            Violation(
                "INV-RP-2",
                f"turn {v.id} of session {name} finished with {cached} of its {len(v.tokens)} tokens cached; the "
                f"session holds a path of {len(path)} tokens"
                + ("" if path == tuple(v.tokens[: len(path)]) else " off them"),
            )
        ]

    def _bookkeeping(self, snap: Any) -> list[Violation]:
        """INV-LIVE-2's first clause: every node an engine index names is in the tree."""
        live = {p.id for p in snap.pages} if isinstance(snap, PageTable) else {n.id for n in snap.nodes}
        out = []
        for name, (_, nodes, *_cap) in self.backend.bookkeeping().items():
            gone = sorted(set(nodes) - live)
            if gone:
                out.append(Violation("INV-LIVE-2", f"{name} names nodes {gone[:5]} that are no longer in the tree"))
        return out

    # ------------------------------------------------------------------ ending a trace

    def quiesce(self) -> None:
        """The client stops sending: the engine runs until every request finished — once nothing moves any more, the
        client closes its sessions first (a high-priority session may hold what a low-priority request waits for) —
        and every session the client opened is closed. Afterwards nothing may be held or locked, and every index is
        back to its baseline."""
        bound = 64 + 4 * sum(len(s.op.tokens) + s.output for s in self.sent.values() if not s.done)
        self._run_down(bound, stall=16)
        self._close_sessions()
        never = any(self._unfit(r) for r in self.in_flight())
        self._run_down(bound, stall=NEVER_FIT_IDLE if never else 0)  # INV-DEC-6: left waiting while nothing moves
        self._close_sessions()  # those whose turn was still running: their client closes them once it ended
        if self.in_flight():
            snap, views = self._snapshot(len(self.ops) - 1, Step())
            where = {v.id: v.state for v in views}
            stuck = ", ".join(f"{r} ({where.get(r, 'unknown to the engine')})" for r in self.in_flight()[:5])
            unfit = [r for r in self.in_flight() if self._unfit(r)]
            raise ConformanceFailure(
                len(self.ops) - 1,
                Step(),
                [
                    Violation(
                        "INV-LIVE-3",
                        (f"{NEVER_FIT_IDLE} steps in a row in which nothing moved" if never else f"{bound} steps")
                        + f" after the client closed its sessions and sent nothing new, requests are unfinished: {stuck}",
                    )
                ]
                + [
                    Violation(
                        "INV-DEC-6",
                        f"request {r} can never fit the device ({len(self.sent[r].op.tokens)} prompt "
                        f"tokens, {self.sent[r].output} output, {self.config.capacity} slots) and is "
                        "still not refused: head of the line, it starves every request behind it",
                    )
                    for r in unfit[:2]
                ],  # fmt: skip
            )
        owes = getattr(self.backend, "owes", None)  # work taken and held by no request: a deferred flush
        for _ in range(8):  # the closes are taken, copies still moving land, and deferred work is done
            self.step(Step())
            if not self.backend.snapshot().pending and not (owes is not None and owes()):
                break
        self._idle(len(self.ops) - 1)

    def _close_sessions(self) -> None:
        """The client closes every session it opened; under the `idle-changes` client rule only those with no turn
        in flight (a busy one is closed after its turn ends)."""
        busy = self.busy_sessions() if "idle-changes" in self.capabilities.client else set()
        for name in self.open_sessions():
            if name not in busy:
                self.step(CloseSession(name))

    def _run_down(self, bound: int, stall: int = 0) -> None:
        """Step until no request is in flight, at most `bound` times; with `stall`, stop after that many steps in a
        row in which no request changed state or computed anything."""
        still, last = 0, None
        for _ in range(bound):
            if not self.in_flight():
                return
            self.step(Step())
            now = tuple((v.id, v.state, v.computed) for v in self.backend.requests())
            still = still + 1 if now == last else 0
            last = now
            if stall and still >= stall:
                return

    def _idle(self, index: int) -> None:
        snap, _ = self._snapshot(index, Step())
        out = []
        if isinstance(snap, PageTable):
            locked = [p.id for p in snap.pages if p.holders]
        else:
            locked = [n.id for n in snap.nodes if n.id != snap.root and n.lock_ref]
        left = {
            ("held pages" if isinstance(snap, PageTable) else "locked nodes"): len(locked),
            "slots held by requests": len(snap.lent_slots),
            "pending copies": len(snap.pending),
        }
        if any(left.values()):
            out.append(Violation("INV-LIVE-1", "every request finished, yet " + ", ".join(f"{v} {k}" for k, v in left.items() if v) + " remain"))  # fmt: skip
        if snap.sessions:
            ids = ", ".join(s.id for s in snap.sessions[:5])
            out.append(
                Violation(
                    "INV-LIVE-2",
                    f"every request finished and every session the client opened is closed, yet {len(snap.sessions)} "
                    f"sessions stay registered ({ids}): state kept per request served",
                )
            )
        for name, (n, _, *cap) in self.backend.bookkeeping().items():
            bound = cap[0] if cap and cap[0] is not None else None
            if n > self.baseline.get(name, 0) and (bound is None or n > bound):
                out.append(
                    Violation(
                        "INV-LIVE-2",
                        f"{name} holds {n} entries after the client is done (before the first request: "
                        f"{self.baseline.get(name, 0)}"
                        + ("" if bound is None else f"; its own cap: {bound}")
                        + "): it grows with the requests served",
                    )
                )
        if out:
            raise ConformanceFailure(index, Step(), out)


def _int(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def tree_prefix_len(snap: Snapshot, namespace: Optional[str], tokens: tuple[int, ...]) -> int:
    """How many of `tokens` the tree holds as a path, on either tier: the end of the deepest node on their path."""
    best = 0
    for ns, path in contracts.node_paths(snap).values():
        if ns == namespace and len(path) > best and tokens[: len(path)] == path:
            best = len(path)
    return best
