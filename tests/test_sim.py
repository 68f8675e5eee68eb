"""`kvcert bench policy`'s simulator: workloads, traces and their errors, the engine's accounting, the caches'
end checks, and a tiny end-to-end run of the command. The figures are measured, not asserted (docs/bench_policy.md);
what is asserted is what must hold whatever the figures: every turn reported, tokens conserved, nothing held
after the run, the bound's hits exactly the reusable history, the same run twice."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from _sim import TINY, serve
from typer.testing import CliRunner

from kvcert.conformance.cli import app
from kvcert.sim import caches, engine, policy, workload
from kvcert.sim.costs import SEED_PREFILL_SLOWDOWN, Costs, with_overrides
from kvcert.sim.costs import engine as named_engine
from kvcert.sim.workload import AgenticSpec, StressSpec, TraceError, agentic, read_trace, stress, write_trace

SPEC = StressSpec(
    hp_clients=4,
    min_turns=2,
    max_turns=4,
    request_length=2048,
    sub_question_length=512,
    output_length=128,
    think_min=0.5,
    think_max=1.0,
)
ASPEC = AgenticSpec(
    hp_clients=4, min_turns=2, max_turns=4, request_length=2048, sub_question_length=512, output_length=128
)
"""SPEC's agentic twin: the same clients, turns and lengths, tool-call pauses for think times."""


_run = serve


# --------------------------------------------------------------------------- workloads


def test_the_stress_workload_follows_the_forks_script() -> None:
    w = stress(StressSpec(hp_clients=64))
    assert len(w.sessions) == 96 and sum(w.high(s) for s in w.sessions) == 64  # the fixed 2:1 split
    assert w.max_in_flight == 64 + 100
    for s in w.sessions:
        assert 5 <= len(s.turns) <= 20 and s.arrival == 0.0
        assert s.turns[0].new_tokens == 15360 and all(t.new_tokens == 1024 for t in s.turns[1:])
        assert all(t.output_tokens == 256 and 5 <= t.think <= 10 for t in s.turns[1:])
    assert stress(StressSpec(hp_clients=64)) == w  # seeded


@pytest.mark.parametrize(
    "bad",
    [
        dict(hp_clients=3),
        dict(hp_clients=0),
        dict(min_turns=0),
        dict(min_turns=6, max_turns=5),
        dict(think_min=3.0, think_max=2.0),
    ],
)
def test_a_bad_stress_spec_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        stress(replace(SPEC, **bad))  # type: ignore[arg-type]


def test_the_agentic_workload_is_the_stress_test_with_tool_call_pauses() -> None:
    """agentic() is a pure function of its spec, and at the same seed it is stress() but for the pauses: the same
    clients, priorities, turn counts, lengths and in-flight limit (at the figures' spec too), other pauses."""
    for a_spec, s_spec in ((ASPEC, SPEC), (AgenticSpec(), StressSpec())):
        a, s = agentic(a_spec), stress(s_spec)
        assert agentic(a_spec) == a
        assert a.max_in_flight == s.max_in_flight and a.params["kind"] == "agentic"
        assert len(a.sessions) == len(s.sessions)
        for x, y in zip(a.sessions, s.sessions):
            assert (x.id, x.priority, x.arrival, len(x.turns)) == (y.id, y.priority, y.arrival, len(y.turns))
            lengths = [(t.new_tokens, t.output_tokens) for t in x.turns]
            assert lengths == [(t.new_tokens, t.output_tokens) for t in y.turns]
            assert all(t.think > 0 for t in x.turns[1:])
        assert [t.think for x in a.sessions for t in x.turns] != [t.think for x in s.sessions for t in x.turns]
    assert agentic(replace(ASPEC, seed=43)) != agentic(ASPEC)


