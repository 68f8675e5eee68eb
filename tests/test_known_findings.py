"""The findings log (conformance/findings/index.json) replayed in CI: every logged trace still breaks a rule on the
engine it was found on, and a correct cache (the reference model) or engine (kvcert's reference engine) plays it
without breaking any, so each is a defect of the engine and not of the rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert.conformance.certification import known
from kvcert.conformance.certification.replay import replay
from kvcert.conformance.reference.engine import factory as reference_engine
from kvcert.conformance.reference.engine_decode import factory as decode_engine
from kvcert.conformance.reference.engine_linker import factory as linked_engine
from kvcert.refimpl import RefCache
from kvcert.spec.ops import REQUEST_OPS, LinkerFault, Trace

ROOT = Path(__file__).parent.parent
FORK_PYTHON = ROOT / ".venv-refaware" / "bin" / "python"
LOGGED = [(f, path) for f in known.findings() for path in f.traces]

REPLAY = """
import json, sys
from kvcert.conformance.certification import known
from kvcert.conformance.certification.certify import load_factory
from kvcert.conformance.certification.replay import judged_as, replay
from kvcert.spec.ops import Trace
out = {}
for path in sys.argv[1:]:
    trace = Trace.from_json(known.trace_text(path))
    make = load_factory(trace.target)
    got = replay(make, judged_as(make.capabilities, trace), trace.config, trace.ops)
    out[path] = sorted({v.inv for v in got.failure.violations}) if got.failure is not None else []
print(json.dumps(out))
"""

REPLAY_FIXED = """
import json, sys
from kvcert.conformance.certification import fixes, known
from kvcert.conformance.certification.certify import load_factory
from kvcert.conformance.certification.replay import judged_as, replay
from kvcert.spec.ops import Trace
out = {}
for arg in sys.argv[1:]:
    ids, path = arg.split("=", 1)
    trace = Trace.from_json(known.trace_text(path))
    make = load_factory(trace.target)
    with fixes.applied([i for i in ids.split(",") if i], trace.target):
        got = replay(make, judged_as(make.capabilities, trace), trace.config, trace.ops)
    out[arg] = sorted({v.inv for v in got.failure.violations}) if got.failure is not None else []
