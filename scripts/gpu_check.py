#!/usr/bin/env python
# Over 600 lines: the one script a lent GPU runs, self-contained by design.
"""One bounded check of kvcert.gpu on a real GPU: engine smoke, SGLang with kvcert's cache, certification on CUDA,
copy bandwidth.

    python scripts/gpu_check.py            # on a CUDA machine: about 3-4 minutes, at most ~5
    python scripts/gpu_check.py --cpu      # dry run: the same code paths on CPU, tiny sizes, seconds

Four parts, each in its own subprocess (and process group) with a soft budget (checked between units
of work) and a hard timeout (the parent kills the group), so a hung or crashed part (a poisoned CUDA
context) costs its own budget only and the next part still runs. A part writes its results after
every unit, so a killed part still reports what it finished.

- smoke: the copy engine directly. Device -> host -> device round trips of scattered and partial
  pages, both layouts on each side, `dma` and `staged` plans, one event or one per layer
  (`wait_layer`), `copy_now`, an injected failure and its retry; every byte compared. Then a
  GpuCache on the engine: write-through backup, eviction to host, load-back, KV read back.
- sglang: SGLang's offline `sglang.Engine` on a tiny random-weight Llama built
  here (no download, no tokenizer), twice, each engine in its own subprocess: with SGLang's default
  radix cache, then with `radix_cache_backend="kvcert"` (kvcert.integrations.sglang). The same
  multi-turn, repeated-prefix workload of token ids, greedy; per request the output ids,
  cached_tokens, prompt_tokens and time to first token of a streamed generate. Reports whether the
  outputs are identical, both cached-token totals, and TTFT median / p90 side by side. Skipped, saying
  why, without CUDA (the --cpu dry run) or when SGLang cannot be imported.
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
import random
import signal
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

PARTS = ("smoke", "sglang", "certify", "bandwidth")
BUDGET = {"smoke": 20.0, "sglang": 140.0, "certify": 40.0, "bandwidth": 40.0}
"""Soft budgets (seconds) of each part on CUDA; the hard timeout adds GRACE. 4 minutes, worst case 5 (with GRACE).
sglang's 140 s (two engine startups) came from certify and bandwidth (85 s each before; their last H200 run took
38 s and 36 s) and smoke (25 s; it took 5 s)."""
CPU_BUDGET = {"smoke": 30.0, "sglang": 5.0, "certify": 8.0, "bandwidth": 20.0}
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


# ---------------------------------------------------------------------------------------------- part: sglang

SGLANG_MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The config.json of the tiny Llama both engines serve: SGLang builds it with random weights (`load_format="dummy"`,
its fixed seed), so nothing is downloaded and there is no tokenizer (`skip_tokenizer_init`: token ids in and out)."""

SGLANG_WORKLOAD = {
    "conversations": 8,
    "turns": 3,
    "system_tokens": 1024,
    "first_tokens": 256,
    "turn_tokens": 64,
    "unrelated": 4,
    "unrelated_tokens": 512,
    "max_new_tokens": 16,
}
"""8 conversations sharing a 1024-token system prompt, 3 turns each (a turn's prompt is the previous prompt, its
output and 64 new tokens), 2 unrelated prompts after each of the first two rounds: 28 measured requests, one at a
time, after 2 warm-up requests."""

SGLANG_SAMPLING = {"temperature": 0.0, "max_new_tokens": SGLANG_WORKLOAD["max_new_tokens"], "ignore_eos": True}

SGLANG_ENGINE: dict[str, Any] = {
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "mem_fraction_static": 0.25,
    "max_total_tokens": 32768,
    "context_length": 4096,
    "disable_prefill_cuda_graph": True,
    "disable_decode_cuda_graph": True,
    "log_level": "error",
}
"""ServerArgs of both engines (the kvcert run adds `radix_cache_backend="kvcert"`): a 32k-token KV pool, far more
than the workload's ~7k distinct tokens, so nothing is evicted; no CUDA graphs to capture at startup."""

SGLANG_ENTRY_POINT = ("sglang.srt.plugins", "kvcert", "kvcert.integrations.sglang:register")
"""pyproject.toml's entry point (group, name, value), written beside a checkout that is not installed."""


