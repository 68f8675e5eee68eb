"""`kvcert bench policy`: the command (registered on `kvcert bench` by `conformance.cli`)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcert.sim import policy, report
from kvcert.sim.costs import engine, with_overrides
from kvcert.sim.sizing import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS, size
from kvcert.sim.targets import CONTENDERS, DEFAULT, SCHEDULERS, parse
from kvcert.sim.workload import (
    AgenticSpec,
    GroupsSpec,
    StressSpec,
    TraceError,
    Workload,
    agentic,
    groups,
    read_trace,
    stress,
)

console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)

TABLE_HP = (64, 96, 128)
_CACHE_HELP = (
    f"rows, CACHE or CACHE@SCHEDULER (default: {', '.join(DEFAULT)}); caches: {', '.join(CONTENDERS)}; schedulers: "
    f"{', '.join(SCHEDULERS)} (priority unless named)"
)
_SWEEP_HELP = f"sensitivity sweep at the first --hp: {', '.join(policy.SWEEPS)}"


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("turns"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not sys.stdout.isatty(),
    )


def _to_bound(s: dict[str, Any], bound: Optional[dict[str, Any]]) -> str:
    """The offline bound's HP turn>=1 hit less this row's, when the table has the bound's row at this point."""
    if bound is None or "high" not in bound or "high" not in s:
        return "-"
    return f"{bound['high']['turn1_cache_hit'] - s['high']['turn1_cache_hit']:.4f}"


def _row(
    t: Table, s: dict[str, Any], base: Optional[dict[str, Any]], lead: list[str], bound: Optional[dict[str, Any]] = None
) -> None:
    if "unavailable" in s:
        t.add_row(*lead, s["contender"], *["-"] * 8, "unavailable here (below)")
        return
    hp, lp = s["high"], s["low"]
    p90 = hp["ttft"]["p90"]
    # one-turn workloads (groups) have no turn >= 1: their hit over every turn, marked *
    later = any(p["turn"] > 0 for p in hp["per_turn"] + lp["per_turn"])

    def hit(b: dict[str, Any]) -> str:
        return f"{b['turn1_cache_hit']:.4f}" if later else f"{b['cache_hit']:.4f}*"

    vs = f" ({base['high']['ttft']['p90'] / p90:.1f}x)" if base and "high" in base and p90 else ""
    bad = policy.failed(s)
    t.add_row(
        *lead,
        s["contender"],
        hit(hp),
        _to_bound(s, bound) if later else "-",
        f"{s['hp_min_turn_hit']:.2f}" if later else "-",
        f"{p90:.1f}{vs}",
        hit(lp),
        f"{lp['ttft']['p90']:.1f}",
        f"{lp['out_tok_per_s']:.0f}",
        str(s["counters"].get("demotions", "-")),
        str(s["counters"].get("alloc_refused", 0)),
        "/".join(str(s["steps"].get(k, 0)) for k in ("retracted", "preempted", "reclaimed")),
        "ok" if not bad else f"[red]{len(bad)} FAILED[/]: {bad[0]}",
    )


def _table(title: str, lead: list[str]) -> Table:
    t = Table(title=title)
    for col in (
        *lead,
        "contender",
        "HP hit t>=1",
        "to bound",
        "HP min turn",
        "HP TTFT p90 s (baseline/it)",
        "LP hit t>=1",
        "LP TTFT p90 s",
        "LP out tok/s",
        "demotions",
        "refused allocs",
        "retracted/preempted/released",
        "checks",
    ):
        t.add_column(col, justify="left" if col in ("contender", "checks") else "right",
                     overflow="fold" if col == "contender" else "ellipsis")  # fmt: skip
    return t


