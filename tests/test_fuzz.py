"""`kvcert fuzz`'s random walk: the certification machine without Hypothesis. Same seed, same run; it finds what
the suite finds (a zoo mutant), shrinks and saves it like certify; a clean cache passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcert.conformance import zoo
from kvcert.conformance.certification.certify import certify
from kvcert.conformance.generation.fuzz import RandomChoices, run_random
from kvcert.spec.ops import Trace

CELL = dict(page_sizes=[1], policies=["lru"], write_policies=[], prefetch_policies=[])


def test_the_same_seed_gives_the_same_walk(tmp_path: Path) -> None:
    a = certify("kvcert.refimpl:factory", examples=20, steps=30, seed=3, out_dir=tmp_path, driver="random", **CELL)
    b = certify("kvcert.refimpl:factory", examples=20, steps=30, seed=3, out_dir=tmp_path, driver="random", **CELL)
    c = certify("kvcert.refimpl:factory", examples=20, steps=30, seed=4, out_dir=tmp_path, driver="random", **CELL)
    assert a.passed and a.cells[0].examples == 20 and a.total_steps > 100
    assert [x.digest for x in a.cells] == [x.digest for x in b.cells]
    assert [x.digest for x in a.cells] != [x.digest for x in c.cells]


def test_a_time_budget_runs_whole_examples(tmp_path: Path) -> None:
    cert = certify("kvcert.gpu:factory", seconds=1.0, steps=30, seed=0, out_dir=tmp_path, driver="random", **CELL)
    assert cert.passed and cert.cells[0].examples >= 1 and cert.cells[0].steps > 0


def test_the_walk_finds_a_mutant_and_saves_a_replayable_trace(tmp_path: Path) -> None:
    (mutant,) = [m for m in zoo.MUTANTS if m.name == "lock_skips_self"]
    cert = certify(
        f"kvcert.conformance.zoo:{mutant.name}",
        factory=zoo.build(mutant),
        examples=200,
        steps=50,
        seed=0,
        page_sizes=mutant.page_sizes,
        policies=mutant.policies,
        write_policies=[],
        prefetch_policies=[],
        out_dir=tmp_path,
        fail_fast=True,
        driver="random",
    )
    (cell,) = [c for c in cert.cells if not c.passed]
    assert cell.reproduced and cell.trace_path is not None and "-fuzz-" in cell.trace_path
    assert "INV-" in (cell.failure or "")
    trace = Trace.from_json(Path(cell.trace_path).read_text())
    assert 0 < len(trace.ops) == cell.trace_len
    # the failure, structured (as the JSON certificate carries it): each broken rule, where, on which op
    assert cell.failures and all(f["trace"] == cell.trace_path for f in cell.failures)
    first = cell.failures[0]
    assert first["invariant"].startswith("INV-") and first["invariant"] in (cell.failure or "")
    assert isinstance(first["step"], int) and first["op"] is not None and first["message"]
    at = cert.cells.index(cell)
    assert json.loads(cert.to_json())["cells"][at]["failures"][0]["invariant"] == first["invariant"]


def test_choices_are_in_range_and_bounded_runs_are_required() -> None:
    cd = RandomChoices("x")
    assert {cd.draw_integer(2, 4) for _ in range(200)} == {2, 3, 4}
    assert all(cd.draw_integer(7, 7) == 7 for _ in range(10))
    assert not any(cd.draw_boolean(0.0) for _ in range(100)) and all(cd.draw_boolean(1.0) for _ in range(100))
    with pytest.raises(ValueError):
        run_random(object, 10, 0)
    with pytest.raises(ValueError):
        certify("kvcert.refimpl:factory", seconds=1.0, **CELL)  # a time budget is the random driver's


def test_the_fuzz_command_runs_and_wants_one_budget(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvcert.conformance.cli import app

    junit = tmp_path / "fuzz.xml"
    args = ["fuzz", "kvcert.gpu:factory", "--examples", "5", "--device-only", "--page-size", "1", "--policy", "lru"]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path), "--junit", str(junit)])
    assert res.exit_code == 0, res.output
    assert "CERTIFIED" in res.output and "<testcase" in junit.read_text()
    # certify's cell selection: only the storage cell asked for, and the bad-input rules off (and said so)
    only = tmp_path / "storage.json"
    picks = ["--page-size", "1", "--write-policy", "write_through", "--prefetch-policy", "best_effort"]
    res = CliRunner().invoke(
        app,
        [
            "fuzz",
            "kvcert.gpu:factory",
            "--examples",
            "2",
            "--storage-only",
            "--no-bad-input",
            *picks,
            "--json",
            str(only),
        ],
    )
    assert res.exit_code == 0, res.output
    got = json.loads(only.read_text())
    assert [(c["page_size"], c["write_policy"]) for c in got["cells"]] == [(1, "write_through+best_effort")]
    assert got["skipped"] == ["bad-input rules: switched off (--no-bad-input)"]
    both = CliRunner().invoke(app, ["fuzz", "kvcert.gpu:factory", "--examples", "5", "--seconds", "1"])
    neither = CliRunner().invoke(app, ["fuzz", "kvcert.gpu:factory"])
    assert both.exit_code == neither.exit_code == 2


def test_cells_in_parallel_give_the_same_certificate(tmp_path: Path) -> None:
    """`jobs` only moves cells to other interpreters: every cell's steps and digest are the same, in cell order."""
    cells = dict(page_sizes=[1, 4], policies=["lru", "fifo"], write_policies=[], prefetch_policies=[])
    seen: list[int] = []
    one = certify("kvcert.gpu:factory", examples=10, steps=20, seed=1, out_dir=tmp_path, driver="random", **cells)
    two = certify(
        "kvcert.gpu:factory",
        examples=10,
        steps=20,
        seed=1,
        out_dir=tmp_path,
        driver="random",
        jobs=2,
        on_progress=lambda cert: seen.append(len(cert.cells)),
        **cells,
    )
    assert len(one.cells) == 4 and seen == [0, 1, 2, 3, 4]  # once before the cells: the findings, complete: false
    assert [(c.page_size, c.policy, c.steps, c.digest) for c in one.cells] == [
        (c.page_size, c.policy, c.steps, c.digest) for c in two.cells
    ]
    with pytest.raises(ValueError):  # a factory object cannot be sent to a worker by name
        certify("x:y", factory=zoo.build(zoo.MUTANTS[0]), examples=2, jobs=2, **cells)


