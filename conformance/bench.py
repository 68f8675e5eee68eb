"""`kvcert bench meta`: radix-tree metadata speed, every implementation on one trace, side by side.

One seeded multi-turn trace (sessions sharing a few system prompts, each turn appending a few
pages, hot sessions picked more often) is replayed against each implementation in the same
process: match, lock, allocate (evicting first when short), insert, free the duplicates, unlock.
Every call is timed with `perf_counter_ns`; the report gives calls/s per operation and the ratio
to SGLang's Python `RadixCache`, the baseline. Only metadata is measured: KV pools are tiny (one
head of width 8 per token), so no call moves real KV.

Each request allocates slots for its whole key and frees the duplicates after the insert, as the
conformance harness does (the Backend protocol's insert takes only slots the caller holds). Real
schedulers allocate only the new tokens, so absolute rates understate every implementation's
allocator path; the ratios compare like with like.

Implementations: the reference model (through the Backend protocol, with a time budget: its
full scans are quadratic by design), `kvcert.gpu` (when it exists) through the same protocol, and
when SGLang 0.5.23 is installed its `RadixCache` and `UnifiedRadixCache` with the Python and the
Rust tree cores, each driven through its own native API (no adapter in the timed path).
"""

from __future__ import annotations

import contextlib
import importlib
import random
import time
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.spec.types import CacheConfig, KVCertError, PoolExhausted

OPS = ("match", "lock", "evict", "insert", "unlock")


# --------------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Request:
    namespace: Optional[str]
    tokens: tuple[int, ...]
    """The whole key: the session's context so far plus this turn."""


@dataclass(frozen=True)
class TraceSpec:
    page_size: int = 64
    pages: int = 20_000
    """Device pool, in pages: the cache holds tens of thousands of pages at steady state."""
    requests: int = 20_000
    sessions: int = 400
    prompts: int = 8
    """System prompts shared by sessions (each session uses one)."""
    prompt_pages: int = 8
    turn_pages: tuple[int, int] = (1, 6)
    max_context_pages: int = 96
    """A session that outgrows this starts over (same prompt, new turns)."""
    seed: int = 0


def make_trace(spec: TraceSpec) -> list[Request]:
    """Multi-turn traffic: Zipf-ish session popularity, shared prompts, growing contexts."""
    rng = random.Random(spec.seed)
    ps = spec.page_size

    def page() -> list[int]:
        return [rng.randrange(1, 50_000) for _ in range(ps)]

    prompts = [[t for _ in range(spec.prompt_pages) for t in page()] for _ in range(spec.prompts)]
    contexts = [list(prompts[i % spec.prompts]) for i in range(spec.sessions)]
    weights = [1.0 / (rank + 1) for rank in range(spec.sessions)]
    out: list[Request] = []
    for _ in range(spec.requests):
        s = rng.choices(range(spec.sessions), weights)[0]
        turn = [t for _ in range(rng.randint(*spec.turn_pages)) for t in page()]
        if len(contexts[s]) + len(turn) > spec.max_context_pages * ps:
            contexts[s] = list(prompts[s % spec.prompts])
        contexts[s] += turn
        out.append(Request(None, tuple(contexts[s])))
    return out


# --------------------------------------------------------------------------- drivers


