"""The end-to-end rules a served engine is judged by (SPEC.md §16.2), as pure functions of what was recorded.

Nothing here talks to a server: `run` records replies, occupancy readings, the event stream and the server's
log, and these functions say which rule each breaks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvcert.conformance.served.client import Malformed, Reply
from kvcert.conformance.served.events import Batch, BlockReplay

__all__ = ["RULES", "Judge", "Violation", "same_output"]

RULES: dict[str, str] = {
    "INV-E2E-1": "same output: every answer's greedy tokens and their logprobs equal a caching-off twin's for the "
    "same prompt, up to the first position where the twin's two best tokens tie",
    "INV-E2E-2": "answered: every well-formed request the client neither aborted nor cut is answered in full "
    "(HTTP 200, finished by length or a stop token) within the timeout; the engine aborts nothing on its own",
    "INV-E2E-3": "events agree: the KV-event stream has no sequence gap, stores no block under a parent it never "
    "stored, and removes no block it does not hold",
    "INV-E2E-4": "cached tokens are announced: no answer reports more cached prompt tokens than the replayed events "
    "held for its prompt at some point from its send until the idle server has published every event, and a prompt "
    "repeated with room to spare hits (positive control)",
    "INV-E2E-5": "bounded memory: once every session has closed and the server is idle, the KV the engine holds for "
    "requests and sessions is back to its baseline, and the engine's own idle check reports no leak",
    "INV-E2E-6": "alive: the server never exits, and a malformed request gets a 4xx",
}

TIE = 0.02
"""Logprob gap under which the twin's two best tokens count as tied: past a tie a correct engine may pick either
(batching and a cached prefix change float rounding), so nothing after it is compared."""
LOGPROB_TOL = 0.02
"""How far a served token's logprob may be from the twin's for the same token (float rounding, fp32 both)."""
EVENT_QUIET = 1.0
"""Seconds without a batch after which an idle server's stream is taken as drained. An engine may announce a block
long after a request used it (SGLang 0.5.23 publishes at a prefill, every 40th decode step, and when idle), so the
window of INV-E2E-4 ends where the idle server's stream does, not at a time after the answer."""
EVENT_LATE = 15.0
"""Seconds more the harness waits for batches, after the stream went quiet, while an answer reports cached tokens
the stream has not announced: on a loaded machine an idle server's publisher can be slower than `EVENT_QUIET`. An
engine that never announces them fails all the same, this much later."""


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str
    rid: str = ""

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


@dataclass
class Compared:
    """What `same_output` compared: tokens checked, and whether a tie ended the comparison early."""

    tokens: int = 0
    tie_at: Optional[int] = None
    max_logprob_gap: float = 0.0


def same_output(reply: Reply, twin: Reply, compared: Optional[Compared] = None) -> Optional[Violation]:
    """INV-E2E-1 for one answer against the twin's full answer to the same prompt."""
    c = compared if compared is not None else Compared()
    rid = reply.ask.rid
    if twin.status != 200 or twin.finish not in ("length", "stop"):
        return Violation("INV-E2E-1", f"{rid}: the twin did not answer ({twin.status} {twin.finish} {twin.error})", rid)
    got, want = reply.output, twin.output
    for i in range(min(len(got), len(want))):
        if got[i] != want[i]:
            gaps = [m for m in (_at(twin.margins, i), _at(reply.margins, i)) if m is not None]
            if gaps and min(gaps) < TIE:
                c.tie_at = i
                return None
            return Violation(
                "INV-E2E-1",
                f"{rid}: token {i} of the answer is {got[i]}, the caching-off twin's is {want[i]} "
                f"(logprob {_fmt(_at(reply.logprobs, i))} vs {_fmt(_at(twin.logprobs, i))}; "
                f"{reply.cached} prompt tokens reported cached of {len(reply.ask.prompt)})",
                rid,
            )
        a, b = _at(reply.logprobs, i), _at(twin.logprobs, i)
        if a is not None and b is not None:
            gap = abs(a - b)
            c.max_logprob_gap = max(c.max_logprob_gap, gap)
            if gap > LOGPROB_TOL:
                return Violation(
                    "INV-E2E-1",
                    f"{rid}: token {i} ({got[i]}) has logprob {a:.4f}, the twin's {b:.4f} "
                    f"({reply.cached} prompt tokens reported cached of {len(reply.ask.prompt)})",
                    rid,
                )
        c.tokens += 1
    if reply.finish in ("length", "stop") and len(got) != len(want):
        return Violation(
            "INV-E2E-1", f"{rid}: answered {len(got)} tokens ({reply.finish}), the twin {len(want)} ({twin.finish})", rid
        )
    if len(got) > len(want):
        return Violation("INV-E2E-1", f"{rid}: {len(got)} tokens streamed, more than the twin's {len(want)}", rid)
    return None


