"""A discrete-event serving engine: SGLang 0.5.23's scheduler over one cache, on a simulated clock.

Every cache runs behind the same scheduler model. Its rules follow the installed wheel's code
(`sglang/srt/managers/...`, line numbers of SGLang 0.5.23):

* **Arrivals.** Closed-loop sessions: a turn arrives `think` seconds after the session's previous
  turn ended; at most `Workload.max_in_flight` requests are outstanding (the clients' semaphore).
  Every request runs to its `max_new_tokens` (`ignore_eos`, as the fork's benchmark sends it), so
  SGLang's `new_token_ratio` plays no part: a running request is charged all of its remaining output
  (`schedule_policy.py:785-793`).
* **Order.** Under the priority scheduler (`--enable-priority-scheduling`) the waiting queue goes
  by priority, higher values first, then by the time the request entered the queue
  (`schedule_policy.py:526-535`); under FCFS by that time alone. A retracted or preempted request
  re-enters at the back (`scheduler.py:3480-3495`).
* **Admission** (`scheduler.py:4204-4292`, `PrefillAdder.add_one_req`, `schedule_policy.py:1395-1430`,
  `prefill_budget.py:62-170`). With its cached prefix locked, a request is admitted when its
  uncached prompt, its whole output and one page of alignment slack are less than the device's
  free plus evictable room less the round's offset: every running request's remaining output,
  and what the round already admitted. A request that does not fit ends the round: the adder does
  not skip. Its host hit is loaded back, and its uncached prompt is allocated, evicting as needed
  (`alloc_for_extend`). A cache whose eviction cannot deliver what its `evictable_size` promised
  (a priority-aware cache asked for room by a low-priority request) refuses the allocation; SGLang
  would fail the prefill there, and the model ends the round instead and counts it.
* **Preemption** (`scheduler.py:4229-4237`, `PrefillAdder.preempt_to_schedule`,
  `schedule_policy.py:1707-1778`). Only when the running batch is full by request count
  (`max_running`), a waiting request may preempt running requests whose priority is lower by more
  than `preemption_threshold` (SGLang's `--priority-scheduling-preemption-threshold`, default 10),
  lowest priority and latest queued first, as many as free its reservation. A request that does
  not fit in memory ends the round without preempting anyone (`scheduler.py:4279-4292`).
* **Prefill before decode.** While any admitted request has prompt left, a step prefills up to
  `chunked_prefill_tokens` of it (longest-waiting first), loads its host hit first; else a step
  decodes `decode_block` tokens for every running request. The first token comes at the end of the
  prefill step that finishes the prompt (TTFT, from arrival). A prompt's KV goes into the tree when
  its prefill ends, so a request arriving meanwhile with the same prefix hits it.
* **Decode allocates as it goes, and retracts when it runs out** (`scheduler.py:4459-4551`,
  `ScheduleBatch.check_decode_mem` / `retract_decode`, `schedule_batch.py:3432-3580`). Before a
  decode step the batch's new pages are made room for, evicting as needed. When they do not fit,
  requests are retracted (`--retraction-policy length`, the default: the fewest output tokens
  first, then the longest input) until they do, keeping at least one; the last one left that
  still cannot fit is aborted. A retracted request's output pages are freed, not cached
  (`release_req`, `schedule_batch.py:2360-2395`), the tree is evicted until `retract_decode_steps`
  tokens per request still running are free, and it re-enters the queue to prefill its
  prompt and output so far again. Its cached tokens are counted at its first admission only
  (`schedule_batch.py:2965-2974`).

The `fork` scheduler is the RefAware fork's admission (its `PrefillAdder` with `enable_ref_aware_kv_buffer`,
`../shared/targets/refaware-sglang-0.5.10/reference/sglang/srt/managers/schedule_policy.py`), in the same
priority order: every request is budgeted against free plus evictable room outside the HIGH_REF tier
(`_ref_aware_full_capacity`, :616; `_ref_aware_deficits`, :742), so a low-priority request is never admitted
into room only high-priority KV would give (:727). A high-priority request short of it first checks that
releasing every running low-priority request (their reserved output, :862) plus the HIGH_REF tier's evictable
room could cover it, then releases them, largest first (:829), until it fits, and takes what is left from
HIGH_REF KV (`_plan_high_priority_admission`, :946-1052). Its handling of a deferred chunk and of request slots
past a full batch is not modelled.

Every request ends finished, aborted, or reported unservable (larger than the device pool); the
accounting (`Run.check`) proves it.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from kvcert.sim.caches import CacheDriver, Hold
from kvcert.sim.costs import Costs
from kvcert.sim.workload import Workload, pages, session_keys

__all__ = ["SCHEDULERS", "Record", "Run", "simulate"]

SCHEDULERS = ("priority", "fcfs", "fork")
"""SGLang 0.5.23 with `--enable-priority-scheduling`; SGLang's default FCFS; the RefAware fork's admission."""


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
    admitted: float = math.nan
    """When the scheduler first admitted it (its prefill could start): before that it waited in the queue."""
    first_token: float = math.nan
    end: float = math.nan
    outcome: str = "pending"
    """finished | unservable | aborted (decode out of memory with nothing left to retract) | not-run (a later
    turn of a session whose earlier turn did not finish)."""
    retracted: int = 0
    """Times the request was retracted or preempted and queued again."""

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
    base: int = 0
    """Output pages in the admission key: a retracted request prefills its output so far again."""
    out_alloc: int = 0
    """Output pages the request holds slots for (the `base` ones included)."""
    entry: float = 0.0
    """When it last entered the waiting queue."""

    @property
    def admit_key(self) -> list[int]:
        return self.key + self.out_key[: self.base]

    @property
    def out_left(self) -> int:
        """Output pages still to allocate: what admission reserves for a running request (ratio 1.0)."""
        return self.out_pages - self.out_alloc


@dataclass
class _Round:
    """One admission round's running totals: the adder's offset (pages) and whom it released."""

    offset: int = 0
    preempted: list[_Req] = field(default_factory=list)


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
            if r.outcome not in ("finished", "unservable", "aborted", "not-run"):
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
    current with each session's next use (the offline bound reads it). `scheduler`: "priority", higher
    priorities admitted first (SGLang's `--enable-priority-scheduling`, preemption included); "fcfs", one
    queue in arrival order (SGLang's default); or "fork", the priority order with the RefAware fork's
    admission budget."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}: {', '.join(SCHEDULERS)}")
    priority_first, fork = scheduler in ("priority", "fork"), scheduler == "fork"
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
    waiting: list[_Req] = []  # in the scheduler's order
    blocked: deque[_Req] = deque()  # arrived while max_in_flight requests were outstanding
    prefilling: list[_Req] = []
    decoding: list[_Req] = []  # SGLang's running batch
    in_flight = 0
    rid = 0
    now = 0.0
    steps = dict.fromkeys(
        ("prefill", "decode", "idle", "admit_refused", "retracted", "preempted", "reclaimed", "aborted"), 0
    )
    limit = workload.max_in_flight or 1 << 60
    turn_of = [0] * len(sessions)

    def order(r: _Req) -> tuple[float, ...]:
        return (-r.rec.priority, r.entry, r.rid) if priority_first else (r.entry, r.rid)

    def enqueue(r: _Req) -> None:
        r.entry = now
        bisect.insort(waiting, r, key=order)

    waits = getattr(cache, "waits", None)

    def receive(r: _Req) -> None:
        """The engine receives a turn: it joins the queue, and a cache that keeps a waiting turn's retention (SPEC.md
        §11.7, `retain_waiting`) is told."""
        enqueue(r)
        if waits is not None:
            waits(sessions[r.sess].id)

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
        receive(req)

    pause = getattr(cache, "pause", None)

    def end_turn(r: _Req, outcome: str) -> None:
        nonlocal in_flight
        i, s = r.sess, sessions[r.sess]
        r.rec.outcome, r.rec.end = outcome, now
        in_flight -= 1
        if blocked:
            in_flight += 1
            receive(blocked.popleft())
        prompt_tokens[i] += s.turns[r.turn].output_tokens
        if outcome == "finished":
            history[i] += keys[i][2 * r.turn + 1]
        nxt = r.turn + 1
        if outcome == "finished" and nxt < len(s.turns):
            turn_of[i] = nxt
            t = now + s.turns[nxt].think
            next_use[s.id] = t
            heapq.heappush(arrivals, (t, r.rid, i))
            if pause is not None:  # the client says when it comes back: its think time (SPEC.md §11.7)
                pause(s.id, s.turns[nxt].think)
            return
        next_use[s.id] = math.inf
        for k in range(nxt, len(s.turns)):  # a turn that did not finish ends its session
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

    def release(r: _Req, remaining: int) -> None:
        """`release_req`: the request's uncached KV freed, its lock returned, the tree evicted down to
        `retract_decode_steps` tokens per request still running; then back to the queue."""
        assert r.hold is not None
        cache.release(r.hold, pages(remaining * costs.retract_decode_steps, pt))
        r.hold, r.rec.retracted = None, r.rec.retracted + 1
        r.prefill_left = r.done_prompt = r.load_due = 0
        r.base = r.out_alloc = min(r.decoded // pt, r.out_pages)  # its output so far is prefilled again

    def preempt(r: _Req, room: int) -> list[_Req]:
        """`preempt_to_schedule`: running requests of a priority lower by more than the threshold, lowest and
        latest queued first, until their reserved output covers `r`'s shortfall (its prompt charged whole: the
        round has not matched it yet); none, and nothing changed, if they cannot."""
        short = len(r.admit_key) + r.out_left - room
        victims: list[_Req] = []
        for v in sorted(decoding, key=lambda v: (v.rec.priority, -v.entry)):
            if r.rec.priority - v.rec.priority <= costs.preemption_threshold:
                break
            victims.append(v)
            short -= v.out_left
            if short <= 0:
                break
        if not victims or short > 0:
            return []
        for v in victims:
            decoding.remove(v)
            release(v, len(decoding))
            steps["preempted"] += 1
        return victims

    rnd = _Round()

    def reserved() -> int:
        """Every running request's remaining output, in pages: what the adder's offset starts from."""
        return sum(r.out_left for r in prefilling) + sum(r.out_left for r in decoding)

    def fits_sglang(r: _Req, extend: int) -> bool:
        """`PrefillAdder.add_one_req`'s budget: prompt, output and a page of slack below free + evictable less the
        round's offset."""
        return extend + r.out_left + 1 < cache.room() - rnd.offset

    def fits_fork(r: _Req, extend: int) -> bool:
        """The fork's `add_one_req` with `enable_ref_aware_kv_buffer`: every request against safe capacity (free +
        evictable outside HIGH_REF); a high-priority one short of it releases running low-priority requests,
        largest first, and may take the rest from HIGH_REF KV (`_plan_high_priority_admission`)."""
        demand = extend + 1 + r.out_left

        def deficit() -> int:
            return max(0, rnd.offset + demand - cache.safe_room())

        if not deficit():
            return True
        if not r.rec.high:
            return False
        victims = sorted((v for v in decoding if not v.rec.high), key=lambda v: -(v.rec.prompt_tokens + v.decoded))
        if deficit() > sum(v.out_left for v in victims) + cache.high_evictable():
            return False  # every feasibility test before the first release
        for v in victims:
            if not deficit():
                break
            rnd.offset -= v.out_left
            decoding.remove(v)
            release(v, len(decoding))
            steps["reclaimed"] += 1
            rnd.preempted.append(v)
        return deficit() <= cache.high_evictable()

    fits = fits_fork if fork else fits_sglang

    clock = getattr(cache, "at", None)  # a cache that takes retentions in seconds follows the simulated time
    while arrivals or waiting or prefilling or decoding or blocked:
        if clock is not None:
            clock(now)
        while arrivals and arrivals[0][0] <= now:
            t, _, i = heapq.heappop(arrivals)
            arrive(i, t)
        # get_new_batch_prefill: one round of admission in the scheduler's order, stopping at the first refusal
        admitted = 0  # this round's, already in `prefilling`: each also holds a page of slack in the offset
        rnd.offset, rnd.preempted = reserved(), []
        for r in list(waiting):
            if len(prefilling) + len(decoding) >= costs.max_running:
                victims = preempt(r, cache.room() - rnd.offset) if priority_first else []
                if not victims:
                    break
                rnd.preempted += victims
                rnd.offset = reserved() + admitted
            s = sessions[r.sess]
            next_use[s.id] = now
            hold = cache.admit(r.admit_key, r.out_left, s.id, s.priority, r.rec.high, partial(fits, r))
            if hold is None:
                steps["admit_refused"] += 1
                break
            waiting.remove(r)
            admitted += 1
            if math.isnan(r.rec.admitted):
                r.rec.admitted = now
            rnd.offset += r.out_left + 1  # the adder's reservation: output plus a page of slack (extend is allocated)
            r.hold = hold
            fill = r.rec.prompt_tokens + (r.decoded if r.rec.retracted else 0)
            cached = min(fill, hold.cached * pt)
            loaded = min(cached, hold.loaded * pt)
            if not r.rec.retracted:  # SGLang counts cached tokens once, before any retraction
                r.rec.cached_tokens, r.rec.loaded_tokens = cached, loaded
            r.prefill_left = max(1, fill - cached)  # the last token is always computed
            r.done_prompt = cached if cached < fill else fill - 1
            r.load_due = loaded
            prefilling.append(r)
        for v in rnd.preempted:
            enqueue(v)
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
                cache.checkpoint(r.admit_key, r.hold, r.rec.session)  # shareable while the request decodes
                if math.isnan(r.rec.first_token):
                    r.rec.first_token = now
                r.decoded = max(r.decoded, 1)
                decoding.append(r)
            _finish_done(decoding, now, cache, end_turn, progress)
            continue
        if decoding:
            k = min(costs.decode_block, min(r.rec.output_tokens - r.decoded for r in decoding))
            k = max(k, 1)
            # update_running_batch: room for the step's new pages, retracting until they fit
            keep = sorted(decoding, key=lambda r: (r.decoded, -(r.rec.prompt_tokens)), reverse=True)
            while True:
                needs = [(r, min(pages(r.decoded + k, pt), r.out_pages) - r.out_alloc) for r in keep]
                needs = [(r, n) for r, n in needs if n > 0]
                assert all(r.hold is not None for r, _ in needs)
                if cache.grow([(r.hold, n, r.rec.high) for r, n in needs]):  # type: ignore[misc]
                    for r, n in needs:
                        r.out_alloc += n
                    break
                victim = keep.pop()
                decoding.remove(victim)
                if keep:
                    release(victim, len(keep))
                    steps["retracted"] += 1
                    enqueue(victim)
                    continue
                assert victim.hold is not None
                cache.release(victim.hold, 0)
                victim.hold = None
                steps["aborted"] += 1
                end_turn(victim, "aborted")
                break
            if not decoding:
                continue
            context = sum(r.rec.prompt_tokens + r.decoded for r in decoding)
            now += costs.decode_s(k, len(decoding), context)
            steps["decode"] += 1
            for r in decoding:
                r.decoded += k
            _finish_done(decoding, now, cache, end_turn, progress)
            continue
        if waiting and not arrivals:
            # nothing runs, nothing will arrive, and the head still does not fit: it never will (larger than
            # the device pool, or a low-priority request facing only high-priority sessions' KV)
            r = waiting.pop(0)
            if r.rec.retracted:
                end_turn(r, "aborted")
                steps["aborted"] += 1
            else:
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
