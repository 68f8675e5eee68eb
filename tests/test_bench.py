"""`kvcert bench meta`: the trace is a pure function of its spec, and replays do the work they report."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.conformance.bench import meta as bench
from kvcert.conformance.cli import app
from kvcert.refimpl import RefCache
from kvcert.spec.types import CacheConfig

SMALL = bench.TraceSpec(
    page_size=4, pages=64, requests=120, sessions=12, prompts=2, prompt_pages=2, max_context_pages=12
)


def test_same_spec_same_trace() -> None:
    assert bench.make_trace(SMALL) == bench.make_trace(SMALL)
    assert bench.make_trace(SMALL) != bench.make_trace(bench.TraceSpec(**{**SMALL.__dict__, "seed": 1}))
    trace = bench.make_trace(SMALL)
    assert all(len(r.tokens) % SMALL.page_size == 0 for r in trace)
    assert max(len(r.tokens) for r in trace) <= SMALL.max_context_pages * SMALL.page_size
    prompts = {r.tokens[: SMALL.prompt_pages * SMALL.page_size] for r in trace}
    assert len(prompts) <= SMALL.prompts, "sessions share their system prompts"


def test_replay_does_every_request_and_leaves_the_cache_sane() -> None:
    trace = bench.make_trace(SMALL)
    cache = RefCache(CacheConfig(page_size=4, capacity=64 * 4))
    res = bench.replay(bench.ProtocolDriver("refimpl", cache), trace, budget=60)
    assert res.error == "" and res.requests == len(trace)
    assert res.calls["match"] == res.calls["insert"] == res.calls["unlock"] == len(trace)
    assert res.calls["evict"] > 0, "the pool is small: the trace must evict"
    snap = cache.snapshot()
    assert snap.protected_size == 0 and len(snap.free_slots) + snap.evictable_size == snap.capacity


def test_cli_prints_and_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "meta", "--page-size", "4", "--pages", "64", "--requests", "80", "--impl", "refimpl"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "kvcert.refimpl" in result.output
    (row,) = json.loads(out.read_text())
    assert row["requests"] == 80 and row["calls"]["match"] == 80


def _sane(snap: object) -> None:
    assert snap.protected_size == 0  # type: ignore[attr-defined]
    assert len(snap.free_slots) + snap.evictable_size == snap.capacity  # type: ignore[attr-defined]


def test_kvcert_gpu_native_and_protocol_drivers_do_the_same_work() -> None:
    """The tensor-native driver and the protocol driver make the same calls: the caches end identical."""
    trace = bench.make_trace(SMALL)
    makers = dict(bench.drivers(4, 64 * 4, ["gpu", "gpu-protocol"]))
    native, protocol = makers["gpu"](), makers["gpu-protocol"]()
    assert isinstance(native, bench.GpuNativeDriver) and type(protocol) is bench.ProtocolDriver
    for driver in (native, protocol):
        res = bench.replay(driver, trace, budget=60)
        assert res.error == "" and res.requests == len(trace) and res.calls["evict"] > 0
    snap = native.cache.snapshot()  # type: ignore[attr-defined]
    assert snap == protocol.cache.snapshot()  # type: ignore[attr-defined]
    _sane(snap)


def test_host_tier_replay_loads_back_and_backs_up() -> None:
    trace = bench.make_trace(SMALL)
    makers = dict(bench.host_drivers(4, 64 * 4, ["gpu", "gpu-protocol", "refimpl"]))
    results = {}
    for label, make in makers.items():
        driver = make()
        res = bench.replay_host(driver, trace, budget=60)
        assert res.error == "" and res.requests == len(trace), (label, res.error)
        assert res.ops == bench.HOST_OPS and res.calls["backup"] == len(trace)
        assert res.calls["load_back"] == res.loaded > 0 and res.calls["evict"] > 0, label
        snap = driver.cache.snapshot()  # type: ignore[attr-defined]
        assert snap.host_capacity == bench.HOST_RATIO * snap.capacity and not snap.pending, label
        results[label] = (snap, res.loaded)
    assert results["gpu"] == results["gpu-protocol"]
    assert results["gpu"][1] == results["refimpl"][1], "the same host hits as the model"


def test_cli_host_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "meta", "--page-size", "4", "--pages", "64", "--requests", "60", "--impl", "gpu", "--host"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "with a host tier" in result.output and "load_back" in result.output
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["device", "host"]
    assert rows[1]["calls"]["backup"] == 60 and set(rows[1]["calls_per_s"]) == set(bench.HOST_OPS)


def test_every_implementation_gives_the_same_answers_on_a_logical_clock() -> None:
    """The bench compares like with like only if every cache makes the same evictions: on the request-number
    clock kvcert.gpu and the model answer every request alike; with gpu's clock left at 0 (as it once was,
    while SGLang read a real clock) LRU degrades to insertion order and the answers part."""
    tight = bench.TraceSpec(**{**SMALL.__dict__, "pages": 16, "requests": 200})  # evicts hot sessions' pages
    trace = bench.make_trace(tight)
    makers = dict(bench.drivers(4, 16 * 4, ["gpu", "refimpl"]))
    same = [bench.replay(makers[k](), trace, budget=60) for k in ("refimpl", "gpu")]
    assert bench.disagreements(same) == [] and same[0].hits and any(d for d, _ in same[0].hits)

    class Frozen(bench.ProtocolDriver):
        def tick(self, now: int) -> None:
            pass

    frozen = bench.replay(Frozen("gpu, clock at 0", makers["gpu"]().cache), trace, budget=60)
    (line,) = bench.disagreements([same[0], frozen])
    assert "gpu, clock at 0 answers request" in line


def test_a_spread_is_the_median_and_the_extreme_rounds() -> None:
    from kvcert.conformance.bench import spread

    assert spread([1.0, 3.0, 2.0]) == "2.00x [1.00x–3.00x]"
    assert spread([1.5]) == "1.50x"
    assert spread([40.0, 50.0], "{:.0f}%") == "45% [40%–50%]"


def test_bench_meta_repeats_each_implementation_and_reports_the_median(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "meta", "--page-size", "4", "--pages", "64", "--requests", "60", "--impl", "refimpl"]
    result = CliRunner().invoke(app, [*args, "--impl", "gpu", "--repeats", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.count("round 3:") == 2 and "median of 3" in result.output
    for row in json.loads(out.read_text()):
        rounds = [r["all_per_s"] for r in row["rounds"]]
        assert len(rounds) == 3 and row["all_per_s"] == statistics.median(rounds)


def test_bench_harness_answers_each_question_on_a_small_walk() -> None:
    from kvcert.conformance.bench import harness

    lines: list[str] = []
    harness.run("checks", "kvcert.refimpl:factory", examples=1, repeats=2, say=lines.append)
    assert lines[-1].startswith("the checks' share of a checked step: ") and "[" in lines[-1]
    assert [line.split()[0] for line in lines[1:4]] == ["every", "state", "state"]
    lines.clear()
    harness.run("profile", "kvcert.refimpl:factory", examples=1, repeats=1, rows=3, say=lines.append)
    assert len(lines) == 3 + 3 and "checked steps" in lines[1]
    with pytest.raises(ValueError, match="unknown question"):
        harness.run("speed", "kvcert.refimpl:factory", examples=1, repeats=1)
    with pytest.raises(ValueError, match="baseline commit"):
        harness.run("versus", "kvcert.refimpl:factory", examples=1, repeats=1)