def _at(xs: Sequence[Optional[float]], i: int) -> Optional[float]:
    return xs[i] if i < len(xs) else None


def _fmt(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:.4f}"


def answered(reply: Reply) -> Optional[Violation]:
    """INV-E2E-2 for one answer."""
    rid = reply.ask.rid
    if reply.ask.intent == "cut":
        if reply.status not in (0, 200) or reply.finish == "error":
            return Violation("INV-E2E-2", f"{rid}: streamed request refused: {reply.status} {reply.error}", rid)
        return None
    if reply.ask.intent == "abort":
        if reply.status != 200 or reply.finish not in ("length", "stop", "abort"):
            return Violation("INV-E2E-2", f"{rid}: aborted request ended {reply.status} {reply.finish} {reply.error}", rid)
        return None
    if reply.status != 200:
        why = reply.error or "no response"
        return Violation("INV-E2E-2", f"{rid}: a well-formed request got HTTP {reply.status}: {why}", rid)
    if reply.finish not in ("length", "stop"):
        return Violation("INV-E2E-2", f"{rid}: ended {reply.finish!r} though its client never aborted it: {reply.error}", rid)
    return None


def refused(m: Malformed, server_alive: bool) -> Optional[Violation]:
    """INV-E2E-6 for one malformed request."""
    if 400 <= m.status < 500:
        return None
    if not server_alive:
        return Violation("INV-E2E-6", f"a malformed request ({m.kind}) and the server exited: {m.body}")
    return Violation("INV-E2E-6", f"a malformed request ({m.kind}) got HTTP {m.status}: {m.body}")


@dataclass
class Judge:
    """The event stream replayed across a run, and the cached-token bound of each answer judged against it."""

    block: int
    replay: BlockReplay = field(default_factory=BlockReplay)
    applied: int = 0
    """Batches applied so far (they are judged in sequence order, once)."""
    contradictions: list[str] = field(default_factory=list)
    hits_seen: int = 0
    """Answers that reported a cached prefix (the rule had something to judge)."""

    def unannounced(self, batches: Sequence[Batch], replies: Iterable[Reply]) -> bool:
        """Whether `take` would find an answer reporting more cached tokens than the stream announced: judged on a
        copy, so nothing is applied."""
        return any(v.rule == "INV-E2E-4" for v in copy.deepcopy(self).take(batches, replies))

    def take(self, batches: Sequence[Batch], replies: Iterable[Reply]) -> list[Violation]:
        """Apply the batches not yet applied (the stream of an idle server, drained); judge INV-E2E-3 on them and
        INV-E2E-4 on `replies`, each against the most the replayed cache held for its prompt from the last batch
        that arrived before its send to the end of the stream."""
        todo = [r for r in replies if r.cached is not None]
        best = {id(r): -1 for r in todo}
        arrivals = [b.arrival for b in batches]
        starts = {id(r): max((i for i, a in enumerate(arrivals) if a <= r.t_send), default=-1) for r in todo}

        def measure(index: int) -> None:
            for r in todo:
                if starts[id(r)] <= index and best[id(r)] < len(r.ask.prompt) // self.block * self.block:
                    best[id(r)] = max(best[id(r)], self.replay.held_prefix(r.ask.prompt, self.block))

        out: list[Violation] = []
        measure(self.applied - 1)
        for i in range(self.applied, len(batches)):
            for bad in self.replay.apply(batches[i]):
                self.contradictions.append(bad)
                out.append(Violation("INV-E2E-3", bad))
            measure(i)
        self.applied = len(batches)
        for r in todo:
            if r.cached:
                self.hits_seen += 1
            if r.cached and r.cached > max(best[id(r)], 0):
                out.append(
                    Violation(
                        "INV-E2E-4",
                        f"{r.ask.rid}: reported {r.cached} of {len(r.ask.prompt)} prompt tokens cached; the events "
                        f"held at most {max(best[id(r)], 0)} of its prompt from its send to the end of the stream",
                        r.ask.rid,
                    )
                )
        return out
