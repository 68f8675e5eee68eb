"""scripts/gpu_check.py and the CUDA engine's copy plans.

On CPU: the script's --cpu dry run end to end (tables, JSON with measured numbers, the sglang part
skipped with its reason), the sglang part's engine processes and comparison against a stand-in
`sglang.Engine`, and the copy plans (`kvcert.gpu.kv.plan_copy`, run by `PlannedCopyEngine`) against
the CPU engines' `copy_from`.
With CUDA: `CudaCopyEngine` itself — every strategy and layout, per-layer events, copy_now, a
retried failure, and a GpuCache certified on it (test_gpu_kv.py keeps the basic both-ways test).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcert.gpu import make_factory
from kvcert.gpu.copy_engine import CopyJob, PlannedCopyEngine, ThreadedCopyEngine
from kvcert.gpu.kv import LAYOUTS, KVGeometry, make_pool, plan_copy

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _random_pools(dl: str, hl: str, g: KVGeometry, ps: int, dev_cap: int, host_cap: int) -> tuple[Any, Any]:
    dev, host = make_pool(dl, dev_cap, ps, g, CPU), make_pool(hl, host_cap, ps, g, CPU)
    dev.u8.view(-1).copy_(torch.randint(0, 256, (dev.u8.numel(),), dtype=torch.uint8))
    host.u8.view(-1).copy_(torch.randint(0, 256, (host.u8.numel(),), dtype=torch.uint8))
    return dev, host


# ---------------------------------------------------------------------------------------------- the script, on CPU


def test_cpu_dry_run_prints_tables_and_writes_measured_json(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--json", str(out), "--budget-scale", "0.6"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for title in ("smoke:", "sglang: skipped: the --cpu dry run", "certify:", "bandwidth:", "elapsed"):
        assert title in proc.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu" and report["problems"] == []
    assert list(report["parts"]) == ["smoke", "sglang", "certify", "bandwidth"]
    sglang = report["parts"]["sglang"]
    assert sglang["skipped"].startswith("the --cpu dry run starts no SGLang engine"), sglang["skipped"]
    assert sglang["engines"] == {} and sglang["comparison"] is None
    assert report["elapsed"]["sglang"]["seconds"] < 15
    assert all(info["status"] == "ok" and info["seconds"] > 0 for info in report["elapsed"].values())
    cases = report["parts"]["smoke"]["cases"]
    assert len(cases) == 17 and all(c["ok"] for c in cases)
    targets = report["parts"]["certify"]["targets"]
    assert len(targets) == 3
    assert all(t["cells_run"] > 0 and t["passed"] == t["cells_run"] and t["steps"] > 0 for t in targets)
    rows = report["parts"]["bandwidth"]["rows"]
    assert {r["pools"] for r in rows} == {
        "layer_first->layer_first",
        "layer_first->page_first",
        "page_first->page_first",
    }
    assert {r["direction"] for r in rows} == {"d2h", "h2d"}
    assert {"dma", "staged", "dma (1 event)", "copy_from"} <= {r["strategy"] for r in rows}
    for r in rows:
        assert "error" not in r, r
        assert r["bytes_ok"] is True, r
        assert r["gbps"] > 0 and r["plain_gbps"] > 0 and r["ms"] > 0 and r["ratio"] > 0, r
        assert r["bytes"] == r["pages"] * report["parts"]["bandwidth"]["page_bytes"]


@pytest.mark.skipif(CUDA, reason="checks the message a machine without CUDA prints")
def test_without_cuda_or_cpu_flag_it_says_so_and_exits_0() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout


# ---------------------------------------------------------------------------------------------- the sglang part, on CPU

FAKE_ENGINE = """
import json, os

