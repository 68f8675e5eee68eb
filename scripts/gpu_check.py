#!/usr/bin/env python
# Over 600 lines: the one script a lent GPU runs, self-contained by design.
"""One bounded check of kvcert.gpu on a real GPU: engine smoke, certification on CUDA, copy bandwidth.

    python scripts/gpu_check.py            # on a CUDA machine: about 3 minutes, at most ~4
    python scripts/gpu_check.py --cpu      # dry run: the same code paths on CPU, tiny sizes, seconds

Three parts, each in its own subprocess with a soft budget (checked between units of work) and a
hard timeout (the parent kills it), so a hung or crashed part (a poisoned CUDA context) costs its
own budget only and the next part still runs. A part writes its results after every unit, so a
killed part still reports what it finished.

- smoke: the copy engine directly. Device -> host -> device round trips of scattered and partial
  pages, both layouts on each side, `dma` and `staged` plans, one event or one per layer
  (`wait_layer`), `copy_now`, an injected failure and its retry; every byte compared. Then a
  GpuCache on the engine: write-through backup, eviction to host, load-back, KV read back.
- certify: the conformance suite (conformance/certification/certify.py's cells and `run_cell`) on caches whose
  device pool lives on CUDA and whose copies go through `CudaCopyEngine`; host-tier and storage
  cells first (the ones that copy), device-only cells while budget lasts. Counterexample traces
  land in $OUT/gpu_check_failures when $OUT is set.
- bandwidth: page-scattered D2H (backup) and H2D (load-back) of random page sets through the
  engine GpuCache uses, for 64-token pages of a 32-layer x 8-head x 128-dim bf16 model, against
  one plain contiguous pinned copy of the same bytes; plus the pre-plan path (`CopyJob.run`, what
  the CPU engines use) for comparison, with its bytes checked too.

Prints rich tables and writes JSON to $OUT/gpu_check.json when $OUT is set and to --json PATH
when given. Without CUDA and without --cpu it says so and exits 0. docs/gpu_check.md explains it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

PARTS = ("smoke", "certify", "bandwidth")
BUDGET = {"smoke": 25.0, "certify": 85.0, "bandwidth": 85.0}
"""Soft budgets (seconds) of each part on CUDA; the hard timeout adds GRACE. Worst case < 4 minutes."""
CPU_BUDGET = {"smoke": 30.0, "certify": 8.0, "bandwidth": 20.0}
GRACE = 15.0
"""Seconds past its soft budget before the parent kills a part (startup, CUDA init, one slow unit)."""


# ---------------------------------------------------------------------------------------------- helpers


@dataclass
class Ctx:
    """Where a part runs: the device, whether this is the CPU dry run, its deadline, where results go."""

    cpu: bool
    device: torch.device
    deadline: float
    sink: Callable[[dict[str, Any]], None]
    args: argparse.Namespace

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _random_fill(t: torch.Tensor, seed: int) -> None:
    """Fill a uint8 tensor with seeded random bytes where it lives (fast on the GPU)."""
    gen = torch.Generator(device=t.device)
    gen.manual_seed(seed)
    flat = t.view(-1)
    chunk = 1 << 28
    for at in range(0, flat.numel(), chunk):
        part = flat[at : at + chunk]
        part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device=t.device, generator=gen))


def _same_cells(dev: Any, dev_slots: Any, host: Any, host_slots: Any, sample: int = 0, seed: int = 0) -> bool:
    """Do the cells of `dev_slots` in `dev` equal those of `host_slots` in `host`? (`sample`: a random subset of slots.)"""
    from kvcert.gpu.kv import slot_tensor

    ds, hs = slot_tensor(dev_slots), slot_tensor(host_slots)
    if sample and len(ds) > sample:
        gen = torch.Generator().manual_seed(seed)
        pick = torch.randperm(len(ds), generator=gen)[:sample]
        ds, hs = ds[pick], hs[pick]
    a = dev.cells.index_select(0, dev.cell_rows(ds).view(-1).to(dev.device)).cpu()
    b = host.cells.index_select(0, host.cell_rows(hs).view(-1).to(host.device)).cpu()
    return torch.equal(a, b)


def _pages_to_slots(pages: list[int], page_size: int) -> list[int]:
    return [p * page_size + i for p in pages for i in range(page_size)]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (dry run)"


# ---------------------------------------------------------------------------------------------- part: smoke


def _engine(ctx: Ctx, strategy: str, by_layer: bool, device_pool: Any) -> Any:
    from kvcert.gpu.copy_engine import CudaCopyEngine, PlannedCopyEngine

    if ctx.cpu:
        return PlannedCopyEngine(strategy=strategy, by_layer=by_layer, device_pool=device_pool)
    return CudaCopyEngine(strategy=strategy, by_layer=by_layer)


def _round_trip(ctx: Ctx, dev_layout: str, host_layout: str, strategy: str, by_layer: bool) -> str:
    """Device -> host -> device through the engine, scattered and partial pages; '' if every byte matched."""
    import random

    from kvcert.gpu.copy_engine import CopyJob
    from kvcert.gpu.kv import KVGeometry, make_pool

    g = KVGeometry(layers=4, heads=2, head_dim=8, dtype=torch.bfloat16)  # 32-byte cells
    ps, pages = 4, 48
    dev = make_pool(dev_layout, pages * ps, ps, g, ctx.device)
    host = make_pool(host_layout, pages * ps, ps, g, torch.device("cpu"), pin=not ctx.cpu)
    _random_fill(dev.u8, 1)
    _random_fill(host.u8, 2)
    engine = _engine(ctx, strategy, by_layer, dev)
    rng = random.Random(f"{dev_layout}{host_layout}{strategy}{by_layer}")
    try:
        order = rng.sample(range(pages), pages)
        src = _pages_to_slots(order[:10], ps) + [order[10] * ps + 1, order[10] * ps + 2]  # a partial page too
        dst = _pages_to_slots(order[11:21], ps) + [order[21] * ps, order[21] * ps + 3]
        down = engine.submit(CopyJob(dev, tuple(src), host, tuple(dst)))
        if not engine.finish(down):
            return "d2h: finish reported failure without a fault"
        if not _same_cells(dev, src, host, dst):
            return "d2h: host bytes differ from the device's"
        back = _pages_to_slots(order[22:32], ps) + [order[32] * ps + 2, order[32] * ps + 3]
        up = engine.submit(CopyJob(host, tuple(dst), dev, tuple(back)))
        if not ctx.cpu and by_layer:
            # a forward pass's view: wait for layer l's event on the current stream, read layer l there
            rows = dev.cell_rows(torch.tensor(back))
            for layer in range(g.layers):
                engine.wait_layer(up, layer)
                got = dev.cells.index_select(0, rows[:, :, layer].reshape(-1).to(ctx.device)).cpu()
                want = host.cells.index_select(0, host.cell_rows(torch.tensor(dst))[:, :, layer].reshape(-1))
                if not torch.equal(got, want):
                    return f"h2d: layer {layer} read after wait_layer differs"
        if not engine.finish(up) or not _same_cells(dev, back, host, dst):
            return "h2d: device bytes differ from the host's"
        # synchronous copies (write-back backups, retraction) and an injected failure's retry
        again = order[33:43]
        engine.copy_now(dev, _pages_to_slots(order[:10], ps), host, _pages_to_slots(again, ps))
        if not _same_cells(dev, _pages_to_slots(order[:10], ps), host, _pages_to_slots(again, ps)):
            return "copy_now d2h: bytes differ"
        _random_fill(dev.u8, 3)
        retry = engine.submit(CopyJob(host, tuple(_pages_to_slots(again, ps)), dev, tuple(src[: 10 * ps])))
        engine.arm_failure()
        if engine.finish(retry) or not engine.finish(retry):
            return "retry: an armed failure did not fail exactly one finish"
        if not _same_cells(dev, src[: 10 * ps], host, _pages_to_slots(again, ps)):
            return "retry h2d: device bytes differ"
        return ""
    finally:
        engine.close()


def _cache_scenario(ctx: Ctx) -> str:
    """A GpuCache on the engine: write-through backup, eviction to host, load-back; KV read back on both tiers."""
    from kvcert.gpu import make_factory
    from kvcert.spec import storage as l3
    from kvcert.spec.types import CacheConfig

    config = CacheConfig(page_size=4, capacity=32, host_capacity=64, write_policy="write_through", kv_layers=3)
    build = _planned_factory("auto") if ctx.cpu else make_factory(engine="cuda", device=ctx.device, heads=2, head_dim=8)
    cache = build(config)
    try:
        tokens = tuple(range(100, 124))
        want = list(l3.token_entries(None, tokens, 3))
        slots = cache.alloc(len(tokens))
        cache.write_kv(slots, want)
        out = cache.insert(None, tokens, slots)
        cache.free(slots[: out.prefix_len])
        snap = cache.snapshot()
        for c in snap.pending:
            cache.complete(c.id)
        cache.poll()
        node = cache.snapshot().by_id()[out.node]
        if node.host_slots is None or cache.read_host_kv(node.host_slots) != want:
            return "write-through backup: host KV differs"
        cache.evict(config.capacity)
        m = cache.match_prefix(None, tokens)
        if m.host_length != len(tokens):
            return f"after eviction the match has host_length {m.host_length}, not {len(tokens)}"
        if cache.load_back(m.host_node) != len(tokens):
            return "load_back refused"
        for c in cache.snapshot().pending:
            cache.complete(c.id)
        cache.poll()
        m = cache.match_prefix(None, tokens)
        if m.length != len(tokens) or cache.read_kv(m.slots) != want:
            return "load-back: device KV differs"
        return ""
    finally:
        cache.close()


def run_smoke(ctx: Ctx) -> dict[str, Any]:
    from kvcert.gpu.kv import LAYOUTS

    cases: list[dict[str, Any]] = []
    result: dict[str, Any] = {"cases": cases}
    work: list[tuple[str, Callable[[], str]]] = []
    for dl in LAYOUTS:
        for hl in LAYOUTS:
            for strategy in ("dma", "staged"):
                for by_layer in (True, False):
                    name = f"{dl}->{hl} {strategy} {'per-layer events' if by_layer else 'one event'}"
                    work.append((name, partial(_round_trip, ctx, dl, hl, strategy, by_layer)))
    work.append(("GpuCache write-through / evict / load-back", partial(_cache_scenario, ctx)))
    for name, fn in work:
        if ctx.left() <= 0:
            cases.append({"case": name, "ok": None, "error": "skipped: out of budget", "seconds": 0.0})
            continue
        start = time.perf_counter()
        try:
            error = fn()
        except Exception as err:  # a crash is a finding: report it and go on
            error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        cases.append({"case": name, "ok": not error, "error": error, "seconds": round(time.perf_counter() - start, 3)})
        ctx.sink(result)
    return result


# ---------------------------------------------------------------------------------------------- part: certify


def _planned_factory(strategy: str, layout: str = "layer_first", host_layout: str = "layer_first") -> Any:
    """CPU caches whose copies run the CUDA engine's plans (`PlannedCopyEngine`, bound to the device pool)."""
    from kvcert.gpu import CAPABILITIES, make_factory
    from kvcert.gpu.copy_engine import PlannedCopyEngine

    base = make_factory(layout=layout, host_layout=host_layout, device=torch.device("cpu"))

    def build(config: Any) -> Any:
        cache = base(config)
        cache.engine.close()
        cache.engine = PlannedCopyEngine(strategy=strategy, device_pool=cache.kv)
        return cache

    f: Any = build
    f.capabilities = CAPABILITIES
    return build


