"""The suite itself: certification, determinism, traces that replay, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.conformance import zoo
from kvcert.conformance.certify import certify, replay_fails
from kvcert.conformance.cli import app
from kvcert.conformance.driver import ConformanceFailure, run_trace
from kvcert.refimpl import RefCache, factory
from kvcert.spec.ops import Evict, Insert, Lock, Match, Trace, Unlock
from kvcert.spec.types import CacheConfig

MUTANT = next(m for m in zoo.MUTANTS if m.name == "evict_locked")


def test_refimpl_certifies_on_every_declared_cell_it_is_asked_for(tmp_path: Path) -> None:
    cert = certify("kvcert.refimpl:factory", examples=15, steps=25, seed=3, page_sizes=[1, 4], out_dir=tmp_path)
    assert cert.passed
    device = {(p, pol, "") for p in (1, 4) for pol in RefCache.capabilities.policies}
    host = {(p, "lru", wp) for p in (1, 4) for wp in RefCache.capabilities.write_policies}
    storage = {
        (p, "lru", f"{wp}+{pf}")
        for p in (1, 4)
        for wp in RefCache.capabilities.write_policies
        for pf in RefCache.capabilities.prefetch_policies
    }
    assert {(c.page_size, c.policy, c.write_policy) for c in cert.cells} == device | host | storage
    assert all(c.steps > 0 for c in cert.cells)
    assert not list(tmp_path.iterdir()), "a passing run saves no counterexample"


def test_same_seed_same_counterexample(tmp_path: Path) -> None:
    runs = [zoo.run_mutant(MUTANT, examples=600, steps=50, seed=11, out_dir=tmp_path / str(i)) for i in range(2)]
    failing = [[c for c in cert.cells if not c.passed] for cert in runs]
    assert failing[0], "the mutant must be killed"
    traces = [Path(cells[0].trace_path).read_text() for cells in failing]  # type: ignore[arg-type]
    assert traces[0] == traces[1]


def test_failure_is_saved_minimal_and_replays(tmp_path: Path) -> None:
    cert = zoo.run_mutant(MUTANT, examples=600, steps=50, seed=0, out_dir=tmp_path)
    cell = next(c for c in cert.cells if not c.passed)
    assert cell.reproduced is True and cell.trace_len is not None and cell.trace_len <= 12
    trace = Trace.from_json(Path(cell.trace_path).read_text())  # type: ignore[arg-type]
    assert trace.target == "kvcert.conformance.zoo:evict_locked"
    assert replay_fails(zoo.build(MUTANT), RefCache.capabilities, trace)
    # the same trace is fine for the unmodified model
    run_trace(factory(trace.config), trace.config, RefCache.capabilities, list(trace.ops))


def test_trace_json_round_trip_keeps_bad_input() -> None:
    ops = (
        Insert("ns", (0, 1.5, "x", True), priority=2, value_len=3),
        Match(None, (1, 2)),
        Lock(0),
        Unlock(7),
        Evict(-1),
    )
    trace = Trace(config=CacheConfig(page_size=2, policy="mru", capacity=8), ops=ops, note="n")
    again = Trace.from_json(trace.to_json())
    assert again == trace
    with pytest.raises(ValueError):
        Trace.from_json(json.dumps({"format": "other"}))


def test_harness_reports_each_kind_of_break() -> None:
    """A hand-written trace per mutant class: the harness names the broken rule."""
    config = CacheConfig(page_size=1, policy="lru", capacity=8)
    cases = {
        "evict_locked": ([Insert(None, (0,)), Lock(0), Evict(1)], "INV-EVICT-3"),
        "lock_skips_self": ([Insert(None, (0,)), Lock(0)], "INV-LOCK-2"),
        "evict_leaks_slots": ([Insert(None, (0,)), Evict(1)], "INV-EVICT-5"),
        "match_does_not_touch": ([Insert(None, (0,)), Insert(None, (1,)), Match(None, (0,)), Evict(1)], "INV-EVICT-4"),
    }
    for name, (ops, inv) in cases.items():
        mutant = zoo.build(next(m for m in zoo.MUTANTS if m.name == name))
        with pytest.raises(ConformanceFailure) as err:
            run_trace(mutant(config), config, RefCache.capabilities, ops)
        assert inv in {v.inv for v in err.value.violations}, (name, err.value)


def test_cli_certify_replay_and_json(tmp_path: Path) -> None:
    runner = CliRunner()
    cert_json = tmp_path / "cert.json"
    res = runner.invoke(
        app,
        [
            "certify",
            "kvcert.refimpl:factory",
            "--examples",
            "5",
            "--steps",
            "10",
            "--page-size",
            "2",
            "--policy",
            "lfu",
            "--json",
            str(cert_json),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "CERTIFIED" in res.output and "steps/s" in res.output
    body = json.loads(cert_json.read_text())
    assert body["passed"] and body["total_steps"] > 0 and body["cells"][0]["policy"] == "lfu"

    bad = tmp_path / "t.json"
    bad.write_text(
        Trace(
            config=CacheConfig(capacity=8),
            ops=(Insert(None, (0,)), Lock(0), Evict(1)),
            target="kvcert.conformance.zoo:evict_locked",
        ).to_json()
    )
    res = runner.invoke(app, ["replay", str(bad)])
    assert res.exit_code == 1 and "INV-EVICT-3" in res.output
    res = runner.invoke(app, ["replay", str(bad), "--target", "kvcert.refimpl:factory"])
    assert res.exit_code == 0 and "PASS" in res.output


def test_cli_storage_only_runs_the_storage_matrix(tmp_path: Path) -> None:
    cert_json = tmp_path / "cert.json"
    res = CliRunner().invoke(
        app,
        ["certify", "kvcert.refimpl:factory", "--storage-only", "--examples", "3", "--steps", "15"]
        + ["--page-size", "4", "--write-policy", "write_back", "--json", str(cert_json)],
    )
    assert res.exit_code == 0, res.output
    cells = json.loads(cert_json.read_text())["cells"]
    assert sorted(c["write_policy"] for c in cells) == [
        "write_back+best_effort",
        "write_back+timeout",
        "write_back+wait_complete",
    ]
