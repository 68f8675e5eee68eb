"""Request-path targets (SPEC.md §12): the harness passes kvcert's reference engine and catches each way an engine's
request handling can go wrong, with a hand-written trace and by generation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcert.conformance.certification.certify import certify
from kvcert.conformance.certification.replay import replay
from kvcert.conformance.harness.requests import turn_tokens
from kvcert.conformance.reference.engine import ReferenceEngine, _Request
from kvcert.conformance.reference.engine import factory as engine_factory
from kvcert.refimpl import RefCache
from kvcert.spec.ops import AbortRequest, CloseSession, Op, Reprioritize, Step, Submit
from kvcert.spec.requests import output_token
from kvcert.spec.types import CacheConfig

CONFIG = CacheConfig(page_size=1, capacity=24, high_priority_threshold=1)
CAPS = engine_factory.capabilities  # type: ignore[attr-defined]


def _factory(engine: type[ReferenceEngine]) -> Callable[[CacheConfig], ReferenceEngine]:
    def make(config: CacheConfig) -> ReferenceEngine:
        return engine(RefCache(config), config)

    make.capabilities = CAPS  # type: ignore[attr-defined]
    return make


class _RegistersShort(ReferenceEngine):
    """Registers a finished turn's session on the node its match ended on, not its insert's: what it decoded and
    cached is left unprotected (the RefAware fork's device cache does this: its insert reports no node)."""

    def register(self, r: _Request, node: int) -> None:
        super().register(r, r.node if r.node is not None else node)


class _ReregistersClosed(ReferenceEngine):
    """A turn that finishes after its session's close registers the session again: refs nothing will release."""

    def registers(self, r: _Request) -> bool:
        return r.session is not None


class _KeepsEveryRequest(ReferenceEngine):
    """Keeps a record of every request it served, forever."""

    def _end(self, r: _Request, state: str) -> None:
        self.served = [*getattr(self, "served", []), r.id]
        super()._end(r, state)

    def bookkeeping(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {**super().bookkeeping(), "served": (len(getattr(self, "served", [])), ())}


class _FreesRowEarly(ReferenceEngine):
    """Frees the last slot of a request's row as soon as its prefill is done, while it still decodes into it."""

    def _forward(self, r: _Request) -> None:
        prefilled = r.computed >= r.target
        super()._forward(r)
        if not prefilled and r.computed >= r.target and r.state == "running" and len(r.row) > r.protected:
            self.cache.free(r.row[-1:])


class _RaisesOnClassChange(ReferenceEngine):
    """Refuses a session's turn in the other priority class with an untyped error (the RefAware fork's R1)."""

    def register(self, r: _Request, node: int) -> None:
        old = next((s for s in self.cache.snapshot().sessions if s.id == r.session), None)
        if old is not None and old.high != (self.open[r.session] >= self.config.high_priority_threshold):
            raise ValueError("Priority class mismatch")
        super().register(r, node)


class _MissesRunningTurn(ReferenceEngine):
    """A priority change reaches the registered session but not its turn in flight, which finishes at its old one."""

    def _take(self, message: tuple[Any, ...]) -> None:
        if message[0] == "priority" and message[1] in self.open:
            session, priority = message[1], message[2]
            if any(s.id == session for s in self.cache.snapshot().sessions):
                self.cache.update_ref(session, priority)
            return
        super()._take(message)

    def register(self, r: _Request, node: int) -> None:
        self.open[r.session] = r.priority  # type: ignore[index]
        super().register(r, node)


def _turn(request: str, session: str | None, tokens: tuple[int, ...], priority: int = 1, output: int = 2) -> Submit:
    return Submit(request, None, tokens, priority, output, session)


NEXT_TURN = turn_tokens(None, (1, 2), 2) + (7, 7)
"""The second turn of a conversation whose first was `_turn(..., (1, 2))`: its prompt, answer and new tokens."""


def _steps(n: int) -> list[Op]:
    return [Step() for _ in range(n)]


DIRECTED: list[tuple[type[ReferenceEngine], list[Op], str]] = [
    (_RegistersShort, [_turn("r1", "s0", (1, 2, 3)), *_steps(3), _turn("r2", "s0", turn_tokens(None, (1, 2, 3), 2) + (0, 1)), *_steps(3)],
     "INV-RP-2"),
    (_ReregistersClosed, [_turn("r1", "s0", (1, 2, 3, 1, 1, 1), output=3), Step(), CloseSession("s0"), *_steps(4)],
     "INV-RP-3"),
    (_KeepsEveryRequest, [_turn("r1", None, (1, 2)), _turn("r2", None, (2, 2)), *_steps(3)], "INV-LIVE-2"),
    (_FreesRowEarly, [_turn("r1", None, (1, 2, 3), output=3), Step(), _turn("r2", None, (3, 3, 3, 3)), *_steps(4)],
     "INV-"),
    (_RaisesOnClassChange, [_turn("r1", "s0", (1, 2)), *_steps(3), _turn("r2", "s0", turn_tokens(None, (1, 2), 2) + (0, 1), priority=0),
                            *_steps(3)], "INV-RP-1"),
    (_MissesRunningTurn, [_turn("r1", "s0", (1, 2)), *_steps(3), _turn("r2", "s0", turn_tokens(None, (1, 2), 2) + (0, 1), priority=1, output=3),
                          Step(), Reprioritize("s0", 0), *_steps(4)], "INV-RP-4"),
]  # fmt: skip


def test_the_reference_engine_passes_every_directed_trace() -> None:
    for _, ops, _ in DIRECTED:
        got = replay(engine_factory, CAPS, CONFIG, ops)
        assert got.failure is None, got.failure


@pytest.mark.parametrize("engine,ops,rule", DIRECTED, ids=[d[0].__name__.strip("_") for d in DIRECTED])
def test_each_defect_breaks_its_rule(engine: type[ReferenceEngine], ops: list[Op], rule: str) -> None:
    got = replay(_factory(engine), CAPS, CONFIG, ops)
    assert got.failure is not None, f"{engine.__name__} passed"
    assert any(v.inv.startswith(rule) for v in got.failure.violations), got.failure


@pytest.mark.parametrize(
    "engine", [_RegistersShort, _ReregistersClosed, _KeepsEveryRequest, _FreesRowEarly, _RaisesOnClassChange,
               _MissesRunningTurn],
    ids=lambda e: e.__name__.strip("_"),
)  # fmt: skip
def test_generation_finds_each_defect(engine: type[ReferenceEngine], tmp_path: Path, monkeypatch: Any) -> None:
    """The request machine reaches each defect on its own, within a small budget, in one device cell."""
    import sys

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "mutant", _factory(engine), raising=False)
    cert = certify(f"{__name__}:mutant", examples=120, steps=40, page_sizes=[1], policies=["lru"],
                   write_policies=[], prefetch_policies=[], out_dir=tmp_path)  # fmt: skip
    assert not cert.passed and cert.cells[0].failure, f"{engine.__name__} survived generation"
    assert cert.cells[0].reproduced


def test_a_reference_engine_certificate_says_what_it_did_not_check(tmp_path: Path) -> None:
    cert = certify("kvcert.conformance.reference.engine:factory", examples=10, steps=30, page_sizes=[1], policies=["lru"],
                   write_policies=[], prefetch_policies=[], out_dir=tmp_path)  # fmt: skip
    assert cert.passed and cert.kind == "request-path" and cert.total_steps > 0
    assert any("reference model beside the engine" in g for g in cert.not_checked)
    ops = cert.cells[0].ops
    assert ops.get("event:finished", 0) > 0 and ops.get("kv:entries", 0) > 0 and ops.get("CloseSession", 0) > 0


def test_a_turns_output_is_the_models() -> None:
    """The client knows a turn's whole conversation without asking the engine (SPEC.md §12.1)."""
    prompt = (1, 2, 3)
    whole = turn_tokens(None, prompt, 3)
    assert whole[:3] == prompt and len(whole) == 6
    assert whole[3] == output_token(None, prompt) and whole[5] == output_token(None, whole[:5])


def test_a_request_trace_round_trips_and_replays(tmp_path: Path) -> None:
    from kvcert.spec.ops import Trace

    ops = [_turn("r1", "s0", (1, 2)), Step(), AbortRequest("r1"), Step(), CloseSession("s0")]
    text = Trace(config=CONFIG, ops=tuple(ops), target="kvcert.conformance.reference.engine:factory").to_json()
    back = Trace.from_json(text)
    assert list(back.ops) == ops
    assert replay(engine_factory, CAPS, CONFIG, back.ops).failure is None


@pytest.mark.parametrize(
    "rule,ops",
    [
        ("no-aborts", [_turn("r1", None, (1, 2)), AbortRequest("r1")]),
        ("sessions-only", [_turn("r1", None, (1, 2))]),
        ("idle-changes", [_turn("r1", "s0", (1, 2), output=3), CloseSession("s0")]),
        ("idle-changes", [_turn("r1", "s0", (1, 2), output=3), Reprioritize("s0", 0)]),
        ("idle-changes", [_turn("r1", "s0", (1, 2)), *_steps(8), _turn("r2", "s0", NEXT_TURN, priority=0)]),
        ("distinct-ids", [_turn("r1", None, (1, 2)), _turn("r1.2", None, (2, 2))]),
        ("distinct-ids", [_turn("r10", None, (1, 2)), _turn("r1", None, (2, 2))]),
    ],
)
def test_a_trace_outside_the_targets_client_rules_is_out_of_its_scope(rule: str, ops: list[Op]) -> None:
    """A target's clients keep its rules (Capabilities.client): a trace that breaks one (another target's logged
    trace, a shrink candidate) is not played, and says which rule; the same trace plays on a target without it."""
    from dataclasses import replace as with_

    assert replay(engine_factory, CAPS, CONFIG, ops).failure is None
    got = replay(engine_factory, with_(CAPS, client=(rule,)), CONFIG, ops)
    assert got.failure is None and got.invalid.endswith(rule), got.invalid


def test_idle_changes_clients_send_a_turn_at_the_priority_they_last_set_or_after_a_close_at_any() -> None:
    """A turn in another class without a priority change first is what the fork's R1 needs; its bench clients never
    send one, so a shrunk trace that does is not theirs."""
    from dataclasses import replace as with_

    caps = with_(CAPS, client=("idle-changes",))
    changed = [_turn("r1", "s0", (1, 2)), *_steps(8), Reprioritize("s0", 0), Step(), _turn("r2", "s0", NEXT_TURN, priority=0)]
    closed = [_turn("r1", "s0", (1, 2)), *_steps(8), CloseSession("s0"), Step(), _turn("r2", "s0", (5, 6), priority=0)]
    for ops in (changed, closed):
        got = replay(engine_factory, caps, CONFIG, ops)
        assert got.failure is None and not got.invalid, got.invalid


def test_distinct_ids_clients_send_ids_none_of_which_starts_with_another(tmp_path: Path, monkeypatch: Any) -> None:
    from dataclasses import replace as with_

    from kvcert.conformance.harness.requests import RequestHarness

    sent: list[str] = []
    step = RequestHarness.step

    def recording(self: RequestHarness, op: Op) -> None:
        if isinstance(op, Submit):
            sent.append(str(op.request))
        step(self, op)

    monkeypatch.setattr(RequestHarness, "step", recording)
    caps = with_(CAPS, client=("distinct-ids",))
    cert = certify("kvcert.conformance.reference.engine:factory", examples=20, steps=30, page_sizes=[1], policies=["lru"],
                   write_policies=[], prefetch_policies=[], out_dir=tmp_path,
                   factory=_with_caps(engine_factory, caps))  # fmt: skip
    assert cert.passed and cert.total_steps > 0
    assert any("(distinct-ids)" in g for g in cert.not_checked)
    assert len(sent) > 20 and not any(a != b and a.startswith(b) for a in sent for b in sent)


def _with_caps(make: Any, caps: Any) -> Any:
    def factory(config: CacheConfig) -> Any:
        return make(config)

    factory.capabilities = caps  # type: ignore[attr-defined]
    return factory


@pytest.mark.parametrize("name, locks", [("sglang-0.5.23", True), ("refaware-0.5.10", False), ("core", False)])
def test_a_pending_loads_host_lock_is_judged_as_the_targets_profile_says(name: str, locks: bool) -> None:
    """INV-HOST-6's LOAD_LOCK clause (a pending load host-locks its anchor) binds only a profile that pins it to
    SGLang's choice: the fork keeps a loading node's host copy by the load's own pins (H1), so judging its request
    path by SGLang's choice reported a defect the fork's design does not have."""
    from dataclasses import replace

    from kvcert.conformance.harness.requests import RequestHarness

    h = RequestHarness(engine_factory(CONFIG), CONFIG, replace(CAPS, profile=name))
    try:
        assert h.checks.load_host_lock is locks
    finally:
        h.close()


class _CachesAbortedTurn(ReferenceEngine):
    """An aborted running turn caches what it computed and registers its session at the turn's own priority, as a
    finished one does (the RefAware fork's abort path); `at` registers it at another priority instead."""

    at: int | None = None

    def _end(self, r: _Request, state: str) -> None:
        if state != "aborted" or r.state != "running":
            super()._end(r, state)
            return
        if self.at is not None and r.session is not None:
            self.open[r.session] = self.at
        super()._end(r, "finished")
        r.state = "aborted"


class _CachesAbortedTurnAtZero(_CachesAbortedTurn):
    at = 0


ABORTED_RAISE = [_turn("r1", "s0", (1, 2)), *_steps(3), _turn("r2", "s0", NEXT_TURN, priority=2, output=3), Step(),
                 AbortRequest("r2"), *_steps(3)]  # fmt: skip
"""A turn at priority 1 finishes; the next turn, at 2, is aborted once its prefill ran."""


def test_an_aborted_turn_may_leave_its_session_at_its_own_priority_and_no_other() -> None:
    """INV-RP-4 after an abort (SPEC.md §12.2): the session stays at its priority, or takes the aborted turn's if the
    engine registered what the turn cached; a third priority is a defect."""
    assert replay(engine_factory, CAPS, CONFIG, ABORTED_RAISE).failure is None
    got = replay(_factory(_CachesAbortedTurn), CAPS, CONFIG, ABORTED_RAISE)
    assert got.failure is None, got.failure
    got = replay(_factory(_CachesAbortedTurnAtZero), CAPS, CONFIG, ABORTED_RAISE)
    assert got.failure is not None and [v.inv for v in got.failure.violations] == ["INV-RP-4"], got.failure
    assert "an aborted turn's: [2]" in str(got.failure)