def _targets(ctx: Ctx) -> list[tuple[str, Any, float]]:
    """(label, factory, share of the certify budget)."""
    from kvcert.gpu import make_factory

    if ctx.cpu:
        return [
            ("planned auto, layer_first (CPU)", _planned_factory("auto"), 0.4),
            ("planned dma, page_first (CPU)", _planned_factory("dma", "page_first", "page_first"), 0.3),
            (
                "planned staged, layer_first->page_first (CPU)",
                _planned_factory("staged", "layer_first", "page_first"),
                0.3,
            ),
        ]
    cuda = ctx.device
    return [
        ("cuda auto, layer_first", make_factory(engine="cuda", device=cuda), 0.45),
        (
            "cuda-dma, page_first",
            make_factory(layout="page_first", host_layout="page_first", engine="cuda-dma", device=cuda),
            0.3,
        ),
        (
            "cuda auto, 8x128 bf16 cells, layer_first->page_first",
            make_factory(
                host_layout="page_first", engine="cuda", device=cuda, heads=8, head_dim=128, dtype=torch.bfloat16
            ),
            0.25,
        ),
    ]


def run_certify(ctx: Ctx) -> dict[str, Any]:
    from kvcert.conformance.backend import capabilities_of
    from kvcert.conformance.certification.certify import cells_for, run_cell

    a = ctx.args
    examples, steps = a.examples, a.steps
    out_dir = Path(os.environ["OUT"]) / "gpu_check_failures" if os.environ.get("OUT") else Path(tempfile.mkdtemp())
    targets: list[dict[str, Any]] = []
    result: dict[str, Any] = {"examples": examples, "steps": steps, "seed": a.seed, "targets": targets}
    plan = _targets(ctx)
    start_all = time.perf_counter()
    total = ctx.deadline - start_all
    spent_share = 0.0
    for label, factory, share in plan:
        spent_share += share
        # a target may use what earlier ones left: its deadline is its cumulative share of the part's budget
        deadline = min(ctx.deadline, start_all + total * spent_share)
        caps = capabilities_of(factory)
        configs, _ = cells_for(caps, None, None)
        configs = sorted(configs, key=lambda c: (not c.host_capacity, c.page_size))  # copying cells first
        if ctx.cpu:
            configs = [c for c in configs if c.host_capacity and c.page_size in (1, 4)]
        entry: dict[str, Any] = {
            "target": label,
            "cells_total": len(configs),
            "cells_run": 0,
            "passed": 0,
            "failed": [],
            "steps": 0,
            "seconds": 0.0,
            "note": "",
        }
        targets.append(entry)
        t0 = time.perf_counter()
        for config in configs:
            if time.perf_counter() >= deadline:
                entry["note"] = f"budget: {len(configs) - entry['cells_run']} cells not run"
                break
            tier = config.write_policy + (f"+{config.prefetch_policy}" if config.prefetch_policy else "")
            cell_name = f"P={config.page_size} {config.policy} {tier or 'device'}"
            try:
                cell = run_cell(
                    factory,
                    caps,
                    config,
                    examples=examples,
                    steps=steps,
                    seed=a.seed,
                    target=f"gpu_check:{label}",
                    out_dir=out_dir,
                )
                ok, failure, steps_done, trace = cell.passed, cell.failure, cell.steps, cell.trace_path
            except Exception as err:  # the harness itself crashed (e.g. a CUDA error outside a step)
                ok, failure, steps_done, trace = False, f"{type(err).__name__}: {err}", 0, None
                traceback.print_exc()
            entry["cells_run"] += 1
            entry["steps"] += steps_done
            if ok:
                entry["passed"] += 1
            else:
                entry["failed"].append({"cell": cell_name, "failure": str(failure)[:2000], "trace": trace})
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            ctx.sink(result)
            if len(entry["failed"]) >= 3:
                entry["note"] = "stopped after 3 failing cells"
                break
        ctx.sink(result)
    return result