def _sglang_engine_args(model_dir: str, backend: str, seed: int) -> dict[str, Any]:
    args = dict(SGLANG_ENGINE, model_path=model_dir, random_seed=seed)
    if backend == "kvcert":
        args["radix_cache_backend"] = "kvcert"
    return args


def _sglang_model_dir(parent: Path) -> str:
    path = parent / "tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SGLANG_MODEL, indent=1))
    return str(path)


def _sglang_installed() -> str:
    """'SGLang <version> is installed' or why not (cheap: metadata only, no import)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (no module named 'sglang')"
    try:
        return f"SGLang {importlib.metadata.version('sglang')} is installed"
    except importlib.metadata.PackageNotFoundError:
        return "SGLang is importable (no package metadata)"


def _sglang_unavailable(ctx: Ctx) -> Optional[str]:
    """Why this part cannot run here, or None. (Whether SGLang imports is found out by the first engine's process.)"""
    installed = _sglang_installed()
    if ctx.cpu:
        return f"the --cpu dry run starts no SGLang engine (SGLang's Engine needs CUDA); {installed} here"
    if not torch.cuda.is_available():
        return f"no CUDA device; {installed} here"
    if "not installed" in installed:
        return f"{installed}; the part needs SGLang 0.5.23 in this Python (requirements/sglang.txt)"
    return None


def _pct(xs: list[float], q: float) -> Optional[float]:
    """The q-quantile of xs, interpolated between the closest ranks (numpy's default); None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    at = q * (len(s) - 1)
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return round(s[lo] + (s[hi] - s[lo]) * (at - lo), 3)


def _sglang_request(stream: Callable[[list[int]], Any], label: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed request: TTFT is the time from the call to its first chunk; the last chunk holds every output
    id (SGLang's default, non-incremental streaming) and the request's meta_info."""
    t0 = time.perf_counter()
    first: Optional[float] = None
    last: Any = None
    for chunk in stream(prompt):
        if first is None:
            first = time.perf_counter()
        last = chunk
    end = time.perf_counter()
    if last is None or first is None:
        raise RuntimeError(f"{label}: the stream yielded nothing")
    meta = last.get("meta_info") or {}
    e2e = meta.get("e2e_latency")
    return {
        "request": label,
        "prompt_len": len(prompt),
        "prompt_tokens": meta.get("prompt_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "output_ids": [int(t) for t in last.get("output_ids") or []],
        "finish_reason": meta.get("finish_reason"),
        "ttft_ms": round((first - t0) * 1e3, 3),
        "e2e_ms": round((end - t0) * 1e3, 3),
        "sglang_e2e_ms": None if e2e is None else round(float(e2e) * 1e3, 3),
    }


def _sglang_drive(
    stream: Callable[[list[int]], Any], seed: int, deadline: float, rows: list[dict[str, Any]], sink: Callable[[], None]
) -> dict[str, Any]:
    """SGLANG_WORKLOAD through `stream` (a prompt's token ids in, the chunks of a streamed generate out), one request
    at a time, appending a row per measured request. Every random token is drawn before the first request, so two
    engines get the same new tokens whatever they answer; a turn's prompt carries the engine's own previous output."""
    w = SGLANG_WORKLOAD
    rng = random.Random(seed)
    vocab = SGLANG_MODEL["vocab_size"]

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2: pad, bos, eos

    convs, turns = w["conversations"], w["turns"]
    warm = toks(256)
    warm_more = warm + toks(64)
    system = toks(w["system_tokens"])
    prompts = [system + toks(w["first_tokens"]) for _ in range(convs)]
    added = [[toks(w["turn_tokens"]) for _ in range(turns - 1)] for _ in range(convs)]
    others = [toks(w["unrelated_tokens"]) for _ in range(w["unrelated"])]
    per_round = -(-len(others) // max(1, turns - 1))
    schedule: list[tuple[str, int, int]] = []
    for turn in range(turns):
        schedule += [("conv", c, turn) for c in range(convs)]
        if turn < turns - 1:
            schedule += [("other", i, turn) for i in range(turn * per_round, min(len(others), (turn + 1) * per_round))]
    info: dict[str, Any] = {"requests_planned": len(schedule), "warmup_ttft_ms": [], "note": ""}
    for prompt in (warm, warm_more):  # not measured: first kernels, and a first prefill over a cached prefix
        info["warmup_ttft_ms"].append(_sglang_request(stream, "warm-up", prompt)["ttft_ms"])
    sink()
    for kind, i, turn in schedule:
        if time.perf_counter() > deadline:
            info["note"] = f"stopped after {len(rows)} of {len(schedule)} requests: out of budget"
            break
        if kind == "other":
            rows.append(_sglang_request(stream, f"other {i}", others[i]))
        else:
            row = _sglang_request(stream, f"conv {i} turn {turn}", prompts[i])
            rows.append(row)
            if turn < turns - 1:
                prompts[i] = prompts[i] + row["output_ids"] + added[i][turn]
        sink()
    return info


def _sglang_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_ms"] for r in rows]
    return {
        "requests": len(rows),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in rows),
        "prompt_tokens": sum(r["prompt_tokens"] if r["prompt_tokens"] is not None else r["prompt_len"] for r in rows),
        "ttft_median_ms": _pct(ttft, 0.5),
        "ttft_p90_ms": _pct(ttft, 0.9),
        "e2e_median_ms": _pct([r["e2e_ms"] for r in rows], 0.5),
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else float(f"{a / b:.4g}")


def _sglang_compare(default: list[dict[str, Any]], kvcert: list[dict[str, Any]]) -> dict[str, Any]:
    """The two runs side by side over the requests both finished (the same requests, in the same order)."""
    n = min(len(default), len(kvcert))
    a, b = default[:n], kvcert[:n]
    if any(x["request"] != y["request"] for x, y in zip(a, b)):
        raise ValueError("the two runs did not send the same requests")
    diff = next((i for i in range(n) if a[i]["output_ids"] != b[i]["output_ids"]), None)
    cached = [i for i in range(n) if a[i]["cached_tokens"] != b[i]["cached_tokens"]]
    sa, sb = _sglang_summary(a), _sglang_summary(b)
    out: dict[str, Any] = {
        "compared": n,
        "outputs_identical": None if not n else diff is None,
        "first_difference": None,
        "cached_tokens": {"default": sa["cached_tokens"], "kvcert": sb["cached_tokens"]},
        "prompt_tokens": sa["prompt_tokens"],
        "requests_with_other_cached_tokens": len(cached),
        "first_other_cached_tokens": None if not cached else a[cached[0]]["request"],
        "ttft_median_ms": {"default": sa["ttft_median_ms"], "kvcert": sb["ttft_median_ms"]},
        "ttft_p90_ms": {"default": sa["ttft_p90_ms"], "kvcert": sb["ttft_p90_ms"]},
        "ttft_median_ratio": _ratio(sb["ttft_median_ms"], sa["ttft_median_ms"]),
        "ttft_p90_ratio": _ratio(sb["ttft_p90_ms"], sa["ttft_p90_ms"]),
    }
    if diff is not None:
        x, y = a[diff]["output_ids"], b[diff]["output_ids"]
        at = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
        out["first_difference"] = {
            "index": diff,
            "request": a[diff]["request"],
            "at_output_token": at,
            "default_output": x,
            "kvcert_output": y,
            "cached_tokens": {"default": a[diff]["cached_tokens"], "kvcert": b[diff]["cached_tokens"]},
        }
    return out


def _sglang_engine_child(args: argparse.Namespace) -> int:
    """Engine process: import SGLang, start one Engine, run the workload, write the record after every step."""
    out = Path(args.result)
    backend = args.sglang_engine
    start = time.perf_counter()
    deadline = start + args.sglang_deadline
    rows: list[dict[str, Any]] = []
    rec: dict[str, Any] = {"backend": backend, "stage": "import", "rows": rows}

    def sink() -> None:
        rec["seconds"] = round(time.perf_counter() - start, 2)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, default=str))
        tmp.replace(out)

    sink()
    try:
        import sglang
        from sglang.srt.entrypoints.engine import Engine
    except Exception as err:  # not installed here, or a hard dependency (sgl_kernel, flashinfer, ...) missing
        rec["import_error"] = f"{type(err).__name__}: {err}"
        sink()
        return 0
    rec["sglang_version"] = str(getattr(sglang, "__version__", "?"))
    rec["import_s"] = round(time.perf_counter() - start, 2)
    if backend == "kvcert":
        import importlib.metadata

        group, name, _ = SGLANG_ENTRY_POINT
        if not any(ep.name == name for ep in importlib.metadata.entry_points(group=group)):
            rec["error"] = f"no '{name}' entry point in group {group}: SGLang's plugin loader cannot register kvcert"
            sink()
            return 0
    rec["stage"] = "start"
    sink()
    t0 = time.perf_counter()
    try:
        engine = Engine(**_sglang_engine_args(args.model_dir, backend, args.seed))
    except Exception as err:
        rec["error"] = f"the engine did not start: {type(err).__name__}: {err}"
        traceback.print_exc()
        sink()
        return 0
    rec["started_s"] = round(time.perf_counter() - t0, 2)
    rec["stage"] = "workload"
    sink()

    def stream(prompt: list[int]) -> Any:
        return engine.generate(input_ids=prompt, sampling_params=dict(SGLANG_SAMPLING), stream=True)

    try:
        rec.update(_sglang_drive(stream, args.seed, deadline, rows, sink))
        rec["stage"] = "done"
    except Exception as err:
        rec["error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    sink()
    t1 = time.perf_counter()
    engine.shutdown()
    rec["shutdown_s"] = round(time.perf_counter() - t1, 2)
    sink()
    return 0


def _kill_tree(proc: subprocess.Popen[Any]) -> None:
    """Kill an engine's process and everything it started (SGLang's scheduler and detokenizer processes)."""
    try:
        import psutil  # an SGLang dependency: present wherever an engine was started

        kids = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        kids = []
    for p in kids:
        try:
            p.kill()
        except Exception:
            pass
    proc.kill()
    proc.wait()


def _log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _sglang_engine(ctx: Ctx, backend: str, model_dir: str, work: Path, limit: float) -> dict[str, Any]:
    """Run one engine's process (killed, with its children, past `limit` seconds); its record, with what went wrong."""
    result = work / f"{backend}.json"
    log = work / f"{backend}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sglang-engine", backend, "--result", str(result)]
    cmd += ["--model-dir", model_dir, "--seed", str(ctx.args.seed), "--sglang-deadline", f"{max(1.0, limit - 15):.1f}"]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=limit)
            ended = "exit 0" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            ended = f"killed after {limit:.0f} s"
        except BaseException:
            _kill_tree(proc)
            raise
    rec: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {"stage": "launch", "rows": []}
    rec.update(backend=backend, ended=ended, wall_s=round(time.perf_counter() - t0, 2), log=str(log))
    if "import_error" not in rec and "error" not in rec and rec.get("stage") != "done":
        rec["error"] = f"the engine's process ended ({ended}) during {rec.get('stage', 'launch')}"
    if "error" in rec or "import_error" in rec:
        rec["log_tail"] = _log_tail(log)
        print(f"-- sglang {backend} engine: {rec.get('error') or rec.get('import_error')}; its log ends:", flush=True)
        print("\n".join(rec["log_tail"].splitlines()[-25:]), flush=True)
    rec["summary"] = _sglang_summary(rec["rows"])
    return rec


