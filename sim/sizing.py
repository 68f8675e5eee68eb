"""Pool sizes from a named model and GPU, under SGLang 0.5.23's own memory defaults.

`kvcert bench policy` serves from a device pool and a host pool whose sizes decide the verdict, so neither is
typed: the device pool is what SGLang's defaults leave for KV on the GPU once the model's weights are loaded,
the host pool `hicache_ratio` times it. Each rule below cites the file of the installed 0.5.23 wheel it follows
(`sglang/srt/...`); every figure a run uses is printed in its header (`Sizing.lines`).

What is left out, and says so in the header: SGLang's post-capture KV sizing (off by default,
`SGLANG_ENABLE_POST_CAPTURE_KV_SIZING`), HiCache's auto-sizing to the host's RAM (it only lowers the ratio when
the host cannot hold it), and the CUDA context's own memory (counted as zero).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUS", "HICACHE_RATIO", "MODELS", "GPUSpec", "ModelSpec", "SGLangMemory", "Sizing", "sglang_memory", "size"]

MIB = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """What a model's KV and weights take: a dense decoder with grouped-query attention."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    weight_bytes: int
    context_len: int
    source: str

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_mib: int
    """What torch and nvidia-smi report as the card's total memory."""
    source: str


MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        "meta-llama/Llama-3.1-8B-Instruct",
        layers=32,
        kv_heads=8,
        head_dim=128,
        dtype_bytes=2,
        weight_bytes=8_030_261_248 * 2,
        context_len=131_072,
        source="config.json: 32 layers, 8 KV heads of 128 (4096 / 32 heads), bf16, 131,072 positions; 8,030,261,248 "
        "parameters",
    ),
}
GPUS: dict[str, GPUSpec] = {
    "h200": GPUSpec("NVIDIA H200", 143_771, "nvidia-smi on a lent H200: docs/runs/2026-12-04-gpu-check/nvidia-smi.txt"),
}
HICACHE_RATIO = 2.0
"""The host pool over the device pool in HiCache's cache mode: `arg_groups/fields/memory.py` (hicache_ratio: "Defaults
to 2.0 in cache mode"), resolved in `mem_cache/kv_cache_builder.py` (`fields["hicache_ratio"] = 2.0`); the host
pool holds `int(device_pool.size * hicache_ratio)` tokens (`mem_cache/hybrid_cache/hybrid_pool_assembler.py`)."""


def prefill_graph_buckets(max_bs: int) -> list[int]:
    """The prefill CUDA graph's token buckets: `arg_groups/cuda_graph_hook.py`,
    `generate_prefill_cuda_graph_batch_sizes`."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_bs + 1, 512))
    )
    return [s for s in sizes if s <= max_bs]


@dataclass(frozen=True)
class SGLangMemory:
    """What SGLang 0.5.23 resolves from the GPU's memory when the user sets none of it (one rank, no pipeline)."""

    chunked_prefill_size: int
    cuda_graph_max_bs: int
    reserved_mib: float
    mem_fraction_static: float


def sglang_memory(gpu_mib: int, tp: int = 1, pp: int = 1) -> SGLangMemory:
    """`arg_groups/memory_hook.py`, `_handle_gpu_memory_settings`, for a text model, no disaggregation, no
    speculative decoding, no DP attention, no DeepEP, on CUDA, without post-capture KV sizing."""
    # GPU-dependent capacity defaults (chunked_prefill_size, the decode graph's max_bs)
    if gpu_mib < 20 * 1024:
        chunked, max_bs = 2048, 8
    elif gpu_mib < 35 * 1024:
        chunked, max_bs = 4096, 48 if tp < 4 else 160
    elif gpu_mib < 60 * 1024:
        chunked, max_bs = 4096, 32 if tp < 4 else 160
    elif gpu_mib < 160 * 1024:  # H100 and A100 80 GB (< 90 GiB), H20 and H200: the same two figures
        chunked, max_bs = 8192, 256 if tp < 4 else 512
    else:
        chunked, max_bs = 16384, 512
    # Static memory and runtime headroom: constant metadata, activations, parallel slack, graphs
    reserved = 512 + max(chunked, 2048) * 1.5 + tp * pp / 8 * 1024
    # reserve_for_graph_mb: the decode graph (backend FULL), the prefill graph (BREAKABLE on CUDA; its buckets
    # up to the documented prefill default of 2048 tokens, 8 MiB each: `model_executor/cuda_graph_config.py`)
    reserved += max_bs * 2 + len(prefill_graph_buckets(2048)) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = round((gpu_mib - reserved) / gpu_mib, 3)
    return SGLangMemory(chunked, max_bs, reserved, fraction)


@dataclass(frozen=True)
class Sizing:
    """The pools a run serves from, and how they were derived."""

    model: ModelSpec
    gpu: GPUSpec
    memory: SGLangMemory
    hicache_ratio: float
    page_tokens: int
    device_tokens: int
    host_tokens: int
    max_running_requests: int

    def lines(self) -> list[str]:
        m, g, s = self.model, self.gpu, self.memory
        kib = m.kv_bytes_per_token / 1024
        return [
            f"model: {m.name} ({m.layers} layers, {m.kv_heads} KV heads of {m.head_dim}, {8 * m.dtype_bytes}-bit: "
            f"{kib:g} KiB of KV per token; weights {m.weight_bytes / 1e9:.2f} GB)",
            f"gpu: {g.name}, {g.memory_mib:,} MiB",
            f"SGLang 0.5.23 defaults: mem_fraction_static {s.mem_fraction_static} (reserved {s.reserved_mib:,.0f} MiB), "
            f"chunked_prefill_size {s.chunked_prefill_size}, hicache_ratio {self.hicache_ratio}, max_running_requests "
            f"{self.max_running_requests}",
            f"pools: device {self.device_tokens:,} tokens (GPU x mem_fraction_static - weights), host "
            f"{self.host_tokens:,} tokens (hicache_ratio x device), pages of {self.page_tokens}",
            "not modelled: post-capture KV sizing (off by default), HiCache's auto-sizing to the host's RAM, the CUDA "
            "context's memory",
        ]


def size(model: str, gpu: str, page_tokens: int = 64, hicache_ratio: float = HICACHE_RATIO) -> Sizing:
    """The pools for `model` on `gpu` under SGLang's defaults, in whole pages (ValueError for an unknown name).

    The KV budget is what is free after the weights less the runtime's slack, `pre_model_load_memory * (1 -
    mem_fraction_static)` (`mem_cache/kv_cache_configurator.py`, `_profile_available_bytes`): with nothing else
    resident, GPU memory times the fraction, less the weights."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)}")
    m, g = MODELS[model], GPUS[gpu]
    memory = sglang_memory(g.memory_mib)
    budget = g.memory_mib * MIB * memory.mem_fraction_static - m.weight_bytes
    device = int(budget // m.kv_bytes_per_token) // page_tokens * page_tokens
    host = int(device * hicache_ratio) // page_tokens * page_tokens
    if device <= 0:
        raise ValueError(f"{m.name} does not leave KV room on {g.name}")
    # max_running_requests unset: `mem_cache/kv_cache_configurator.py`, `resolve_max_num_reqs`
    running = min(max(min(int(device / m.context_len * 512), 4096), 2048), device // 2)
    return Sizing(m, g, memory, hicache_ratio, page_tokens, device, host, running)


DEFAULT_MODEL, DEFAULT_GPU = "llama-3.1-8b", "h200"
