"""Workloads: sessions of turns, generated from the seed's stress test (or its agentic variant) or read from a trace.

A session is a conversation: turn k's prompt is turn k-1's prompt, its output and turn k's new
tokens, so everything but the new tokens is reusable KV. The simulator is closed-loop as the
seed's clients are: a session's next turn arrives `think` seconds after its previous one finished.

Token ids are drawn from a seeded generator per session and turn, so two runs (and every cache in
one run) see the same keys. Lengths are in tokens; the simulator keys caches by pages of
`Costs.page_tokens` tokens, so every length is rounded up to whole pages (the seed's lengths,
15,360 / 1,024 / 256, are whole 64-token pages).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "SYFI_TOOL_CALLS",
    "AgenticSpec",
    "Session",
    "StressSpec",
    "GroupsSpec",
    "Turn",
    "TraceError",
    "Workload",
    "agentic",
    "groups",
    "read_trace",
    "stress",
    "tool_mean_s",
    "tool_pause",
]


@dataclass(frozen=True)
class Turn:
    new_tokens: int
    """Tokens appended to the session's history before this turn (the whole prompt on turn 0)."""
    output_tokens: int
    think: float = 0.0
    """Seconds between the previous turn's end and this turn's arrival (ignored on turn 0)."""


@dataclass(frozen=True)
class Session:
    id: str
    priority: int
    arrival: float
    """When turn 0 arrives, in seconds."""
    turns: tuple[Turn, ...]
    prefix: Optional[str] = None
    """A shared prefix group: the session's first prompt starts with that group's tokens."""
    prefix_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    high_threshold: int = 1
    """priority >= this is high priority (the fork's `--high-priority-threshold`)."""
    max_in_flight: int = 0
    """Requests the clients keep in flight at once (the fork's semaphore); 0: no limit."""
    params: dict[str, Any] = field(default_factory=dict)

    def high(self, s: Session) -> bool:
        return s.priority >= self.high_threshold

    @property
    def turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class StressSpec:
    """The fork's `bench_ref_aware_multiturn.py`, its defaults, and the seed's run (SPEC of the figures).

    The script fixes a 2:1 split of high- to low-priority clients (`fixed_priority_split`) and keeps
    `high + 100` requests in flight; the seed ran it at 64/96/128 high-priority clients (96/144/192
    clients). Think time is the script's `--interaction-delay-min/max`. The seed's run also names
    `staleness=0.5`: the RL trainer's setting, with no counterpart in the script; it is not modelled.
    """

    hp_clients: int = 128
    min_turns: int = 5
    max_turns: int = 20
    request_length: int = 15360
    sub_question_length: int = 1024
    output_length: int = 256
    think_min: float = 5.0
    think_max: float = 10.0
    seed: int = 42
    lp_per_hp: float = 0.5
    """Low-priority clients per high-priority one: the script's fixed 2:1 split is 0.5."""


def stress(spec: StressSpec) -> Workload:
    """The seed's multi-turn stress test: every client arrives at t=0 (the script gathers them at once)."""
    _check_clients_and_turns(spec)
    if not 0 <= spec.think_min <= spec.think_max:
        raise ValueError(f"need 0 <= think_min <= think_max, got {spec.think_min}, {spec.think_max}")
    rng = random.Random(spec.seed)
    lp = int(spec.hp_clients * spec.lp_per_hp)
    sessions = []
    for i in range(spec.hp_clients + lp):
        turns = rng.randint(spec.min_turns, spec.max_turns)
        seq = [Turn(spec.request_length, spec.output_length)]
        for _ in range(turns - 1):
            seq.append(Turn(spec.sub_question_length, spec.output_length, rng.uniform(spec.think_min, spec.think_max)))
        sessions.append(Session(f"c{i}", 1 if i < spec.hp_clients else 0, 0.0, tuple(seq)))
    return Workload(
        f"stress-hp{spec.hp_clients}",
        tuple(sessions),
        max_in_flight=spec.hp_clients + 100,
        params={"kind": "stress", **spec.__dict__},
    )


