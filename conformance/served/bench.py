"""`kvcert bench served`: kvcert's plugin against SGLang's own caches, served, on one multi-turn traffic with
priorities, and the simulator's prediction for the same pools and traffic beside every figure (docs/served.md,
"Served figures").

Each target's real server runs on the tiny model with small pools (`targets.TARGETS`), every one behind SGLang's
priority scheduler (`--enable-priority-scheduling`) with the same request and prefill limits. The traffic is the
simulator's stress test scaled to those pools (`kvcert.sim.workload.stress`): high- and low-priority clients, each a
session of turns whose prompt is the last prompt, its answer and new tokens, sent after a think time. What a cache
kept is read from the engine's own report (`meta_info.cached_tokens`), the first token's arrival from the stream.
One run per workload seed and target; between runs the server's cache is flushed (`/flush_cache`).

The prediction serves the same sessions (same lengths, priorities, think times) from the simulator's caches over
the same pools, with costs calibrated on the served engine by a probe (`calibrate`): nothing of the served run's
outcome goes into it.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from kvcert.conformance.served.client import Ask, Client, client_for
from kvcert.conformance.served.harness import EnvironmentMissing, make_model
from kvcert.conformance.served.server import Server, free_port
from kvcert.conformance.served.targets import TARGETS, ServedTarget, launch_argv, python_of
from kvcert.sim.costs import Costs
from kvcert.sim.policy import run_one
from kvcert.sim.workload import StressSpec, Workload, stress

__all__ = [
    "BENCH_TARGETS",
    "PREDICTED_BY",
    "BenchSpec",
    "EnvironmentMissing",
    "Turned",
    "bench",
    "calibrate",
    "costs_for",
    "figures",
    "host_ratio",
    "play",
    "ratios",
    "spread",
]

BENCH_TARGETS = ("sglang", "sglang-hicache", "sglang-kvcert", "sglang-kvcert-retain")
PREDICTED_BY = {
    "sglang": "blind",
    "sglang-hicache": "baseline",
    "sglang-kvcert": "proactive-unscoped",
    "sglang-kvcert-retain": "proactive-unscoped-retain-1-wait",
}
"""The simulator's row for each served target: SGLang's device-only radix cache by kvcert.gpu's priority-blind LRU
with no host pool (certified to evict as SGLang's does), HiCache by SGLang 0.5.23's own UnifiedRadixCache + HiCache
code, and the plugin by kvcert.gpu with session refs (SPEC.md §11), the cache the plugin runs, its evictions
unscoped as SGLang 0.5.23's scheduler calls them (docs/sglang-plugin.md, "Priorities and sessions"); with retention
on, the same with each client's hint of its think time + 1 s and the engine's hold on a waiting turn (SPEC.md §11.7),
as the served clients send (`play`) and the plugin does."""

SCHEDULER_FLAGS = ("--enable-priority-scheduling",)
VOCAB = 512


@dataclass(frozen=True)
class BenchSpec:
    """The traffic, scaled to the served pools (1,024 device tokens): the stress test's shape with fewer, shorter
    sessions. Lengths are whole 16-token pages, so the simulator's page keys fit the served prompts."""

    hp_clients: int = 6
    lp_per_hp: float = 0.5
    min_turns: int = 3
    max_turns: int = 6
    request_length: int = 160
    sub_question_length: int = 48
    output_length: int = 16
    think_min: float = 1.0
    think_max: float = 3.0
    max_running: int = 8
    """`--max-running-requests` on every server, `Costs.max_running` in the prediction."""
    chunked_prefill: int = 512
    """`--chunked-prefill-size` on every server, `Costs.chunked_prefill_tokens` in the prediction."""

    def workload(self, seed: int) -> Workload:
        return stress(
            StressSpec(
                self.hp_clients,
                self.min_turns,
                self.max_turns,
                self.request_length,
                self.sub_question_length,
                self.output_length,
                self.think_min,
                self.think_max,
                seed,
                self.lp_per_hp,
            )
        )

    def flags(self) -> tuple[str, ...]:
        return ("--max-running-requests", str(self.max_running), "--chunked-prefill-size", str(self.chunked_prefill))


@dataclass(frozen=True)
class Turned:
    """One turn as its client saw it."""

    session: str
    turn: int
    high: bool
    prompt_tokens: int
    cached: int
    cached_host: int
    ttft: float
    latency: float
    finish: str
    status: int
    retractions: int

    @property
    def done(self) -> bool:
        return self.status == 200 and self.finish in ("length", "stop")


def _tokens(seed: int, session: str, turn: int, n: int) -> tuple[int, ...]:
    rng = random.Random(f"kvcert-bench-served:{seed}:{session}:{turn}")
    return tuple(rng.randrange(3, VOCAB) for _ in range(n))  # 0, 1, 2: the tokenizer's specials


RETAIN_SLACK_S = 1.0
"""A hinting client's retention: the pause before its next turn and this much more (the engine first looks at a turn
a moment after it arrives)."""


def play(client: Client, workload: Workload, seed: int, session_ids: bool, hints: bool = False) -> list[Turned]:
    """Serve `workload` as its clients would: a thread per session, each turn after its think time, streamed; with
    `session_ids`, every turn names its session and the session is closed after its last turn; with `hints`, every
    turn but the last carries its client's retention hint (the next pause + `RETAIN_SLACK_S`)."""
    out: list[Turned] = []
    lock = threading.Lock()

    def run(s: Any) -> None:
        time.sleep(s.arrival)
        context: tuple[int, ...] = ()
        for k, turn in enumerate(s.turns):
            if k:
                time.sleep(turn.think)
            prompt = context + _tokens(seed, s.id, k, turn.new_tokens)
            ask = Ask(
                rid=f"bench-{seed}-{s.id}-t{k:02d}",
                session=s.id,
                turn=k,
                prompt=prompt,
                max_new_tokens=turn.output_tokens,
                priority=s.priority,
                session_id=s.id if session_ids else None,
                stream=True,
                retain=s.turns[k + 1].think + RETAIN_SLACK_S if hints and k + 1 < len(s.turns) else None,
            )
            r = client.generate(ask)
            got = Turned(
                s.id,
                k,
                workload.high(s),
                len(prompt),
                r.cached or 0,
                r.cached_host,
                (r.t_first or r.t_end) - r.t_send,
                r.t_end - r.t_send,
                r.finish,
                r.status,
                r.retractions,
            )
            with lock:
                out.append(got)
            if not got.done:
                break  # the client stops: its context is gone
            context = prompt + r.output
        if session_ids:
            client.close_session(s.id)

    with ThreadPoolExecutor(max_workers=max(1, len(workload.sessions))) as pool:
        for f in [pool.submit(run, s) for s in workload.sessions]:
            f.result()
    return sorted(out, key=lambda t: (t.session, t.turn))


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def figures(turns: Sequence[Turned], high: bool) -> dict[str, float]:
    """One priority class's figures, as the simulator reports them (kvcert.sim.report.block): the share of turn>=1
    prompt tokens the engine reported cached, and TTFT percentiles over every finished turn."""
    mine = [t for t in turns if t.high == high]
    done = [t for t in mine if t.done]
    later = [t for t in done if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in later)
    return {
        "turns": len(mine),
        "not_finished": len(mine) - len(done),
        "turn1_hit": sum(t.cached for t in later) / prompt if prompt else float("nan"),
        "host_share": sum(t.cached_host for t in later) / prompt if prompt else float("nan"),
        "ttft_p50": _pct([t.ttft for t in done], 50),
        "ttft_p90": _pct([t.ttft for t in done], 90),
        "retracted": float(sum(t.retractions for t in mine)),
    }


def calibrate(client: Client, seed: int, reps: int = 3) -> dict[str, float]:
    """The served engine's prefill and decode rates, from requests sent alone with fresh tokens (nothing cached):
    prefill per token from the latency of a 1-token answer to a 16- and a 512-token prompt, a decode step from a
    65-token answer to the 16-token prompt. Medians of `reps` probes each."""

    def once(n: int, out: int, i: int) -> float:
        ask = Ask(f"probe-{seed}-{n}-{out}-{i}", "probe", 0, _tokens(seed, f"probe{n}x{out}", i, n), out)
        r = client.generate(ask)
        if r.status != 200:
            raise RuntimeError(f"calibration probe refused ({r.status}): {r.error}")
        return r.t_end - r.t_send

    short = statistics.median(once(16, 1, i) for i in range(reps))
    long = statistics.median(once(512, 1, i) for i in range(reps))
    decode = statistics.median(once(16, 65, i) for i in range(reps))
    return {
        "prefill_16_s": short,
        "prefill_512_s": long,
        "answer_65_s": decode,
        "prefill_token_s": max(0.0, (long - short) / 496),
        "decode_step_s": max(0.0, (decode - short) / 64),
    }


def host_ratio(target: ServedTarget) -> float:
    """The host pool's size in device pools (`--hicache-ratio`), 0 without a host tier."""
    flags = list(target.flags)
    if "--enable-hierarchical-cache" not in flags:
        return 0.0
    return float(flags[flags.index("--hicache-ratio") + 1]) if "--hicache-ratio" in flags else 2.0


def costs_for(target: ServedTarget, spec: BenchSpec, rates: dict[str, float]) -> Costs:
    """The simulator's costs for `target`'s pools and limits, at the probe's rates (no per-step fixed cost: the
    simulator has none for prefill, so the probe's intercept is left out and printed)."""
    return Costs(
        page_tokens=target.block,
        device_tokens=target.pool_tokens,
        host_tokens=int(target.pool_tokens * host_ratio(target)),
        prefill_token_s=rates["prefill_token_s"],
        attention_pair_s=0.0,
        decode_step_s=rates["decode_step_s"],
        decode_request_s=0.0,
        decode_context_s=0.0,
        load_token_s=0.0,
        chunked_prefill_tokens=spec.chunked_prefill,
        max_running=spec.max_running,
        decode_block=1,
    )


def _predict(target: ServedTarget, w: Workload, costs: Costs) -> dict[str, float]:
    s = run_one(PREDICTED_BY[target.name], w, costs)
    if "unavailable" in s:
        return {"unavailable": 1.0}
    return {
        "hp_turn1_hit": s["high"]["turn1_cache_hit"],
        "lp_turn1_hit": s["low"]["turn1_cache_hit"],
        "hp_ttft_p90": s["high"]["ttft"]["p90"],
        "lp_ttft_p90": s["low"]["ttft"]["p90"],
    }


def _flush(client: Client) -> None:
    """Empty the cache once the scheduler runs and queues nothing (a flush needs an idle scheduler)."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        load = client.occupancy()
        if load is not None and not load["running"] and not load["waiting"]:
            break
        time.sleep(0.3)
    for _ in range(20):
        if client.flush():
            return
        time.sleep(0.5)
    raise RuntimeError(f"{client.url}/flush_cache refused: the next run would not start from an empty cache")


def bench(
    names: Sequence[str],
    spec: BenchSpec,
    seeds: Sequence[int],
    logs: Path,
    python: Optional[str] = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every target's runs at every seed, and the prediction of each: {"spec", "rates", "runs": [...]}."""
    targets = [TARGETS[n] for n in names]
    for sd in seeds:
        spec.workload(sd)  # a bad spec fails before any server starts
    say(f"traffic: {spec}; every server also runs {' '.join(SCHEDULER_FLAGS + spec.flags())}")
    rates: dict[str, float] = {}
    runs: list[dict[str, Any]] = []
    for t in targets:
        py = python_of(t, python)
        model = make_model(t, py, 0)
        port = free_port()
        argv, env = launch_argv(t, py, Path(model["path"]), port, twin=False, extra=SCHEDULER_FLAGS + spec.flags())
        say(f"{t.name}: starting {t.summary}")
        with Server(f"{t.name} server", argv, port, logs / f"{t.name}.log", env) as server:
            server.wait_ready()
            client = client_for(t.flavor, server.url, vocab=VOCAB, context=t.context)
            if not rates:
                rates = calibrate(client, 0)
                say("calibrated on " + t.name + ": " + ", ".join(f"{k} {v:.4g}" for k, v in rates.items()))
            else:
                calibrate(client, 1, reps=1)  # the same warm-up every server gets
            costs = costs_for(t, spec, rates)
            for seed in seeds:
                _flush(client)
                w = spec.workload(seed)
                t0 = time.monotonic()
                turned = play(client, w, seed, bool(t.traffic.get("session_ids")), bool(t.traffic.get("retain_hints")))
                wall = time.monotonic() - t0
                high, low, predicted = figures(turned, True), figures(turned, False), _predict(t, w, costs)
                row: dict[str, Any] = {
                    "target": t.name,
                    "seed": seed,
                    "wall_s": round(wall, 1),
                    "high": high,
                    "low": low,
                    "predicted": predicted,
                    "alive": server.alive(),
                }
                runs.append(row)
                say(
                    f"{t.name} seed {seed}: HP hit {high['turn1_hit']:.3f} (predicted "
                    f"{predicted.get('hp_turn1_hit', float('nan')):.3f}), HP TTFT p90 "
                    f"{high['ttft_p90']:.3f} s, LP TTFT p90 {low['ttft_p90']:.3f} s, {wall:.0f} s"
                )
                if not server.alive():
                    raise RuntimeError(f"{t.name}: the server exited during the run: {server.exit_note()}")
    return {"spec": asdict(spec), "seeds": list(seeds), "rates": rates, "runs": runs}


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the finite values (NaN when none)."""
    v = [x for x in values if x == x]
    if not v:
        return (float("nan"),) * 3  # type: ignore[return-value]
    return statistics.median(v), min(v), max(v)


def ratios(runs: Sequence[dict[str, Any]], it: str, base: str, cls: str, key: str) -> list[float]:
    """Per seed, `it`'s figure over `base`'s (the runs a seed shares)."""
    by = {(r["target"], r["seed"]): r for r in runs}
    out = []
    for (name, seed), r in sorted(by.items()):
        other = by.get((base, seed))
        if name == it and other is not None and other[cls][key]:
            out.append(r[cls][key] / other[cls][key])
    return out



def _cell(values: Sequence[float], digits: int = 3) -> str:
    med, lo, hi = spread(values)
    if med != med:
        return "-"
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


FIGURES = (
    ("HP hit turn>=1", "high", "turn1_hit", "hp_turn1_hit"),
    ("LP hit turn>=1", "low", "turn1_hit", "lp_turn1_hit"),
    ("HP TTFT p90 s", "high", "ttft_p90", "hp_ttft_p90"),
    ("LP TTFT p90 s", "low", "ttft_p90", "lp_ttft_p90"),
)
"""(column, class, served figure, predicted figure): what the tables print."""


def tables(result: dict[str, Any]) -> list[Any]:
    """The figures table (each target's served figures, and below them the simulator's prediction, median [min-max]
    over the seeds) and a ratio table per plugin target (per seed, its figure over each SGLang cache's, and with
    retention over the plugin's without it; median [min-max])."""
    from rich.markup import escape
    from rich.table import Table

    runs = result["runs"]
    seeds = result["seeds"]
    names = list(dict.fromkeys(r["target"] for r in runs))
    fig = Table(title=escape(f"served, and predicted by the simulator: median [min-max] over {len(seeds)} workload seeds"))
    fig.add_column("target")
    fig.add_column("figures")
    for col, *_ in FIGURES:
        fig.add_column(col, justify="right")
    fig.add_column("HP host share", justify="right")
    fig.add_column("not finished", justify="right")
    for n in names:
        mine = [r for r in runs if r["target"] == n]
        served = [escape(_cell([r[cls][key] for r in mine])) for _, cls, key, _ in FIGURES]
        unfinished = sum(r["high"]["not_finished"] + r["low"]["not_finished"] for r in mine)
        fig.add_row(n, "served", *served, escape(_cell([r["high"]["host_share"] for r in mine])), str(unfinished))
        predicted = [escape(_cell([r["predicted"].get(p, float("nan")) for r in mine])) for *_, p in FIGURES]
        fig.add_row("", f"sim {PREDICTED_BY[n]}", *predicted, "", "", end_section=True)
    out = [fig]
    for it in (n for n in names if n.startswith("sglang-kvcert")):
        rat = Table(title=escape(f"ratios: {it} over each SGLang cache, per seed, median [min-max]"))
        rat.add_column("over")
        for col, *_ in FIGURES:
            rat.add_column(col, justify="right")
        # SGLang's own caches; the plugin with retention also over the plugin without it
        for base in (n for n in names if n != it and (n == "sglang-kvcert" or not n.startswith("sglang-kvcert"))):
            rat.add_row(base, *(escape(_cell(ratios(runs, it, base, cls, key), 2)) for _, cls, key, _ in FIGURES))
        out.append(rat)
    return out