def test_progress_inside_a_cell_sees_every_example_start_and_changes_nothing(tmp_path: Path) -> None:
    seen: list[tuple[int, int, int]] = []
    run = dict(examples=12, steps=30, seed=2, out_dir=tmp_path, driver="random", **{**CELL, "page_sizes": [1, 4]})
    watched = certify("kvcert.refimpl:factory", on_example=lambda c, k, s: seen.append((c.page_size, k, s)), **run)  # type: ignore[arg-type]
    plain = certify("kvcert.refimpl:factory", **run)  # type: ignore[arg-type]
    assert [c.digest for c in watched.cells] == [c.digest for c in plain.cells]
    for cell in watched.cells:
        mine = [(k, s) for ps, k, s in seen if ps == cell.page_size]
        assert [k for k, _ in mine] == list(range(1, 13))  # each example, as it starts
        steps = [s for _, s in mine]
        assert steps == sorted(steps) and steps[0] == 0 and 0 < steps[-1] < cell.steps


def test_a_steps_digest_bytes_are_its_json_encoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`step_bytes` skips `asdict`; every op kind, from a walk over every tier with bad input, encodes as before."""
    from kvcert.conformance.generation import determinism
    from kvcert.spec.ops import OP_TYPES, op_to_json

    fast, kinds = determinism.step_bytes, set()

    def both(op: object) -> bytes:
        got = fast(op)  # type: ignore[arg-type]
        assert got == json.dumps(op_to_json(op), sort_keys=True, default=repr).encode()  # type: ignore[arg-type]
        kinds.add(type(op).__name__)
        return got

    monkeypatch.setattr(determinism, "step_bytes", both)
    cells = dict(page_sizes=[1, 4], policies=["priority"], write_policies=["write_back"], prefetch_policies=["timeout"])
    cert = certify("kvcert.gpu:factory", examples=40, steps=50, seed=0, out_dir=tmp_path, driver="random", **cells)  # type: ignore[arg-type]
    device = dict(page_sizes=[1], policies=["lru"], write_policies=[], prefetch_policies=[])  # and a request path's ops
    served = certify("kvcert.conformance.reference.engine:factory", examples=10, steps=30, seed=0, out_dir=tmp_path, driver="random", **device)  # type: ignore[arg-type]
    linked = certify("kvcert.conformance.reference.engine_linker:factory", examples=10, steps=30, seed=0, out_dir=tmp_path, driver="random", **device)  # type: ignore[arg-type]
    decoded = certify("kvcert.conformance.reference.engine_decode:factory", examples=10, steps=30, seed=0, out_dir=tmp_path, driver="random", **device)  # type: ignore[arg-type]
    assert cert.passed and served.passed and linked.passed and decoded.passed, "a target failed"
    assert kinds == set(OP_TYPES), sorted(set(OP_TYPES) - kinds)