# ---------------------------------------------------------------------------------------------- part: bandwidth


def _timed(ctx: Ctx, fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """Median seconds of `fn` end to end (synchronised), and median seconds until it returned (host side)."""
    total, host = [], []
    for _ in range(reps):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        ctx.sync()
        t2 = time.perf_counter()
        total.append(t2 - t0)
        host.append(t1 - t0)
    return statistics.median(total), statistics.median(host)


def run_bandwidth(ctx: Ctx) -> dict[str, Any]:
    import random

    from kvcert.gpu.copy_engine import CopyJob
    from kvcert.gpu.kv import KVGeometry, make_pool

    a = ctx.args
    if ctx.cpu:
        g, ps, sizes, reps = KVGeometry(layers=2, heads=1, head_dim=8, dtype=torch.bfloat16), 4, [2, 8], 2
    else:
        g, ps, sizes, reps = KVGeometry(layers=32, heads=8, head_dim=128, dtype=torch.bfloat16), 64, a.pages, 3
    page_bytes = ps * 2 * g.layers * g.width
    pool_pages = max(sizes) * 5 // 4 + 4
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "geometry": {"layers": g.layers, "heads": g.heads, "head_dim": g.head_dim, "dtype": str(g.dtype)},
        "page_size": ps,
        "page_bytes": page_bytes,
        "pool_pages": pool_pages,
        "reps": reps,
        "rows": rows,
        "skipped": [],
    }
    combos = [("layer_first", "layer_first"), ("layer_first", "page_first"), ("page_first", "page_first")]
    rng = random.Random(a.seed)
    for dl, hl in combos:
        if ctx.left() <= 0:
            result["skipped"].append(f"{dl}->{hl}: out of budget")
            continue
        dev = make_pool(dl, pool_pages * ps, ps, g, ctx.device)
        host = make_pool(hl, pool_pages * ps, ps, g, torch.device("cpu"), pin=not ctx.cpu)
        _random_fill(dev.u8, 7)
        host.u8.view(-1).copy_(dev.u8.view(-1))  # host content: the device's bytes, then new device bytes
        _random_fill(dev.u8, 8)
        ctx.sync()
        for size in sizes:
            n = size * page_bytes
            dflat, hflat = dev.u8.view(-1)[:n], host.u8.view(-1)[:n]
            plain = {
                "d2h": _timed(ctx, partial(hflat.copy_, dflat, non_blocking=True), reps)[0],
                "h2d": _timed(ctx, partial(dflat.copy_, hflat, non_blocking=True), reps)[0],
            }
            variants = [
                ("d2h", "dma", True),
                ("d2h", "staged", True),
                ("h2d", "dma", True),
                ("h2d", "dma", False),
                ("h2d", "staged", True),
                ("d2h", "copy_from", True),
                ("h2d", "copy_from", True),
            ]
            for direction, strategy, by_layer in variants:
                if ctx.left() <= 0:
                    result["skipped"].append(f"{dl}->{hl} {size} pages {direction} {strategy}: out of budget")
                    continue
                if strategy == "copy_from" and size > 64:
                    continue  # the pre-plan path gathers on the CPU: slow, and only for comparison
                dev_pages = rng.sample(range(pool_pages), size)
                host_pages = rng.sample(range(pool_pages), size)
                ds, hs = _pages_to_slots(dev_pages, ps), _pages_to_slots(host_pages, ps)
                row: dict[str, Any] = {
                    "pools": f"{dl}->{hl}",
                    "direction": direction,
                    "pages": size,
                    "bytes": n,
                    "strategy": strategy if by_layer or direction == "d2h" else f"{strategy} (1 event)",
                }
                try:
                    if strategy == "copy_from":
                        job = (
                            CopyJob(dev, tuple(ds), host, tuple(hs))
                            if direction == "d2h"
                            else CopyJob(host, tuple(hs), dev, tuple(ds))
                        )
                        side = torch.cuda.Stream(ctx.device) if not ctx.cpu else None

                        def legacy(job: Any = job, side: Any = side) -> None:
                            if side is None:
                                job.run()
                                return
                            side.wait_stream(torch.cuda.current_stream(ctx.device))
                            with torch.cuda.stream(side):
                                job.run(non_blocking=True)  # what the CUDA engine did before plans
                            torch.cuda.current_stream(ctx.device).wait_stream(side)

                        if direction == "h2d":
                            _random_fill(dev.u8, 9)
                        legacy()
                        ctx.sync()
                        row["runs"] = None
                        row["bytes_ok"] = _same_cells(dev, ds, host, hs, sample=256, seed=size)
                        total, submit = _timed(ctx, legacy, reps)
                    else:
                        engine = _engine(ctx, strategy, by_layer, dev)
                        job = (
                            CopyJob(dev, tuple(ds), host, tuple(hs))
                            if direction == "d2h"
                            else CopyJob(host, tuple(hs), dev, tuple(ds))
                        )
                        if direction == "h2d":
                            _random_fill(dev.u8, 9)  # so a copy that moved nothing cannot pass
                        t = engine.submit(job)
                        engine.finish(t)
                        row["runs"] = t.plan.runs if t.plan is not None else None
                        row["bytes_ok"] = _same_cells(dev, ds, host, hs, sample=256, seed=size)
                        submit_times: list[float] = []

                        def once(engine: Any = engine, job: Any = job, st: list[float] = submit_times) -> None:
                            t0 = time.perf_counter()
                            ticket = engine.submit(job)
                            st.append(time.perf_counter() - t0)
                            engine.finish(ticket)

                        total, _ = _timed(ctx, once, reps)
                        submit = statistics.median(submit_times)
                        engine.close()
                    # four significant figures, not three decimals: a 512-byte copy on a loaded CPU is
                    # well under 0.001 GB/s, and rounding it to 0 would read as "nothing moved"
                    row["gbps"] = float(f"{n / total / 1e9:.4g}")
                    row["plain_gbps"] = float(f"{n / plain[direction] / 1e9:.4g}")
                    row["ratio"] = float(f"{plain[direction] / total:.4g}")
                    row["submit_ms"] = round(submit * 1e3, 3)
                    row["ms"] = round(total * 1e3, 3)
                except Exception as err:
                    traceback.print_exc()
                    row["error"] = f"{type(err).__name__}: {err}"
                rows.append(row)
                ctx.sink(result)
        del dev, host
        if not ctx.cpu:
            torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------- rendering


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    console.print(
        f"[bold]kvcert gpu_check[/bold] on {report['device']} (torch {report['torch']}, mode {report['mode']})"
    )
    parts = report["parts"]
    smoke = parts.get("smoke") or {}
    if smoke.get("cases"):
        t = Table(title="smoke: the copy engine and a GpuCache on it")
        for col in ("case", "ok", "s", "error"):
            t.add_column(col)
        for c in smoke["cases"]:
            ok = {True: "[green]yes", False: "[red]NO", None: "-"}[c["ok"]]
            t.add_row(c["case"], ok, f"{c['seconds']:.2f}", c["error"] or "")
        console.print(t)
    cert = parts.get("certify") or {}
    if cert.get("targets"):
        t = Table(title=f"certify: {cert['examples']} examples x {cert['steps']} steps per cell, seed {cert['seed']}")
        for col in ("target", "cells run", "passed", "failed", "steps", "s", "first failure / note"):
            t.add_column(col)
        for e in cert["targets"]:
            first = e["failed"][0] if e["failed"] else None
            text = f"{first['cell']}: {first['failure'].splitlines()[-1] if first['failure'] else ''}" if first else ""
            t.add_row(
                e["target"],
                f"{e['cells_run']}/{e['cells_total']}",
                str(e["passed"]),
                f"[red]{len(e['failed'])}" if e["failed"] else "0",
                str(e["steps"]),
                f"{e['seconds']:.1f}",
                (text + " " + e["note"]).strip()[:90],
            )
        console.print(t)
    bw = parts.get("bandwidth") or {}
    if bw.get("rows"):
        g = bw["geometry"]
        title = (
            f"bandwidth: {bw['page_size']}-token pages of {g['layers']} layers x {g['heads']} heads x {g['head_dim']} "
            f"{g['dtype'].replace('torch.', '')} ({_size(bw['page_bytes'])} a page), median of {bw['reps']}"
        )
        t = Table(title=title)
        for col in (
            "pools dev->host",
            "dir",
            "pages",
            "bytes",
            "strategy",
            "host runs",
            "GB/s",
            "plain GB/s",
            "ratio",
            "submit ms",
            "bytes ok",
        ):
            t.add_column(col, justify="right" if col not in ("pools dev->host", "dir", "strategy") else "left")
        for r in bw["rows"]:
            if "error" in r:
                t.add_row(
                    r["pools"],
                    r["direction"],
                    str(r["pages"]),
                    _size(r["bytes"]),
                    r["strategy"],
                    "",
                    "[red]" + r["error"][:40],
                    "",
                    "",
                    "",
                    "",
                )
                continue
            ok = "[green]yes" if r["bytes_ok"] else "[red]NO"
            t.add_row(
                r["pools"],
                r["direction"],
                str(r["pages"]),
                _size(r["bytes"]),
                r["strategy"],
                "" if r["runs"] is None else str(r["runs"]),
                f"{r['gbps']:.2f}",
                f"{r['plain_gbps']:.2f}",
                f"{r['ratio']:.2f}",
                f"{r['submit_ms']:.2f}",
                ok,
            )
        console.print(t)
        console.print(
            "  copy_from: the CUDA engine's path before copy plans (CopyJob.run, non_blocking, on a side stream);"
            " 'NO' on its d2h rows is that path's race (docs/gpu_check.md), not the current engine's."
        )
        for s in bw.get("skipped", []):
            console.print(f"  skipped: {s}")
    t = Table(title="elapsed")
    for col in ("part", "s", "status"):
        t.add_column(col)
    for part, info in report["elapsed"].items():
        t.add_row(part, f"{info['seconds']:.1f}", info["status"])
    t.add_row("total", f"{report['total_seconds']:.1f}", "")
    console.print(t)


