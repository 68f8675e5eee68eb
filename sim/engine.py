"""A discrete-event serving engine: continuous batching over one cache, on a simulated clock.

What it models, each step priced by `Costs`:

* **Arrivals.** Closed-loop sessions: a turn arrives `think` seconds after the session's previous
  turn ended; at most `Workload.max_in_flight` requests are outstanding (the clients' semaphore).
* **Scheduling, the same for every cache.** Under the priority scheduler (SGLang's
  `--enable-priority-scheduling`) waiting requests go by priority, then arrival
  (`managers/schedule_policy.py`, `_sort_by_priority_and_fcfs`: high priority values first by
  default); under FCFS (SGLang's default) in arrival order. Admission stops at the first request
  the cache cannot make room for (SGLang's PrefillAdder does not skip), or at `max_running`. A
  request is admitted with room for its uncached prompt and its whole output (the engine reserves
  decode room up front, so decode never runs out of memory and nothing is retracted).
* **Prefill before decode.** While any admitted request has prompt left, a step prefills up to
  `chunked_prefill_tokens` of it (longest-waiting first), loads its host hit first; else a step
  decodes `decode_block` tokens for every running request. The first token comes at the end
  of the prefill step that finishes the prompt (TTFT, from arrival).
* **Sharing while decoding.** A prompt's KV goes into the tree when its prefill ends (SGLang's
  `cache_unfinished_req`), so a request arriving meanwhile with the same prefix hits it.
* **Not modelled.** Preemption of running requests (`SchedulePolicy.preempt_to_schedule`): SGLang
  preempts only for a priority difference above `--priority-scheduling-preemption-threshold`
  (default 10), and the stress test's priorities are 1 and 0. Decode-time retraction
  (`retract_decode`), since decode room is reserved at admission.

Every request ends finished, or reported unservable (larger than the device pool); the
accounting (`Run.check`) proves it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from kvcert.sim.caches import CacheDriver, Hold
from kvcert.sim.costs import Costs
from kvcert.sim.workload import Workload, pages, session_keys

__all__ = ["Record", "Run", "simulate"]


@dataclass
class Record:
    """One turn of one session, as the client saw it."""

    session: str
    turn: int
    priority: int
    high: bool
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    loaded_tokens: int = 0
    first_token: float = math.nan
    end: float = math.nan
    outcome: str = "pending"
    """finished | unservable | not-run (a later turn of a session whose earlier turn was unservable)."""

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def latency(self) -> float:
        return self.end - self.arrival

    @property
    def hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Req:
    rid: int
    sess: int
    turn: int
    key: list[int]
    out_pages: int
    rec: Record
    hold: Optional[Hold] = None
    prefill_left: int = 0
    done_prompt: int = 0
    decoded: int = 0
    load_due: int = 0
    out_key: list[int] = field(default_factory=list)


@dataclass
class Run:
    """What one simulation produced: every turn's record, the clock's end, the cache's counters and checks."""

    cache: str
    workload: str
    records: list[Record]
    duration: float
    counters: dict[str, int]
    checks: list[str]
    steps: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def accounting(self, workload: Workload, costs: Costs) -> list[str]:
        """Every turn of the workload finished or reported, and the tokens add up."""
        out = []
        want = {(s.id, k) for s in workload.sessions for k in range(len(s.turns))}
        got = {(r.session, r.turn) for r in self.records}
        if want != got:
            out.append(f"{len(want - got)} turns never reported, {len(got - want)} unknown turns reported")
        for r in self.records:
            where = f"{r.session} turn {r.turn}"
            if r.outcome not in ("finished", "unservable", "not-run"):
                out.append(f"{where}: ended {r.outcome!r}")
            if r.outcome != "finished":
                continue
            if not 0 <= r.loaded_tokens <= r.cached_tokens <= r.prompt_tokens:
                out.append(
                    f"{where}: loaded {r.loaded_tokens} <= cached {r.cached_tokens} <= prompt {r.prompt_tokens} fails"
                )
            if not r.arrival <= r.first_token <= r.end <= self.duration:
                out.append(f"{where}: arrival {r.arrival} <= first token {r.first_token} <= end {r.end} fails")
        by_session: dict[str, list[Record]] = {}
        for r in sorted(self.records, key=lambda r: (r.session, r.turn)):
            by_session.setdefault(r.session, []).append(r)
        for s in workload.sessions:
            recs = by_session.get(s.id, [])
            total = s.prefix_tokens
            for k, (t, r) in enumerate(zip(s.turns, recs)):
                total += t.new_tokens
                if r.prompt_tokens != total:
                    out.append(f"{s.id} turn {k}: prompt {r.prompt_tokens} tokens, the workload's history is {total}")
                if r.output_tokens != t.output_tokens:
                    out.append(f"{s.id} turn {k}: {r.output_tokens} output tokens, asked {t.output_tokens}")
                if k and r.outcome == "finished" and recs[k - 1].outcome == "finished":
                    if r.arrival + 1e-9 < recs[k - 1].end + t.think:
                        out.append(f"{s.id} turn {k}: arrived before the previous turn's end + think")
                total += t.output_tokens
        return out