class Driver:
    """One implementation's calls for one request step; subclasses bind them to a real API."""

    name = ""

    def match(self, req: Request) -> Any:
        raise NotImplementedError

    def lock(self, node: Any) -> Any:
        raise NotImplementedError

    def unlock(self, lock: Any) -> None:
        raise NotImplementedError

    def free_count(self) -> int:
        raise NotImplementedError

    def evict(self, n: int) -> None:
        raise NotImplementedError

    def insert(self, req: Request) -> bool:
        """Allocate the key's slots, insert, free the duplicates; False when the pool is short."""
        raise NotImplementedError

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """Entered once around the whole replay (per-process state an engine keeps in globals)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class ProtocolDriver(Driver):
    """A kvcert Backend (the reference model, kvcert.gpu) through the conformance protocol."""

    def __init__(self, name: str, backend: Any) -> None:
        self.name, self.cache = name, backend
        self.capacity = backend.snapshot().capacity

    def match(self, req: Request) -> Any:
        return self.cache.match_prefix(req.namespace, req.tokens).node

    def lock(self, node: Any) -> Any:
        self.cache.inc_lock_ref(node)
        return node

    def unlock(self, lock: Any) -> None:
        self.cache.dec_lock_ref(lock)

    def free_count(self) -> int:
        count = getattr(self.cache, "free_count", None)
        if callable(count):
            return int(count())
        pool = getattr(self.cache, "pool", None)  # the reference model: its free list
        if pool is not None:
            return len(pool.free_list)
        return len(self.cache.snapshot().free_slots)

    def evict(self, n: int) -> None:
        self.cache.evict(n)

    def insert(self, req: Request) -> bool:
        try:
            slots = self.cache.alloc(len(req.tokens))
        except PoolExhausted:
            return False
        out = self.cache.insert(req.namespace, req.tokens, slots)
        self.cache.free(slots[: out.prefix_len])
        return True


class _SGLangDriver(Driver):
    """The calls SGLang's two trees share: keys, match, the allocator, eviction."""

    sg: Any
    cache: Any
    allocator: Any

    def _key(self, req: Request) -> Any:
        return self.sg.RadixKey(array("q", req.tokens), extra_key=req.namespace)

    def match(self, req: Request) -> Any:
        return self.cache.match_prefix(self.sg.MatchPrefixParams(key=self._key(req))).last_device_node

    def free_count(self) -> int:
        return int(self.allocator.available_size())

    def evict(self, n: int) -> None:
        self.cache.evict(self.sg.EvictParams(num_tokens=n))


class SGLangRadixDriver(_SGLangDriver):
    """SGLang's `RadixCache` (Python tree), native calls only."""

    name = "sglang RadixCache (python)"

    def __init__(self, page_size: int, capacity: int) -> None:
        import torch

        from kvcert.conformance.adapters._sglang_env import import_sglang

        sg = import_sglang()
        self.sg = sg
        kv = sg.MHATokenToKVPool(
            size=capacity,
            page_size=page_size,
            dtype=torch.float32,
            head_num=1,
            head_dim=8,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        if page_size == 1:
            self.allocator = sg.TokenToKVPoolAllocator(
                capacity, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False
            )
        else:
            self.allocator = sg.PagedTokenToKVPoolAllocator(
                capacity, page_size, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False
            )
        params = sg.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
            eviction_policy="lru",
        )
        self.cache = sg.RadixCache(params)

    def lock(self, node: Any) -> Any:
        self.cache.inc_lock_ref(node)
        return node

    def unlock(self, lock: Any) -> None:
        self.cache.dec_lock_ref(lock)

    def insert(self, req: Request) -> bool:
        slots = self.allocator.alloc(len(req.tokens))
        if slots is None:
            return False
        res = self.cache.insert(self.sg.InsertParams(key=self._key(req), value=slots))
        if res.prefix_len:
            self.allocator.free(slots[: res.prefix_len])
        return True


