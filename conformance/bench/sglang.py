"""`kvcert bench meta`'s SGLang drivers: its trees through their own native APIs, on the bench's logical clock.

Split from `conformance.bench.meta`, which imports it only when SGLang is installed (both subclass
`conformance.bench.driver.Driver`): the timed path calls SGLang's methods directly, no adapter in between, and
SGLang's clocks read a logical clock (`_LogicalTime`) so that its LRU stamps are as deterministic as kvcert's.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import time
from array import array
from typing import Any

from kvcert.conformance.bench.driver import HOST_RATIO, Driver, Hit, Request


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Any:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


class _LogicalTime:
    """Stands in for the `time` module inside SGLang's radix_cache: its clocks read the bench's logical clock.

    `monotonic` and `perf_counter` are C calls (a partial of `getitem` on a one-element box), as
    `time.monotonic` is: SGLang stamps every node a match walks, and a Python method per stamp would
    slow the baseline every ratio divides by (scripts/bench_shims.py)."""

    def __init__(self) -> None:
        self.box = [0.0]
        self.monotonic = self.perf_counter = functools.partial(operator.getitem, self.box, 0)

    @property
    def now(self) -> float:
        return self.box[0]

    @now.setter
    def now(self, value: float) -> None:
        self.box[0] = value

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class _SGLangDriver(Driver):
    """The calls SGLang's trees share: keys, match, the allocator, eviction."""

    sg: Any
    cache: Any
    allocator: Any

    def key(self, req: Request) -> Any:
        return array("q", req.tokens)

    def match(self, req: Request, key: Any) -> tuple[Any, int]:
        params = self.sg.MatchPrefixParams(key=self.sg.RadixKey(key, extra_key=req.namespace))
        res = self.cache.match_prefix(params)
        return res.last_device_node, res.device_prefix_len

    def free_count(self) -> int:
        return int(self.allocator.available_size())

    def evict(self, n: int) -> None:
        self.cache.evict(self.sg.EvictParams(num_tokens=n))


class SGLangRadixDriver(_SGLangDriver):
    """SGLang's `RadixCache` (Python tree), native calls only."""

    name = "sglang RadixCache (python)"

    def __init__(self, page_size: int, capacity: int) -> None:
        import torch

        from kvcert.conformance.adapters.sglang.env import OrderedSet, import_sglang

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
        # TreeNodes hash by address; insertion order is one order its set of leaves could have, the same every
        # run (ties between equal-stamp leaves then break alike run to run), as in the certified adapter.
        self.cache.evictable_leaves = OrderedSet(self.cache.evictable_leaves)
        self.clock = _LogicalTime()

    def tick(self, now: int) -> None:
        self.clock.now = float(now)

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """RadixCache stamps nodes with `time.monotonic()`: read the request number instead, as the others do."""
        return _patched(self.sg.radix_cache, "time", self.clock)

    def lock(self, node: Any) -> Any:
        self.cache.inc_lock_ref(node)
        return node

    def unlock(self, lock: Any) -> None:
        self.cache.dec_lock_ref(lock)

    def insert(self, req: Request, key: Any) -> bool:
        slots = self.allocator.alloc(len(key))
        if slots is None:
            return False
        res = self.cache.insert(self.sg.InsertParams(key=self.sg.RadixKey(key, extra_key=req.namespace), value=slots))
        if res.prefix_len:
            self.allocator.free(slots[: res.prefix_len])
        return True


class SGLangUnifiedDriver(_SGLangDriver):
    """SGLang's `UnifiedRadixCache`, one tree core, native calls only; with `host_tier`, HiCache too.

    Built through the HiCache driver (`sglang_hicache.SGLangHiCache`) for its CPU shims and
    runtime context; the timed calls go to the cache object directly. With a host tier the
    controller's ack queues are SGLang's own lists again (the driver's deferred-ack wrappers are
    removed): on the CPU a copy has moved its bytes when it is submitted, so `check_hicache_events`
    consumes its ack at once, as a GPU scheduler's step does once the copy's event has fired.
    """

    def __init__(self, page_size: int, capacity: int, core: str, host_tier: bool = False) -> None:
        from kvcert.conformance.adapters.sglang import hicache as hc
        from kvcert.conformance.adapters.sglang.hicache_backend import host_ratio_for

        self.name = f"sglang {'HiCache' if host_tier else 'UnifiedRadixCache'} ({core} core)"
        self.drv = hc.SGLangHiCache(
            hc.HiCacheConfig(
                page_size=page_size,
                device_pages=capacity // page_size,
                # exactly HOST_RATIO x capacity host slots, as kvcert's caches get (SGLang adds a page to a ratio)
                host_ratio=host_ratio_for(capacity, HOST_RATIO * capacity, page_size),
                write_policy="write_through",
                core=core,
                host_tier=host_tier,
            )
        )
        self.cache, self.sg, self.allocator = self.drv.cache, hc.SG, self.drv.allocator
        self._load_params, self._req = hc._bpc.InitLoadBackParams, hc._Req
        if host_tier:
            self.drv.cc.ack_write_queue = []
            self.drv.cc.ack_load_queue = []

    def lock(self, node: Any) -> Any:
        return node, self.cache.inc_lock_ref(node).to_dec_params()

    def unlock(self, lock: Any) -> None:
        node, receipt = lock
        self.cache.dec_lock_ref(node, receipt)

    def insert(self, req: Request, key: Any) -> bool:
        slots = self.allocator.alloc(len(key))
        if slots is None:
            return False
        params = self.sg.InsertParams(key=self.sg.RadixKey(key, extra_key=req.namespace), value=slots)
        self.cache.insert(params)  # frees its duplicates itself; with HiCache, queues the write-through backup
        return True

    def match_host(self, req: Request, key: Any) -> Hit:
        params = self.sg.MatchPrefixParams(key=self.sg.RadixKey(key, extra_key=req.namespace))
        res = self.cache.match_prefix(params)
        return Hit(res.last_device_node, int(res.host_hit_length), res.last_host_node, res.device_prefix_len)

    def load_back(self, hit: Hit) -> Any:
        params = self._load_params(
            best_match_node=hit.host_node, host_hit_length=hit.host_length, mem_quota=None, req=self._req(hit.node)
        )
        out = self.cache.init_load_back(params)
        self.cache.ready_to_load_host_cache()
        self.cache.check_hicache_events()
        return hit.node if out is None else out[1]

    def backup(self) -> None:
        self.cache.flush_pending_backups()
        self.cache.check_hicache_events()

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """SGLang mints lock uuids and node ids from module globals: use the ones this cache was built with.

        Its clock is already logical: every touch takes the next value of an access counter, so the order
        of its stamps is the order of the requests (no `tick` needed)."""
        return self.drv._in_sglang()

    def close(self) -> None:
        close = getattr(self.drv, "close", None)
        if callable(close):
            close()


# --------------------------------------------------------------------------- running


def sglang_available() -> bool:
    try:
        from kvcert.conformance.adapters.sglang.env import import_sglang

        import_sglang()
        return True
    except Exception:  # noqa: BLE001 - SGLang is optional: missing, or its import shims fail here
        return False