# ---------------------------------------------------------------------------------------------- driver


def _run_part(part: str, args: argparse.Namespace) -> None:
    """Child process: run one part, writing its result JSON to --result after every unit."""
    cpu = args.cpu
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    budget = (CPU_BUDGET if cpu else BUDGET)[part] * args.budget_scale
    out = Path(args.result)

    name = _device_name(device)

    def sink(result: dict[str, Any]) -> None:
        result["device"] = name
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)

    ctx = Ctx(cpu, device, time.perf_counter() + budget, sink, args)
    fn = {"smoke": run_smoke, "certify": run_certify, "bandwidth": run_bandwidth}[part]
    sink(fn(ctx))


def _problems(report: dict[str, Any]) -> list[str]:
    """What failed, in one line each (the exit status is 1 when any)."""
    out: list[str] = []
    parts = report["parts"]
    for c in (parts.get("smoke") or {}).get("cases", []):
        if c["ok"] is False:
            out.append(f"smoke {c['case']}: {c['error']}")
    for e in (parts.get("certify") or {}).get("targets", []):
        out += [f"certify {e['target']} {f['cell']}" for f in e["failed"]]
    for r in (parts.get("bandwidth") or {}).get("rows", []):
        if r.get("error") or (r.get("bytes_ok") is False and r["strategy"] != "copy_from"):
            out.append(
                f"bandwidth {r['pools']} {r['direction']} {r['pages']} {r['strategy']}: {r.get('error', 'bytes differ')}"
            )
    for part, info in report["elapsed"].items():
        if info["status"] not in ("ok",):
            out.append(f"{part}: {info['status']}")
    return out


