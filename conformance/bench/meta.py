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

Implementations: `kvcert.gpu` through its tensor-native API (`GpuNativeDriver`) and through the
Backend protocol it is certified on (`ProtocolDriver`: the same internals behind per-token tuples),
the reference model (the protocol, with a time budget: its full scans are quadratic by design),
and when SGLang 0.5.23 is installed its `RadixCache` and `UnifiedRadixCache` with the Python and
the Rust tree cores, each driven through its own native API (no adapter in the timed path).

With a host tier (`replay_host`, `kvcert bench meta --host`): the same trace over a device pool
and a host pool twice its size under write-through. A match whose prefix continues on the host
loads it back (the load's copy completed and its ack consumed, then the request proceeds); every
request ends with the scheduler's step (write copies landed, acks consumed): the `load_back`
and `backup` columns. SGLang's `UnifiedRadixCache` with HiCache is the baseline there.
"""

from __future__ import annotations

import gc
import importlib
import random
import time
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.conformance.bench.driver import HOST_RATIO, Driver, Hit, Request
from kvcert.spec.types import CacheConfig, KVCertError, PoolExhausted

OPS = ("match", "lock", "evict", "insert", "unlock")
HOST_OPS = ("match", "load_back", "lock", "evict", "insert", "unlock", "backup")
LOAD_BACK_THRESHOLD = 10
"""Host tokens below which a load-back is refused: SGLang's default, given to kvcert's caches too."""


# --------------------------------------------------------------------------- the trace


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


class ProtocolDriver(Driver):
    """A kvcert Backend (the reference model, kvcert.gpu) through the conformance protocol: tuples of ints."""

    def __init__(self, name: str, backend: Any) -> None:
        self.name, self.cache = name, backend

    def tick(self, now: int) -> None:
        self.cache.set_clock(now)

    def match(self, req: Request, key: Any) -> tuple[Any, int]:
        out = self.cache.match_prefix(req.namespace, key)
        return out.node, out.length

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

    def insert(self, req: Request, key: Any) -> bool:
        try:
            slots = self.cache.alloc(len(key))
        except PoolExhausted:
            return False
        out = self.cache.insert(req.namespace, key, slots)
        self.cache.free(slots[: out.prefix_len])
        return True

    def match_host(self, req: Request, key: Any) -> Hit:
        out = self.cache.match_prefix(req.namespace, key)
        return Hit(out.node, out.host_length, out.host_node, out.length)

    def load_back(self, hit: Hit) -> Any:
        if not self.cache.load_back(hit.host_node):
            return hit.node
        self.backup()
        return hit.host_node

    def _in_flight(self) -> list[int]:
        in_flight = getattr(self.cache, "in_flight", None)
        if callable(in_flight):
            return list(in_flight())
        return [c.id for c in self.cache.copies if not c.finished]  # the reference model's copy list

    def backup(self) -> None:
        for copy in self._in_flight():
            self.cache.complete(copy)
        self.cache.poll()

    def close(self) -> None:
        close = getattr(self.cache, "close", None)
        if callable(close):  # kvcert.gpu's copy engine
            close()


class GpuNativeDriver(ProtocolDriver):
    """`kvcert.gpu` through its tensor-native API, as an engine calls it (and as SGLang's trees are driven here).

    Per request: the key as an `array("q")` (the form SGLang's drivers get too),
    `match_prefix_fast` (slots back as one int64 tensor), `alloc_tensor`, `insert_fast`,
    `free_tensor` of the duplicates: the same internals the Backend protocol wraps, without a
    Python int per token or slot. Locks, eviction, load-back and copies take node and copy ids:
    the same calls as the protocol's.
    """

    def key(self, req: Request) -> Any:
        return array("q", req.tokens)

    def match(self, req: Request, key: Any) -> tuple[Any, int]:
        out = self.cache.match_prefix_fast(req.namespace, key)
        return out.node, len(out.slots)

    def free_count(self) -> int:
        return int(self.cache.free_count())

    def insert(self, req: Request, key: Any) -> bool:
        try:
            slots = self.cache.alloc_tensor(len(key))
        except PoolExhausted:
            return False
        out = self.cache.insert_fast(req.namespace, key, slots)
        if out.prefix_len:
            self.cache.free_tensor(slots[: out.prefix_len])
        return True

    def match_host(self, req: Request, key: Any) -> Hit:
        out = self.cache.match_prefix_fast(req.namespace, key)
        return Hit(out.node, out.host_length, out.host_node, len(out.slots))

    def backup(self) -> None:
        for copy in self.cache.in_flight():
            self.cache.complete(copy)
        self.cache.poll()


@dataclass
class Result:
    name: str
    ops: tuple[str, ...] = OPS
    requests: int = 0
    """Requests replayed (all of them, unless the time budget ran out)."""
    seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    nanos: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    refused: int = 0
    """Inserts the pool could not hold even after eviction (everything locked)."""
    loaded: int = 0
    """Requests whose match continued on the host (a load-back was asked for)."""
    error: str = ""
    hits: list[tuple[int, int]] = field(default_factory=list)
    """Per request, (device tokens hit, host tokens hit): the answers, which every implementation must share."""

    def rate(self, op: str) -> Optional[float]:
        return self.calls[op] / (self.nanos[op] / 1e9) if self.nanos.get(op) else None

    @property
    def total_rate(self) -> Optional[float]:
        ns = sum(self.nanos.values())
        return sum(self.calls.values()) / (ns / 1e9) if ns else None


def _replay(driver: Driver, trace: Sequence[Request], budget: float, host: bool) -> Result:
    res = Result(driver.name, HOST_OPS if host else OPS)
    clock = time.perf_counter_ns
    start = time.perf_counter()

    now = 0

    def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal now
        now += 1
        driver.tick(now)  # untimed: every call at its own logical time, as the harness steps them
        t0 = clock()
        out = fn(*args)
        res.nanos[op] += clock() - t0
        res.calls[op] += 1
        return out

    # The trace (tens of millions of ints in tuples) is the harness's, not the cache's: freeze it out of the
    # collector, or a full collection walks it inside whichever call triggers one (~0.25 s at page size 64).
    gc.collect()
    gc.freeze()
    try:
        with driver.session():
            for req in trace:
                key = driver.key(req)
                if host:
                    hit = timed("match", driver.match_host, req, key)
                    node = hit.node
                    res.hits.append((int(hit.length), int(hit.host_length)))
                    if hit.host_length:
                        res.loaded += 1
                        node = timed("load_back", driver.load_back, hit)
                else:
                    node, length = timed("match", driver.match, req, key)
                    res.hits.append((int(length), 0))
                held = timed("lock", driver.lock, node)
                short = len(req.tokens) - driver.free_count()
                if short > 0:
                    timed("evict", driver.evict, short)
                if not timed("insert", driver.insert, req, key):
                    res.refused += 1
                timed("unlock", driver.unlock, held)
                if host:
                    timed("backup", driver.backup)
                res.requests += 1
                if time.perf_counter() - start > budget:
                    break
    except (KVCertError, AssertionError, RuntimeError) as err:  # report, keep the other implementations
        res.error = f"{type(err).__name__}: {err}"
    finally:
        gc.unfreeze()
    res.seconds = time.perf_counter() - start
    driver.close()
    return res


def disagreements(results: Sequence[Result]) -> list[str]:
    """Where implementations answered a request differently (hit lengths), against the first: a bench of
    caches that made different choices compares different work. Runs cut short by the budget are compared
    over the requests they did."""
    if not results:
        return []
    base, out = results[0], []
    for other in results[1:]:
        for i, (a, b) in enumerate(zip(base.hits, other.hits)):
            if a != b:
                out.append(f"{other.name} answers request {i} with (device, host) hit {b}, {base.name} with {a}")
                break
    return out


def replay(driver: Driver, trace: Sequence[Request], budget: float) -> Result:
    """Replay `trace` on `driver` (device tier only), timing each call; stop early once `budget` seconds have passed."""
    return _replay(driver, trace, budget, host=False)


def replay_host(driver: Driver, trace: Sequence[Request], budget: float) -> Result:
    """Replay `trace` with a host tier: load-back of host hits, the scheduler's copy step after every request."""
    return _replay(driver, trace, budget, host=True)


def _makers(config: CacheConfig) -> dict[str, Callable[[], Driver]]:
    """kvcert's implementations under `config` (kvcert.gpu when torch imports)."""
    makers: dict[str, Callable[[], Driver]] = {}
    try:
        gpu = importlib.import_module("kvcert.gpu")
        if hasattr(gpu, "factory"):
            makers["gpu"] = lambda: GpuNativeDriver("kvcert.gpu", gpu.factory(config))
            makers["gpu-protocol"] = lambda: ProtocolDriver("kvcert.gpu (protocol)", gpu.factory(config))
    except ImportError:
        pass

    def refimpl() -> Driver:
        from kvcert.refimpl import RefCache

        return ProtocolDriver("kvcert.refimpl", RefCache(config))

    makers["refimpl"] = refimpl
    return makers


def _sglang() -> Any:
    """`conformance.bench.sglang` when SGLang is installed and imports here, else None."""
    from kvcert.conformance.bench import sglang as bench_sglang

    return bench_sglang if bench_sglang.sglang_available() else None


def drivers(page_size: int, capacity: int, which: Sequence[str]) -> list[tuple[str, Callable[[], Driver]]]:
    """(label, constructor) of every implementation asked for that can be built here."""
    makers = _makers(CacheConfig(page_size=page_size, capacity=capacity))
    sg = _sglang()
    if sg is not None:
        makers["sglang-radix"] = lambda: sg.SGLangRadixDriver(page_size, capacity)
        makers["sglang-unified-python"] = lambda: sg.SGLangUnifiedDriver(page_size, capacity, "python")
        makers["sglang-unified-rust"] = lambda: sg.SGLangUnifiedDriver(page_size, capacity, "rust")
    return [(k, makers[k]) for k in which if k in makers]


def host_drivers(page_size: int, capacity: int, which: Sequence[str]) -> list[tuple[str, Callable[[], Driver]]]:
    """`drivers` with a host tier: HOST_RATIO x `capacity` host slots, write-through."""
    config = CacheConfig(
        page_size=page_size,
        capacity=capacity,
        host_capacity=HOST_RATIO * capacity,
        write_policy="write_through",
        load_back_threshold=LOAD_BACK_THRESHOLD,
    )
    makers = _makers(config)
    sg = _sglang()
    if sg is not None:
        makers["sglang-hicache-python"] = lambda: sg.SGLangUnifiedDriver(page_size, capacity, "python", host_tier=True)
        makers["sglang-hicache-rust"] = lambda: sg.SGLangUnifiedDriver(page_size, capacity, "rust", host_tier=True)
    return [(k, makers[k]) for k in which if k in makers]


def __getattr__(name: str) -> Any:
    """`bench.SGLangRadixDriver` and the other SGLang drivers, from `conformance.bench.sglang`."""
    if name in ("SGLangRadixDriver", "SGLangUnifiedDriver"):
        from kvcert.conformance.bench import sglang as bench_sglang

        return getattr(bench_sglang, name)
    raise AttributeError(name)


IMPLEMENTATIONS = ("gpu", "gpu-protocol", "sglang-radix", "sglang-unified-python", "sglang-unified-rust", "refimpl")
BASELINE = "sglang-radix"
HOST_IMPLEMENTATIONS = ("gpu", "gpu-protocol", "sglang-hicache-python", "sglang-hicache-rust", "refimpl")
HOST_BASELINE = "sglang-hicache-python"
