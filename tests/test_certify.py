"""The suite itself: certification, determinism, traces that replay, and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.conformance import zoo
from kvcert.conformance.certification.certify import certify
from kvcert.conformance.certification.replay import replay_fails
from kvcert.conformance.cli import app
from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
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


# --------------------------------------------------------------------------- what a certificate claims


def _one_cell(cls: type, tmp_path: Path, *, examples: int, steps: int):  # type: ignore[no-untyped-def]
    """Certify a RefCache subclass on one device-only cell (page size 1, LRU)."""

    def make(config: CacheConfig) -> RefCache:
        return cls(config)

    make.capabilities = RefCache.capabilities  # type: ignore[attr-defined]
    return certify(
        "x",
        factory=make,
        examples=examples,
        steps=steps,
        page_sizes=[1],
        policies=["lru"],
        write_policies=[],
        prefetch_policies=[],
        out_dir=tmp_path,
    )


def test_a_certificate_says_what_it_did_not_check(tmp_path: Path) -> None:
    """Capabilities a backend does not declare are listed as not checked, beside CERTIFIED."""
    from dataclasses import replace

    def device_only(config: CacheConfig) -> RefCache:
        return RefCache(config)

    device_only.capabilities = replace(  # type: ignore[attr-defined]
        RefCache.capabilities,
        name="device-only model",
        write_policies=(),
        prefetch_policies=(),
        faults=(),
        retraction=False,
        kv_reads=False,
        priority_refs=False,
        strict_input=False,
        policies=("lru",),
    )
    cert = certify("x", factory=device_only, examples=5, steps=10, page_sizes=[1], out_dir=tmp_path)
    assert cert.passed
    gaps = "\n".join(cert.not_checked)
    for part in ("KV bytes", "host tier", "storage tier", "retraction", "priority tiers", "bad input"):
        assert f"{part}" in gaps and "not declared" in gaps, part
    assert "injected host_alloc faults" in gaps and "injected copy faults" in gaps
    assert "eviction policies lfu, fifo, mru, priority, slru, tlru: not declared" in gaps
    full = certify(
        "kvcert.refimpl:factory",
        examples=5,
        steps=10,
        page_sizes=[1],
        device_cells=True,
        write_policies=[],
        prefetch_policies=[],
        out_dir=tmp_path,
    )
    assert all("not declared" not in g for g in full.not_checked)  # the model declares everything
    assert any("host tier" in g and "no step of this run" in g for g in full.not_checked)  # but --device-only ran none
    assert any(g.startswith("state between steps: not re-read") for g in full.not_checked)


def test_a_backend_still_between_calls_is_read_once_a_step() -> None:
    """Declared `still_between_calls`: the snapshot after a step is the next step's before (one read a step,
    two otherwise), and a step's findings are the same either way."""
    from dataclasses import replace

    config = CacheConfig(page_size=1, capacity=8)
    ops = [Insert(None, (1, 2, 3)), Match(None, (1, 2)), Lock(1), Evict(8), Unlock(1), Evict(8)]
    reads = {}
    for still in (False, True):
        backend = RefCache(config)
        count = [0]
        real = backend.snapshot

        def counting(real=real, count=count):  # type: ignore[no-untyped-def]
            count[0] += 1
            return real()

        backend.snapshot = counting  # type: ignore[method-assign]
        run_trace(backend, config, replace(RefCache.capabilities, still_between_calls=still), ops, quiesce=False)
        reads[still] = count[0]
    assert reads == {False: 1 + 2 * len(ops), True: 1 + len(ops)}
    for still in (False, True):
        caps = replace(RefCache.capabilities, still_between_calls=still)
        with pytest.raises(ConformanceFailure) as failure:
            run_trace(zoo.build(MUTANT)(config), config, caps, ops)
        assert failure.value.step == 3, still  # the mutant evicts the locked node, at the same step either way
        assert "INV-EVICT-3" in {v.inv for v in failure.value.violations}


def test_cli_prints_the_scope_next_to_the_verdict(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app,
        ["certify", "kvcert.refimpl:factory", "--examples", "3", "--steps", "8", "--device-only", "--page-size", "1"],
    )
    assert res.exit_code == 0, res.output
    verdict = next(line for line in res.output.splitlines() if line.startswith("CERTIFIED"))
    assert "NOT CHECKED" in verdict and "not checked: host tier" in res.output