class Engine:
    \"\"\"Stands in for sglang.Engine: outputs a function of the prompt, cached_tokens from the prompts it saw.\"\"\"

    def __init__(self, **kwargs):
        self.backend = kwargs.get("radix_cache_backend") or "default"
        with open(os.path.join(os.environ["FAKE_SGLANG_DIR"], self.backend + ".args.json"), "w") as f:
            json.dump(kwargs, f)
        self.seen = []

    def generate(self, input_ids, sampling_params, stream):
        assert stream and sampling_params["temperature"] == 0.0
        n = sampling_params["max_new_tokens"]
        out = [(sum(input_ids) * 31 + k) % 32000 for k in range(n)]
        if self.backend == os.environ.get("FAKE_SGLANG_DIFFERS") and len(self.seen) == 9:
            out[3] += 1
        lcp = max([next((i for i, (a, b) in enumerate(zip(s, input_ids)) if a != b), min(len(s), len(input_ids)))
                   for s in self.seen] or [0])
        self.seen.append(list(input_ids) + out[:-1])
        meta = {"prompt_tokens": len(input_ids), "cached_tokens": min(lcp, len(input_ids) - 1), "e2e_latency": 1e-3}
        return ({"output_ids": out[:k], "meta_info": meta} for k in range(1, n + 1))

    def shutdown(self):
        pass
"""


def _fake_sglang(root: Path) -> Path:
    pkg = root / "fake" / "sglang"
    (pkg / "srt" / "entrypoints").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0.fake"\n')
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "entrypoints" / "__init__.py").write_text("")
    (pkg / "srt" / "entrypoints" / "engine.py").write_text(FAKE_ENGINE)
    return root / "fake"


def _run_sglang_part(gc: Any, tmp_path: Path, monkeypatch: Any, differs: str = "") -> dict[str, Any]:
    monkeypatch.setattr(gc, "_sglang_unavailable", lambda ctx: None)  # as if on CUDA with SGLang installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(_fake_sglang(tmp_path)), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_SGLANG_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_SGLANG_DIFFERS", differs)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    ctx = gc.Ctx(False, CPU, time.perf_counter() + 140, lambda r: None, argparse.Namespace(seed=3))
    return gc.run_sglang(ctx)


def test_sglang_part_runs_both_engines_in_their_own_processes_and_compares(tmp_path: Path, monkeypatch: Any) -> None:
    """The part's path on a GPU machine, with a stand-in `sglang.Engine`: two engine processes, the kvcert one with
    radix_cache_backend="kvcert", the same workload (each turn extends the previous prompt and output), rows with
    TTFT and cached tokens, the comparison, the table and no problem."""
    gc = _script()
    result = _run_sglang_part(gc, tmp_path, monkeypatch)
    assert result["skipped"] is None and result["sglang_version"] == "0.0.fake"
    args = {b: json.loads((tmp_path / f"{b}.args.json").read_text()) for b in ("default", "kvcert")}
    assert "radix_cache_backend" not in args["default"] and args["kvcert"]["radix_cache_backend"] == "kvcert"
    assert args["default"] | {"radix_cache_backend": "kvcert"} == args["kvcert"]
    assert args["default"]["load_format"] == "dummy" and args["default"]["random_seed"] == 3
    assert json.loads(Path(args["default"]["model_path"], "config.json").read_text()) == gc.SGLANG_MODEL
    w = gc.SGLANG_WORKLOAD
    planned = w["conversations"] * w["turns"] + w["unrelated"]
    for backend in ("default", "kvcert"):
        e = result["engines"][backend]
        assert e["stage"] == "done" and e["ended"] == "exit 0" and "error" not in e, e
        assert e["requests_planned"] == planned and len(e["rows"]) == planned and len(e["warmup_ttft_ms"]) == 2
        by = {r["request"]: r for r in e["rows"]}
        first, second = by["conv 0 turn 0"], by["conv 0 turn 1"]
        assert second["prompt_len"] == first["prompt_len"] + w["max_new_tokens"] + w["turn_tokens"]
        assert second["cached_tokens"] == first["prompt_len"] + w["max_new_tokens"] - 1
        assert by["conv 1 turn 0"]["cached_tokens"] == w["system_tokens"]
        assert all(len(r["output_ids"]) == w["max_new_tokens"] and r["ttft_ms"] > 0 for r in e["rows"])
    c = result["comparison"]
    assert c["compared"] == planned and c["outputs_identical"] is True and c["first_difference"] is None
    assert c["cached_tokens"]["default"] == c["cached_tokens"]["kvcert"] > 0
    assert c["ttft_median_ratio"] > 0 and c["ttft_p90_ratio"] > 0
    report = {
        "parts": {"sglang": result},
        "elapsed": {"sglang": {"seconds": 1.0, "status": "ok"}},
        "total_seconds": 1.0,
    }
    assert gc._problems(report) == []
    gc.render(report | {"device": "cpu", "torch": torch.__version__, "mode": "cuda"})


def test_sglang_part_reports_kvcerts_first_differing_output(tmp_path: Path, monkeypatch: Any) -> None:
    gc = _script()
    result = _run_sglang_part(gc, tmp_path, monkeypatch, differs="kvcert")
    first = result["comparison"]["first_difference"]
    assert result["comparison"]["outputs_identical"] is False
    assert first["index"] == 7 and first["at_output_token"] == 3, first  # the 10th request, after 2 warm-ups
    report = {"parts": {"sglang": result}, "elapsed": {}}
    assert gc._problems(report) == [
        f"sglang: kvcert's outputs differ from SGLang's default cache's from request '{first['request']}'"
    ]


def test_sglang_part_skips_when_sglang_does_not_import(tmp_path: Path, monkeypatch: Any) -> None:
    gc = _script()
    (tmp_path / "fake" / "sglang").mkdir(parents=True)
    (tmp_path / "fake" / "sglang" / "__init__.py").write_text("raise ImportError('no sgl_kernel here')\n")
    monkeypatch.setattr(gc, "_sglang_unavailable", lambda ctx: None)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    ctx = gc.Ctx(False, CPU, time.perf_counter() + 140, lambda r: None, argparse.Namespace(seed=0))
    result = gc.run_sglang(ctx)
    assert result["skipped"] == "SGLang cannot be imported here: ImportError: no sgl_kernel here"
    assert list(result["engines"]) == ["default"] and result["comparison"] is None
    assert gc._problems({"parts": {"sglang": result}, "elapsed": {}}) == []


def test_the_entry_point_beside_a_checkout_is_pyprojects(tmp_path: Path) -> None:
    """On a machine where kvcert is not installed the script writes kvcert's SGLang entry point beside its links;
    importlib.metadata (what SGLang's plugin loader reads) finds it, and it is the one pyproject.toml declares."""
    import importlib.metadata

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    gc = _script()
    gc._write_entry_point(tmp_path)
    group, name, value = gc.SGLANG_ENTRY_POINT
    eps = [ep for d in importlib.metadata.distributions(path=[str(tmp_path)]) for ep in d.entry_points]
    assert [(ep.group, ep.name, ep.value) for ep in eps] == [(group, name, value)]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][group]
    assert declared == {name: value}


