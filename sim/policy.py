"""`kvcert bench policy`: run contenders over a workload, the 3 x N table, the sensitivity sweep, plots.

Each run is independent (a fresh cache, the same seeded workload), so figures of different
contenders compare the caches and schedulers alone. A run that fails its end checks or its
accounting is reported as such, and the command exits 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from kvcert.sim import remote, report
from kvcert.sim.costs import Costs
from kvcert.sim.engine import simulate
from kvcert.sim.targets import CONTENDERS, SCHEDULERS, Unavailable, build, parse
from kvcert.sim.workload import StressSpec, Workload, stress

__all__ = ["SWEEPS", "run_one", "sweep", "table"]


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


def failed(s: dict[str, Any]) -> list[str]:
    return [*s.get("checks", []), *s.get("accounting", [])]


def table(
    names: Sequence[str],
    hps: Sequence[int],
    costs: Costs,
    spec: StressSpec,
    seed: int = 0,
    on_run: Optional[Callable[[int, str, Workload], Optional[Callable[[int], None]]]] = None,
) -> list[dict[str, Any]]:
    """Every contender at every high-priority client count: one summary each (hp recorded)."""
    out = []
    for hp in hps:
        w = stress(replace(spec, hp_clients=hp))
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


SWEEPS: dict[str, Sweep] = {
    "host": Sweep("host pool (x the device pool: SGLang's hicache_ratio, default 2)", (1.0, 1.5, 2.0, 3.0, 4.0, 5.0), _host),
    "think": Sweep("mean think time (s)", (1.5, 3.75, 7.5, 15.0, 30.0), _think),
    "speed": Sweep("engine speed (x the default costs)", (0.5, 1.0, 2.0, 4.0), _speed),
}


def sweep(
    which: str,
    names: Sequence[str],
    hp: int,
    costs: Costs,
    spec: StressSpec,
    seed: int = 0,
    on_run: Optional[Callable[[float, str, Workload], Optional[Callable[[int], None]]]] = None,
) -> list[dict[str, Any]]:
    sw = SWEEPS[which]
    out = []
    for v in sw.values:
        c, s = sw.apply(costs, replace(spec, hp_clients=hp), v)
        w = stress(s)
        for name in names:
            r = run_one(name, w, c, seed, on_run(v, name, w) if on_run else None)
            r |= {"sweep": which, "value": v, "hp_clients": hp}
            out.append(r)
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