@pytest.mark.parametrize("bad_builds", [(3,), (3, 4)], ids=["hypothesis-replay-passes", "fresh-replay-passes"])
def test_a_failure_that_does_not_replay_is_reported_as_inv_det_1(tmp_path: Path, bad_builds: tuple[int, ...]) -> None:
    """A backend whose failure depends on something outside the trace (here: how many backends were built
    in this process) fails a run but not the replay: the cell reports INV-DET-1 with the original failure,
    whether Hypothesis's own replay passed or only kvcert's replay on a fresh backend did."""
    from kvcert.spec.types import InsertOut

    built = {"n": 0}

    class Flaky(RefCache):
        def __init__(self, config: CacheConfig) -> None:
            super().__init__(config)
            built["n"] += 1
            self.bad = built["n"] in bad_builds  # only these backends ever built misbehave

        def insert(self, namespace, tokens, slots, priority=0) -> InsertOut:  # type: ignore[no-untyped-def]
            out = super().insert(namespace, tokens, slots, priority)
            return InsertOut(out.prefix_len + 1, out.node) if self.bad else out

    cert = _one_cell(Flaky, tmp_path, examples=10, steps=10)
    (cell,) = cert.cells
    assert not cell.passed and cell.reproduced is False
    assert cell.failure is not None and cell.failure.startswith("INV-DET-1")
    # ... with what the run saw: the misreported prefix itself (INV-INS-1), or the caller's free of the
    # one slot too many that it made the harness give back (a typed error, INV-ERR-*), whichever came first
    reported = cell.failure.split("the run reported:", 1)[1]
    assert re.search(r"INV-(INS-1|ERR-\d)", reported), reported
    assert "None" != cell.failure


def test_certificates_of_the_same_run_are_the_same(tmp_path: Path) -> None:
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"c{i}.json")
        res = CliRunner().invoke(
            app,
            [
                "certify",
                "kvcert.refimpl:factory",
                "--examples",
                "4",
                "--steps",
                "10",
                "--page-size",
                "1",
                "--policy",
                "lru",
                "--device-only",
                "--json",
                str(paths[-1]),
            ],
        )
        assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["same", str(paths[0]), str(paths[1])])
    assert res.exit_code == 0 and "same run" in res.output
    body = json.loads(paths[1].read_text())
    body["cells"][0]["digest"] = "0" * 64
    paths[1].write_text(json.dumps(body))
    res = CliRunner().invoke(app, ["same", str(paths[0]), str(paths[1])])
    assert res.exit_code == 1 and "DIFFERENT" in res.output
    body["cells"][0]["page_size"] = 4  # no cell in common: nothing compared is no "same run"
    paths[1].write_text(json.dumps(body))
    res = CliRunner().invoke(app, ["same", "--common", str(paths[0]), str(paths[1])])
    assert res.exit_code == 1 and "no cell in common" in res.output
    body["cells"][0]["page_size"], body["examples"] = 1, 5  # another budget is another run
    body["cells"][0]["digest"] = json.loads(paths[0].read_text())["cells"][0]["digest"]
    paths[1].write_text(json.dumps(body))
    res = CliRunner().invoke(app, ["same", str(paths[0]), str(paths[1])])
    assert res.exit_code == 1 and "DIFFERENT examples" in res.output, res.output


def test_the_shrinker_renumbers_every_op_that_names_a_handle() -> None:
    from kvcert.conformance.generation.shrink import BY_HANDLE, without
    from kvcert.spec.ops import OP_TYPES, LoadBack, Prefetch, RegisterRef, Retract

    assert {t.__name__ for t in BY_HANDLE} == {
        name for name, t in OP_TYPES.items() if "handle" in t.__dataclass_fields__
    }
    ops = [
        Insert(None, (1,)),
        Insert(None, (2,)),
        RegisterRef("a", 1, 1),
        Lock(1),
        LoadBack(1),
        Prefetch(1),
        Retract(1, 1),
    ]
    assert without(ops, 0) == [
        Insert(None, (2,)),
        RegisterRef("a", 0, 1),
        Lock(0),
        LoadBack(0),
        Prefetch(0),
        Retract(0, 1),
    ]
    assert without(ops, 1) == [Insert(None, (1,))]  # every op naming the deleted one goes with it


def test_host_cells_load_back_and_land_it(tmp_path: Path) -> None:
    """Reach: a host cell loads KV back and lets the load land, so INV-KV-1 reads loaded slots. Before the
    `readmit` rule SGLang's P=4 write-through cell loaded back nothing in 100 examples."""
    from dataclasses import replace

    def plain(config: CacheConfig) -> RefCache:
        return RefCache(config)

    plain.capabilities = replace(RefCache.capabilities, priority_refs=False, strict_input=False)  # type: ignore[attr-defined]
    cert = certify(
        "x",
        factory=plain,
        examples=100,
        steps=30,
        page_sizes=[4],
        write_policies=["write_through"],
        device_cells=False,
        prefetch_policies=[],
        out_dir=tmp_path,
    )
    (cell,) = cert.cells
    assert cell.passed and cell.ops.get("LoadBack>0", 0) >= 5, cell.ops


