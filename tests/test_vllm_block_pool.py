"""vLLM 0.32's `BlockPool` at its API (`conformance.adapters.vllm.block_pool`): the unmodified pool is CERTIFIED on a
run that reaches hits, evictions, a connector's evict_blocks and a reset, and each bug planted into the pool fails it
under the rule it breaks — the page-level core, the event stream, or the `vllm-0.32` profile's pool."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _vllm import plant_runs, run_vllm

TARGET = "kvcert.conformance.adapters.vllm.block_pool:factory"
PLANTS = {
    "leak-on-free": {"INV-PAGE-2", "INV-POOL-1"},
    "lora-unhashed": {"INV-KV-1", "INV-REQ-2"},
    "evict-keeps-hash": {"INV-POOL-1", "INV-ERR-3"},
    "hit-stays-queued": {"INV-ACCT-1"},
    "cached-freed-to-head": {"INV-POOL-1"},
    "lookup-newest-duplicate": {"INV-POOL-1"},
    "eviction-unannounced": {"INV-EVENT-1"},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return plant_runs(["tests/vllm_plants.py", TARGET, "100", "none", *PLANTS])


def test_the_unmodified_pool_is_certified_on_a_run_that_reaches_evictions(runs: dict[str, dict[str, Any]]) -> None:
    clean = runs["none"]
    assert clean["passed"] and clean["rules"] == [], clean
    assert clean["reached"].get("evicted", 0) > 100, clean["reached"]
    said = " ".join(clean["not_checked"])
    assert "no step of this run exercised" not in said, said  # hits, evictions, evict_blocks and a reset all ran


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_bug_planted_in_the_pool_fails_under_the_rule_it_breaks(runs: dict[str, dict[str, Any]], plant: str) -> None:
    got = runs[plant]
    assert not got["passed"] and set(got["rules"]) & PLANTS[plant], got


def test_a_saved_walk_trace_replays_with_its_failure_and_passes_on_the_real_pool(tmp_path: Any) -> None:
    """A failing walk is shrunk and saved; `kvcert replay` plays it: it fails with the bug planted and passes on the
    pool as shipped."""
    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, 'tests'); import vllm_plants as p\n"
        "from kvcert.conformance.certification.certify import certify, load_factory\n"
        "from kvcert.conformance.certification.walk import replay_walk_trace\n"
        f"out = Path({str(tmp_path)!r})\n"
        "with p.planted('cached-freed-to-head'):\n"
        f"    c = certify({TARGET!r}, examples=100, out_dir=out)\n"
        "    path = Path(c.cells[0].trace_path)\n"
        f"    planted = replay_walk_trace(path, load_factory({TARGET!r}))\n"
        f"shipped = replay_walk_trace(path, load_factory({TARGET!r}))\n"
        "print(json.dumps([str(path), c.cells[0].trace_len, [v.inv for v in planted.violations], shipped is None]))"
    )
    rc, out, stdout = run_vllm(["python", "-c", code])
    assert rc == 0, out[-3000:]
    path, length, rules, shipped_passes = json.loads(stdout.strip().splitlines()[-1])
    assert "INV-POOL-1" in rules and shipped_passes and 0 < length <= 20, (rules, length)
    rc, out, _ = run_vllm(["kvcert", "replay", path])
    assert rc == 0 and "PASS" in out, out[-2000:]
