"""`KvcertRadixCache`: SGLang 0.5.23's `BasePrefixCache`, implemented over `kvcert.gpu.GpuCache`.

What SGLang's scheduler calls, and what it becomes here:

- `match_prefix` -> `GpuCache.match_prefix_fast` under the key's namespace; `path_device_indices` reads
  the matched path's slots (`GpuCache.path_slots`), which `prefix_device_indices` cuts to the hit.
- `checkpoint(req, up_to)` -> `insert_fast` of the request's row; the duplicates the insert exposes go back
  to SGLang's allocator, the row is repointed onto the tree's slots and the request's lock moves to the
  insert's node (what `RadixCache.checkpoint` does). `release_kv_cache` (SGLang's) frees the rest.
- `evict` / `evict_for_alloc` -> `GpuCache.evict`: the tree picks victims by its policy and §11's tiers and
  hands their slots back to SGLang's allocator (`kvcert.gpu.alloc.EngineSlots`).
- `inc_lock_ref` / `dec_lock_ref` -> the tree's locks; sizes -> the tree's counters.
- with `--enable-session-radix-cache`: a request's `session_id` holds the path its checkpoint ended on at
  the request's priority (`register_ref`), until SGLang closes the session (`release_radix_session`).
- with `KVCERT_RETENTION=1` (`options.RETENTION_ENV`): a session's finished turn whose `custom_params` carry
  `kvcert_retain_seconds` retains the session's path that long (`retain`, SPEC.md §11.7); the tree's clock then
  follows wall time in microseconds (`clock`), still a tick later each call. When the session's next turn arrives
  (SGLang stamps its epoch, `ensure_session_generation`) a live retention holds until that turn registers
  (`retain_waiting`), so the hint need cover only the pause, not the wait in SGLang's queue.
- with `--enable-hierarchical-cache`: the host tier is kvcert.gpu's own (pinned host pool on a GPU), its
  device side SGLang's buffers (`kv.EnginePool`). A match reports the host part (`host_hit_length`, the
  deepest host copy as `best_match_node`); `init_load_back` loads it (`GpuCache.load_back`); backups follow
  `--hicache-write-policy`. A load-back finishes within `init_load_back` (`_settle`), so SGLang's forward waits on
  nothing and `ready_to_load_host_cache` reports no layer-wise load; write-through backups are acknowledged at the
  next iteration's `check_hicache_events`.

- what SGLang's other callers read: `token_to_kv_pool_host` (the host tier's size and room, for `--enable-metrics`),
  `clear_storage_backend` (no storage tier: nothing to clear); priorities in SGLang's direction
  (`--schedule-low-priority-values-first` flips them, so the tree protects what SGLang's scheduler favours).

SGLang's allocator owns the device slots and their KV; the tree records which slots it holds, so a slot
is never both the tree's and a request's. Node handles are the tree's node ids (ints; the root is 0).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.events import KVCacheEventRecorder

from kvcert.gpu import GpuCache
from kvcert.integrations.sglang.events import EventWatch
from kvcert.integrations.sglang.kv import EnginePool
from kvcert.integrations.sglang.options import RETAIN_PARAM, BackendOptions
from kvcert.spec.types import CacheConfig, Namespace

__all__ = ["KvcertRadixCache", "namespace_of", "retain_hint"]

logger = logging.getLogger(__name__)


def namespace_of(extra_key: Optional[str], cache_salt: Optional[str]) -> Namespace:
    """The tree namespace of SGLang's key parts: None for neither, else both as one JSON pair (injective: no
    `extra_key` can spell another request's pair)."""
    cache_salt = cache_salt or None  # SGLang's RadixKey reads an empty salt as none: so must the insert
    if extra_key is None and cache_salt is None:
        return None
    return json.dumps([extra_key, cache_salt])


class _Slots:
    """SGLang's token allocator as `kvcert.gpu.alloc.SlotSource`: it lends slots; the tree gives evicted ones back."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.device = torch.device(allocator.device) if isinstance(allocator.device, (str, torch.device)) else None

    def available(self) -> int:
        return int(self.allocator.available_size())

    def release(self, raw: bytes) -> None:
        if raw:
            slots = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            self.allocator.free(slots.to(self.device) if self.device is not None else slots)

    def take(self, n: int) -> bytes:
        got = self.allocator.alloc(n)
        if got is None:  # the tree checked `available` first: only a torn free list gets here
            raise RuntimeError(f"SGLang's allocator refused {n} slots with {self.available()} available")
        return got.to(torch.int64).cpu().numpy().tobytes()

    def free_slots(self) -> tuple[int, ...]:
        pages = self.allocator.get_all_free_pages()
        if pages is None:
            return ()
        ps = self.allocator.page_size
        return tuple(sorted(int(p) * ps + i for p in pages.tolist() for i in range(ps)))


class HostPoolView:
    """What SGLang's metrics read of a HiCache host pool (`MetricsReporter._log_hicache_stats`): its size in tokens
    and the tokens free, here the host tier of kvcert's tree."""

    def __init__(self, owner: KvcertRadixCache) -> None:
        self._owner = owner

    @property
    def logical_size(self) -> int:
        return self._owner.cache.host_capacity

    @property
    def size(self) -> int:
        return self._owner.cache.host_capacity

    def available_size(self) -> int:
        return self._owner.cache.host_free_count()


