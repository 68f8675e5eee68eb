"""The seed's KVCR direct linker (SGLang PR #39946) at its own API (`conformance.adapters.kvcr.linker`), judged by the
linker side of SPEC.md §14 (`kvcert.spec.linker.LinkerSide`, INV-LINK-8..14): the checker on hand-made histories (no
SGLang), then, in `.venv-kvcr` (scripts/install_kvcr.sh): the unmodified linker failing only under the two defects
the walk found (their saved traces replay), the linker with both repaired CERTIFIED on a run that reaches hits, loads
landed and failed, capacity evictions, an eviction between prepare and fetch, quarantining resets and late work, and
each bug planted into the linker failing under the rule it breaks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _vllm import run_side

from kvcert.spec import linker as lk

ROOT = Path(__file__).resolve().parent.parent
TRACES = sorted((ROOT / "docs" / "runs" / "2026-12-05-kvcr").glob("*.json"))


def run_kvcr(cmd: list[str]) -> tuple[int, str, str]:
    """`run_side` in the KVCR linker's environment."""
    return run_side(".venv-kvcr", cmd)


# --------------------------------------------------------------------------- the checker, without SGLang


def test_a_lookup_may_report_only_the_claimed_prefix() -> None:
    side = lk.LinkerSide()
    side.lookup("r", 4, [1, 2], 2)
    side.lookup("r", 4, [], 0)
    assert side.found == []
    side.lookup("r", 4, [1, 3], 2)  # a hint or an unclaimed page counted
    side.lookup("r", 2, [3], 5)  # longer than asked
    assert [v.inv for v in side.found] == ["INV-LINK-8", "INV-LINK-8"]


def test_offload_results_in_queue_order_success_only_when_every_object_stored() -> None:
    side = lk.LinkerSide()
    side.offload(["a", "b"])
    side.offload(["c"])
    side.submitted(1, ["a", "b"])
    side.submitted(2, ["c"])
    side.stored(2, {"c": True})  # the second finishes first
    side.published(True)  # the first's result while its write is in flight: out of order
    assert [v.inv for v in side.found] == ["INV-LINK-9", "INV-LINK-9"]
    side = lk.LinkerSide()
    side.offload(["a", "b"])
    side.submitted(1, ["a", "b"])
    side.stored(1, {"a": True, "b": False})
    side.published(False)
    assert side.found == []
    side.published(True)
    side.submitted(3, ["z"])
    assert [v.inv for v in side.found] == ["INV-LINK-9", "INV-LINK-9"]


def test_loads_idle_removed_and_reset() -> None:
    side = lk.LinkerSide()
    side.load(0, True, 0, [])
    side.load(1, False, 1, ["p"])
    assert side.found == []
    side.load(2, True, 1, [])
    side.load(3, True, 0, ["p"])
    side.hung("load batch 4")
    assert [v.inv for v in side.found] == ["INV-LINK-10"] * 3
    side = lk.LinkerSide()
    side.hung("preparation of r1")  # a deadline that never makes the preparation ready
    assert [v.inv for v in side.found] == ["INV-LINK-11"]
    side = lk.LinkerSide()
    side.idle({"outstanding_claims": 0, "abandoned_bytes": 0}, 0)
    side.evicted([5, 7])
    side.taken_removed([5, 7])
    side.reset(2, False, True, False)
    side.reset(0, True, False, False)
    assert side.found == []
    side.idle({"abandoned_bytes": 64}, 0)
    side.stray_claims(["claim 1 on r#1#0"])
    side.evicted([5])
    side.taken_removed([])
    side.reset(1, True, False, False)
    side.reset(0, False, False, True)
    assert [v.inv for v in side.found] == ["INV-LINK-12", "INV-LINK-12", "INV-LINK-13", "INV-LINK-14", "INV-LINK-14", "INV-LINK-14"]


def test_every_rule_the_checker_files_is_stated() -> None:
    source = (ROOT / "spec" / "linker.py").read_text()
    assert set(re.findall(r'"(INV-LINK-[0-9]+)"', source)) == set(lk.RULES)
    spec = (ROOT / "spec" / "SPEC.md").read_text()
    assert all(f"| {rule} |" in spec for rule in lk.RULES), "every rule has a row in SPEC.md §14"


# --------------------------------------------------------------------------- the PR's linker, in .venv-kvcr

EXAMPLES = 60
PLANTS: dict[str, set[str]] = {
    "lookup-unclaimed": {"INV-LINK-8"},
    "fifo-broken": {"INV-LINK-9"},
    "counter-early": {"INV-LINK-10"},
    "failed-load-completes": {"INV-LINK-10"},
    "late-claims-kept": {"INV-LINK-12"},
    "reset-no-quarantine": {"INV-LINK-14"},
    "removed-dropped": {"INV-LINK-13"},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    rc, out, stdout = run_kvcr(["python", "tests/kvcr_linker_plants.py", str(EXAMPLES), "none", "fixed", *PLANTS])
    assert rc == 0, out[-3000:]
    return {r["plant"]: r for r in map(json.loads, (ln for ln in stdout.splitlines() if ln.startswith("{")))}


def test_the_unmodified_linker_fails_only_under_its_two_defects(runs: dict[str, dict[str, Any]]) -> None:
    none = runs["none"]
    assert not none["passed"] and set(none["rules"]) <= {"INV-LINK-12", "INV-LINK-14"}, none["failures"]


def test_the_saved_traces_of_the_defects_replay() -> None:
    assert len(TRACES) == 3
    script = ("import sys; from pathlib import Path; from kvcert.conformance.certification.walk import replay_walk_trace;"
              "from kvcert.conformance.adapters.kvcr.linker import factory\n"
              "for p in sys.argv[1:]: f = replay_walk_trace(Path(p), factory); print(p, f.violations[0].inv if f else 'PASS')")  # fmt: skip
    rc, out, stdout = run_kvcr(["python", "-c", script, *map(str, TRACES)])
    assert rc == 0, out[-3000:]
    assert [ln.split()[-1] for ln in stdout.splitlines()] == ["INV-LINK-12", "INV-LINK-12", "INV-LINK-14"], stdout


def test_the_repaired_linker_is_certified_on_a_run_that_reaches_the_faults(runs: dict[str, dict[str, Any]]) -> None:
    fixed = runs["fixed"]
    assert fixed["passed"] and fixed["rules"] == [], fixed["failures"]
    assert len(fixed["cells"]) == 4
    ops = fixed["ops"]
    for key, least in (("lookup:hit", 50), ("load:landed", 20), ("load:failed", 3), ("evicted", 100),
                       ("evict:between-prepare-and-fetch", 10), ("reset:quarantined", 1), ("late:drained", 50),
                       ("prepare:hinted-dead", 20), ("offload:failed", 10), ("idle", 10)):  # fmt: skip
        assert ops.get(key, 0) >= least, (key, ops)
    assert not [x for x in fixed["not_checked"] if "no step of this run" in x], fixed["not_checked"]


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_bug_fails_under_the_rule_it_breaks(runs: dict[str, dict[str, Any]], plant: str) -> None:
    got = runs[plant]
    assert not got["passed"] and set(got["rules"]) & PLANTS[plant], got["failures"]
    assert "INV-ERR-3" not in got["rules"], got["failures"]