def simulate(
    workload: Workload,
    cache: CacheDriver,
    costs: Costs,
    *,
    seed: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    future: Optional[dict[str, float]] = None,
    scheduler: str = "priority",
) -> Run:
    """Serve `workload` from `cache`; `progress(n)` after each finished turn; `future`, when given, is kept
    current with each session's next use (the offline bound reads it). `scheduler`: "priority", high-priority
    requests admitted before low ones (SGLang's `--enable-priority-scheduling`), or "fcfs", one queue in arrival
    order (SGLang's default)."""
    if scheduler not in ("priority", "fcfs"):
        raise ValueError(f"unknown scheduler {scheduler!r}: priority or fcfs")
    priority_first = scheduler == "priority"
    wall = time.perf_counter()
    pt = costs.page_tokens
    sessions = workload.sessions
    keys = [session_keys(s, seed, pt) for s in sessions]
    history: list[list[int]] = [[] for _ in sessions]
    prompt_tokens = [s.prefix_tokens for s in sessions]
    records: list[Record] = []
    arrivals: list[tuple[float, int, int]] = []  # (time, seq, session)
    seq = 0
    next_use = future if future is not None else {}
    for i, s in enumerate(sessions):
        heapq.heappush(arrivals, (s.arrival, seq, i))
        seq += 1
        next_use[s.id] = s.arrival
    waiting_hi: deque[_Req] = deque()
    waiting_lo: deque[_Req] = deque()
    blocked: deque[_Req] = deque()  # arrived while max_in_flight requests were outstanding
    prefilling: list[_Req] = []
    decoding: list[_Req] = []
    in_flight = 0
    rid = 0
    now = 0.0
    steps = {"prefill": 0, "decode": 0, "idle": 0, "admit_refused": 0}
    limit = workload.max_in_flight or 1 << 60

    turn_of = [0] * len(sessions)

    def arrive(i: int, t: float) -> None:
        nonlocal rid, in_flight
        s, k = sessions[i], turn_of[i]
        history[i] += keys[i][2 * k]
        prompt_tokens[i] += s.turns[k].new_tokens
        rec = Record(s.id, k, s.priority, workload.high(s), t, prompt_tokens[i], s.turns[k].output_tokens)
        records.append(rec)
        req = _Req(rid, i, k, list(history[i]), pages(s.turns[k].output_tokens, pt), rec, out_key=keys[i][2 * k + 1])
        rid += 1
        if in_flight >= limit:
            blocked.append(req)
            return
        in_flight += 1
        (waiting_hi if rec.high or not priority_first else waiting_lo).append(req)

    def end_turn(r: _Req, outcome: str) -> None:
        nonlocal in_flight
        i, s = r.sess, sessions[r.sess]
        r.rec.outcome, r.rec.end = outcome, now
        in_flight -= 1
        if blocked:
            b = blocked.popleft()
            in_flight += 1
            (waiting_hi if b.rec.high or not priority_first else waiting_lo).append(b)
        prompt_tokens[i] += s.turns[r.turn].output_tokens
        if outcome == "finished":
            history[i] += keys[i][2 * r.turn + 1]
        nxt = r.turn + 1
        if outcome == "finished" and nxt < len(s.turns):
            turn_of[i] = nxt
            t = now + s.turns[nxt].think
            next_use[s.id] = t
            heapq.heappush(arrivals, (t, r.rid, i))
            return
        next_use[s.id] = math.inf
        for k in range(nxt, len(s.turns)):  # an unservable turn ends its session
            prompt_tokens[i] += s.turns[k].new_tokens
            records.append(
                Record(
                    s.id,
                    k,
                    s.priority,
                    workload.high(s),
                    math.nan,
                    prompt_tokens[i],
                    s.turns[k].output_tokens,
                    outcome="not-run",
                )
            )
            prompt_tokens[i] += s.turns[k].output_tokens
        cache.end_session(s.id)

    while arrivals or waiting_hi or waiting_lo or prefilling or decoding or blocked:
        while arrivals and arrivals[0][0] <= now:
            t, _, i = heapq.heappop(arrivals)
            arrive(i, t)
        # admission: high priority first, stop at the first refusal
        while (waiting_hi or waiting_lo) and len(prefilling) + len(decoding) < costs.max_running:
            queue = waiting_hi if waiting_hi else waiting_lo
            r = queue[0]
            s = sessions[r.sess]
            next_use[s.id] = now
            hold = cache.admit(r.key, r.out_pages, s.id, s.priority, r.rec.high)
            if hold is None:
                steps["admit_refused"] += 1
                break
            queue.popleft()
            r.hold = hold
            cached = min(r.rec.prompt_tokens, hold.cached * pt)
            loaded = min(cached, hold.loaded * pt)
            r.rec.cached_tokens, r.rec.loaded_tokens = cached, loaded
            r.prefill_left = max(1, r.rec.prompt_tokens - cached)  # the last token is always computed
            r.done_prompt = cached if cached < r.rec.prompt_tokens else r.rec.prompt_tokens - 1
            r.load_due = loaded
            prefilling.append(r)
        if prefilling:
            budget, cost, done = costs.chunked_prefill_tokens, 0.0, []
            for r in prefilling:
                if budget <= 0:
                    break
                take = min(budget, r.prefill_left)
                cost += costs.prefill_s(take, r.done_prompt) + r.load_due * costs.load_token_s
                r.load_due = 0
                r.prefill_left -= take
                r.done_prompt += take
                budget -= take
                if not r.prefill_left:
                    done.append(r)
            now += cost
            steps["prefill"] += 1
            for r in done:
                prefilling.remove(r)
                assert r.hold is not None
                cache.checkpoint(r.key, r.hold, r.rec.session)  # the prompt is shareable while the request decodes
                if math.isnan(r.rec.first_token):
                    r.rec.first_token = now
                r.decoded = 1
                decoding.append(r)
            _finish_done(decoding, now, cache, end_turn, progress)
            continue
        if decoding:
            k = min(costs.decode_block, min(r.rec.output_tokens - r.decoded for r in decoding))
            k = max(k, 1)
            context = sum(r.rec.prompt_tokens + r.decoded for r in decoding)
            now += costs.decode_s(k, len(decoding), context)
            steps["decode"] += 1
            for r in decoding:
                r.decoded += k
            _finish_done(decoding, now, cache, end_turn, progress)
            continue
        if (waiting_hi or waiting_lo) and not arrivals:
            # nothing runs, nothing will arrive, and the head still does not fit: it never will (larger than
            # the device pool, or a low-priority request facing only high-priority sessions' KV)
            queue = waiting_hi if waiting_hi else waiting_lo
            r = queue.popleft()
            end_turn(r, "unservable")
            continue
        if arrivals:
            now = max(now, arrivals[0][0])
            steps["idle"] += 1
    checks = cache.check()
    return Run(
        cache.name,
        workload.name,
        records,
        now,
        cache.counters(),
        checks,
        steps,
        time.perf_counter() - wall,
    )


def _finish_done(
    decoding: list[_Req],
    now: float,
    cache: CacheDriver,
    end_turn: Callable[[_Req, str], None],
    progress: Optional[Callable[[int], None]],
) -> None:
    for r in [r for r in decoding if r.decoded >= r.rec.output_tokens]:
        decoding.remove(r)
        assert r.hold is not None
        cache.finish(r.key + r.out_key, r.hold, r.rec.session, r.rec.priority)
        r.hold = None
        end_turn(r, "finished")
        if progress is not None:
            progress(1)