def _check_clients_and_turns(spec: StressSpec | AgenticSpec) -> None:
    """ValueError unless the spec makes whole clients of both priorities and at least one turn each."""
    if spec.hp_clients <= 0 or spec.lp_per_hp < 0 or not float(spec.hp_clients * spec.lp_per_hp).is_integer():
        raise ValueError(
            f"need hp_clients > 0 and a whole number of low-priority clients (hp_clients x lp_per_hp), got "
            f"{spec.hp_clients} x {spec.lp_per_hp}"
        )
    if not 1 <= spec.min_turns <= spec.max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {spec.min_turns}, {spec.max_turns}")


# --------------------------------------------------------------------------- agentic: pauses from a published trace

SYFI_URL = "https://tracelab.cs.washington.edu/exp/tool_calls/codex_wall_internal_gap/"

SYFI_TOOL_CALLS: dict[str, tuple[int, float]] = {
    "exec_command": (184_000, 97.8),
    "write_stdin": (61_000, 314.6),
    "shell_command": (6_100, 5.3),
    "apply_patch": (2_500, 0.5),
}
"""Per Codex tool: (timed calls, summed end-to-end latency in hours), as printed (rounded) in Table 1, "Codex tool
end-to-end vs internal latency and the residual gap, by tool", of the SyFI TraceLab page "Codex tool end-to-end vs
internal latency" (University of Washington; SYFI_URL):

    https://tracelab.cs.washington.edu/exp/tool_calls/codex_wall_internal_gap/

253k Codex tool calls with both timings, from the public SyFI pool of Claude Code and Codex traces. End-to-end is the
span from the model emitting the call to its output being recorded: the pause between two model calls of a session.

The page gives per tool only totals, so only a mean (`tool_mean_s`, computed from them, never typed); its percentiles
(P50/90/99) are of the residual gap (end-to-end less the runner's internal time), not of the end-to-end latency. How
the pauses of one tool spread is therefore not in the source: the exponential shape `agentic` draws within a tool is
kvcert's assumption."""


def tool_mean_s(tool: str) -> float:
    """A tool's mean end-to-end latency in seconds: its summed hours over its calls (SYFI_TOOL_CALLS)."""
    calls, hours = SYFI_TOOL_CALLS[tool]
    return hours * 3600 / calls


@dataclass(frozen=True)
class AgenticSpec:
    """The stress test (`StressSpec`, the same clients, turns and lengths) with each later turn after a tool call:
    its pause is a tool kind drawn in proportion to its calls, then an exponential draw with that tool's mean
    end-to-end latency (SYFI_TOOL_CALLS; the exponential shape is kvcert's assumption, the page gives means)."""

    hp_clients: int = 128
    min_turns: int = 5
    max_turns: int = 20
    request_length: int = 15360
    sub_question_length: int = 1024
    output_length: int = 256
    seed: int = 42
    lp_per_hp: float = 0.5
    """Low-priority clients per high-priority one: the script's fixed 2:1 split is 0.5."""


def tool_pause(rng: random.Random) -> tuple[str, float]:
    """One tool call's pause: (tool, seconds), the tool drawn in proportion to its calls, the seconds from an
    exponential distribution with the tool's mean (SYFI_TOOL_CALLS)."""
    tools = list(SYFI_TOOL_CALLS)
    tool = rng.choices(tools, weights=[SYFI_TOOL_CALLS[t][0] for t in tools])[0]
    return tool, rng.expovariate(1 / tool_mean_s(tool))


def agentic(spec: AgenticSpec) -> Workload:
    """The stress test with tool-call pauses (`AgenticSpec`): every client arrives at t=0, and at the same seed its
    turn counts are `stress()`'s (drawn from the same stream, which advances past the stress test's think draws as
    `stress()` does), the pauses from a stream of their own: only the pause distribution differs."""
    _check_clients_and_turns(spec)
    rng = random.Random(spec.seed)
    pauses = random.Random(f"{spec.seed}/syfi-tool-pauses")
    lp = int(spec.hp_clients * spec.lp_per_hp)
    sessions, tools = [], dict.fromkeys(SYFI_TOOL_CALLS, 0)
    for i in range(spec.hp_clients + lp):
        turns = rng.randint(spec.min_turns, spec.max_turns)
        seq = [Turn(spec.request_length, spec.output_length)]
        for _ in range(turns - 1):
            rng.random()  # the draw stress() spends on this turn's think time: the turn counts stay stress()'s
            tool, pause = tool_pause(pauses)
            tools[tool] += 1
            seq.append(Turn(spec.sub_question_length, spec.output_length, pause))
        sessions.append(Session(f"c{i}", 1 if i < spec.hp_clients else 0, 0.0, tuple(seq)))
    return Workload(
        f"agentic-syfi-hp{spec.hp_clients}",
        tuple(sessions),
        max_in_flight=spec.hp_clients + 100,
        params={"kind": "agentic", **spec.__dict__, "source": SYFI_URL, "tool_calls": tools},
    )


