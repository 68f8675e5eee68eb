"""A certificate never claims more than ran: empty cells, cut-short runs, unexercised parts, adapter deviations and
known findings each read as what they are, never as CERTIFIED."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.conformance.certification import known, reports
from kvcert.conformance.certification.certificate import CellResult
from kvcert.conformance.certification.certify import certify
from kvcert.conformance.certification.scope import scope_gaps
from kvcert.conformance.cli import app
from kvcert.refimpl import RefCache
from kvcert.spec.ops import Evict, Insert, Lock, Trace, UpdateRef
from kvcert.spec.types import CacheConfig

ONE_CELL = dict(page_sizes=[1], policies=["lru"], write_policies=[], prefetch_policies=[])


def test_a_cell_with_no_steps_is_not_passed(tmp_path: Path) -> None:
    cert = certify("kvcert.refimpl:factory", examples=0, out_dir=tmp_path, driver="random", **ONE_CELL)  # type: ignore[arg-type]
    (cell,) = cert.cells
    assert cell.steps == 0 and not cell.passed and "NO-STEPS" in (cell.failure or "")
    assert not cert.passed and "1 of 1 cells failed" in reports.verdict_reasons(cert)


def test_fuzz_with_zero_examples_is_not_certified(tmp_path: Path) -> None:
    got = CliRunner().invoke(
        app, ["fuzz", "kvcert.refimpl:factory", "--examples", "0", "--device-only", "--page-size", "1",
              "--policy", "lru", "--out", str(tmp_path), "--json", str(tmp_path / "c.json")]
    )  # fmt: skip
    assert got.exit_code == 1, got.output
    assert "NOT CERTIFIED" in got.output and "CERTIFIED  seed" not in got.output.replace("NOT CERTIFIED", "")
    body = json.loads((tmp_path / "c.json").read_text())
    assert body["passed"] is False and body["total_steps"] == 0


def test_a_time_budget_too_short_for_one_example_is_not_certified(tmp_path: Path) -> None:
    cert = certify("kvcert.refimpl:factory", seconds=1e-9, out_dir=tmp_path, driver="random", **ONE_CELL)  # type: ignore[arg-type]
    assert cert.total_steps == 0 and not cert.passed


def test_a_run_cut_short_leaves_json_that_says_incomplete(tmp_path: Path) -> None:
    """Each rewrite of the JSON while cells run says complete: false with the planned and finished cells, and its
    not-checked list is the one the cells so far leave; the last one is complete."""
    cells = dict(page_sizes=[1, 4], policies=["lru"], write_policies=[], prefetch_policies=[])
    seen: list[dict[str, object]] = []
    cert = certify(
        "kvcert.refimpl:factory", examples=3, steps=10, out_dir=tmp_path, driver="random",
        on_progress=lambda c: seen.append(json.loads(c.to_json())), **cells,  # type: ignore[arg-type]
    )  # fmt: skip
    assert [(s["finished_cells"], s["planned_cells"], s["complete"], s["passed"]) for s in seen] == [
        (0, 2, False, False),
        (1, 2, False, False),
        (2, 2, True, True),
    ]
    assert seen[1]["not_checked"], "a partial certificate says what it has not checked yet"
    assert cert.passed and cert.complete


def test_fail_fast_stops_short_and_says_so(tmp_path: Path) -> None:
    cells = dict(page_sizes=[1, 4], policies=["lru", "fifo"], write_policies=[], prefetch_policies=[])
    cert = certify(
        "kvcert.conformance.zoo:evict_locked", examples=50, steps=20, out_dir=tmp_path, fail_fast=True,
        **cells,  # type: ignore[arg-type]
    )  # fmt: skip
    assert len(cert.cells) < len(cert.planned) == 4 and not cert.complete and not cert.passed
    assert any(r.startswith("incomplete: 1 of 4") for r in reports.verdict_reasons(cert))
    md = reports.markdown(cert, env={})
    assert "| cells | 1 of 4 planned |" in md


def _cell(ops: dict[str, int]) -> CellResult:
    return CellResult(1, "lru", True, 1, 10, 0.1, ops=ops)


def test_kv_namespaces_and_bad_input_count_as_exercised_only_from_steps_that_did_them() -> None:
    caps = RefCache.capabilities
    idle = scope_gaps(caps, [_cell({"Insert": 5, "Insert:error": 2})])
    assert any(g.startswith("KV bytes") and "no step" in g for g in idle)
    assert any(g.startswith("namespaces") and "no step" in g for g in idle)
    assert any(g.startswith("bad input") and "no step" in g for g in idle), "pool exhaustion is not bad input"
    busy = scope_gaps(
        caps, [_cell({"Insert": 5, "Insert:error": 2, "Insert:bad": 1, "kv:entries": 9, "namespace:named": 3})]
    )
    assert not any(g.startswith(("KV bytes", "namespaces", "bad input")) for g in busy)


def test_a_real_run_counts_what_it_exercised(tmp_path: Path) -> None:
    cert = certify("kvcert.refimpl:factory", examples=20, steps=20, out_dir=tmp_path, **ONE_CELL)  # type: ignore[arg-type]
    ops = cert.cells[0].ops
    assert ops.get("kv:entries", 0) > 0 and ops.get("namespace:named", 0) > 0 and ops.get("Insert:bad", 0) >= 0
    assert sum(v for k, v in ops.items() if k.endswith(":bad")) > 0, "the model is strict: some bad input is sent"


def test_adapter_deviations_and_notes_are_printed_in_every_report(tmp_path: Path) -> None:
    caps = replace(RefCache.capabilities, deviations=("the eviction set iterates in insertion order",), notes=("n1",))
    gaps = scope_gaps(caps, [_cell({})])
    line = next(g for g in gaps if g.startswith("adapter deviation"))
    assert "insertion order" in line
    cert = certify("kvcert.refimpl:factory", examples=2, steps=5, out_dir=tmp_path, **ONE_CELL)  # type: ignore[arg-type]
    cert.not_checked.append(line)
    cert.adapter_notes = ["n1"]
    md, xml = reports.markdown(cert, env={}), reports.junit_xml(cert)
    for text in (md, xml):
        assert "insertion order" in text and "n1" in text
    assert "native" in md and "kind" in xml


def _fake_finding(tmp_path: Path, ops: list[object], config: CacheConfig, adapters: tuple[str, ...]) -> known.Finding:
    path = tmp_path / "Z1.json"
    path.write_text(Trace(config=config, ops=tuple(ops), target="kvcert.conformance.zoo:evict_locked").to_json())  # type: ignore[arg-type]
    return known.Finding("Z1", "zoo", "evicts a locked node", "request-path", "wrong KV", (str(path),), adapters, "n/a")


def test_a_known_finding_in_scope_is_never_certified_at_any_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutant's defect, logged: certify replays it before any cell, so even a budget that finds nothing (and
    one that runs nothing) is NOT CERTIFIED, naming the finding."""
    config = CacheConfig(page_size=1, capacity=16)
    finding = _fake_finding(tmp_path, [Insert(None, (1,)), Lock(0), Evict(1)], config, ("kvcert.conformance.zoo",))
    monkeypatch.setattr(known, "findings", lambda: (finding,))
    cert = certify("kvcert.conformance.zoo:evict_locked", examples=1, steps=1, out_dir=tmp_path, **ONE_CELL)  # type: ignore[arg-type]
    (judged,) = cert.findings
    assert judged.reproduced and "INV-EVICT-3" in judged.rules
    assert not cert.passed and "known findings reproduce: Z1" in reports.verdict_reasons(cert)
    model = certify("kvcert.refimpl:factory", examples=2, steps=5, out_dir=tmp_path, **ONE_CELL)  # type: ignore[arg-type]
    assert model.findings == [] and model.passed  # another engine's log is not replayed on it


