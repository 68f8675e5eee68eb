"""What clients send a served engine, drawn from a seed: conversations of multi-turn sessions (SPEC.md §16.1).

A `Conversation` is a few sessions that start close together, so that more requests are in flight than the pool
holds. A session opens on one of the conversation's two system prompts (drawn from the seed's four, so a later
conversation meets a prompt an earlier one cached, evicted or moved to the host), then sends turns: each turn's prompt is
the session's context (its last prompt and the answer it got) plus new tokens, sent after a think time. A turn
may carry the session's priority, its partition key (a cache salt or an extra key, where the engine takes them),
be aborted by the client shortly after it is sent, or be cut by a client that disconnects mid-stream. A malformed
request may stand in for a turn (it is not part of the context). The session may be closed at the end.

Everything here is a pure function of `(seed, index, Traffic)`, drawn with `random.Random` from a string seed:
the same seed gives the same conversations in any process. What the engine answers decides the later prompts, as
it does for a real client; a correct engine answers the same, so the same seed sends the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

__all__ = ["MALFORMED", "Conversation", "Session", "Traffic", "Turn", "conversation"]

MALFORMED: dict[str, str] = {
    "bad-json": "a body that is not JSON",
    "negative-max-tokens": "a negative output length",
    "wrong-type": "an output length that is a string",
    "empty-prompt": "an empty prompt",
    "negative-temperature": "a negative temperature",
    "prompt-id-out-of-vocab": "a prompt token id at or past the vocabulary's end",
    "negative-prompt-id": "a negative prompt token id",
    "too-long": "a prompt and output longer than the context",
}
"""Malformed requests the traffic may send, each of which a correct server refuses with a 4xx."""


@dataclass(frozen=True)
class Traffic:
    """How a target's traffic is drawn: the engine's limits and which features it serves."""

    vocab: int
    context: int
    pool_tokens: int
    block: int
    sessions: tuple[int, int] = (3, 6)
    turns: tuple[int, int] = (1, 4)
    system_tokens: tuple[int, int] = (32, 96)
    new_tokens: tuple[int, int] = (8, 64)
    output_tokens: tuple[int, int] = (4, 24)
    think: tuple[float, float] = (0.0, 0.6)
    priorities: tuple[int, ...] = ()
    """Priority values clients send (empty: the engine is not told priorities)."""
    keys: tuple[str, ...] = ()
    """Partition keys the engine takes per request: "cache_salt", "extra_key"."""
    sessions_closed: bool = False
    """The engine has a session close (SGLang's /close_session, the fork's /release_ref)."""
    session_ids: bool = False
    """Clients send their session's id with every turn (SGLang's session_id, --enable-session-radix-cache)."""
    session_rid: bool = False
    """A session's turns share one request id: the engine names a conversation by it (the fork's rid)."""
    update_ref: bool = False
    """A client announces its session's new priority before the turn that carries it (the fork's /update_ref)."""
    retain_hints: bool = False
    """A client sends, with each turn but its session's last, how long it will pause before the next (the next turn's
    think time and a second): a retention hint (kvcert's SGLang backend with KVCERT_RETENTION=1, SPEC.md §11.7)."""
    abort: str = ""
    """How a client aborts a request in flight: "endpoint" (the engine's abort call) or "" (none)."""
    cut: bool = True
    """Clients may disconnect mid-stream."""
    malformed: tuple[str, ...] = tuple(MALFORMED)
    p_abort: float = 0.08
    p_cut: float = 0.08
    p_malformed: float = 0.06
    p_key: float = 0.3


@dataclass(frozen=True)
class Turn:
    new: tuple[int, ...]
    """Tokens appended to the session's context for this turn."""
    max_new_tokens: int
    think: float
    """Seconds the client waits after its previous answer (or the session's start) before sending."""
    priority: Optional[int] = None
    abort_after: Optional[float] = None
    """The client aborts the request this many seconds after sending it (None: it does not)."""
    cut_after: Optional[int] = None
    """The client disconnects after this many streamed tokens (None: it reads to the end)."""
    malformed: Optional[str] = None
    """A malformed request of this kind is sent in this turn's place (`MALFORMED`)."""
    skip_update: bool = False
    """The client changes its session's priority with this turn without announcing it first (where the engine asks
    for an announcement: the fork's /update_ref)."""
    prompt: Optional[tuple[int, ...]] = None
    """The prompt sent, once sent (kept in a replay file: a replay sends exactly it)."""


@dataclass(frozen=True)
class Session:
    sid: str
    system: Optional[int]
    """Index of the conversation's shared system prompt it opens with (None: no system prompt)."""
    turns: tuple[Turn, ...]
    start: float
    close: bool = False
    key: Optional[tuple[str, str]] = None
    """(kind, value): a partition key sent with every turn (`Traffic.keys`)."""


@dataclass(frozen=True)
class Conversation:
    seed: int
    index: int
    systems: tuple[tuple[int, ...], ...]
    sessions: tuple[Session, ...] = field(default_factory=tuple)

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(body: dict[str, Any]) -> Conversation:
        def turn(t: dict[str, Any]) -> Turn:
            prompt = t.get("prompt")
            return Turn(**{**t, "new": tuple(t["new"]), "prompt": tuple(prompt) if prompt is not None else None})

        sessions = tuple(
            Session(
                **{
                    **s,
                    "turns": tuple(turn(t) for t in s["turns"]),
                    "key": tuple(s["key"]) if s.get("key") else None,
                }
            )
            for s in body["sessions"]
        )
        return Conversation(
            seed=body["seed"], index=body["index"], systems=tuple(tuple(x) for x in body["systems"]), sessions=sessions
        )

    def without(self, session: int) -> Conversation:
        return replace(self, sessions=self.sessions[:session] + self.sessions[session + 1 :])

    def with_session(self, i: int, session: Session) -> Conversation:
        return replace(self, sessions=self.sessions[:i] + (session,) + self.sessions[i + 1 :])


def _tokens(rng: random.Random, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))  # 0, 1, 2: the tokenizer's specials


