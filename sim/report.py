"""The seed's metric block and per-turn breakdown, for high- and low-priority clients, as values and text.

Definitions follow the fork's `bench_ref_aware_multiturn.py` so the figures read like the seed's:
a turn's hit is `cached_tokens / prompt_tokens` (device hits and host hits loaded back both count,
as SGLang's `cached_tokens` does); "turn>=1 cache hit" is token-weighted over turns >= 1; a
per-turn hit is the mean of that turn's ratios; percentiles are numpy's (linear). TTFT and
latency run from the turn's arrival.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcert.sim.engine import Record, Run
from kvcert.sim.workload import Workload

__all__ = ["block", "per_turn", "retention_at_admission", "summary", "text_block"]


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    s = np.sort(np.asarray(values, dtype=float))
    return {
        "mean": float(s.mean()),
        "p50": float(np.percentile(s, 50)),
        "p90": float(np.percentile(s, 90)),
        "p99": float(np.percentile(s, 99)),
        "max": float(s[-1]),
    }


def per_turn(records: Sequence[Record]) -> list[dict[str, Any]]:
    turns: dict[int, list[Record]] = {}
    for r in records:
        turns.setdefault(r.turn, []).append(r)
    return [
        {
            "turn": k,
            "n": len(rs),
            "avg_out": float(np.mean([r.output_tokens for r in rs])),
            "cache_hit": float(np.mean([r.hit for r in rs])),
            "ttft": float(np.mean([r.ttft for r in rs])),
            "ttft_p90": float(np.percentile([r.ttft for r in rs], 90)),
        }
        for k, rs in sorted(turns.items())
    ]


def around_p90(done: list[Record]) -> dict[str, float]:
    """What a class's TTFT p90 is made of: the turns ranked within two percent of the class's turns either side of
    its 90th percentile TTFT, as medians: time queued before the scheduler first admitted them, time from admission
    to the first token, prefix hit; and their share of first turns and of retracted turns. (A band this narrow stays
    on one side of a cliff such as the first turns' long wait behind every HP turn.)"""
    ranked = sorted(done, key=lambda r: r.ttft)
    lo, hi = int(0.88 * len(ranked)), int(0.92 * len(ranked))
    band = ranked[lo : max(hi, lo + 1)]
    if not band:
        return {}
    return {
        "n": len(band),
        "ttft_s": float(np.median([r.ttft for r in band])),
        "queued_s": float(np.median([r.admitted - r.arrival for r in band])),
        "admitted_to_first_s": float(np.median([r.first_token - r.admitted for r in band])),
        "first_turns": sum(r.turn == 0 for r in band) / len(band),
        "hit": float(np.median([r.hit for r in band])),
        "retracted": sum(r.retracted > 0 for r in band) / len(band),
    }


def block(run: Run, workload: Workload, high: bool) -> dict[str, Any]:
    """One priority class's figures (the fork's summary, plus what did not finish)."""
    clients = [s for s in workload.sessions if workload.high(s) == high]
    mine = [r for r in run.records if r.high == high]
    done = [r for r in mine if r.outcome == "finished"]
    later = [r for r in done if r.turn > 0]
    first = [r for r in done if r.turn == 0]
    prompt = sum(r.prompt_tokens for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    makespan = max((r.end for r in done), default=0.0)
    return {
        "clients": len(clients),
        "turns_completed": len(done),
        "turns_not_finished": len(mine) - len(done),
        "completion_tokens": out_tokens,
        "makespan_s": makespan,
        "out_tok_per_s": out_tokens / run.duration if run.duration else 0.0,
        "cache_hit": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "turn1_cache_hit": (
            sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later) if later else 0.0
        ),
        "loaded_share": sum(r.loaded_tokens for r in done) / prompt if prompt else 0.0,
        "ttft": _stats([r.ttft for r in done]),
        "latency": _stats([r.latency for r in done]),
        "turn0_ttft": _stats([r.ttft for r in first]),
        "turn1_ttft": _stats([r.ttft for r in later]),
        "around_p90": around_p90(done),
        "per_turn": per_turn(done),
    }


def summary(run: Run, workload: Workload, accounting: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """Everything one run reports: both classes, the cache's counters, its end checks and the accounting."""
    hp, lp = block(run, workload, True), block(run, workload, False)
    later = [p["cache_hit"] for p in hp["per_turn"] if p["turn"] > 0]
    return {
        "cache": run.cache,
        "workload": run.workload,
        "duration_s": run.duration,
        "wall_s": round(run.wall_s, 2),
        "high": hp,
        "low": lp,
        "hp_min_turn_hit": min(later) if later else math.nan,
        "counters": run.counters,
        "steps": run.steps,
        "checks": run.checks,
        "accounting": accounting,
        **extra,
    }


def retention_at_admission(s: dict[str, Any], high: bool = True) -> str:
    """How many of a class's turns were admitted while their session's retention held, how many after it had
    expired in the queue, and the hit of each (the retaining caches' counters; "" for a run without them). With the
    engine's half (`-wait` rows), the HP line adds how many retentions it held for a waiting turn and how many had run
    out before it received the turn (in a client's own queue)."""
    c, cls = s["counters"], "high" if high else "low"
    parts = []
    for state, label in (("live", "while retained"), ("expired", "after it expired")):
        n = c.get(f"retention_{cls}_{state}_admits", 0)
        prompt = c.get(f"retention_{cls}_{state}_prompt_pages", 0)
        hit = c.get(f"retention_{cls}_{state}_hit_pages", 0) / prompt if prompt else 0.0
        parts.append(f"{n} {label} (hit {hit:.4f})")
    if high and ("held_waiting" in c or "retention_ran_out_unreceived" in c):  # the engine's half, both classes
        parts.append(
            f"both classes: {c.get('held_waiting', 0)} held for a waiting turn, "
            f"{c.get('retention_ran_out_unreceived', 0)} ran out before the engine received the turn"
        )
    return ", ".join(parts) if any(f"retention_{cls}_" in k for k in c) else ""


def text_block(s: dict[str, Any], high: bool = True) -> str:
    """The fork's report for one class, line for line where the simulator has the figure."""
    b = s["high" if high else "low"]
    who = "High" if high else "Low"
    lines = [
        f"  {who}-priority clients:           {b['clients']}",
        f"  Duration:                        {s['duration_s']:.2f}s",
        f"  {who}-priority makespan:          {b['makespan_s']:.2f}s",
        f"  {who}-priority turns completed:   {b['turns_completed']}"
        + (f"  ({b['turns_not_finished']} not finished)" if b["turns_not_finished"] else ""),
        f"  {who}-priority completion tokens: {b['completion_tokens']}",
        f"  {who}-priority out tok (wall):    {b['out_tok_per_s']:.0f} tok/s",
        f"  {who}-priority cache hit:         {b['cache_hit']:.4f}",
        f"  {who}-priority turn>=1 cache hit: {b['turn1_cache_hit']:.4f}",
        f"  {who}-priority TTFT mean/p90/p99: {b['ttft']['mean']:.3f} / {b['ttft']['p90']:.3f} / {b['ttft']['p99']:.3f}s",
        f"  {who}-priority Lat mean/p90/p99:  {b['latency']['mean']:.3f} / {b['latency']['p90']:.3f} / {b['latency']['p99']:.3f}s",
        f"  {who}-priority turn0 TTFT p90/p99:{b['turn0_ttft']['p90']:.3f} / {b['turn0_ttft']['p99']:.3f}s",
        f"  {who}-priority turn>=1 TTFT p90/p99:{b['turn1_ttft']['p90']:.3f} / {b['turn1_ttft']['p99']:.3f}s",
    ]
    if "demotions" in s["counters"]:
        lines.append(f"  Adaptive demotions:              {s['counters']['demotions']}")
    if retention := retention_at_admission(s, high):
        lines.append(f"  Retention at admission:          {retention}")
    lines.append(f"\n  {who}-priority per-turn breakdown:")
    for p in b["per_turn"]:
        lines.append(
            f"    Turn {p['turn']:2d}: n={p['n']:4d}, avg_out={p['avg_out']:7.1f}, "
            f"cache_hit={p['cache_hit']:.4f}, ttft={p['ttft']:.3f}s"
        )
    return "\n".join(lines)