class SGLangUnifiedDriver(_SGLangDriver):
    """SGLang's `UnifiedRadixCache` (device tier only), one tree core, native calls only.

    Built through the HiCache driver (`sglang_hicache.SGLangHiCache`, host tier off) for its
    CPU shims and runtime context; the timed calls go to the cache object directly.
    """

    def __init__(self, page_size: int, capacity: int, core: str) -> None:
        from kvcert.conformance.adapters import sglang_hicache as hc

        self.name = f"sglang UnifiedRadixCache ({core} core)"
        self.drv = hc.SGLangHiCache(
            hc.HiCacheConfig(page_size=page_size, device_pages=capacity // page_size, core=core, host_tier=False)
        )
        self.cache, self.sg, self.allocator = self.drv.cache, hc.SG, self.drv.allocator

    def lock(self, node: Any) -> Any:
        return node, self.cache.inc_lock_ref(node).to_dec_params()

    def unlock(self, lock: Any) -> None:
        node, receipt = lock
        self.cache.dec_lock_ref(node, receipt)

    def insert(self, req: Request) -> bool:
        slots = self.allocator.alloc(len(req.tokens))
        if slots is None:
            return False
        self.cache.insert(self.sg.InsertParams(key=self._key(req), value=slots))  # frees its duplicates itself
        return True

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """SGLang mints lock uuids and node ids from module globals: use the ones this cache was built with."""
        return self.drv._in_sglang()

    def close(self) -> None:
        close = getattr(self.drv, "close", None)
        if callable(close):
            close()


# --------------------------------------------------------------------------- running


@dataclass
class Result:
    name: str
    requests: int = 0
    """Requests replayed (all of them, unless the time budget ran out)."""
    seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    nanos: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    refused: int = 0
    """Inserts the pool could not hold even after eviction (everything locked)."""
    error: str = ""

    def rate(self, op: str) -> Optional[float]:
        return self.calls[op] / (self.nanos[op] / 1e9) if self.nanos.get(op) else None

    @property
    def total_rate(self) -> Optional[float]:
        ns = sum(self.nanos.values())
        return sum(self.calls.values()) / (ns / 1e9) if ns else None


def replay(driver: Driver, trace: Sequence[Request], budget: float) -> Result:
    """Replay `trace` on `driver`, timing each call; stop early once `budget` seconds have passed."""
    res = Result(driver.name)
    clock = time.perf_counter_ns
    start = time.perf_counter()

    def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = clock()
        out = fn(*args)
        res.nanos[op] += clock() - t0
        res.calls[op] += 1
        return out

    try:
        with driver.session():
            for req in trace:
                node = timed("match", driver.match, req)
                held = timed("lock", driver.lock, node)
                short = len(req.tokens) - driver.free_count()
                if short > 0:
                    timed("evict", driver.evict, short)
                if not timed("insert", driver.insert, req):
                    res.refused += 1
                timed("unlock", driver.unlock, held)
                res.requests += 1
                if time.perf_counter() - start > budget:
                    break
    except (KVCertError, AssertionError, RuntimeError) as err:  # report, keep the other implementations
        res.error = f"{type(err).__name__}: {err}"
    res.seconds = time.perf_counter() - start
    driver.close()
    return res


def drivers(page_size: int, capacity: int, which: Sequence[str]) -> list[tuple[str, Callable[[], Driver]]]:
    """(label, constructor) of every implementation asked for that can be built here."""
    config = CacheConfig(page_size=page_size, capacity=capacity)
    makers: dict[str, Callable[[], Driver]] = {}
    try:
        gpu = importlib.import_module("kvcert.gpu")
        if hasattr(gpu, "factory"):
            makers["gpu"] = lambda: ProtocolDriver("kvcert.gpu", gpu.factory(config))
    except ImportError:
        pass

    def refimpl() -> Driver:
        from kvcert.refimpl import RefCache

        return ProtocolDriver("kvcert.refimpl", RefCache(config))

    makers["refimpl"] = refimpl
    try:
        from kvcert.conformance.adapters._sglang_env import import_sglang

        import_sglang()
        makers["sglang-radix"] = lambda: SGLangRadixDriver(page_size, capacity)
        makers["sglang-unified-python"] = lambda: SGLangUnifiedDriver(page_size, capacity, "python")
        makers["sglang-unified-rust"] = lambda: SGLangUnifiedDriver(page_size, capacity, "rust")
    except Exception:  # noqa: BLE001 - SGLang is optional: missing, or its import shims fail here
        pass
    return [(k, makers[k]) for k in which if k in makers]


IMPLEMENTATIONS = ("gpu", "sglang-radix", "sglang-unified-python", "sglang-unified-rust", "refimpl")
BASELINE = "sglang-radix"