class KvcertRadixCache(BasePrefixCache):
    """kvcert's priority-aware radix tree behind SGLang's tree-cache interface (device and host tiers)."""

    def __init__(self, params: Any, options: BackendOptions) -> None:
        self.disable = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.options = options
        self.enable_session_radix_cache = options.sessions
        self._slots = _Slots(self.token_to_kv_pool_allocator)
        self.device = self._slots.device or torch.device("cpu")
        if options.metrics:
            self.init_metrics_collector()
        self.kv_events = KVCacheEventRecorder(
            enabled=bool(params.enable_kv_cache_events),
            page_size=self.page_size,
            dynamo_format=params.dynamo_kv_event_format,
            lora_names=params.kv_event_lora_names,
        )
        self.kv_events.record_all_cleared()  # as SGLang's caches start: a restarted worker's blocks are gone
        self._tick = 0
        self.clock: Callable[[], float] = time.monotonic
        """Seconds, for retention deadlines (`options.retention` only); a harness that drives time replaces it."""
        self._clock_origin = self.clock()
        self.loaded_back = 0
        """Host tokens loaded back to the device so far."""
        self._epochs: dict[str, int] = {}
        """Open sessions -> their epoch (`ensure_session_generation`)."""
        self._next_epoch = 0
        self.events: Optional[EventWatch] = None
        """The tree's watch with `--kv-events-config` (the scheduler takes the events, `take_events`)."""
        self.cache = self._new_tree()
        self.root_node = self.cache.root.id
        self.token_to_kv_pool_host: Optional[HostPoolView] = HostPoolView(self) if options.host_capacity else None
        """The host tier as SGLang's metrics read a host pool (None without one, as SGLang's caches)."""

    def _new_tree(self) -> GpuCache:
        allocator, ps, host = self.token_to_kv_pool_allocator, self.page_size, self.options.host_capacity
        # SGLang's slot ids run from one page in (slot 0 pads) to size + page_size.
        capacity = allocator.size + ps
        capacity -= capacity % ps
        # With a host tier the tree's device pool is SGLang's own (its copies move SGLang's bytes); without one
        # the KV lives in SGLang's pools only and the tree's pool is a placeholder of one layer on the CPU.
        kv = EnginePool(allocator.get_kvcache(), capacity, ps) if host else None
        config = CacheConfig(
            page_size=ps,
            policy=self.options.policy,
            capacity=capacity,
            host_capacity=host,
            write_policy=self.options.write_policy,
            kv_layers=kv.geometry.layers if kv is not None else 1,
            high_priority_threshold=self._priority(self.options.high_priority_threshold),
            policy_config=self.options.policy_config,
        )
        tree = GpuCache(
            config,
            geometry=kv.geometry if kv is not None else None,
            kv=kv,
            device=self.device if kv is not None else torch.device("cpu"),
            engine=self.options.copy_engine if kv is not None else "deferred",
            engine_slots=self._slots,
        )
        if self.kv_events.enabled:
            tree.watch = self.events = EventWatch(self.kv_events, ps, tree.nodes)
        return tree

    def _priority(self, priority: int) -> int:
        """SGLang's priority in the tree's direction (larger is more important): flipped under
        `--schedule-low-priority-values-first`, where SGLang schedules smaller values first."""
        return -priority if self.options.low_values_first else priority

    def _settle(self) -> None:
        """Land every copy in flight and consume its ack (the copy engine waits for each): a load-back before
        `init_load_back` returns, so SGLang's forward never reads a slot still loading; backups at the next
        `check_hicache_events` (or an earlier call that settles)."""
        cache = self.cache
        if cache.host is None:
            return
        for copy in cache.in_flight():
            cache.complete(copy)
        cache.poll()

    def _stamp(self) -> None:
        """The tree's logical clock: one tick a call, the same on every tensor-parallel rank. With retention, the
        microseconds since start (`clock`) when they are further on, so a retention's deadline is wall time."""
        self._tick += 1
        if self.options.retention:
            self._tick = max(self._tick, round((self.clock() - self._clock_origin) * 1e6))
        self.cache.set_clock(self._tick)

    # ------------------------------------------------------------------ BasePrefixCache

    def reset(self) -> None:
        """A new, empty tree; SGLang clears its allocator itself right after (`Scheduler.flush_cache`)."""
        self.cache.close()
        self._epochs.clear()
        self.kv_events.record_all_cleared()
        self.cache = self._new_tree()
        self.root_node = self.cache.root.id

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        size = len(key) - len(key) % self.page_size
        root = self.root_node
        if size <= 0:
            return MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root)
        self._stamp()
        got = self.cache.match_prefix_fast(namespace_of(key.extra_key, key.cache_salt), key.token_ids[:size])
        n = len(got.slots)
        best = got.host_node if got.host_length else got.node  # a load-back's anchor: the deepest host copy
        return MatchResult(
            device_prefix_len=n,
            last_device_node=got.node,
            last_host_node=got.host_node if got.host_length else got.node,
            best_match_node=best,
            host_hit_length=got.host_length,
            full_kv_hit_length=n + got.host_length,
        )

    def touch_prefix(self, key: Any) -> None:
        """A waiting request's prefix is used again: stamp its cached path (a match whose answer is dropped)."""
        self.match_prefix(MatchPrefixParams(key=key))

    def path_device_indices(self, node: Any) -> torch.Tensor:
        return self.cache.path_slots(int(node)).to(self.device)

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        kv = req.kv
        tokens = req.full_untruncated_fill_ids[:up_to]
        size = len(tokens) - len(tokens) % self.page_size
        priority = self._priority(req.priority or 0)
        if size > kv.cache_protected_len:
            self._insert_row(req, tokens, size, priority)
        session = req.session_id
        if (
            self.enable_session_radix_cache
            and session is not None
            and req.last_node != self.root_node
            and self._epochs.get(session) == getattr(req, "session_generation", None)
        ):  # a turn that finishes after its session closed holds nothing
            self.cache.register_ref(session, int(req.last_node), priority)
            if self.options.retention and req.finished() and not isinstance(req.finished_reason, FINISH_ABORT):
                ttl = retain_hint(req)
                if ttl is not None:
                    self._stamp()
                    self.cache.retain(session, ttl)

    def reset_clock_origin(self) -> None:
        """Read `clock`'s origin again (after a harness replaced `clock`)."""
        self._clock_origin = self.clock()

    def _insert_row(self, req: Any, tokens: Any, size: int, priority: int) -> None:
        """Insert the row's first `size` tokens; repoint the row and move the lock (RadixCache.checkpoint's steps)."""
        kv = req.kv
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :size].to(dtype=torch.int64, copy=True)
        self._stamp()
        events = self.events
        if events is not None:
            events.session = req.session_id  # the stores this insert announces are this request's
        try:
            out = self.cache.insert_fast(namespace_of(req.extra_key, req.cache_salt), tokens[:size], row.cpu(), priority)
        finally:
            if events is not None:
                events.session = None
        kv.cache_inserted_len = max(kv.cache_inserted_len, size)
        protected = kv.cache_protected_len
        if out.prefix_len > protected:  # the request computed KV the tree already had: its copies go back
            self.token_to_kv_pool_allocator.free_segment(row[protected : out.prefix_len], start_pos=protected)
        tree = self.path_device_indices(out.node)
        self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, size)), tree[protected:size])
        kv.cache_protected_len = size
        self.unlock(req.lock)
        req.lock = self.lock(out.node)
        req.last_node = out.node
        # The write-through backups the insert issued run on (a GPU's on the D2H side stream) while SGLang finishes
        # the iteration; the next iteration's `check_hicache_events` acknowledges them, as SGLang's HiCache does.

    def evict(self, params: EvictParams) -> EvictResult:
        if params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        self._stamp()
        freed = self.cache.evict(params.num_tokens)
        self._settle()  # write-back backups of the victims
        self.update_eviction_metrics(freed, start)
        return EvictResult(num_tokens_evicted=freed)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        node = int(node)
        if node == self.root_node:
            return IncLockRefResult(delta=0, node_id=node)
        before = self.cache.evictable_size
        self.cache.inc_lock_ref(node)
        return IncLockRefResult(delta=self.cache.evictable_size - before, node_id=node)

    def dec_lock_ref(self, node: Any, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        node = int(node)
        if node == self.root_node:
            return DecLockRefResult(delta=0)
        before = self.cache.evictable_size
        self.cache.dec_lock_ref(node)
        return DecLockRefResult(delta=self.cache.evictable_size - before)

    # ------------------------------------------------------------------ host tier (--enable-hierarchical-cache)

    enable_storage = False

    @property
    def ongoing_write_through(self) -> dict[int, Any]:
        """Backups in flight until the next `check_hicache_events`; SGLang's idle check reads it."""
        return {c.id: c for c in self.cache.copies.values() if c.kind == "write"}

    @property
    def ongoing_load_back(self) -> dict[int, Any]:
        return {c.id: c for c in self.cache.copies.values() if c.kind == "load"}

    def init_load_back(self, params: Any) -> tuple[int, Any]:
        """Load the host part of a match back to the device (`GpuCache.load_back`, finished before this returns):
        (tokens loaded, the node the request's device prefix now ends at). All of the host hit or none of it."""
        req = params.req
        before = req.last_node if req is not None else self.root_node
        if params.host_hit_length <= 0:
            return 0, before
        self._stamp()
        loaded = self.cache.load_back(int(params.best_match_node))
        self._settle()
        self.loaded_back += loaded
        return (loaded, int(params.best_match_node)) if loaded else (0, before)

    def ready_to_load_host_cache(self) -> int:
        """No layer-wise load is pending (loads finish in `init_load_back`): -1, the forward waits for nothing."""
        return -1

    def check_hicache_events(self) -> None:
        """The start of every scheduler iteration: every copy in flight lands and is acknowledged. All of them, not
        those that happen to be done: tensor-parallel ranks then take the same acks at the same call."""
        self._settle()

    def flush_pending_backups(self) -> None:
        """The end of an iteration: the tree issued its backups when it inserted (nothing is queued here)."""

    def release_host_resources(self) -> None:
        self.cache.close()

    def clear_storage_backend(self) -> bool:
        """`/hicache/storage-backend/clear`: there is no storage tier to clear (L3 is refused at startup), so
        nothing is cleared — SGLang's own cache answers the same without one."""
        return False

    # ------------------------------------------------------------------ sizes

    def evictable_size(self) -> int:
        return self.cache.evictable_size

    def full_evictable_size(self) -> int:
        return self.cache.evictable_size

    def protected_size(self) -> int:
        return self.cache.protected_size

    def full_protected_size(self) -> int:
        return self.cache.protected_size

    def total_size(self) -> int:
        return self.cache.evictable_size + self.cache.protected_size

    def pretty_print(self) -> None:
        for view in self.cache.snapshot().nodes:
            print(view.id, view.parent, len(view.key), view.lock_ref, view.meta)
        print(f"#tokens: {self.total_size()}")

    # ------------------------------------------------------------------ radix-native sessions (§11)

    def open_radix_session(self, session_id: str) -> Optional[int]:
        return self.ensure_session_generation(session_id)

    def ensure_session_generation(self, session_id: Optional[str]) -> int:
        """The session's epoch, stamped on each arriving request (`Req.session_generation`): a turn registers its
        path only while its epoch is the session's, so a turn still running when its session closes holds
        nothing afterwards. Epochs come from one counter; only open sessions keep one."""
        if session_id is None:
            return 0
        epoch = self._epochs.get(session_id)
        if epoch is None:
            self._next_epoch += 1
            epoch = self._epochs[session_id] = self._next_epoch
        if self.options.retention and session_id in self.cache.sessions:
            # SGLang calls this as each turn arrives, before it queues: a live retention holds while the turn waits
            self._stamp()
            self.cache.retain_waiting(session_id)  # (SPEC.md §11.7, the engine's half)
        return epoch

    def release_radix_session(self, session_id: str) -> int:
        """SGLang closes the session: its path is no longer held, and its turns still running will hold nothing."""
        self._epochs.pop(session_id, None)
        if session_id in self.cache.sessions:
            self.cache.release_ref(session_id)
        return 0

    def reprioritize(self, session_id: str, priority: int) -> None:
        """A session's new priority (§11.3); SGLang 0.5.23 has no request path that calls it."""
        self.cache.update_ref(session_id, self._priority(priority))

    def plan_admission(self, *args: Any, **kwargs: Any) -> Any:
        """§11.5's admission plan (`GpuCache.plan_admission`); SGLang 0.5.23's scheduler does not ask for one."""
        return self.cache.plan_admission(*args, **kwargs)


def retain_hint(req: Any) -> Optional[int]:
    """The request's retention hint in microseconds (`RETAIN_PARAM`), or None. A hint that is not a finite number of
    seconds above zero retains nothing and is logged: the request was already served, so refusing it is too late."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(params, dict) or RETAIN_PARAM not in params:
        return None
    seconds = params[RETAIN_PARAM]
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
    if not ok or seconds <= 0:
        logger.warning("request %s: %s=%r is not a number of seconds > 0; nothing retained", req.rid, RETAIN_PARAM, seconds)
        return None
    return max(1, round(seconds * 1e6))  # an aborted turn's hint retains nothing: the client did not get its answer