def policy_cmd(
    hp: list[int] = typer.Option([128], "--hp", help="high-priority clients (the seed: 64, 96, 128); one run each"),
    cache: Optional[list[str]] = typer.Option(None, "--cache", help=_CACHE_HELP),
    table_: bool = typer.Option(False, "--table", help="the 3 x N grid: every contender at 64, 96 and 128 HP clients"),
    sweep_: Optional[str] = typer.Option(None, "--sweep", help=_SWEEP_HELP),
    map_: Optional[str] = typer.Option(
        None,
        "--map",
        help=f"X,Y: the proactive cache's gain over the baseline, both behind the priority scheduler, at every pair "
        f"of two sweeps' values, at the first --hp ({', '.join(policy.SWEEPS)}); with --cache, those rows' figures at "
        "every pair instead",
    ),
    workload: str = typer.Option(
        "stress",
        help="stress | agentic-syfi | groups-10x50 | groups-50x10 (agentic-syfi: the stress test's clients, turns and "
        "lengths, each pause a tool call's, drawn from the SyFI trace's per-tool means; docs/bench_policy.md)",
    ),
    trace: Optional[Path] = typer.Option(None, "--trace", help="a JSONL trace of sessions (docs/bench_policy.md)"),
    min_turns: int = typer.Option(5, help="stress, agentic-syfi: fewest turns per client (the fork's --min-turns)"),
    max_turns: int = typer.Option(20, help="stress, agentic-syfi: most turns per client"),
    request_length: int = typer.Option(15360, help="stress, agentic-syfi: first prompt, tokens"),
    sub_question_length: int = typer.Option(1024, help="stress, agentic-syfi: tokens appended each later turn"),
    output_length: int = typer.Option(256, help="stress, agentic-syfi: output tokens per turn"),
    think_min: float = typer.Option(
        5.0, help="stress: think time between turns, seconds (min); not agentic-syfi, whose pauses are tool calls'"
    ),
    think_max: float = typer.Option(
        10.0, help="stress: think time between turns, seconds (max); not agentic-syfi, whose pauses are tool calls'"
    ),
    rate: float = typer.Option(4.0, help="groups: prompts arriving per second (Poisson)"),
    workload_seed: int = typer.Option(
        42, help="the workload's seed (turn counts, think times or tool-call pauses; the fork's --seed)"
    ),
    seed: int = typer.Option(0, help="the simulator's seed (token ids)"),
    engine_: str = typer.Option(
        "physical",
        "--engine",
        help="physical (costs derived from an 8B model on an H200-class GPU) or seed (prefill at the seed's measured rate)",
    ),
    model: str = typer.Option(DEFAULT_MODEL, help=f"the model the pools are sized for: {', '.join(MODELS)}"),
    gpu: str = typer.Option(DEFAULT_GPU, help=f"the GPU the pools are sized for: {', '.join(GPUS)}"),
    set_: list[str] = typer.Option([], "--set", help="override an engine cost or limit: NAME=VALUE (kvcert.sim.costs)"),
    repeat: int = typer.Option(
        1, help="run each row at this many workload seeds (from --workload-seed on) and print each figure's median "
        "and range over them"
    ),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write every run's figures as JSON"),
    plots: Optional[Path] = typer.Option(None, "--plots", help="write PNG plots into this directory"),
    breakdown: bool = typer.Option(True, help="print each run's metric block and per-turn breakdown"),
) -> None:
    """Serve the seed's stress test (or another workload) from real caches on a simulated engine; print the seed's
    metric block per run and a comparison table. Exits 1 if any run fails its cache's end checks or the accounting."""
    try:
        costs = with_overrides(engine(engine_, model, gpu), set_)
        sizing = size(model, gpu)
        spec = StressSpec(
            hp[0],
            min_turns,
            max_turns,
            request_length,
            sub_question_length,
            output_length,
            think_min,
            think_max,
            workload_seed,
        )
        tools: Optional[AgenticSpec] = None
        if workload == "agentic-syfi" and trace is None:
            tools = AgenticSpec(
                hp[0], min_turns, max_turns, request_length, sub_question_length, output_length, workload_seed
            )
            agentic(tools)  # validates the spec before any run
        else:
            stress(spec)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    names = list(cache or DEFAULT)
    try:
        for n in names:
            parse(n)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if sweep_ is not None and sweep_ not in policy.SWEEPS:
        console.print(f"[red]error:[/] --sweep {sweep_!r}: one of {', '.join(policy.SWEEPS)}")
        raise typer.Exit(2)
    axes = map_.split(",") if map_ is not None else []
    if map_ is not None and (len(axes) != 2 or len(set(axes)) != 2 or not set(axes) <= set(policy.SWEEPS)):
        console.print(f"[red]error:[/] --map {map_!r}: two different sweeps X,Y of {', '.join(policy.SWEEPS)}")
        raise typer.Exit(2)
    if tools is not None and (axes or sweep_ is not None):
        console.print(
            "[red]error:[/] --sweep and --map vary the stress test (its think time among their axes) and run only "
            "--workload stress, not agentic-syfi"
        )
        raise typer.Exit(2)
    try:
        if tools is None:
            policy.points(axes or ([sweep_] if sweep_ else []), hp[0], costs, spec)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
    for line in sizing.lines():
        console.print(line)
    pools = [p for p in set_ if p.partition("=")[0] in ("device_tokens", "host_tokens", "page_tokens")]
    if pools:
        console.print(f"pools overridden: {', '.join(pools)}")
    for sched, about in SCHEDULERS.items():
        console.print(f"scheduler {sched}: {about}")
    console.print(f"engine: {costs}")
    results: list[dict[str, Any]] = []
    with _progress() as bar:

        def on_run(tag: object, name: str, w: Workload) -> Any:
            task = bar.add_task(f"{name} @ {tag}", total=w.turns)
            return lambda n: bar.advance(task, n)

        if axes:
            rows = tuple(cache) if cache else policy.MAP_ROWS
            results = policy.grid(axes[0], axes[1], hp[0], costs, spec, seed, on_run, rows)
        elif sweep_ is not None:
            results = policy.sweep(sweep_, names, hp[0], costs, spec, seed, on_run)
        elif repeat > 1:
            seeds = range(workload_seed, workload_seed + repeat)
            results = policy.repeated(names, TABLE_HP if table_ else hp, costs, tools or spec, seeds, seed, on_run)
        elif table_:
            results = policy.table(names, TABLE_HP, costs, tools or spec, seed, on_run)
        else:
            workloads: list[Workload] = []
            try:
                if trace is not None:
                    workloads = [read_trace(trace)]
                elif workload == "stress":
                    workloads = [stress(replace(spec, hp_clients=h)) for h in hp]
                elif tools is not None:
                    workloads = [agentic(replace(tools, hp_clients=h)) for h in hp]
                elif workload in ("groups-10x50", "groups-50x10"):
                    g, p = (10, 50) if workload == "groups-10x50" else (50, 10)
                    workloads = [
                        groups(GroupsSpec(groups=g, prompts=p, hp_groups=g // 2, rate=rate, seed=workload_seed))
                    ]
                else:
                    raise ValueError(f"--workload {workload!r}: stress, agentic-syfi, groups-10x50 or groups-50x10")
            except (TraceError, ValueError, OSError) as e:
                console.print(f"[red]error:[/] {e}")
                raise typer.Exit(2) from None
            for w in workloads:
                for name in names:
                    s = policy.run_one(name, w, costs, seed, on_run(w.name, name, w))
                    s["hp_clients"] = sum(1 for x in w.sessions if w.high(x))
                    results.append(s)
    if repeat > 1 and not axes and sweep_ is None:
        _print_spread(results)
    elif axes and cache:
        _print_map_rows(results)
    elif axes:
        _print_map(results)
    else:
        _print(results, names, sweep_, breakdown and sweep_ is None and not table_)
    if plots is not None:
        for path in _plots(results, plots, sweep_):
            console.print(f"plot: {path}")
    if json_out is not None:
        spec_ = {"agentic": tools.__dict__} if tools is not None else {"stress": spec.__dict__}
        json_out.write_text(json.dumps({"costs": costs.__dict__, **spec_, "runs": results}, indent=1))
        console.print(f"figures: {json_out}")
    if any(policy.failed(r) for r in results):
        raise typer.Exit(1)


def _print(results: list[dict[str, Any]], names: list[str], sweep_: Optional[str], breakdown: bool) -> None:
    if breakdown:
        for s in results:
            if "unavailable" in s:
                continue
            console.print(f"\n[bold]{s['contender']}[/]: {s['about']}  ({s['workload']}, {s['wall_s']:.1f}s wall)")
            console.print(report.text_block(s, True))
            console.print(report.text_block(s, False))
    lead = ["value"] if sweep_ else ["HP clients"]
    title = (
        f"sweep: {policy.SWEEPS[sweep_].label}"
        if sweep_
        else "HP = high priority, LP = low; turn>=1 hit token-weighted (* a one-turn workload: the hit over every turn); "
        "to bound: the offline bound's HP hit less the row's (with an offline row); refused allocs: rounds a scoped "
        "cache ended where SGLang's prefill would fail its allocation"
    )
    t = _table(title, lead)
    key = "value" if sweep_ else "hp_clients"
    for group in dict.fromkeys(r[key] for r in results):
        rows = [r for r in results if r[key] == group]
        base = next((r for r in rows if r["contender"] == "baseline"), None)
        bound = next((r for r in rows if r["contender"] == "offline"), None)
        for r in rows:
            _row(t, r, base, [f"{group}"], bound)
    console.print(t)
    for r in results:
        if "unavailable" in r:
            console.print(f"{r['contender']}: {r['unavailable']}")
        for msg in policy.failed(r):
            console.print(f"[red]FAILED[/] {r['contender']} ({r['workload']}): {msg}")


def _print_map(results: list[dict[str, Any]]) -> None:
    x, y = results[0]["map"]
    t = Table(
        title=f"{results[0]['hp_clients']} HP clients: proactive over baseline, both behind the priority scheduler"
    )
    for col in (x, y, "baseline HP hit t>=1", "proactive HP hit t>=1", "hit gained", "HP TTFT p90 baseline/proactive"):
        t.add_column(col, justify="right")
    for g in policy.gains(results):
        t.add_row(
            f"{g['x']:g}", f"{g['y']:g}", f"{g['base_hit']:.4f}", f"{g['it_hit']:.4f}", f"{g['hit_gain']:+.4f}",
            f"{g['ttft_ratio']:.2f}x",
        )  # fmt: skip
    console.print(t)
    _print_problems(results)


def _print_problems(results: list[dict[str, Any]]) -> None:
    """Under a table: each row that could not run here, and each run's first failed check."""
    for r in results:
        if "unavailable" in r:
            console.print(f"{r['contender']}: {r['unavailable']}")
        elif policy.failed(r):
            console.print(f"[red]FAILED[/] {r['contender']} ({r['workload']}): {policy.failed(r)[0]}")


def _print_spread(results: list[dict[str, Any]]) -> None:
    """Each row's figures over the workload seeds: median [min, max]."""
    t = Table(title="median \\[min, max] over workload seeds " + ", ".join(
        str(s) for s in dict.fromkeys(r["workload_seed"] for r in results)))  # fmt: skip
    for col in ("HP clients", "row", "runs", *policy.SPREAD_METRICS):
        t.add_column(col, justify="right")
    for s in policy.spread(results):
        cells = [f"{s[m][0]:.4f} [{s[m][1]:.4f}, {s[m][2]:.4f}]" if "hit" in m else
                 f"{s[m][0]:.1f} [{s[m][1]:.1f}, {s[m][2]:.1f}]" for m in policy.SPREAD_METRICS]  # fmt: skip
        t.add_row(str(s["hp_clients"]), s["contender"], str(s["runs"]), *cells)
    console.print(t)
    _print_problems(results)


def _print_map_rows(results: list[dict[str, Any]]) -> None:
    """A map of the rows `--cache` named: each one's HP and LP figures at every point."""
    x, y = results[0]["map"]
    t = Table(title=f"{results[0]['hp_clients']} HP clients, every row behind its scheduler")
    for col in (x, y, "row", "HP hit t>=1", "to bound", "HP TTFT p90 s", "LP TTFT p90 s", "checks"):
        t.add_column(col, justify="right")
    bounds = {(r["x"], r["y"]): r for r in results if r["contender"] == "offline"}
    for r in results:
        if "unavailable" in r:
            continue
        h, lo = r["high"], r["low"]
        t.add_row(
            f"{r['x']:g}", f"{r['y']:g}", r["contender"], f"{h['turn1_cache_hit']:.4f}",
            _to_bound(r, bounds.get((r["x"], r["y"]))), f"{h['ttft']['p90']:.1f}", f"{lo['ttft']['p90']:.1f}",
            "FAILED" if policy.failed(r) else "ok",
        )  # fmt: skip
    console.print(t)
    _print_problems(results)


def _plots(results: list[dict[str, Any]], where: Path, sweep_: Optional[str]) -> list[Path]:
    if results and "map" in results[0]:
        x, y = results[0]["map"]
        return [policy.plot_map(results, where / f"map-{x}-{y}.png")]
    if sweep_ is not None:
        return [policy.plot_sweep(results, where / f"sweep-{sweep_}.png")]
    out = []
    for group in dict.fromkeys((r["workload"], r.get("hp_clients")) for r in results):
        rows = [r for r in results if (r["workload"], r.get("hp_clients")) == group]
        out.append(policy.plot_turns(rows, where / f"turns-{group[0]}.png", f"{group[0]}: per-turn, high priority"))
    return out