@dataclass(frozen=True)
class GroupsSpec:
    """Shared-prefix groups: `groups` x `prompts` one-turn requests, each group's prompts sharing a prefix.

    Prompts arrive as a Poisson stream (`rate` per second) in a seeded random order; the first
    `hp_groups` groups are high priority.
    """

    groups: int = 10
    prompts: int = 50
    prefix_length: int = 16384
    suffix_length: int = 1024
    output_length: int = 256
    rate: float = 4.0
    hp_groups: int = 5
    seed: int = 42


def groups(spec: GroupsSpec) -> Workload:
    if spec.groups <= 0 or spec.prompts <= 0 or spec.rate <= 0:
        raise ValueError("groups, prompts and rate must be positive")
    rng = random.Random(spec.seed)
    order = [(g, p) for g in range(spec.groups) for p in range(spec.prompts)]
    rng.shuffle(order)
    t, sessions = 0.0, []
    for g, p in order:
        t += rng.expovariate(spec.rate)
        sessions.append(
            Session(
                f"g{g}-p{p}",
                1 if g < spec.hp_groups else 0,
                t,
                (Turn(spec.suffix_length, spec.output_length),),
                prefix=f"g{g}",
                prefix_tokens=spec.prefix_length,
            )
        )
    return Workload(f"groups-{spec.groups}x{spec.prompts}", tuple(sessions), params={"kind": "groups", **spec.__dict__})


# --------------------------------------------------------------------------- user traces