def test_the_agentic_pauses_have_the_tables_mean() -> None:
    """Over about 100,000 pauses the sample mean is within 3% of the mixture's mean, which the table's totals give
    directly (all hours over all calls): with the mixture's standard deviation of about 11.7 s that is about five
    standard errors. Each tool's share of the pauses is within 0.01 of its share of the calls."""
    w = agentic(AgenticSpec(hp_clients=6000, request_length=64, sub_question_length=64, output_length=64))
    pauses = [t.think for s in w.sessions for t in s.turns[1:]]
    assert len(pauses) > 90_000
    calls = sum(c for c, _ in workload.SYFI_TOOL_CALLS.values())
    mean = sum(h for _, h in workload.SYFI_TOOL_CALLS.values()) * 3600 / calls
    assert math.isclose(sum(pauses) / len(pauses), mean, rel_tol=0.03), (sum(pauses) / len(pauses), mean)
    drawn = w.params["tool_calls"]
    assert sum(drawn.values()) == len(pauses)
    for tool, (n, hours) in workload.SYFI_TOOL_CALLS.items():
        assert abs(drawn[tool] / len(pauses) - n / calls) < 0.01, tool
        assert workload.tool_mean_s(tool) == hours * 3600 / n


@pytest.mark.parametrize(
    "bad",
    [dict(hp_clients=3), dict(hp_clients=0), dict(lp_per_hp=-0.5), dict(min_turns=0), dict(min_turns=6, max_turns=5)],
)
def test_a_bad_agentic_spec_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        agentic(replace(ASPEC, **bad))  # type: ignore[arg-type]


def test_a_trace_round_trips(tmp_path: Path) -> None:
    w = stress(SPEC)
    write_trace(w, tmp_path / "t.jsonl")
    back = read_trace(tmp_path / "t.jsonl")
    assert back.sessions == w.sessions
    g = workload.groups(workload.GroupsSpec(groups=3, prompts=2))
    write_trace(g, tmp_path / "g.jsonl")
    assert read_trace(tmp_path / "g.jsonl").sessions == g.sessions


GOOD = '{"session": "a", "priority": 1, "new_tokens": 128, "output_tokens": 64}'


@pytest.mark.parametrize(
    ("lines", "line", "words"),
    [
        ([GOOD, "{not json"], 2, "not JSON"),
        ([GOOD, "[1, 2]"], 2, "JSON object"),
        ([GOOD, '{"session": "b", "new_tokens": 1, "output_tokens": 1, "colour": 3}'], 2, "unknown field"),
        (['{"session": "", "new_tokens": 1, "output_tokens": 1}'], 1, "non-empty string"),
        (['{"session": "a", "output_tokens": 1}'], 1, "missing field 'new_tokens'"),
        (['{"session": "a", "new_tokens": -1, "output_tokens": 1}'], 1, ">= 0"),
        (['{"session": "a", "new_tokens": 1.5, "output_tokens": 1}'], 1, "an integer"),
        (['{"session": "a", "new_tokens": true, "output_tokens": 1}'], 1, "an integer"),
        (['{"session": "a", "new_tokens": 1, "output_tokens": 0}'], 1, "> 0"),
        (['{"session": "a", "new_tokens": 0, "output_tokens": 1}'], 1, "needs tokens"),
        ([GOOD, '{"session": "a", "priority": 0, "new_tokens": 1, "output_tokens": 1}'], 2, "changes priority"),
        ([GOOD, '{"session": "a", "priority": 1, "new_tokens": 1, "output_tokens": 1, "at": 3}'], 2, "first line"),
        (['{"session": "a", "new_tokens": 1, "output_tokens": 1, "think": 3}'], 1, "later lines"),
        (['{"session": "a", "new_tokens": 1, "output_tokens": 1, "prefix": "p"}'], 1, "come together"),
        (
            [
                '{"session": "a", "new_tokens": 1, "output_tokens": 1, "prefix": "p", "prefix_tokens": 64}',
                '{"session": "b", "new_tokens": 1, "output_tokens": 1, "prefix": "p", "prefix_tokens": 128}',
            ],
            2,
            "another length",
        ),
        (['{"session": "a", "new_tokens": 1, "output_tokens": 1, "at": NaN}'], 1, "finite"),
        (["# only a comment", ""], 0, "no requests"),
    ],
)
def test_a_bad_trace_line_is_named(lines: list[str], line: int, words: str) -> None:
    with pytest.raises(TraceError) as err:
        read_trace("t.jsonl", lines)
    assert err.value.line == line and words in str(err.value) and f"t.jsonl:{line}:" in str(err.value)