def _make_kvcert_importable() -> None:
    """On a bare GPU machine (its own python, kvcert not installed), import kvcert from this checkout.

    The package maps top-level folders onto `kvcert.*` (pyproject's package-dir), so the checkout itself
    is not importable as `kvcert`; a temporary folder of links gives the same namespace, and PYTHONPATH
    carries it into the parts' subprocesses.
    """
    import importlib.util

    if importlib.util.find_spec("kvcert") is not None:
        return
    root = Path(__file__).resolve().parent.parent
    shim = Path(tempfile.mkdtemp(prefix="kvcert-path-"))
    (shim / "kvcert").mkdir()
    for sub in ("spec", "refimpl", "gpu", "conformance", "sim"):
        (shim / "kvcert" / sub).symlink_to(root / sub, target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH", "")]))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with tiny sizes (CI)")
    ap.add_argument("--json", default=None, help="also write the JSON report here")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument(
        "--examples", type=int, default=None, help="Hypothesis examples per certification cell (10; --cpu: 4)"
    )
    ap.add_argument("--steps", type=int, default=None, help="steps per example (20; --cpu: 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pages", default="8,64,256", help="page-set sizes of the bandwidth part (CUDA)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's budget")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.pages = [int(x) for x in str(args.pages).split(",") if x]
    args.examples = args.examples if args.examples is not None else (4 if args.cpu else 10)
    args.steps = args.steps if args.steps is not None else (12 if args.cpu else 20)
    _make_kvcert_importable()
    if args.part:
        _run_part(args.part, args)
        return 0
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check.")
        print("gpu_check: run it on a GPU machine, or `python scripts/gpu_check.py --cpu` for the CPU dry run.")
        return 0
    report: dict[str, Any] = {
        "mode": "cpu" if args.cpu else "cuda",
        "device": "cpu (dry run)" if args.cpu else "cuda (no part reported its name)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "argv": sys.argv[1:] if argv is None else argv,
        "parts": {},
        "elapsed": {},
    }
    start = time.perf_counter()
    wanted = [p for p in args.parts.split(",") if p]
    budgets = CPU_BUDGET if args.cpu else BUDGET
    with tempfile.TemporaryDirectory() as tmp:
        for part in wanted:
            if part not in PARTS:
                raise SystemExit(f"unknown part {part!r}; one of {PARTS}")
            result = Path(tmp) / f"{part}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--result", str(result)]
            cmd += ["--examples", str(args.examples), "--steps", str(args.steps), "--seed", str(args.seed)]
            cmd += ["--pages", ",".join(map(str, args.pages)), "--budget-scale", str(args.budget_scale)]
            cmd += ["--cpu"] if args.cpu else []
            limit = budgets[part] * args.budget_scale + GRACE
            t0 = time.perf_counter()
            print(
                f"== gpu_check: {part} (budget {budgets[part] * args.budget_scale:.0f} s, killed at {limit:.0f} s)",
                flush=True,
            )
            try:
                proc = subprocess.run(cmd, timeout=limit)
                status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                status = f"killed after {limit:.0f} s (partial results)"
            seconds = time.perf_counter() - t0
            report["elapsed"][part] = {"seconds": round(seconds, 2), "status": status}
            report["parts"][part] = json.loads(result.read_text()) if result.exists() else None
            if report["parts"][part]:
                report["device"] = report["parts"][part].pop(
                    "device", report["device"]
                )  # the parent never touches CUDA
            print(f"== gpu_check: {part} done in {seconds:.1f} s: {status}", flush=True)
    report["total_seconds"] = round(time.perf_counter() - start, 2)
    report["problems"] = _problems(report)
    render(report)
    paths = [Path(p) for p in ([os.environ["OUT"] + "/gpu_check.json"] if os.environ.get("OUT") else [])]
    paths += [Path(args.json)] if args.json else []
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"gpu_check: JSON written to {path}")
    if report["problems"]:
        print("gpu_check: problems:\n  " + "\n  ".join(report["problems"]))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