def test_a_known_finding_out_of_scope_judges_nothing_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CacheConfig(page_size=3, capacity=12)  # the zoo's mutants declare page sizes 1, 2, 4, 8, 16
    finding = _fake_finding(tmp_path, [Insert(None, (1, 2, 3)), Lock(0), Evict(3)], config, ("kvcert.conformance.zoo",))
    monkeypatch.setattr(known, "findings", lambda: (finding,))
    cert = certify("kvcert.conformance.zoo:evict_locked", examples=3, steps=5, out_dir=tmp_path, **ONE_CELL)  # type: ignore[arg-type]
    (judged,) = cert.findings
    assert not judged.reproduced and "out of this target's declared scope" in judged.summary
    assert "page size 3" in judged.summary


def test_in_scope_follows_the_declared_capabilities() -> None:
    caps = RefCache.capabilities
    t = Trace(config=CacheConfig(page_size=3), ops=(Insert(None, (1, 2, 3)),))
    assert "page size 3" in known.in_scope(t, caps)
    t = Trace(config=CacheConfig(), ops=(UpdateRef("a", 1),))
    assert known.in_scope(t, caps) == ""
    assert "update_ref not declared" in known.in_scope(t, replace(caps, priority_parts=("high", "scope")))


def test_the_findings_log_loads_and_names_only_logged_traces() -> None:
    """Every entry has a known class and its traces exist in the package (what a wheel install replays)."""
    for f in known.findings():
        assert f.cls in known.CLASSES and f.user_sees and f.adapters
        for path in f.traces:
            Trace.from_json(known.trace_text(path))
