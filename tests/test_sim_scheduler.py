"""The simulator's scheduler model: SGLang 0.5.23's preemption and decode retraction, each rule on a workload
built to reach it, against a real cache (kvcert.gpu) and the infinite bound. What is asserted is what SGLang's
code does (`kvcert.sim.engine` cites the lines): who is preempted or retracted, in which order, what happens to
them after, and that every turn is still accounted for and nothing is left held."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from _sim import TINY, serve

from kvcert.sim import bounds, caches, engine, workload

_run = serve


def _low_then_high(at: float) -> workload.Workload:
    """A low-priority request with a long output, and a high-priority one arriving `at` seconds later."""
    lp = workload.Session("lp", 0, 0.0, (workload.Turn(1024, 2048),))
    hp = workload.Session("hp", 1, at, (workload.Turn(1024, 128),))
    return workload.Workload("low-then-high", (lp, hp))


@pytest.mark.parametrize("name", ["blind", "proactive", "infinite"])
def test_a_full_batch_is_preempted_for_a_priority_above_the_threshold(name: str) -> None:
    """One running request at most: at threshold 0 the high-priority arrival preempts the low one, which goes back
    to the queue and finishes after it; at SGLang's default threshold (10) a difference of 1 preempts nobody."""
    w = _low_then_high(0.5)
    one = replace(TINY, max_running=1, preemption_threshold=0)
    run = _run(name, w, one)
    assert not run.accounting(w, one) and not run.checks
    lp, hp = (next(r for r in run.records if r.session == s) for s in ("lp", "hp"))
    assert run.steps["preempted"] == 1 and lp.retracted == 1 and hp.retracted == 0
    assert lp.outcome == hp.outcome == "finished"
    assert lp.first_token < hp.arrival < hp.end < lp.end
    assert lp.cached_tokens == 0  # counted at its first admission only, as SGLang does

    for threshold in (10, 1):  # SGLang's default; a difference equal to the threshold is not above it
        costs = replace(TINY, max_running=1, preemption_threshold=threshold)
        run = _run(name, w, costs)
        assert not run.accounting(w, costs) and not run.checks
        lp, hp = (next(r for r in run.records if r.session == s) for s in ("lp", "hp"))
        assert run.steps["preempted"] == 0 and lp.retracted == 0
        assert lp.end <= hp.first_token


def test_memory_alone_preempts_nobody() -> None:
    """SGLang tries preemption only when the batch is full by request count; a request that does not fit in memory
    ends the round (`scheduler.py:4278-4286`), whatever its priority."""
    lp = workload.Session("lp", 0, 0.0, (workload.Turn(64 * 150, 2048),))
    hp = workload.Session("hp", 5, 0.5, (workload.Turn(64 * 150, 128),))
    w = workload.Workload("no-room", (lp, hp))
    costs = replace(TINY, preemption_threshold=0)
    run = _run("blind", w, costs)
    assert not run.accounting(w, costs) and not run.checks
    lp_rec, hp_rec = run.records[0], run.records[1]
    assert run.steps["preempted"] == 0 and run.steps["admit_refused"] > 0
    assert lp_rec.end <= hp_rec.first_token


class _Cramped(bounds.InfiniteBound):
    """Promises the whole pool to the scheduler's budget but can hold only `limit` pages: what a cache whose
    eviction cannot reach all it reports as evictable looks like to SGLang's scheduler."""

    def __init__(self, device_pages: int, limit: int) -> None:
        super().__init__(device_pages)
        self.limit = limit
        self.grown: list[int] = []

    def grow(self, needs: Sequence[tuple[caches.Hold, int, bool]]) -> bool:
        total = sum(n for _, n, _ in needs)
        if self.used + total > self.limit:
            return False
        return super().grow(needs)


def test_decode_out_of_memory_retracts_the_shortest_output_then_the_longest_input() -> None:
    """Three requests decode together until the pool is short: `retract_decode` (length policy) retracts the one
    with the fewest output tokens, ties going to the longest input; it re-enters the queue, prefills its prompt and
    output so far again, and finishes."""
    sizes = {"a": 64 * 10, "b": 64 * 30, "c": 64 * 20}
    w = workload.Workload(
        "retract", tuple(workload.Session(s, 0, 0.0, (workload.Turn(n, 64 * 20),)) for s, n in sizes.items())
    )
    cache = _Cramped(TINY.device_pages, limit=10 + 30 + 20 + 30)
    run = engine.simulate(w, cache, TINY)
    assert not run.accounting(w, TINY) and not run.checks
    by = {r.session: r for r in run.records}
    assert all(r.outcome == "finished" for r in run.records)
    assert by["b"].retracted >= 1 and by["a"].retracted == by["c"].retracted == 0
    assert run.steps["retracted"] == by["b"].retracted
    assert by["b"].end > max(by["a"].end, by["c"].end)
    assert cache.used == 0


