"""`kvcert bench policy`: run contenders over a workload, the 3 x N table, the sensitivity sweep, plots.

Each run is independent (a fresh cache, the same seeded workload), so figures of different
contenders compare the caches and schedulers alone. A run that fails its end checks or its
accounting is reported as such, and the command exits 1.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from kvcert.sim import remote, report
from kvcert.sim.costs import Costs
from kvcert.sim.engine import simulate
from kvcert.sim.targets import CONTENDERS, SCHEDULERS, Unavailable, build, parse
from kvcert.sim.workload import AgenticSpec, StressSpec, Workload, agentic, stress

__all__ = [
    "MAP_ROWS", "SWEEPS", "gains", "generate", "grid", "plot_map", "repeated", "run_one", "spread", "sweep", "table",
]


def run_one(
    name: str,
    workload: Workload,
    costs: Costs,
    seed: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    elsewhere: bool = True,
) -> dict[str, Any]:
    """One row (`CACHE` or `CACHE@SCHEDULER`, kvcert.sim.targets.parse) over one workload: its summary
    (report.summary), or {"unavailable": why}.

    A contender whose engine cannot be imported here but has its own environment in this checkout (the
    RefAware fork's `.venv-refaware`) runs there, in a subprocess (`kvcert.sim.remote`), when `elsewhere`."""
    cache_name, scheduler = parse(name)
    future: dict[str, float] = {}
    try:
        cache = build(cache_name, costs, workload, future)
    except Unavailable as e:
        python = remote.python_for(cache_name) if elsewhere else None
        if python is not None:
            return remote.run_elsewhere(python, name, workload, costs, seed)
        return {"contender": name, "workload": workload.name, "unavailable": str(e)}
    try:
        run = simulate(
            workload,
            cache,
            costs,
            seed=seed,
            progress=progress,
            future=future,
            scheduler=scheduler,
        )
    finally:
        cache.close()
    extra = {
        "contender": name,
        "about": CONTENDERS[cache_name].about,
        "scheduler": scheduler,
        "scheduler_about": SCHEDULERS[scheduler],
    }
    return report.summary(run, workload, run.accounting(workload, costs), extra)


def generate(spec: StressSpec | AgenticSpec) -> Workload:
    """The multi-turn workload a spec describes: the stress test, or its agentic variant (tool-call pauses)."""
    return agentic(spec) if isinstance(spec, AgenticSpec) else stress(spec)


def failed(s: dict[str, Any]) -> list[str]:
    return [*s.get("checks", []), *s.get("accounting", [])]


def table(
    names: Sequence[str],
    hps: Sequence[int],
    costs: Costs,
    spec: StressSpec | AgenticSpec,
    seed: int = 0,
    on_run: Optional[Callable[[int, str, Workload], Optional[Callable[[int], None]]]] = None,
) -> list[dict[str, Any]]:
    """Every contender at every high-priority client count: one summary each (hp recorded)."""
    out = []
    for hp in hps:
        w = generate(replace(spec, hp_clients=hp))
        for name in names:
            s = run_one(name, w, costs, seed, on_run(hp, name, w) if on_run else None)
            s["hp_clients"] = hp
            out.append(s)
    return out


@dataclass(frozen=True)
class Sweep:
    label: str
    values: tuple[float, ...]
    apply: Callable[[Costs, StressSpec, float], tuple[Costs, StressSpec]]


def _host(c: Costs, s: StressSpec, v: float) -> tuple[Costs, StressSpec]:
    return replace(c, host_tokens=int(v * c.device_tokens) // c.page_tokens * c.page_tokens), s


def _think(c: Costs, s: StressSpec, v: float) -> tuple[Costs, StressSpec]:
    return c, replace(s, think_min=v / 1.5, think_max=v / 0.75)  # mean v: the script's 5-10 s is v = 7.5


def _speed(c: Costs, s: StressSpec, v: float) -> tuple[Costs, StressSpec]:
    keys = (
        "prefill_token_s",
        "attention_pair_s",
        "decode_step_s",
        "decode_request_s",
        "decode_context_s",
        "load_token_s",
    )
    return replace(c, **{k: getattr(c, k) / v for k in keys}), s


def _lp(c: Costs, s: StressSpec, v: float) -> tuple[Costs, StressSpec]:
    return c, replace(s, lp_per_hp=v)


def _growth(c: Costs, s: StressSpec, v: float) -> tuple[Costs, StressSpec]:
    return c, replace(s, sub_question_length=int(v))


SWEEPS: dict[str, Sweep] = {
    "host": Sweep(
        "host pool (x the device pool: SGLang's hicache_ratio, default 2)", (1.25, 1.5, 2.0, 3.0, 4.0, 5.0), _host
    ),
    "think": Sweep("mean think time (s)", (1.5, 3.75, 7.5, 15.0, 30.0), _think),
    "speed": Sweep("engine speed (x the default costs)", (0.5, 1.0, 2.0, 4.0), _speed),
    "lp": Sweep("low-priority clients per high-priority one (the script: 0.5)", (0.25, 0.5, 1.0, 2.0), _lp),
    "growth": Sweep("tokens appended per turn (the script: 1024)", (256.0, 512.0, 1024.0, 2048.0, 4096.0), _growth),
}

MAP_ROWS = ("baseline", "proactive")
"""What a map compares: the blind SGLang cache and the proactive one, both behind the priority scheduler."""


def points(
    axes: Sequence[str], hp: int, costs: Costs, spec: StressSpec
) -> list[tuple[tuple[float, ...], Costs, Workload]]:
    """Every combination of the named sweeps' values, as (values, costs, workload); ValueError, before anything
    runs, for a combination that makes no workload (a fractional number of clients)."""
    combos: list[tuple[tuple[float, ...], Costs, StressSpec]] = [((), costs, replace(spec, hp_clients=hp))]
    for axis in axes:
        combos = [((*vs, v), *SWEEPS[axis].apply(c, s, v)) for vs, c, s in combos for v in SWEEPS[axis].values]
    return [(vs, c, stress(s)) for vs, c, s in combos]


def grid(
    x: str,
    y: str,
    hp: int,
    costs: Costs,
    spec: StressSpec,
    seed: int = 0,
    on_run: Optional[Callable[[str, str, Workload], Optional[Callable[[int], None]]]] = None,
    names: Sequence[str] = MAP_ROWS,
) -> list[dict[str, Any]]:
    """Every pair of values of sweeps `x` and `y` (the others at their defaults), each row of `names` at each."""
    out = []
    for (vx, vy), c, w in points((x, y), hp, costs, spec):
        for name in names:
            r = run_one(name, w, c, seed, on_run(f"{x}={vx:g} {y}={vy:g}", name, w) if on_run else None)
            r |= {"map": [x, y], "x": vx, "y": vy, "hp_clients": hp}
            out.append(r)
    return out


def gains(rows: Sequence[dict[str, Any]], base: str = MAP_ROWS[0], it: str = MAP_ROWS[1]) -> list[dict[str, Any]]:
    """Per map point, `it` over `base`: the HP turn>=1 hit gained (points of hit) and the HP TTFT p90 ratio
    (base / it: above 1, `it` is faster)."""
    out = []
    for vx, vy in dict.fromkeys((r["x"], r["y"]) for r in rows):
        at = {r["contender"]: r for r in rows if (r["x"], r["y"]) == (vx, vy) and "high" in r}
        if base not in at or it not in at:
            continue
        b, p = at[base]["high"], at[it]["high"]
        out.append(
            {
                "x": vx,
                "y": vy,
                "hit_gain": p["turn1_cache_hit"] - b["turn1_cache_hit"],
                "ttft_ratio": b["ttft"]["p90"] / p["ttft"]["p90"] if p["ttft"]["p90"] else float("nan"),
                "base_hit": b["turn1_cache_hit"],
                "it_hit": p["turn1_cache_hit"],
            }
        )
    return out


def sweep(
    which: str,
    names: Sequence[str],
    hp: int,
    costs: Costs,
    spec: StressSpec,
    seed: int = 0,
    on_run: Optional[Callable[[float, str, Workload], Optional[Callable[[int], None]]]] = None,
) -> list[dict[str, Any]]:
    out = []
    for (v,), c, w in points((which,), hp, costs, spec):
        for name in names:
            r = run_one(name, w, c, seed, on_run(v, name, w) if on_run else None)
            r |= {"sweep": which, "value": v, "hp_clients": hp}
            out.append(r)
    return out


def repeated(
    names: Sequence[str],
    hps: Sequence[int],
    costs: Costs,
    spec: StressSpec | AgenticSpec,
    workload_seeds: Sequence[int],
    seed: int = 0,
    on_run: Optional[Callable[[str, str, Workload], Optional[Callable[[int], None]]]] = None,
) -> list[dict[str, Any]]:
    """Every row at every HP client count, once per workload seed (the fork's `--seed`: other turn counts and think
    times, or tool-call pauses for an `AgenticSpec`): the spread a difference between two rows must clear."""
    out = []
    for hp in hps:
        for ws in workload_seeds:
            w = generate(replace(spec, hp_clients=hp, seed=ws))
            for name in names:
                r = run_one(name, w, costs, seed, on_run(f"{hp} HP, workload seed {ws}", name, w) if on_run else None)
                out.append(r | {"hp_clients": hp, "workload_seed": ws})
    return out


SPREAD_METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "HP hit t>=1": lambda r: float(r["high"]["turn1_cache_hit"]),
    "HP TTFT p90 s": lambda r: float(r["high"]["ttft"]["p90"]),
    "LP TTFT p90 s": lambda r: float(r["low"]["ttft"]["p90"]),
}


def spread(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (HP clients, row): each of SPREAD_METRICS as (median, min, max) over the workload seeds run."""
    out = []
    for hp, name in dict.fromkeys((r["hp_clients"], r["contender"]) for r in rows if "high" in r):
        runs = [r for r in rows if (r["hp_clients"], r["contender"]) == (hp, name) and "high" in r]
        stats = {}
        for metric, get in SPREAD_METRICS.items():
            vals = [get(r) for r in runs]
            stats[metric] = (statistics.median(vals), min(vals), max(vals))
        out.append({"hp_clients": hp, "contender": name, "runs": len(runs), **stats})
    return out


# --------------------------------------------------------------------------- plots


def plot_turns(summaries: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Per-turn high-priority hit rate and TTFT, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for s in summaries:
        if "unavailable" in s:
            continue
        turns = s["high"]["per_turn"]
        x = [p["turn"] for p in turns]
        ax1.plot(x, [p["cache_hit"] for p in turns], marker="o", ms=3, label=s["contender"])
        ax2.plot(x, [p["ttft"] for p in turns], marker="o", ms=3, label=s["contender"])
    ax1.set(xlabel="turn", ylabel="HP cache hit (mean per turn)", ylim=(0, 1.02), title="HP cache hit by turn")
    ax2.set(xlabel="turn", ylabel="HP TTFT mean (s)", title="HP TTFT by turn")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """HP turn>=1 hit and HP TTFT p90 against the swept parameter, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    which = results[0]["sweep"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name in dict.fromkeys(r["contender"] for r in results):
        rs = [r for r in results if r["contender"] == name and "unavailable" not in r]
        x = [r["value"] for r in rs]
        ax1.plot(x, [r["high"]["turn1_cache_hit"] for r in rs], marker="o", label=name)
        ax2.plot(x, [r["high"]["ttft"]["p90"] for r in rs], marker="o", label=name)
    ax1.set(xlabel=SWEEPS[which].label, ylabel="HP turn>=1 cache hit", ylim=(0, 1.02))
    ax2.set(xlabel=SWEEPS[which].label, ylabel="HP TTFT p90 (s)", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"sweep: {SWEEPS[which].label}, {results[0]['hp_clients']} HP clients")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_map(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Two heatmaps over the map's two parameters: the proactive cache's HP turn>=1 hit gain over the blind one,
    and the HP TTFT p90 ratio, both behind the priority scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y = rows[0]["map"]
    xs, ys = list(SWEEPS[x].values), list(SWEEPS[y].values)
    g = {(r["x"], r["y"]): r for r in gains(rows)}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, label, cmap in (
        (axes[0], "hit_gain", "HP turn>=1 hit gained (proactive - baseline)", "Greens"),
        (axes[1], "ttft_ratio", "HP TTFT p90, baseline / proactive", "Blues"),
    ):
        grid_ = [[g[(vx, vy)][key] if (vx, vy) in g else float("nan") for vx in xs] for vy in ys]
        im = ax.imshow(grid_, origin="lower", aspect="auto", cmap=cmap)
        for j, row in enumerate(grid_):
            for i, v in enumerate(row):
                ax.text(i, j, f"{v:.2f}" if key == "hit_gain" else f"{v:.1f}x", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(xs)), [f"{v:g}" for v in xs])
        ax.set_yticks(range(len(ys)), [f"{v:g}" for v in ys])
        ax.set(xlabel=SWEEPS[x].label, ylabel=SWEEPS[y].label, title=label)
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"where the cache matters: {rows[0]['hp_clients']} HP clients, both behind the priority scheduler")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