def test_the_command_refuses_a_bad_trace_before_simulating_anything(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(GOOD + "\n" + '{"session": "b", "new_tokens": "x", "output_tokens": 1}\n')
    out = tmp_path / "out.json"
    res = CliRunner().invoke(app, ["bench", "policy", "--trace", str(trace), "--cache", "infinite", "--json", str(out)])
    assert res.exit_code == 2 and "bad.jsonl:2:" in res.output and "an integer" in res.output
    assert not out.exists()


def test_a_bad_cost_override_is_named() -> None:
    assert with_overrides(Costs(), ["host_tokens=128"]).host_tokens == 128
    for bad in (["nope=1"], ["host_tokens"], ["host_tokens=x"], ["host_tokens=100"], ["decode_block=0"]):
        with pytest.raises(ValueError):
            with_overrides(Costs(), bad)


def test_the_seed_engine_only_slows_prefill() -> None:
    physical, seed = named_engine("physical"), named_engine("seed")
    assert physical == Costs()
    assert math.isclose(seed.prefill_s(15360, 4096), SEED_PREFILL_SLOWDOWN * physical.prefill_s(15360, 4096))
    assert (
        replace(seed, prefill_token_s=physical.prefill_token_s, attention_pair_s=physical.attention_pair_s) == physical
    )
    with pytest.raises(ValueError, match="physical, seed"):
        named_engine("fast")
    res = CliRunner().invoke(app, ["bench", "policy", "--engine", "fast", "--cache", "infinite"])
    assert res.exit_code == 2 and "--engine 'fast'" in res.output


# --------------------------------------------------------------------------- the engine


def test_the_infinite_bound_hits_exactly_the_reusable_history() -> None:
    """Turn k's prompt is everything before plus its new tokens: an infinite cache hits all but the new tokens."""
    w = stress(SPEC)
    run = _run("infinite", w)
    assert not run.accounting(w, TINY) and not run.checks
    for r in run.records:
        assert r.outcome == "finished"
        new = SPEC.request_length if r.turn == 0 else SPEC.sub_question_length
        assert r.cached_tokens == r.prompt_tokens - new


@pytest.mark.parametrize("name", ["proactive", "blind", "offline", "infinite"])
def test_every_turn_is_reported_and_nothing_is_held_after_the_run(name: str) -> None:
    w = stress(replace(SPEC, hp_clients=8))
    run = _run(name, w)
    assert run.accounting(w, TINY) == []
    assert run.checks == []
    assert all(r.outcome == "finished" for r in run.records)
    assert len(run.records) == w.turns


def test_the_same_seed_gives_the_same_run() -> None:
    w = stress(SPEC)
    a, b = _run("proactive", w), _run("proactive", w)
    assert a.records == b.records and a.duration == b.duration and a.counters == b.counters


def test_pressure_makes_the_caches_evict_and_load_back() -> None:
    """The tiny pools are too small for the workload: the run must reach eviction and load-back (else the tests
    above would certify an engine that never exercises the cache)."""
    w = stress(replace(SPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    run = _run("proactive", w, tight)
    assert run.counters["evicted"] > 0 and run.counters["loads"] > 0
    assert not run.accounting(w, tight) and not run.checks


def test_the_accounting_catches_a_lost_turn_and_a_wrong_count() -> None:
    w = stress(SPEC)
    run = _run("infinite", w)
    lost = replace(run, records=run.records[1:])
    assert any("never reported" in m for m in lost.accounting(w, TINY))
    r = run.records[3]
    bad = replace(run, records=[*run.records[:3], replace(r, cached_tokens=r.prompt_tokens + 1), *run.records[4:]])
    assert any("cached" in m for m in bad.accounting(w, TINY))
    early = replace(run, records=[*run.records[:3], replace(r, first_token=r.arrival - 1), *run.records[4:]])
    assert any("first token" in m for m in early.accounting(w, TINY))


class _LeakyDriver(caches.ProtocolDriver):
    """Forgets to return a finished request's lock: the end checks must say so."""

    def finish(self, key, hold, session, prio):  # type: ignore[no-untyped-def]
        hold.lock_kept = hold.lock  # type: ignore[attr-defined]
        self.c.inc_lock_ref(hold.lock)
        super().finish(key, hold, session, prio)


def test_the_end_checks_catch_a_leaked_lock() -> None:
    from kvcert.gpu import factory

    w = stress(SPEC)
    cache = _LeakyDriver("leaky", factory(caches._config(TINY)), True, 1)
    run = engine.simulate(w, cache, TINY)
    assert any("still locked" in m or "INV-" in m for m in run.checks)


def test_an_unservable_request_is_reported_and_ends_its_session() -> None:
    w = stress(replace(SPEC, request_length=64 * 300))  # larger than the 256-page device pool
    run = _run("proactive", w)
    assert not run.accounting(w, TINY) and not run.checks
    firsts = [r for r in run.records if r.turn == 0]
    assert all(r.outcome == "unservable" for r in firsts)
    assert all(r.outcome == "not-run" for r in run.records if r.turn > 0)


def test_the_offline_bound_is_no_better_than_the_infinite_one() -> None:
    w = stress(replace(SPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 400, host_tokens=64 * 64)
    inf, off = _run("infinite", w, tight), _run("offline", w, tight)
    hit = lambda run: sum(r.cached_tokens for r in run.records)  # noqa: E731
    assert hit(off) <= hit(inf)
    assert off.counters["evicted"] > 0  # the pool was too small: the bound had to choose


def test_a_shared_prefix_is_a_hit_for_the_groups_later_prompts() -> None:
    g = workload.groups(workload.GroupsSpec(groups=2, prompts=3, prefix_length=1024, rate=0.5))
    run = _run("proactive", g)
    assert not run.accounting(g, TINY) and not run.checks
    by_group: dict[str, list[engine.Record]] = {}
    for r in sorted(run.records, key=lambda r: r.arrival):
        by_group.setdefault(r.session.split("-")[0], []).append(r)
    for recs in by_group.values():
        assert recs[0].cached_tokens == 0 and all(r.cached_tokens == 1024 for r in recs[1:])


# --------------------------------------------------------------------------- the command


def test_the_command_runs_end_to_end(tmp_path: Path) -> None:
    """What CI runs: a tiny configuration through the command, JSON and plots written, accounting clean."""
    out = tmp_path / "out.json"
    args = [
        "bench",
        "policy",
        "--hp",
        "4",
        "--min-turns",
        "2",
        "--max-turns",
        "3",
        "--request-length",
        "2048",
        "--set",
        "device_tokens=16384",
        "--set",
        "host_tokens=32768",
        "--cache",
        "proactive",
        "--cache",
        "blind",
        "--cache",
        "infinite",
        "--cache",
        "offline",
        "--json",
        str(out),
        "--plots",
        str(tmp_path),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "High-priority turn>=1 cache hit" in res.output and "Turn  1:" in res.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["contender"] for r in runs] == ["proactive", "blind", "infinite", "offline"]
    for r in runs:
        assert r["accounting"] == [] and r["checks"] == []
        assert r["high"]["clients"] == 4 and r["low"]["clients"] == 2
        assert not math.isnan(r["high"]["turn1_cache_hit"])
    png = tmp_path / "turns-stress-hp4.png"
    assert png.stat().st_size > 10_000


def test_the_sweep_and_table_run_and_plot(tmp_path: Path) -> None:
    small = replace(SPEC, hp_clients=2)
    rows = policy.sweep("host", ["infinite", "blind"], 2, TINY, small)
    assert {r["value"] for r in rows} == set(policy.SWEEPS["host"].values)
    assert policy.plot_sweep(rows, tmp_path / "s.png").stat().st_size > 10_000
    grid = policy.table(["infinite"], (2, 4), TINY, small)
    assert [r["hp_clients"] for r in grid] == [2, 4]


# --------------------------------------------------------------------------- sizes and schedulers


def test_the_pools_are_sglangs_defaults_for_the_named_model_and_gpu() -> None:
    """Llama 3.1 8B (128 KiB of KV per token, 16.06 GB of weights) on a 143,771 MiB H200: SGLang reserves 512 MiB +
    1.5 x 8192 + 128 (one rank) + 2 x 256 (the decode graph) + 8 x 42 (the prefill graph's buckets), so
    mem_fraction_static is round((143771 - 13776) / 143771, 3) = 0.904; the pool is what that leaves after the
    weights, in whole pages, and the host pool twice it (hicache_ratio 2.0)."""
    from kvcert.sim import sizing

    mem = sizing.sglang_memory(143_771)
    assert (mem.chunked_prefill_size, mem.cuda_graph_max_bs, mem.reserved_mib) == (8192, 256, 13_776)
    assert mem.mem_fraction_static == 0.904
    s = sizing.size("llama-3.1-8b", "h200")
    budget = 143_771 * 2**20 * 0.904 - 8_030_261_248 * 2
    assert s.device_tokens == int(budget // (128 * 1024)) // 64 * 64 == Costs().device_tokens
    assert s.host_tokens == int(s.device_tokens * 2.0) // 64 * 64 == Costs().host_tokens
    assert s.max_running_requests == min(max(min(int(s.device_tokens / 131_072 * 512), 4096), 2048), 2**40)
    assert sizing.sglang_memory(40 * 1024).chunked_prefill_size == 4096  # an A100 40 GB: SGLang's smaller defaults
    with pytest.raises(ValueError, match="known: llama-3.1-8b"):
        sizing.size("gpt-5", "h200")


def test_a_row_names_its_cache_and_scheduler() -> None:
    from kvcert.sim.targets import parse

    assert parse("baseline") == ("baseline", "priority") and parse("proactive@fcfs") == ("proactive", "fcfs")
    for bad, words in (("nope", "unknown contender"), ("baseline@lifo", "unknown scheduler")):
        with pytest.raises(ValueError, match=words):
            parse(bad)
    res = CliRunner().invoke(app, ["bench", "policy", "--cache", "baseline@lifo"])
    assert res.exit_code == 2 and "unknown scheduler" in res.output


def test_the_priority_scheduler_admits_high_priority_first_and_fcfs_does_not() -> None:
    """Six low-priority clients, then six high-priority ones, all at t=0, and a pool that holds a few prompts at a
    time: the priority scheduler starts every high-priority first turn before any low-priority one; FCFS starts
    them in arrival order, the low-priority ones first."""
    turns = (workload.Turn(2048, 128), workload.Turn(512, 128, 0.5))
    sessions = [workload.Session(f"c{i}", 0 if i < 6 else 1, 0.0, turns) for i in range(12)]
    w = workload.Workload("lp-first", tuple(sessions))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    for scheduler in ("priority", "fcfs"):
        run = _run("blind", w, tight, scheduler=scheduler)
        assert not run.accounting(w, tight) and not run.checks
        hp = [r.first_token for r in run.records if r.turn == 0 and r.high]
        lp = [r.first_token for r in run.records if r.turn == 0 and not r.high]
        if scheduler == "priority":  # admitted in one batch, a high and a low first turn may start together
            assert max(hp) <= min(lp), (hp, lp)
        else:
            assert max(lp) <= min(hp) and min(lp) < min(hp), (hp, lp)
    with pytest.raises(ValueError, match="unknown scheduler"):
        _run("blind", w, tight, scheduler="lifo")


def test_the_map_compares_the_proactive_cache_with_the_baseline_at_every_pair(tmp_path: Path) -> None:
    """`--map X,Y`: both caches at every pair of the two sweeps' values, the gain per pair, a heatmap; a pair that
    makes no workload (a fractional number of clients) is refused before anything runs."""
    small = replace(SPEC, hp_clients=4, min_turns=2, max_turns=2)
    rows = policy.grid("lp", "think", 4, TINY, small, names=("blind", "proactive"))
    pairs = {(x, y) for x in policy.SWEEPS["lp"].values for y in policy.SWEEPS["think"].values}
    assert {(r["x"], r["y"]) for r in rows} == pairs and len(rows) == 2 * len(pairs)
    g = policy.gains(rows, base="blind", it="proactive")
    assert len(g) == len(pairs) and all(-1 <= p["hit_gain"] <= 1 and p["ttft_ratio"] > 0 for p in g)
    assert policy.plot_map(rows, tmp_path / "m.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="whole number of low-priority clients"):
        policy.points(("lp",), 2, TINY, small)
    for bad in ("host", "host,host", "host,nope"):
        res = CliRunner().invoke(app, ["bench", "policy", "--map", bad])
        assert res.exit_code == 2 and "two different sweeps" in res.output
    res = CliRunner().invoke(app, ["bench", "policy", "--hp", "2", "--map", "lp,think"])
    assert res.exit_code == 2 and "whole number of low-priority clients" in res.output


def test_the_model_runs_as_kvcert_gpu_and_each_ablation_changes_one_choice() -> None:
    """`model` is kvcert's reference model with SGLang 0.5.23's choices: it serves a workload exactly as kvcert.gpu's
    proactive cache does (same records, same clock, same demotions), so an ablation row (`model-queued`, ...)
    differs from it by the one choice it names (docs/bench_policy.md, "What the gap is made of")."""
    from kvcert.sim.targets import ABLATIONS, CONTENDERS

    w = stress(replace(SPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    gpu, model = _run("proactive", w, tight), _run("model", w, tight)
    assert gpu.records == model.records and gpu.duration == model.duration
    assert gpu.counters["demotions"] == model.counters["demotions"] > 0
    assert set(ABLATIONS) <= set(CONTENDERS)
    queued = _run("model-queued", w, tight)
    assert not queued.checks and not queued.accounting(w, tight)


def test_kvcert_gpu_in_the_forks_demotion_order_runs_as_the_model_does() -> None:
    """`proactive-queued` (kvcert.gpu:factory_queued) serves a workload exactly as the model with DEMOTE "queued"
    (`model-queued`): the two implementations of the order agree run for run."""
    w = stress(replace(SPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    gpu, model = _run("proactive-queued", w, tight), _run("model-queued", w, tight)
    assert gpu.records == model.records and gpu.duration == model.duration
    assert gpu.counters["demotions"] == model.counters["demotions"] > 0
    assert gpu.records != _run("proactive", w, tight).records  # the order changes what is kept


def test_repeated_runs_give_each_figures_median_and_range(tmp_path: Path) -> None:
    """`--repeat N`: each row once per workload seed; the table prints median [min, max], and the runs differ (other
    turn counts and think times), so the range is a real spread."""
    out = tmp_path / "out.json"
    args = ["bench", "policy", "--hp", "4", "--min-turns", "2", "--max-turns", "4", "--request-length", "2048",
            "--set", "device_tokens=16384", "--set", "host_tokens=32768", "--cache", "proactive", "--cache", "blind",
            "--repeat", "3", "--json", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "median [min, max]" in res.output and "workload seeds" in res.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["contender"], r["workload_seed"]) for r in runs] == [
        (name, s) for s in (42, 43, 44) for name in ("proactive", "blind")
    ]
    (p, b) = policy.spread(runs)
    assert p["runs"] == 3 and p["contender"] == "proactive" and b["contender"] == "blind"
    lo, hi = p["HP TTFT p90 s"][1], p["HP TTFT p90 s"][2]
    assert lo <= p["HP TTFT p90 s"][0] <= hi and lo < hi


def test_retention_runs_clean_and_agrees_with_the_model() -> None:
    """`proactive-retain`: each session's client retains its path for its think time when its turn ends (SPEC.md
    §11.7). The run accounts for every turn and ends clean, and kvcert's model given the same retentions serves it
    run for run as kvcert.gpu does."""
    from kvcert.refimpl import RefCache
    from kvcert.sim.caches import ProtocolDriver, _config

    w = stress(replace(SPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    gpu = _run("proactive-retain", w, tight)
    assert not gpu.checks and not gpu.accounting(w, tight)
    assert gpu.counters["retained"] > 0
    model_cache = ProtocolDriver("model", RefCache(_config(tight)), True, tight.load_back_threshold, retain_slack=0.0)
    try:
        model = engine.simulate(w, model_cache, tight, future={})
    finally:
        model_cache.close()
    assert model.records == gpu.records and model.duration == gpu.duration


def test_each_admitted_later_turn_is_counted_retained_or_expired_once() -> None:
    """The retaining driver counts, at each later turn's first admission, whether its session's retention still held
    (`retention_*_live_*`) or had run out while the turn waited (`*_expired_*`). A retention of exactly the think time
    has run out at every admission (the turn arrives at its deadline and is admitted no earlier); 1,000 s more
    outlasts every wait of this small run. Either way each admitted later turn is counted once, in its class, with
    its hit at admission."""
    from kvcert.sim import report
    from kvcert.sim.caches import ProtocolDriver
    from kvcert.sim.targets import built

    w = stress(replace(SPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    for slack, state in ((0.0, "expired"), (1000.0, "live")):
        backend = built("kvcert.gpu:factory", tight)
        cache = ProtocolDriver("r", backend, True, tight.load_back_threshold, retain_slack=slack)
        try:
            run = engine.simulate(w, cache, tight, future={})
        finally:
            cache.close()
        assert not run.checks and not run.accounting(w, tight)
        c = run.counters
        for high in (True, False):
            cls = "high" if high else "low"
            later = [r for r in run.records if r.high == high and r.turn > 0 and not math.isnan(r.admitted)]
            assert c.get(f"retention_{cls}_{state}_admits", 0) == len(later) > 0, (slack, cls)
            other = "live" if state == "expired" else "expired"
            assert not any(k.startswith(f"retention_{cls}_{other}") for k in c), (slack, c)
            assert 0 <= c[f"retention_{cls}_{state}_hit_pages"] <= c[f"retention_{cls}_{state}_prompt_pages"]
        line = report.retention_at_admission({"counters": c}, True)
        assert (f"{len([r for r in run.records if r.high and r.turn > 0 and not math.isnan(r.admitted)])} "
                f"{'after it expired' if state == 'expired' else 'while retained'}") in line, line


@pytest.mark.parametrize("name", ["proactive-queued-retain-120", "proactive-queued-retain-600", "proactive-retain-600"])
def test_a_retention_slack_row_retains_for_the_think_time_and_its_slack(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `-retain-N` rows retain a paused session for its think time and N s more (in the cache's microseconds),
    on the order their name says (`-queued-`: kvcert.gpu:factory_queued)."""
    from kvcert.sim.caches import ProtocolDriver
    from kvcert.sim.targets import build

    cache = build(name, TINY, stress(replace(SPEC, hp_clients=2)), {})
    assert isinstance(cache, ProtocolDriver) and cache.retain_slack == float(name.rsplit("-", 1)[1])
    assert ("factory_queued" in cache.name) == ("-queued-" in name)
    seen: list[tuple[float, int]] = []
    pause = cache.pause

    def spy(session: str, seconds: float) -> None:
        pause(session, seconds)
        seen.append((seconds, {s.id: s.retained_until for s in cache.c.snapshot().sessions}[session] - cache._now))

    monkeypatch.setattr(cache, "pause", spy)
    w = stress(replace(SPEC, hp_clients=4))
    try:
        run = engine.simulate(w, cache, TINY, future={})
    finally:
        cache.close()
    assert not run.checks and not run.accounting(w, TINY) and seen
    assert all(until == round((think + cache.retain_slack) * 1e6) for think, until in seen)


def test_a_fixed_ttl_retains_for_the_ttl_whatever_the_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """`proactive-ttl-10`: after every paused turn the session's retention deadline, in the cache's own session view,
    is 10 s (in the cache's microseconds) past the call, for pauses shorter and longer than 10 s alike; the run accounts
    for every turn and ends clean. A driver given both a slack and a TTL is refused."""
    from kvcert.sim.caches import ProtocolDriver
    from kvcert.sim.targets import build

    w = agentic(replace(ASPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    cache = build("proactive-ttl-10", tight, w, {})
    assert isinstance(cache, ProtocolDriver)
    seen: list[tuple[float, int]] = []
    pause = cache.pause

    def spy(session: str, seconds: float) -> None:
        pause(session, seconds)
        until = {s.id: s.retained_until for s in cache.c.snapshot().sessions}[session]
        seen.append((seconds, until - cache._now))

    monkeypatch.setattr(cache, "pause", spy)
    try:
        run = engine.simulate(w, cache, tight, future={})
    finally:
        cache.close()
    assert not run.checks and not run.accounting(w, tight)
    assert {ttl for _, ttl in seen} == {10_000_000}
    assert min(p for p, _ in seen) < 10 < max(p for p, _ in seen)  # the TTL did not follow the pause
    assert run.counters["retained"] == len(seen) > 0
    with pytest.raises(ValueError, match="exclusive"):
        ProtocolDriver("both", None, True, 1, retain_slack=30.0, retain_ttl=10.0)
    with pytest.raises(ValueError, match="> 0"):
        ProtocolDriver("none", None, True, 1, retain_ttl=0.0)


def test_the_engine_keeps_a_waiting_turns_retention_and_the_model_agrees() -> None:
    """`proactive-retain-1-wait`: each client retains for its think time and 1 s; when the engine receives the next
    turn within that, it calls `retain_waiting` (SPEC.md §11.7), so no later turn is admitted after its retention ran
    out, where the same hint without the engine's half lets most of them run out in the queue. kvcert's model, driven
    alike, serves the run as kvcert.gpu does."""
    from kvcert.refimpl import RefCache
    from kvcert.sim.caches import ProtocolDriver, _config
    from kvcert.sim.targets import build, built

    w = stress(replace(SPEC, hp_clients=8))
    tight = replace(TINY, device_tokens=64 * 160, host_tokens=64 * 200)
    cache = build("proactive-retain-1-wait", tight, w, {})
    assert isinstance(cache, ProtocolDriver) and cache.hold_waiting and cache.retain_slack == 1.0
    plain = ProtocolDriver("no engine half", built("kvcert.gpu:factory", tight), True, 1, retain_slack=1.0)
    model = ProtocolDriver("model", RefCache(_config(tight)), True, 1, retain_slack=1.0, hold_waiting=True)
    runs = []
    for driver in (cache, plain, model):
        try:
            runs.append(engine.simulate(w, driver, tight, future={}))
        finally:
            driver.close()
    held, alone, by_model = runs
    for run in runs:
        assert not run.checks and not run.accounting(w, tight)
    later = len([r for r in held.records if r.turn > 0 and not math.isnan(r.admitted)])
    c = held.counters
    assert c["held_waiting"] > 0 and not any(k.endswith("expired_admits") for k in c), c
    assert sum(c[f"retention_{cls}_live_admits"] for cls in ("high", "low")) == later
    assert sum(alone.counters.get(f"retention_{cls}_expired_admits", 0) for cls in ("high", "low")) > 0
    assert by_model.records == held.records and by_model.duration == held.duration


def test_the_command_runs_the_agentic_workload(tmp_path: Path) -> None:
    """`--workload agentic-syfi` serves agentic(), once per --hp and, with --repeat, once per workload seed; the maps
    and sweeps, which vary the stress test's think time, refuse it rather than run the stress test."""
    out = tmp_path / "out.json"
    tiny = ["bench", "policy", "--workload", "agentic-syfi", "--hp", "4", "--min-turns", "2", "--max-turns", "3",
            "--request-length", "2048", "--set", "device_tokens=16384", "--set", "host_tokens=32768"]  # fmt: skip
    res = CliRunner().invoke(app, [*tiny, "--cache", "proactive-ttl-10", "--cache", "offline", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["agentic"]["hp_clients"] == 4 and "stress" not in doc
    assert [(r["contender"], r["workload"]) for r in doc["runs"]] == [
        ("proactive-ttl-10", "agentic-syfi-hp4"),
        ("offline", "agentic-syfi-hp4"),
    ]
    assert all(r["accounting"] == [] and r["checks"] == [] for r in doc["runs"])
    res = CliRunner().invoke(app, [*tiny, "--cache", "infinite", "--repeat", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["workload"], r["workload_seed"]) for r in runs] == [("agentic-syfi-hp4", 42), ("agentic-syfi-hp4", 43)]
    grid = policy.table(["infinite"], (2, 4), TINY, replace(ASPEC, hp_clients=2))  # --table
    assert [(r["workload"], r["hp_clients"]) for r in grid] == [("agentic-syfi-hp2", 2), ("agentic-syfi-hp4", 4)]
    for extra in (["--map", "host,think"], ["--sweep", "host"]):
        res = CliRunner().invoke(app, [*tiny, "--cache", "infinite", *extra])
        assert res.exit_code == 2 and "not agentic-syfi" in res.output


class _EvictRecorder:
    """A backend that records how each eviction was scoped (the driver's only call under test)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, bool]] = []

    def evict(self, n: int, **scope: bool) -> int:
        self.calls.append(scope)
        return 0

    def in_flight(self) -> list[int]:
        return []

    def poll(self) -> None:
        pass


@pytest.mark.parametrize(("scoped", "want"), [(True, {"allow_low": True, "allow_high": False}), (False, {})])
def test_an_unscoped_driver_evicts_as_an_engine_that_names_no_request(scoped: bool, want: dict[str, bool]) -> None:
    """proactive-unscoped stands for kvcert's cache under SGLang 0.5.23, whose scheduler calls evict with a token
    count only: a low-priority request's room is made across every tier, in §11's order."""
    recorder = _EvictRecorder()
    driver = caches.ProtocolDriver("recorder", recorder, True, 1, scoped=scoped)
    driver._evict(4, False)
    assert recorder.calls == [want]
    assert policy.parse("proactive-unscoped") == ("proactive-unscoped", "priority")