def test_a_request_that_cannot_decode_even_alone_is_aborted_and_ends_its_session() -> None:
    """The last request of the batch is never retracted: when even it cannot grow, SGLang aborts it."""
    turns = (workload.Turn(64 * 10, 64 * 20), workload.Turn(64, 64, 0.5))
    w = workload.Workload("abort", (workload.Session("x", 0, 0.0, turns),))
    cache = _Cramped(TINY.device_pages, limit=15)
    run = engine.simulate(w, cache, TINY)
    assert not run.accounting(w, TINY) and not run.checks
    assert [r.outcome for r in run.records] == ["aborted", "not-run"]
    assert run.steps["aborted"] == 1 and cache.used == 0


def test_a_scoped_cache_refuses_what_the_budget_admits_and_the_round_ends() -> None:
    """kvcert.gpu with §11 scopes behind SGLang's budget: the budget counts HIGH_REF KV as evictable, a low-priority
    request's eviction cannot take it, and the model ends the round there (SGLang's prefill would fail its
    allocation). The driver counts it; the run still accounts for every turn and ends clean."""
    hp = [
        workload.Session(f"h{i}", 1, 0.0, (workload.Turn(64 * 60, 64), workload.Turn(64, 64, 30.0))) for i in range(3)
    ]
    lp = [workload.Session(f"l{i}", 0, 1.0, (workload.Turn(64 * 100, 64),)) for i in range(2)]
    w = workload.Workload("scoped", (*hp, *lp))
    costs = replace(TINY, host_tokens=0)
    run = _run("proactive", w, costs)
    assert not run.accounting(w, costs) and not run.checks
    assert run.counters.get("alloc_refused", 0) > 0
    blind = _run("blind", w, costs)
    assert "alloc_refused" not in blind.counters


@pytest.mark.parametrize("name", ["blind", "proactive"])
def test_the_forks_admission_releases_running_low_priority_requests_for_a_high_one(name: str) -> None:
    """A low-priority request reserving a long output, and a high-priority one that does not fit beside it. SGLang's
    budget makes the high one wait (memory preempts nobody); the fork's `_plan_high_priority_admission` releases
    the running low one, which is queued again and finishes after."""
    lp = workload.Session("lp", 0, 0.0, (workload.Turn(64 * 20, 64 * 150),))
    hp = workload.Session("hp", 1, 0.5, (workload.Turn(64 * 100, 128),))
    w = workload.Workload("reclaim", (lp, hp))
    host = replace(TINY, host_tokens=0)
    for scheduler in ("fork", "priority"):
        run = _run(name, w, host, scheduler=scheduler)
        assert not run.accounting(w, host) and not run.checks
        lp_rec, hp_rec = run.records
        assert lp_rec.outcome == hp_rec.outcome == "finished"
        if scheduler == "fork":
            assert run.steps["reclaimed"] == lp_rec.retracted == 1
            assert hp_rec.end < lp_rec.end
        else:
            assert run.steps["reclaimed"] == lp_rec.retracted == 0
            assert lp_rec.end <= hp_rec.first_token


def test_the_forks_admission_keeps_low_priority_requests_out_of_high_priority_kv() -> None:
    """Behind the fork's budget a low-priority request is admitted only into free and non-HIGH_REF room, so the
    scoped cache never refuses an allocation the budget granted (it does behind SGLang's, above)."""
    hp = [
        workload.Session(f"h{i}", 1, 0.0, (workload.Turn(64 * 60, 64), workload.Turn(64, 64, 30.0))) for i in range(3)
    ]
    lp = [workload.Session(f"l{i}", 0, 1.0, (workload.Turn(64 * 100, 64),)) for i in range(2)]
    w = workload.Workload("scoped", (*hp, *lp))
    costs = replace(TINY, host_tokens=0)
    run = _run("proactive", w, costs, scheduler="fork")
    assert not run.accounting(w, costs) and not run.checks
    assert run.counters.get("alloc_refused", 0) == 0
    assert all(r.outcome == "finished" for r in run.records)


def test_a_whole_number_of_low_priority_clients_per_high_one_may_be_an_int() -> None:
    """`lp_per_hp=4` (an int, as `--set`-style callers pass it) makes 4 low-priority clients per high one."""
    w = workload.stress(workload.StressSpec(hp_clients=2, lp_per_hp=4))
    assert sum(not w.high(s) for s in w.sessions) == 8
