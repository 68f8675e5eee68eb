"""The engine's costs and limits: every figure the simulator's clock advances by, with its reason.

The defaults describe Llama 3.1 8B (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV per token) on one H200
under SGLang 0.5.23's own defaults. The pools are derived, not chosen (`kvcert.sim.sizing`: the GPU's memory
times SGLang's `mem_fraction_static` less the weights, and `hicache_ratio` 2.0 times that on the host); the time
costs are parameters of that model and GPU, not measurements. `kvcert bench policy --set NAME=VALUE` changes any
of them, and the sensitivity sweep (`--sweep`) shows where the verdict depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kvcert.sim.sizing import DEFAULT_GPU, DEFAULT_MODEL, size

__all__ = ["ENGINES", "SEED_PREFILL_SLOWDOWN", "Costs", "engine", "with_overrides"]

_SIZED = size(DEFAULT_MODEL, DEFAULT_GPU)
"""The default pools: Llama 3.1 8B on an H200 under SGLang 0.5.23's memory defaults."""


@dataclass(frozen=True)
class Costs:
    page_tokens: int = 64
    """Tokens per cache slot. Caches are keyed by pages (SGLang's `page_size` 64 is common), so pools
    and trees are metadata-sized: a 1M-token device pool is 16,384 slots."""
    device_tokens: int = _SIZED.device_tokens
    """Device KV pool: the H200's memory times SGLang's `mem_fraction_static` (0.904) less the 8B model's weights,
    at 128 KiB per token (`kvcert.sim.sizing`)."""
    host_tokens: int = _SIZED.host_tokens
    """Host KV pool: SGLang's `hicache_ratio` default, 2.0 times the device pool."""
    prefill_token_s: float = 20e-6
    """Linear prefill cost per uncached token: 2 x 8B FLOP at ~800 TFLOP/s effective."""
    attention_pair_s: float = 4 * 32 * 4096 / 500e12
    """Prefill attention per (new token, context token) pair: 4 x layers x hidden FLOP (QK^T and AV, 32 x 4096
    for an 8B model) at ~500 TFLOP/s: 1.05e-9 s, so a 15k-token prompt's attention costs about 40% of its
    linear part and a miss on a 30k-token history costs more than its length alone."""
    decode_step_s: float = 0.010
    """Fixed cost of one decode step: weights read once (16 GB at 4.8 TB/s) plus launch overhead."""
    decode_request_s: float = 50e-6
    """Per running request per decode step (sampling, scheduler bookkeeping)."""
    decode_context_s: float = 2.0e-8
    """Per context token per decode step: its KV read from HBM (128 KiB at ~6 TB/s)."""
    load_token_s: float = 4e-6
    """Host->device load per token: 128 KiB over PCIe at ~32 GB/s. Charged to the prefill that needs it."""
    chunked_prefill_tokens: int = _SIZED.memory.chunked_prefill_size
    """New tokens per prefill step (SGLang's `chunked_prefill_size`, 8192 on an H200); a longer prompt takes
    several."""
    max_running: int = _SIZED.max_running_requests
    """Requests running at once: SGLang's `max_running_requests` default for this pool and the model's 131,072
    positions (`kvcert.sim.sizing`); device memory binds first."""
    decode_block: int = 8
    """Decode steps simulated as one event: the clock's resolution while decoding."""
    load_back_threshold: int = 1
    """Pages a host hit must reach before it is loaded back (SGLang's default is 10 tokens: one page)."""
    preemption_threshold: int = 10
    """SGLang's `--priority-scheduling-preemption-threshold`: a waiting request preempts running ones only when
    its priority is higher by more than this (and the batch is full by request count)."""
    retract_decode_steps: int = 20
    """SGLang's `SGLANG_RETRACT_DECODE_STEPS`: tokens of room per request still running that a retraction
    evicts the tree down to."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"Costs.{f.name} must be a non-negative number, got {v!r}")
        for name in ("page_tokens", "device_tokens", "chunked_prefill_tokens", "max_running", "decode_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Costs.{name} must be positive")
        if self.device_tokens % self.page_tokens or self.host_tokens % self.page_tokens:
            raise ValueError("device_tokens and host_tokens must be whole pages")

    @property
    def device_pages(self) -> int:
        return self.device_tokens // self.page_tokens

    @property
    def host_pages(self) -> int:
        return self.host_tokens // self.page_tokens

    def prefill_s(self, new: int, context: int) -> float:
        """`new` tokens computed after `context` cached ones."""
        return new * self.prefill_token_s + self.attention_pair_s * new * (context + new / 2)

    def decode_s(self, steps: int, running: int, context: int) -> float:
        """`steps` decode steps of `running` requests holding `context` tokens in all."""
        return steps * (self.decode_step_s + running * self.decode_request_s + context * self.decode_context_s)


def with_overrides(costs: Costs, pairs: list[str]) -> Costs:
    """`NAME=VALUE` pairs applied to `costs` (ValueError naming the bad pair)."""
    known = {f.name: f.type for f in fields(Costs)}
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or name not in known:
            raise ValueError(f"--set {pair!r}: expected NAME=VALUE with NAME one of {sorted(known)}")
        try:
            changes[name] = int(value) if known[name] in (int, "int") else float(value)
        except ValueError:
            raise ValueError(f"--set {pair!r}: {value!r} is not a {known[name]}") from None
    return replace(costs, **changes)


SEED_PREFILL_SLOWDOWN = 1.66
"""How much slower the seed's engine prefills than `Costs()`. Every turn-0 prompt of the stress test is a miss, so
the HP turn-0 TTFT p90 under HP-first admission measures the engine's cold prefill rate and nothing of the cache
or its policy. The seed's is 1.80, 1.46 and 1.72 times the simulator's at these defaults at 64, 96 and 128 HP
clients (`scripts/seed_compare.py` prints each); this is their mean. The seed names neither its model nor its
GPU, and this is the one figure of its that fixes the rate without involving the cache."""

ENGINES = ("physical", "seed")
"""`--engine`: `physical` is `Costs()`, each default derived from an 8B model on an H200-class GPU; `seed` is the
same with prefill (linear and attention) slowed by `SEED_PREFILL_SLOWDOWN`, the seed's measured cold rate."""


def engine(name: str, model: str = DEFAULT_MODEL, gpu: str = DEFAULT_GPU) -> Costs:
    """The named engine's costs, its pools and limits sized for `model` on `gpu` (`kvcert.sim.sizing`); ValueError
    for an unknown name."""
    if name not in ENGINES:
        raise ValueError(f"--engine {name!r}: one of {', '.join(ENGINES)}")
    sized = size(model, gpu)
    c = replace(
        Costs(),
        device_tokens=sized.device_tokens,
        host_tokens=sized.host_tokens,
        chunked_prefill_tokens=sized.memory.chunked_prefill_size,
        max_running=sized.max_running_requests,
    )
    if name == "seed":
        k = SEED_PREFILL_SLOWDOWN
        c = replace(c, prefill_token_s=c.prefill_token_s * k, attention_pair_s=c.attention_pair_s * k)
    return c