def conversation(seed: int, index: int, traffic: Traffic) -> Conversation:
    """Conversation `index` of `seed` (a pure function: same arguments, same conversation)."""
    rng = random.Random(f"kvcert-served:{seed}:{index}")
    t = traffic
    shared = random.Random(f"kvcert-served:{seed}:systems")  # the seed's system prompts, shared by its conversations
    pool = [_tokens(shared, t.vocab, shared.randint(*t.system_tokens)) for _ in range(4)]
    systems = tuple(rng.sample(pool, 2))
    sessions = []
    for s in range(rng.randint(*t.sessions)):
        system = rng.choice((None, 0, 0, 1, 1))
        used = len(systems[system]) if system is not None else 0
        priority = rng.choice(t.priorities) if t.priorities else None
        key = None
        if t.keys and rng.random() < t.p_key:
            key = (rng.choice(t.keys), rng.choice(("a", "b")))
        turns = []
        for k in range(rng.randint(*t.turns)):
            new = _tokens(rng, t.vocab, rng.randint(*t.new_tokens))
            out = rng.randint(*t.output_tokens)
            if used + len(new) + out + 1 > min(t.context, t.pool_tokens) // 2:
                break  # the session's context would outgrow half the pool: the client stops here
            think = round(rng.uniform(*t.think), 3) if k else 0.0
            malformed = None
            if t.malformed and rng.random() < t.p_malformed:
                malformed = rng.choice(t.malformed)
            abort_after = cut_after = None
            if malformed is None and t.abort and rng.random() < t.p_abort:
                abort_after = round(rng.uniform(0.0, 0.3), 3)
            elif malformed is None and t.cut and rng.random() < t.p_cut:
                cut_after = rng.randint(0, max(0, out - 1))
            if priority is not None and t.priorities and rng.random() < 0.15:
                priority = rng.choice(t.priorities)  # a later turn at another priority
            turns.append(Turn(new, out, think, priority, abort_after, cut_after, malformed))
            if malformed is None:
                used += len(new) + out
        if not turns:
            continue
        sessions.append(
            Session(
                sid=f"c{index:03d}s{s:02d}",
                system=system,
                turns=tuple(turns),
                start=round(rng.uniform(0.0, 0.5), 3),
                close=t.sessions_closed and rng.random() < 0.8,
                key=key,
            )
        )
    return Conversation(seed, index, systems, tuple(sessions))


def request_id(session: Session, turn: int) -> str:
    """A request id of one length for every request (no id extends another: SG-ABORT's prefix match is not sent)."""
    return f"{session.sid}t{turn:02d}"


def malformed_body(kind: str, prompt: Sequence[int], vocab: int, context: int) -> tuple[str, Any]:
    """The body of a malformed request: ("raw", text) for bytes that are not JSON, else ("json", the fields that
    differ from a well-formed request: a prompt and an output length)."""
    prompt = list(prompt) or [3]
    if kind == "bad-json":
        return "raw", '{"prompt": [1, 2'
    fields: dict[str, Any] = {"prompt": prompt, "max_new_tokens": 4}
    if kind == "negative-max-tokens":
        fields["max_new_tokens"] = -3
    elif kind == "wrong-type":
        fields["max_new_tokens"] = "four"
    elif kind == "empty-prompt":
        fields["prompt"] = []
    elif kind == "negative-temperature":
        fields["temperature"] = -1.0
    elif kind == "prompt-id-out-of-vocab":
        fields["prompt"] = prompt[:8] + [vocab + 7]
    elif kind == "negative-prompt-id":
        fields["prompt"] = prompt[:8] + [-5]
    elif kind == "too-long":
        fields["prompt"] = (prompt * (context // len(prompt) + 2))[: context + 8]
    else:
        raise ValueError(f"unknown malformed request kind {kind!r}; known: {sorted(MALFORMED)}")
    return "json", fields