class TraceError(ValueError):
    """A trace line that does not follow the schema (docs/bench_policy.md); names the file and line."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path, self.line = path, line


_FIELDS = {"session", "priority", "new_tokens", "output_tokens", "at", "think", "prefix", "prefix_tokens"}


def _number(path: str, no: int, row: dict[str, Any], key: str, *, integer: bool, default: Any) -> Any:
    if key not in row:
        if default is None:
            raise TraceError(path, no, f"missing field {key!r}")
        return default
    v = row[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise TraceError(path, no, f"{key!r} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v):
        raise TraceError(path, no, f"{key!r} must be a finite number, got {v!r}")
    if v < 0:
        raise TraceError(path, no, f"{key!r} must be >= 0, got {v!r}")
    return v


def read_trace(path: Path | str, lines: Optional[Iterable[str]] = None, high_threshold: int = 1) -> Workload:
    """A JSONL trace: one object per request (turn), a session's turns in file order.

    Fields: `session` (str, required), `new_tokens` (int > 0 on a session's first line, >= 0 after),
    `output_tokens` (int > 0), `priority` (int, default 0; the same on every line of a session),
    `at` (first line only: arrival in seconds, default 0), `think` (later lines: seconds after the
    previous turn's end, default 0), `prefix` / `prefix_tokens` (first line only: a shared prefix
    group and its length). Blank lines and lines starting with `#` are skipped. Any other field,
    or a bad value, is a `TraceError` naming the line; nothing is simulated from a bad trace.
    """
    name = str(path)
    text = lines if lines is not None else Path(path).read_text().splitlines()
    rows: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for no, raw in enumerate(text, 1):
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TraceError(name, no, f"not JSON: {e.msg}") from None
        if not isinstance(row, dict):
            raise TraceError(name, no, f"a line is a JSON object, got {type(row).__name__}")
        extra = set(row) - _FIELDS
        if extra:
            raise TraceError(name, no, f"unknown field(s) {sorted(extra)} (known: {sorted(_FIELDS)})")
        sid = row.get("session")
        if not isinstance(sid, str) or not sid:
            raise TraceError(name, no, f"'session' must be a non-empty string, got {sid!r}")
        rows.setdefault(sid, []).append((no, row))
    if not rows:
        raise TraceError(name, 0, "the trace has no requests")
    sessions = []
    prefixes: dict[str, int] = {}
    for sid, lines_of in rows.items():
        turns = []
        first_no, first = lines_of[0]
        prio = first.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise TraceError(name, first_no, f"'priority' must be an integer, got {prio!r}")
        for k, (no, row) in enumerate(lines_of):
            if row.get("priority", 0) != prio:
                raise TraceError(name, no, f"session {sid!r} changes priority ({prio} on line {first_no})")
            if k and ("at" in row or "prefix" in row or "prefix_tokens" in row):
                raise TraceError(name, no, "'at', 'prefix' and 'prefix_tokens' belong on a session's first line")
            if not k and "think" in row:
                raise TraceError(name, no, "'think' belongs on a session's later lines ('at' places the first)")
            new = _number(name, no, row, "new_tokens", integer=True, default=None)
            if not k and new == 0 and not first.get("prefix_tokens"):
                raise TraceError(name, no, "a session's first prompt needs tokens")
            out = _number(name, no, row, "output_tokens", integer=True, default=None)
            if out == 0:
                raise TraceError(name, no, "'output_tokens' must be > 0")
            think = _number(name, no, row, "think", integer=False, default=0.0)
            turns.append(Turn(new, out, float(think)))
        at = _number(name, first_no, first, "at", integer=False, default=0.0)
        prefix = first.get("prefix")
        plen = _number(name, first_no, first, "prefix_tokens", integer=True, default=0)
        if (prefix is None) != (plen == 0):
            raise TraceError(name, first_no, "'prefix' and 'prefix_tokens' (> 0) come together")
        if prefix is not None:
            if not isinstance(prefix, str) or not prefix:
                raise TraceError(name, first_no, f"'prefix' must be a non-empty string, got {prefix!r}")
            if prefixes.setdefault(prefix, plen) != plen:
                raise TraceError(name, first_no, f"prefix {prefix!r} has another length elsewhere ({prefixes[prefix]})")
        sessions.append(Session(sid, prio, float(at), tuple(turns), prefix, plen))
    return Workload(Path(name).stem, tuple(sessions), high_threshold, params={"kind": "trace", "path": name})


def write_trace(workload: Workload, path: Path) -> None:
    """The workload as a JSONL trace `read_trace` reads back to the same sessions."""
    with open(path, "w") as f:
        for s in workload.sessions:
            for k, t in enumerate(s.turns):
                row: dict[str, Any] = {"session": s.id, "priority": s.priority}
                row |= {"new_tokens": t.new_tokens, "output_tokens": t.output_tokens}
                if k:
                    row["think"] = t.think
                else:
                    row["at"] = s.arrival
                    if s.prefix is not None:
                        row |= {"prefix": s.prefix, "prefix_tokens": s.prefix_tokens}
                f.write(json.dumps(row) + "\n")


def page_ids(seed: int, label: str, n: int) -> list[int]:
    """`n` page ids for one piece of a prompt, a pure function of (seed, label): the same keys in every run."""
    rng = random.Random(f"{seed}/{label}")
    return [rng.randrange(1, 1 << 40) for _ in range(n)]


def pages(tokens: int, page_tokens: int) -> int:
    return -(-tokens // page_tokens)


def session_keys(s: Session, seed: int, page_tokens: int) -> Sequence[list[int]]:
    """Per turn, the page ids appended before it (prefix + new tokens on turn 0) and those of its output."""
    out: list[list[int]] = []
    for k, t in enumerate(s.turns):
        new = page_ids(seed, f"{s.id}/{k}/in", pages(t.new_tokens, page_tokens))
        if not k and s.prefix is not None:
            new = page_ids(seed, f"prefix/{s.prefix}", pages(s.prefix_tokens, page_tokens)) + new
        out.append(new)
        out.append(page_ids(seed, f"{s.id}/{k}/out", pages(t.output_tokens, page_tokens)))
    return out