SERVER_ARGS = """
import importlib.util, sys, tempfile
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
gc = importlib.util.module_from_spec(spec); sys.modules["gpu_check"] = gc; spec.loader.exec_module(gc)
from kvcert.conformance.adapters.sglang import env as env
env.install_shims()
with env.quiet_imports():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
args = ServerArgs(**gc._sglang_engine_args(gc._sglang_model_dir(Path(tempfile.mkdtemp())), "kvcert", 0))
model = ModelConfig.from_server_args(args)
SamplingParams(**gc.SGLANG_SAMPLING).verify(32000)
print(args.radix_cache_backend, args.load_format, model.num_hidden_layers, model.head_dim, model.context_len)
"""


@pytest.mark.sglang
def test_the_engine_args_are_sglangs_server_args() -> None:
    """Every option the part passes `sglang.Engine` is a field of SGLang 0.5.23's ServerArgs, and SGLang's
    ModelConfig reads the tiny Llama's config.json (built through kvcert's CPU import shims, no engine)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed")
    proc = subprocess.run([sys.executable, "-c", SERVER_ARGS, str(SCRIPT)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-5:] == ["kvcert", "dummy", "2", "64", "4096"], proc.stdout


# ---------------------------------------------------------------------------------------------- copy plans, on CPU


@pytest.mark.parametrize("seed", range(4))
def test_planned_copies_equal_copy_from(seed: int) -> None:
    """The CUDA engine's plans, run on CPU pools, move exactly what the CPU engines' copy_from moves."""
    rng = random.Random(seed)
    for _ in range(40):
        g = KVGeometry(layers=rng.choice([1, 3]), heads=rng.choice([1, 2]), head_dim=4, dtype=torch.bfloat16)
        ps = rng.choice([1, 2, 4])
        dl, hl = rng.choice(LAYOUTS), rng.choice(LAYOUTS)
        dev, host = _random_pools(dl, hl, g, ps, 32, 48)
        n = rng.randint(1, 24)
        src, dst = rng.sample(range(32), n), rng.sample(range(48), n)
        if rng.random() < 0.3:
            src, dst = list(range(4, 4 + n)), list(range(8, 8 + n))
        engine = PlannedCopyEngine(
            strategy=rng.choice(["auto", "dma", "staged"]),
            by_layer=rng.random() < 0.5,
            min_run_bytes=rng.choice([0, 64, 1 << 20]),
            device_pool=dev,
        )
        want = host.u8.clone()
        ref = make_pool(hl, 48, ps, g, CPU)
        ref.u8.copy_(want)
        ref.copy_from(dev, src, dst)
        ticket = engine.submit(CopyJob(dev, tuple(src), host, tuple(dst)))
        assert engine.finish(ticket) and torch.equal(host.u8, ref.u8)
        back = make_pool(dl, 32, ps, g, CPU)
        back.u8.copy_(dev.u8)
        back.copy_from(host, dst[::-1], src)
        engine.copy_now(host, dst[::-1], dev, src)
        assert torch.equal(dev.u8, back.u8)


def test_plans_merge_runs_and_pick_a_strategy() -> None:
    g = KVGeometry(layers=4, heads=2, head_dim=8, dtype=torch.bfloat16)  # 32-byte cells
    dev = make_pool("layer_first", 64, 4, g, CPU)
    host = make_pool("page_first", 64, 4, g, CPU)
    # three consecutive whole host pages: every layer's K and V of them is one contiguous host run
    plan = plan_copy(host, range(8, 20), dev, [40, 41, 42, 43, 0, 1, 2, 3, 20, 21, 22, 23], "d2h", strategy="dma")
    assert plan.runs == 1 and plan.rows == 12 * 2 * 4 and plan.nbytes == plan.rows * 32
    assert not plan.groups[0].direct  # scattered on the device: staged through one gather
    by_layer = plan_copy(host, range(8, 20), dev, range(12), "h2d", by_layer=True, strategy="dma")
    assert [grp.layer for grp in by_layer.groups] == [0, 1, 2, 3]
    assert all(len(grp.starts) == 3 for grp in by_layer.groups)  # per page, a layer's K and V are adjacent: one run
    # the same layout on both sides and contiguous slots: direct copies, no staging
    same = plan_copy(make_pool("layer_first", 64, 4, g, CPU), range(16, 24), dev, range(0, 8), "d2h")
    assert same.groups[0].direct and same.runs == 2 * 4
    # auto: runs of 64 KiB and more go as DMAs, short ones staged
    assert plan_copy(host, range(4), dev, range(4), "d2h", min_run_bytes=1 << 16).strategy == "staged"
    assert plan_copy(host, range(4), dev, range(4), "d2h", min_run_bytes=16).strategy == "dma"
    with pytest.raises(ValueError):
        plan_copy(host, range(4), dev, range(3), "d2h")


def test_planned_engine_certifies_on_a_host_tier_cell(tmp_path: Path) -> None:
    from kvcert.conformance.certification.certify import certify

    build = _script()._planned_factory("dma", "page_first", "layer_first")
    cert = certify(
        "gpu_check:planned",
        factory=build,
        examples=4,
        steps=15,
        page_sizes=[2],
        device_cells=False,
        prefetch_policies=[],
        out_dir=tmp_path,
    )
    assert cert.cells and cert.passed, [c.failure for c in cert.cells if not c.passed]


def test_a_staged_backup_lands_its_host_scatter_at_finish_or_drain() -> None:
    g = KVGeometry(layers=2, heads=1, head_dim=4, dtype=torch.bfloat16)
    dev, host = _random_pools("layer_first", "page_first", g, 2, 16, 16)
    before = host.u8.clone()
    engine = PlannedCopyEngine(strategy="staged", device_pool=dev)
    ticket = engine.submit(CopyJob(dev, (3, 9, 4), host, (0, 1, 6)))
    assert ticket.plan is not None and ticket.plan.strategy == "staged"
    assert torch.equal(host.u8, before)  # gathered and staged; the host pool is written after the event
    engine.drain()
    after = host.u8.clone()
    assert not torch.equal(after, before)
    assert engine.finish(ticket) and torch.equal(host.u8, after)  # already landed: finish moves nothing more
    ref = make_pool("page_first", 16, 2, g, CPU)
    ref.u8.copy_(before)
    ref.copy_from(dev, (3, 9, 4), (0, 1, 6))
    assert torch.equal(host.u8, ref.u8)


# ---------------------------------------------------------------------------------------------- the threaded engine


def test_threaded_engine_drains_and_reraises_worker_errors() -> None:
    g = KVGeometry(layers=2)
    dev, host = make_pool("layer_first", 16, 1, g, CPU), make_pool("layer_first", 16, 1, g, CPU)
    engine = ThreadedCopyEngine()
    try:
        gate = threading.Event()
        original = CopyJob.run

        class Slow(CopyJob):
            def run(self, non_blocking: bool = False) -> None:
                gate.wait()
                original(self, non_blocking)

        dev.u8.fill_(7)
        tickets = [engine.submit(Slow(dev, (i,), host, (i,))) for i in range(8)]
        assert int(host.u8.sum()) == 0  # the worker is held at the gate: nothing has moved
        gate.set()
        engine.drain()  # returns only once every queued job has run
        assert bool((host.u8[:, :, :8] == 7).all())
        assert all(engine.finish(t) for t in tickets)

        class Boom(CopyJob):
            def run(self, non_blocking: bool = False) -> None:
                raise RuntimeError("boom")

        bad = engine.submit(Boom(dev, (0,), host, (0,)))
        with pytest.raises(RuntimeError, match="boom"):  # raised on the worker, re-raised on the caller's thread
            engine.finish(bad)
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------- CUDA only


def _cuda_ctx(module: Any) -> Any:
    return module.Ctx(False, torch.device("cuda"), time.perf_counter() + 600, lambda r: None, None)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["dma", "staged"])
@pytest.mark.parametrize("by_layer", [True, False])
def test_cuda_engine_round_trips_every_layout(strategy: str, by_layer: bool) -> None:  # pragma: no cover
    """Scattered and partial pages down and back, copy_now, a retried failure, per-layer waits: bytes equal."""
    module = _script()
    ctx = _cuda_ctx(module)
    for dl in LAYOUTS:
        for hl in LAYOUTS:
            assert module._round_trip(ctx, dl, hl, strategy, by_layer) == ""


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_backup_and_load_back_through_the_cache() -> None:  # pragma: no cover
    assert _script()._cache_scenario(_cuda_ctx(_script())) == ""


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_engine_realistic_pages_land_bit_for_bit() -> None:  # pragma: no cover
    """64-token pages of 8 x 128 bf16 cells, 40 scattered pages each way, both strategies chosen by size."""
    from kvcert.gpu.copy_engine import CudaCopyEngine

    module = _script()
    g = KVGeometry(layers=4, heads=8, head_dim=128, dtype=torch.bfloat16)
    ps = 64
    for dl, hl in (("layer_first", "page_first"), ("page_first", "layer_first")):
        dev = make_pool(dl, 64 * ps, ps, g, torch.device("cuda"))
        host = make_pool(hl, 64 * ps, ps, g, CPU, pin=True)
        module._random_fill(dev.u8, 5)
        rng = random.Random(dl)
        src = module._pages_to_slots(rng.sample(range(64), 40), ps)
        dst = module._pages_to_slots(rng.sample(range(64), 40), ps)
        for min_run in (0, 1 << 30):  # auto: every run a DMA, then every copy staged
            engine = CudaCopyEngine(min_run_bytes=min_run)
            t = engine.submit(CopyJob(dev, tuple(src), host, tuple(dst)))
            assert engine.finish(t) and module._same_cells(dev, src, host, dst)
            module._random_fill(dev.u8, 6)
            t = engine.submit(CopyJob(host, tuple(dst), dev, tuple(src[::-1])))
            assert engine.finish(t) and module._same_cells(dev, src[::-1], host, dst)
            engine.close()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("engine", ["cuda", "cuda-dma", "cuda-staged"])
def test_cuda_caches_certify_on_host_tier_cells(engine: str, tmp_path: Path) -> None:  # pragma: no cover
    from kvcert.conformance.certification.certify import certify

    build = make_factory(host_layout="page_first", engine=engine, device=torch.device("cuda"))
    cert = certify(
        f"cuda:{engine}", factory=build, examples=6, steps=20, page_sizes=[1, 4], device_cells=False, out_dir=tmp_path
    )
    assert cert.passed, [c.failure for c in cert.cells if not c.passed]