def run_sglang(ctx: Ctx) -> dict[str, Any]:
    engines: dict[str, Any] = {}
    result: dict[str, Any] = {
        "skipped": None,
        "model": {k: SGLANG_MODEL[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")}
        | {"dtype": SGLANG_ENGINE["dtype"]},
        "workload": dict(SGLANG_WORKLOAD),
        "sampling": dict(SGLANG_SAMPLING),
        "engine_args": dict(SGLANG_ENGINE),
        "seed": ctx.args.seed,
        "engines": engines,
        "comparison": None,
    }
    why = _sglang_unavailable(ctx)
    if why:
        result["skipped"] = why
        print(f"-- sglang: skipped: {why}", flush=True)
        return result
    work = Path(os.environ["OUT"]) / "gpu_check_sglang" if os.environ.get("OUT") else Path(tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    model_dir = _sglang_model_dir(work)
    ctx.sink(result)
    for backend in ("default", "kvcert"):
        left = ctx.left() - 5  # the last kill and this part's own exit
        limit = left / 2 if backend == "default" else left  # the second engine gets what the first left
        if limit < 30:
            engines[backend] = {"backend": backend, "rows": [], "note": f"not started: {max(0.0, limit):.0f} s left"}
            if backend == "default":
                result["skipped"] = f"out of budget: {max(0.0, left):.0f} s left for two engines"
            break
        print(f"-- sglang: {backend} cache: one engine process, at most {limit:.0f} s", flush=True)
        rec = engines[backend] = _sglang_engine(ctx, backend, model_dir, work, limit)
        if rec.get("sglang_version"):
            result["sglang_version"] = rec["sglang_version"]
        ctx.sink(result)
        if backend == "default" and "import_error" in rec:
            result["skipped"] = f"SGLang cannot be imported here: {rec['import_error']}"
            break
        if backend == "default" and not rec["rows"]:
            result["skipped"] = (
                f"SGLang's engine with its default cache ran no request here ({rec.get('error')}), "
                "so there is nothing to compare kvcert's with"
            )
            break
    if result["skipped"]:
        print(f"-- sglang: skipped: {result['skipped']}", flush=True)
    if engines.get("default", {}).get("rows") and engines.get("kvcert", {}).get("rows"):
        result["comparison"] = _sglang_compare(engines["default"]["rows"], engines["kvcert"]["rows"])
    return result


# ---------------------------------------------------------------------------------------------- rendering


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _ms(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.1f}"


def _render_sglang(console: Any, sg: dict[str, Any]) -> None:
    from rich.table import Table

    if not sg:
        return
    if sg.get("skipped"):
        console.print(f"[bold]sglang[/bold]: skipped: {sg['skipped']}")
        return
    m, w = sg["model"], sg["workload"]
    title = (
        f"sglang {sg.get('sglang_version', '?')}: offline Engine, tiny Llama ({m['num_hidden_layers']} layers x "
        f"{m['hidden_size']}, {m['dtype']}, random weights), {w['conversations']} conversations x {w['turns']} turns "
        f"+ {w['unrelated']} other prompts, {w['max_new_tokens']} new tokens, greedy; TTFT of a streamed generate"
    )
    t = Table(title=title)
    for col in ("cache", "import s", "start s", "requests", "cached / prompt tokens", "TTFT median ms", "TTFT p90 ms",
                "e2e median ms", "note"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("cache", "note") else "right")
    for backend, e in sg["engines"].items():
        s = e.get("summary") or _sglang_summary(e.get("rows") or [])
        note = e.get("error") or e.get("import_error") or e.get("note") or ""
        t.add_row(
            "SGLang default" if backend == "default" else "kvcert",
            _ms(e.get("import_s")),
            _ms(e.get("started_s")),
            f"{s['requests']}/{e.get('requests_planned', s['requests'])}",
            f"{s['cached_tokens']} / {s['prompt_tokens']}",
            _ms(s["ttft_median_ms"]),
            _ms(s["ttft_p90_ms"]),
            _ms(s["e2e_median_ms"]),
            ("[red]" if e.get("error") else "") + note[:70],
        )
    console.print(t)
    c = sg.get("comparison")
    if not c:
        console.print("  no comparison: the two engines did not both finish requests")
        return
    first = c["first_difference"]
    same = (
        "[green]yes"
        if c["outputs_identical"]
        else f"[red]NO[/red], first at '{first['request']}' output token {first['at_output_token']} "
        f"(cached tokens there: default {first['cached_tokens']['default']}, kvcert {first['cached_tokens']['kvcert']})"
    )
    console.print(f"  outputs identical over {c['compared']} requests: {same}")
    console.print(
        f"  cached tokens: default {c['cached_tokens']['default']}, kvcert {c['cached_tokens']['kvcert']} "
        f"(of {c['prompt_tokens']} prompt tokens; {c['requests_with_other_cached_tokens']} requests differ)"
    )
    console.print(
        f"  TTFT kvcert / default: median {c['ttft_median_ratio']} "
        f"({_ms(c['ttft_median_ms']['kvcert'])} / {_ms(c['ttft_median_ms']['default'])} ms), "
        f"p90 {c['ttft_p90_ratio']} ({_ms(c['ttft_p90_ms']['kvcert'])} / {_ms(c['ttft_p90_ms']['default'])} ms)"
    )


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
    _render_sglang(console, parts.get("sglang") or {})
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
    fn = {"smoke": run_smoke, "sglang": run_sglang, "certify": run_certify, "bandwidth": run_bandwidth}[part]
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
    sg = parts.get("sglang") or {}
    if not sg.get("skipped"):
        kv = (sg.get("engines") or {}).get("kvcert") or {}
        if kv.get("error"):
            out.append(f"sglang kvcert engine: {kv['error'][:300]}")
        first = (sg.get("comparison") or {}).get("first_difference")
        if first:
            out.append(
                f"sglang: kvcert's outputs differ from SGLang's default cache's from request '{first['request']}'"
            )
    for r in (parts.get("bandwidth") or {}).get("rows", []):
        if r.get("error") or (r.get("bytes_ok") is False and r["strategy"] != "copy_from"):
            out.append(
                f"bandwidth {r['pools']} {r['direction']} {r['pages']} {r['strategy']}: {r.get('error', 'bytes differ')}"
            )
    for part, info in report["elapsed"].items():
        if info["status"] not in ("ok",):
            out.append(f"{part}: {info['status']}")
    return out


def _write_entry_point(folder: Path) -> None:
    """Distribution metadata in `folder` (a sys.path entry) carrying kvcert's SGLang entry point, so that SGLang's
    plugin loader (`load_plugins`, in every SGLang process) registers `--radix-cache-backend kvcert` from a checkout
    that is not installed, as it would from an installed kvcert."""
    group, name, value = SGLANG_ENTRY_POINT
    info = folder / "kvcert_checkout-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcert-checkout\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")


def _make_kvcert_importable() -> None:
    """On a bare GPU machine (its own python, kvcert not installed), import kvcert from this checkout.

    The package maps top-level folders onto `kvcert.*` (pyproject's package-dir), so the checkout itself
    is not importable as `kvcert`; a temporary folder of links gives the same namespace (with kvcert's
    SGLang entry point beside it), and PYTHONPATH carries it into the parts' subprocesses, SGLang's too.
    """
    import importlib.util

    if importlib.util.find_spec("kvcert") is not None:
        return
    root = Path(__file__).resolve().parent.parent
    shim = Path(tempfile.mkdtemp(prefix="kvcert-path-"))
    (shim / "kvcert").mkdir()
    for sub in ("spec", "refimpl", "gpu", "conformance", "sim", "integrations"):
        if (root / sub).is_dir():
            (shim / "kvcert" / sub).symlink_to(root / sub, target_is_directory=True)
    _write_entry_point(shim)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH", "")]))


def _run_group(cmd: list[str], limit: float) -> Optional[int]:
    """Run a part in its own process group; past `limit` seconds kill the whole group (an SGLang engine's scheduler
    processes too, which a hung part would leave holding the GPU). The exit status, None when killed."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a finished part too; none is the usual case
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


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
    ap.add_argument("--sglang-engine", default=None, choices=("default", "kvcert"), help=argparse.SUPPRESS)
    ap.add_argument("--sglang-deadline", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.pages = [int(x) for x in str(args.pages).split(",") if x]
    args.examples = args.examples if args.examples is not None else (4 if args.cpu else 10)
    args.steps = args.steps if args.steps is not None else (12 if args.cpu else 20)
    _make_kvcert_importable()
    if args.sglang_engine:
        return _sglang_engine_child(args)
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
            rc = _run_group(cmd, limit)
            status = (
                f"killed after {limit:.0f} s (partial results)" if rc is None else "ok" if rc == 0 else f"exit {rc}"
            )
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