print(json.dumps(out))
"""
"""REPLAY with fixes applied while each trace replays (arguments IDS=path, IDS comma-separated)."""
FIXED = [(f, path) for f in known.findings() if f.fixes for path in f.traces]


def _fork_trace(path: str) -> bool:
    return path.startswith(("refaware/", "refaware_requests/"))


def _fix_runs(fork: bool) -> list[str]:
    """For each trace of a finding with a fix: the trace with every fix logged for its target's engine applied, and
    with every one but its own (findings meet on one trace: R1's with R1 fixed reaches Q5's leak)."""
    out = []
    for f, path in FIXED:
        if _fork_trace(path) != fork:
            continue
        module = Trace.from_json(known.trace_text(path)).target.partition(":")[0]
        every = sorted({g.id for g, _ in FIXED if module in g.fixes})
        out += [f"{','.join(every)}={path}", f"{','.join(i for i in every if i != f.id)}={path}"]
    return out


def _expect_fixed(got: dict[str, list[str]]) -> None:
    """With every fix, each trace passes but for those its finding says its fix cannot reach (`fix_leaves`); with
    every fix but its own, each still fails: the fix is what makes it pass."""
    owner = {p: f for f, p in FIXED}
    for arg, rules in got.items():
        ids, path = arg.split("=", 1)
        f = owner[path]
        if f.id not in ids.split(","):
            assert rules, f"{path} passes without {f.id}'s fix"
        elif path in dict(f.fix_leaves):
            assert rules, f"{path} now passes with {f.id}'s fix: drop it from fix_leaves"
        else:
            assert not rules, f"{path} still fails with the fixes of {ids}: {rules}"


REUSED_IDS = frozenset({"R1", "R2", "Q6"})
"""Findings whose request traces kvcert's reference engine declines to play (TraceInvalid); every other trace it plays
to its end. R1's and R2's send one request id for several turns (the fork's rid names its conversation), which a
client of the reference engine never does. Q6's sends a session's next turn once the fork has finished the one
before (r9, then r12 of s0): the reference engine schedules differently, has not finished r9 by then, and a client
sends no second turn of a session in flight. A trace with linker faults is played by the reference engine with a
direct linker (`conformance.reference.engine_linker`), whose store takes every fault kind; a decode server's by the reference
decode server (`conformance.reference.engine_decode`)."""


def _is_request_trace(trace: Trace) -> bool:
    return all(isinstance(op, REQUEST_OPS) for op in trace.ops)


@pytest.mark.parametrize("finding,path", LOGGED, ids=[f"{f.id}:{Path(p).stem}" for f, p in LOGGED])
def test_a_correct_cache_plays_every_logged_trace(finding: known.Finding, path: str) -> None:
    trace = Trace.from_json(known.trace_text(path))
    if _is_request_trace(trace):
        engine = linked_engine if any(isinstance(op, LinkerFault) for op in trace.ops) else reference_engine
        if "sglang_decode" in trace.target:  # a decode server's trace (SPEC.md §15): kvcert's reference one plays it
            engine = decode_engine
        caps = engine.capabilities  # type: ignore[attr-defined]
        got = replay(engine, caps, trace.config, trace.ops)
    else:
        got = replay(RefCache, RefCache.capabilities, trace.config, trace.ops)
    assert got.failure is None, f"{finding.id}: {got.failure}"
    assert not got.invalid or finding.id in REUSED_IDS, f"{finding.id}: the reference engine could not play it: {got.invalid}"


def test_the_log_names_its_request_path_defects() -> None:
    """Each request-path trace names the rule SPEC.md §12 gives its defect (the log's title says which)."""
    by_id = {f.id: f for f in known.findings()}
    assert {"Q1", "Q2", "Q3", "Q4"} <= set(by_id) and all(
        by_id[q].cls == "request-path" for q in ("Q1", "Q2", "Q3", "Q4")
    )


@pytest.mark.sglang
def test_every_sglang_trace_still_fails_on_its_engine() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed")
    paths = [p for f, p in LOGGED if not p.startswith(("refaware/", "refaware_requests/"))]
    for path in paths:
        trace = Trace.from_json(known.trace_text(path))
        from kvcert.conformance.certification.certify import load_factory
        from kvcert.conformance.certification.replay import judged_as

        make = load_factory(trace.target)
        got = replay(make, judged_as(make.capabilities, trace), trace.config, trace.ops)
        assert got.failure is not None, f"{path} no longer fails on {trace.target}"


EXPECTED_FORK = {
    "Q1": "INV-RP-2",
    "Q2": "INV-RP-3",
    "Q3": "INV-RP-1",
    "Q4": "INV-LIVE-2",
    "R1": "INV-",
    "SG-ABORT": "INV-RP-5",
}


def test_every_fork_trace_still_fails_on_the_fork() -> None:
    if not FORK_PYTHON.exists():
        if os.environ.get("KVCERT_REFAWARE", "0") == "1":
            pytest.fail("KVCERT_REFAWARE=1 but .venv-refaware is missing", pytrace=False)
        pytest.skip(".venv-refaware missing: run scripts/install_refaware.sh")
    paths = [p for f, p in LOGGED if p.startswith(("refaware/", "refaware_requests/"))]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [str(FORK_PYTHON), "-W", "ignore", "-c", REPLAY, *paths],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    ids = {p: f.id for f, p in LOGGED}
    for path, rules in got.items():
        assert rules, f"{path} no longer fails on the fork"
        want = EXPECTED_FORK.get(ids[path])
        if want is not None:
            assert any(r.startswith(want) for r in rules), (path, rules)


def test_the_findings_log_tells_every_logged_finding() -> None:
    """docs/findings.md has a section for each entry of the log, and its summary names each entry's class."""
    text = (ROOT / "docs" / "findings.md").read_text()
    for f in known.findings():
        assert f"\n### {f.id}\n" in text, f.id
        assert f"[{f.id}](#{f.id.lower()})" in text, f"{f.id} missing from the summary"


def test_every_fork_fix_makes_its_findings_traces_pass() -> None:
    """Each logged fix of the fork's findings, applied in-process (`fixes`), makes every trace of its finding pass."""
    if not FORK_PYTHON.exists():
        if os.environ.get("KVCERT_REFAWARE", "0") == "1":
            pytest.fail("KVCERT_REFAWARE=1 but .venv-refaware is missing", pytrace=False)
        pytest.skip(".venv-refaware missing: run scripts/install_refaware.sh")
    args = _fix_runs(fork=True)
    done = subprocess.run(
        [str(FORK_PYTHON), "-W", "ignore", "-c", REPLAY_FIXED, *args],
        cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _expect_fixed(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.sglang
def test_every_sglang_fix_makes_its_findings_traces_pass() -> None:
    """The same for SGLang's findings, in this process (the fixes are put back after each trace)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed")
    args = _fix_runs(fork=False)
    assert args, "no SGLang finding carries a fix"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", REPLAY_FIXED, *args],
        cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _expect_fixed(json.loads(done.stdout.strip().splitlines()[-1]))
