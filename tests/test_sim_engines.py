"""`kvcert bench policy` over the real engines' caches: SGLang 0.5.23's HiCache (the baseline) in this process, the
RefAware fork's cache in its own environment (`.venv-refaware`, through `kvcert.sim.remote`). A tiny stress run
each, under pressure: every turn reported, tokens conserved, and the engine's own checks clean at the end
(SGLang's `sanity_check`, kvcert's snapshot invariants, nothing locked or referenced)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from _sglang import require_sglang

from kvcert.sim import policy, remote
from kvcert.sim.costs import Costs
from kvcert.sim.workload import StressSpec, stress

require_sglang()

TIGHT = Costs(device_tokens=64 * 160, host_tokens=64 * 200)
SPEC = StressSpec(
    hp_clients=8,
    min_turns=2,
    max_turns=4,
    request_length=2048,
    sub_question_length=512,
    output_length=128,
    think_min=0.5,
    think_max=1.0,
)


@pytest.mark.parametrize("name", ["baseline", "baseline@fcfs"])
def test_sglang_hicache_serves_the_stress_test_and_ends_clean(name: str) -> None:
    w = stress(SPEC)
    s = policy.run_one(name, w, TIGHT)
    assert s["accounting"] == [] and s["checks"] == []
    assert s["high"]["turns_completed"] + s["low"]["turns_completed"] == w.turns
    assert s["counters"]["evicted"] > 0 and s["counters"]["loads"] > 0  # the pools were too small: it had to choose


@pytest.mark.parametrize("scheduler", ["priority", "fcfs"])
def test_the_sglang_baseline_and_kvcerts_blind_cache_agree(scheduler: str) -> None:
    """kvcert.gpu without the priority calls runs SGLang's policy (LRU, write-through): on the same workload, behind
    either scheduler, the two give the same hits turn by turn and the same run. A gap here would be a difference
    between the caches, not the policies (it was one: kvcert.gpu's clock was never set, so its LRU ranked by node
    id; the driver now advances it before every call, as SGLang's tree advances its own counter)."""
    w = stress(replace(SPEC, hp_clients=16))
    a, b = policy.run_one(f"baseline@{scheduler}", w, TIGHT), policy.run_one(f"blind@{scheduler}", w, TIGHT)
    for cls in ("high", "low"):
        assert a[cls]["per_turn"] == b[cls]["per_turn"]
    assert a["duration_s"] == b["duration_s"] and a["steps"] == b["steps"]
    assert a["counters"]["evicted"] == b["counters"]["evicted"] > 0 and a["counters"]["loads"] == b["counters"]["loads"]


@pytest.mark.parametrize("row", ["refaware", "refaware@fork"])
def test_the_refaware_fork_serves_the_stress_test_in_its_own_environment(row: str) -> None:
    if remote.python_for("refaware") is None:
        why = ".venv-refaware missing: run scripts/install_refaware.sh"
        if os.environ.get("KVCERT_REFAWARE", "0") == "1":
            pytest.fail(f"KVCERT_REFAWARE=1 but {why}", pytrace=False)
        pytest.skip(why)
    w = stress(SPEC)
    s = policy.run_one(row, w, TIGHT)
    assert "unavailable" not in s, s
    assert s["environment"].endswith(".venv-refaware/bin/python")
    assert s["accounting"] == [] and s["checks"] == []
    assert s["high"]["turns_completed"] + s["low"]["turns_completed"] == w.turns
    assert s["scheduler"] == (row.partition("@")[2] or "priority")


def test_the_prefill_graph_buckets_are_sglangs_own() -> None:
    """The one SGLang function the pool sizing copies (`kvcert.sim.sizing`), against the installed wheel's."""
    from kvcert.conformance.adapters.sglang.env import install_shims
    from kvcert.sim import sizing

    install_shims()
    from sglang.srt.arg_groups.cuda_graph_hook import generate_prefill_cuda_graph_batch_sizes

    for max_bs in (2048, 8192):
        assert sizing.prefill_graph_buckets(max_bs) == generate_prefill_cuda_graph_batch_sizes(max_bs)


@pytest.mark.parametrize("name", ["baseline", "refaware"])
def test_preemption_returns_what_the_preempted_held(name: str) -> None:
    """At most 2 running requests and preemption at any priority difference: high-priority turns preempt running
    low-priority ones, whose output is freed and lock returned through the cache's own calls; the engine's checks
    stay clean and every turn still finishes."""
    if name == "refaware" and remote.python_for("refaware") is None:
        pytest.skip(".venv-refaware missing: run scripts/install_refaware.sh")
    w = stress(replace(SPEC, hp_clients=2, lp_per_hp=4, output_length=512, think_min=2.0, think_max=4.0))
    costs = replace(TIGHT, max_running=2, preemption_threshold=0)
    s = policy.run_one(name, w, costs)
    assert s["accounting"] == [] and s["checks"] == []
    assert s["steps"]["preempted"] > 0
    assert s["high"]["turns_completed"] + s["low"]["turns_completed"] == w.turns


CITED = {
    "schedule_policy.py:785-793": "def _get_running_request_total_token_offset",
    "schedule_policy.py:526-535": "def _sort_by_priority_and_fcfs",
    "scheduler.py:3480-3495": "set_wait_queue_entry_time",
    "scheduler.py:4204-4292": "for req in self.waiting_queue",
    "schedule_policy.py:1395-1430": "def add_one_req(",
    "prefill_budget.py:62-170": "class PrefillBudget",
    "scheduler.py:4229-4237": "preempt_to_schedule",
    "schedule_policy.py:1707-1778": "def preempt_to_schedule",
    "scheduler.py:4279-4292": "AddReqResult.NO_TOKEN",
    "scheduler.py:4459-4551": "batch.retract_decode()",
    "schedule_batch.py:3432-3580": "def retract_decode",
    "schedule_batch.py:2360-2395": "req.reset_for_retract()",
    "schedule_batch.py:2965-2974": "retracted_stain",
}


def test_the_scheduler_models_citations_point_at_the_installed_wheels_code() -> None:
    """Every `file:first-last` the engine model cites is in this table, and the installed SGLang's file holds what
    the table says between those lines: a wheel whose code moved fails here, not silently."""
    import re
    from pathlib import Path

    import sglang

    from kvcert.sim import engine

    cited = set(re.findall(r"`(\w+\.py):(\d+-\d+)`", engine.__doc__ or ""))
    assert {f"{f}:{r}" for f, r in cited} == set(CITED)
    root = Path(sglang.__file__).parent / "srt"
    for where, text in CITED.items():
        name, span = where.split(":")
        first, last = map(int, span.split("-"))
        (path,) = [p for p in (root / "managers" / name, root / "mem_cache" / name) if p.exists()]
        lines = path.read_text().splitlines()[first - 1 : last]
        assert any(text in line for line in lines), f"{where} does not hold {text!r}"