@pytest.mark.parametrize("mutant", [None, "evict_locked"])
def test_every_backend_built_is_closed(tmp_path: Path, mutant: object) -> None:
    """Generation, Hypothesis's own replay, shrinking and the final replay all build backends: every one of
    them is closed, pass or fail, so an engine's pools and threads never outlive their run."""
    cls = (
        RefCache
        if mutant is None
        else zoo.build(next(m for m in zoo.MUTANTS if m.name == mutant))(CacheConfig()).__class__
    )
    built, closed = [], []

    class Counted(cls):  # type: ignore[valid-type, misc]
        def __init__(self, config: CacheConfig) -> None:
            super().__init__(config)
            built.append(self)

        def close(self) -> None:
            closed.append(self)

    cert = _one_cell(Counted, tmp_path, examples=40, steps=50)
    assert cert.passed == (mutant is None)
    # One backend an example at least (a failure's replays and shrinking build more), each closed once; a
    # mutant's cell stops at its failing example.
    ran = cert.cells[0].examples
    assert ran >= 40 or mutant is not None
    assert len(built) >= ran + (mutant is not None) and len(closed) == len(built)
    assert len({id(b) for b in closed}) == len(built)


def test_a_snapshot_that_raises_fails_its_cell_with_a_trace(tmp_path: Path) -> None:
    """An adapter that cannot read its cache's state fails the step, shrunk and saved like any failure;
    it does not end the whole run without a trace (a ten-times SGLang run lost an hour that way)."""

    class Blind(RefCache):
        def snapshot(self):  # type: ignore[no-untyped-def]
            snap = super().snapshot()
            if len(snap.nodes) > 2:
                raise AssertionError("cannot name a node")
            return snap

    cert = _one_cell(Blind, tmp_path, examples=20, steps=10)
    (cell,) = cert.cells
    assert not cell.passed and cell.reproduced
    assert cell.failure is not None and "INV-ERR-3" in cell.failure and "snapshot raised" in cell.failure
    assert cell.trace_path and Path(cell.trace_path).exists() and (cell.trace_len or 0) <= 3


def test_shrinking_keeps_a_lenient_backends_trace_valid() -> None:
    """For a backend sent only valid traffic, the shrinker may not reduce a failure to one on a caller bug: deleting
    the Lock of `Lock, Unlock` leaves an unlock with no lock, which the oracle rejects (LockUnderflow)."""
    from dataclasses import replace

    from kvcert.conformance.certification.certify import guarded
    from kvcert.conformance.certification.replay import Replay, replay
    from kvcert.conformance.generation.shrink import shrink
    from kvcert.conformance.harness.driver import ConformanceFailure
    from kvcert.spec.invariants import Violation

    config = CacheConfig(page_size=1, capacity=8)
    ops = [Insert(None, (1,)), Insert(None, (2,)), Lock(0), Unlock(0)]

    def unlocks(factory: object, caps: object, config: CacheConfig, ops: list) -> Replay:  # type: ignore[type-arg]
        """The real replay's bad-input steps, and a failure at the last unlock while the trace unlocks something."""
        got = replay(factory, caps, config, ops)  # type: ignore[arg-type]
        at = [i for i, op in enumerate(ops) if isinstance(op, Unlock)]
        failure = ConformanceFailure(at[-1], ops[at[-1]], [Violation("INV-X", "unlocked")]) if at else None
        return Replay(failure, got.rejected)

    assert replay(factory, RefCache.capabilities, config, ops).rejected == []
    assert replay(factory, RefCache.capabilities, config, [Insert(None, (1,)), Unlock(0)]).rejected == [1]
    lenient = replace(RefCache.capabilities, strict_input=False)
    kept = shrink(list(ops), guarded(factory, lenient, config, replayer=unlocks), 1)
    assert [type(op) for op in kept.ops] == [Insert, Lock, Unlock] and kept.note == ""
    strict = shrink(list(ops), guarded(factory, RefCache.capabilities, config, replayer=unlocks), 1)
    assert [type(op) for op in strict.ops] == [Insert, Unlock]  # a strict backend is judged on bad input too


def test_a_trace_that_will_not_shrink_says_why() -> None:
    """A failure whose trace does not fail again on a fresh backend comes back as found, with the reason."""
    from kvcert.conformance.generation.shrink import shrink

    ops = [Insert(None, (1,)), Match(None, (1,))]
    got = shrink(list(ops), lambda _ops: None, 1)
    assert got.ops == ops and "does not fail again" in got.note
    capped = shrink([Insert(None, (i,)) for i in range(6)], lambda o: ["INV-X"] if len(o) > 1 else None, 1, budget=2)
    assert len(capped.ops) > 2 and "budget of 2 replays" in capped.note


def test_a_shrink_candidate_no_caller_could_play_is_discarded() -> None:
    """Deleting a running request's Start can leave an Unlock of the lock it held: the oracle cannot play that
    (TraceInvalid), and the replay reports it as no failure instead of raising out of the shrinker."""
    from kvcert.conformance.certification.replay import replay
    from kvcert.spec.ops import Start

    config = CacheConfig(page_size=1, capacity=8)
    ops = [Insert(None, (1, 2)), Start(None, (1, 2, 3), 0), Unlock(1)]
    got = replay(factory, RefCache.capabilities, config, ops)
    assert got.failure is None and "lock was dropped" in got.invalid


