# Over 600 lines: a deterministic driver of SGLang's HiCache and the ack ledgers its interface needs.
"""A deterministic CPU driver of SGLang's real hierarchical cache (0.5.23): UnifiedRadixCache + HiCache.

Groundwork for a kvcert adapter of the host tier (the spec/protocol for it does
not exist yet). It builds the real objects -- ``ServerArgs``, the published
runtime context, ``UnifiedRadixCache(CacheInitParams(tree_components=(FULL,)))``
and ``.init_hicache(args, params)``, which assembles the real
``HybridCacheController`` and ``MHATokenToKVPoolHost`` -- and exposes plain
methods over node ids. See ``docs/calibration/sglang_hicache_notes.md`` for the facts (with
file:line references) this file relies on.

CPU shims (installed once, process-wide, idempotent):

* host pools are built with ``pin_memory=False`` (the default registers memory
  through ``cudaHostRegister``);
* the ``sgl_kernel.kvcacheio`` transfer ops that ``pool_host/mha.py`` binds
  only on CUDA/HIP/XPU get torch index-copy equivalents (``direct`` io backend,
  layouts ``layer_first`` and ``page_first_direct``).

Deferred completions. On CPU every copy finishes inside its submission
(``start_writing`` / ``start_loading``), so SGLang would consume each ack on
its next poll. The driver replaces the controller's ``ack_write_queue`` and
``ack_load_queue`` with lists that wrap each ack's ``finish_event`` in a
:class:`_HeldEvent` whose ``query()`` is False until the harness calls
:meth:`SGLangHiCache.complete`. SGLang's own consumers then behave as on a
GPU with a slow copy: ``check_hicache_events`` counts ready acks front to back
and stops at the first unready one (FIFO), and a blocking
``finish_event.synchronize()`` (write_back eviction) forces completion, which
is recorded in :attr:`SGLangHiCache.forced`. With ``copy_at="ack"`` the
bytes themselves move only when the op completes (worst case for readers that
race the ack); the default ``"submit"`` is what the CPU really does.

Determinism. SGLang numbers Python-core nodes from the class-wide
``UnifiedTreeNode.counter``, stamps access times from a module-global counter
(``components/base.py``), mints lock uuids and ``CacheOperation`` ids from
globals. While a call into SGLang runs, the driver swaps all four for its own
counters and restores them afterwards, so ids and stamps depend only on this
driver's op sequence. The Rust core mints ids per instance (root is 1) and
keeps its own counters. Not thread-safe; no L3 storage threads unless
``storage_dir`` is set without ``stepped_storage`` (with it, the driver runs the storage threads'
bodies itself: ``sglang_hicache_storage.py``).

Observation. The Python core is read off its node objects. The Rust core has
none; it is read through the tree-core interface only (``_snapshot_interface``,
docs/calibration/sglang_hicache_notes.md §8), and what that interface hides is kept in ledgers
of SGLang's own calls into the core: ``host_lock_ref`` (:class:`HostLockLedger`)
and the nodes an in-flight load moves (:class:`LoadLedger`). Both are held to
the Python core's node objects by the smoke tests.

Longer than this project's ~600-line rooms: `SGLangHiCache` mirrors one SGLang class
(`UnifiedRadixCache` + `HybridCacheController`) call for call, and its ack ledgers
(`HostLockLedger`, `LoadLedger`) read its internals at the same points; splitting it would scatter
one engine's facts across modules. Its notes file lists each with its SGLang file:line.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import sys
import tempfile
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from kvcert.conformance.adapters.sglang.env import OrderedSet, import_sglang

__all__ = ["HOST_BUDGET_DEVIATION", "HiCacheConfig", "Match", "SGLangHiCache", "install_cpu_shims"]

SG = import_sglang()
"""SGLang's classes; importing this module fails here, with an install hint, when sglang is missing."""

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.managers import cache_controller as _cc_mod  # noqa: E402
from sglang.srt.mem_cache import base_prefix_cache as _bpc  # noqa: E402
from sglang.srt.mem_cache.pool_host import base as _host_base  # noqa: E402
from sglang.srt.mem_cache.pool_host import mha as _host_mha  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import base as _comp_base  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvcert.conformance.adapters.sglang.storage.stepped import SteppedStorage, stepped_threads  # noqa: E402

FULL = ComponentType.FULL
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LAYOUTS = ("layer_first", "page_first_direct")
CORES = ("python", "rust")

# --------------------------------------------------------------------------- CPU shims

_COPY_SINK: list[Optional[list[Callable[[], None]]]] = [None]
"""Where the transfer shims put their copies: None runs them now, a list defers them (copy_at="ack")."""


def _run_or_defer(copy: Callable[[], None]) -> None:
    sink = _COPY_SINK[0]
    if sink is None:
        copy()
    else:
        sink.append(copy)


def _transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """sgl_kernel.kvcacheio.transfer_kv_direct: per layer tensor [slots, heads, dim], dst[dst_idx] = src[src_idx]."""
    src_idx, dst_idx = src_indices.clone(), dst_indices.clone()

    def copy() -> None:
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst[dst_idx] = src[src_idx]

    _run_or_defer(copy)


def _transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layer-first [2L x (slots, H, D)] -> host page-first-direct k/v [pages, L, page, H, D] (D2H backup)."""
    src_idx, dst_idx = src_indices.clone(), dst_indices.clone()

    def copy() -> None:
        layers = len(src_ptrs) // 2
        host_pages = dst_idx[::page_size] // page_size
        for kv in range(2):
            for layer in range(layers):
                src = src_ptrs[kv * layers + layer]
                dst_ptrs[kv][host_pages, layer] = src[src_idx].view(len(host_pages), page_size, *src.shape[1:])

    _run_or_defer(copy)


def _transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host page-first-direct k/v [pages, L, page, H, D] -> one device layer (slots, H, D) (H2D load)."""
    src_idx, dst_idx = src_indices.clone(), dst_indices.clone()

    def copy() -> None:
        host_pages = src_idx[::page_size] // page_size
        for kv in range(2):
            dst = dst_ptrs[kv]
            dst[dst_idx] = src_ptrs[kv][host_pages, layer_id].reshape(-1, *dst.shape[1:])

    _run_or_defer(copy)


HOST_BUDGET_BYTES = 1 << 30
"""What a host pool's free-memory check books against (`pool_host/base.py`'s `host_memory_budget_scope`, SGLang's own
booking of one budget, as its HiCache auto-sizing does): a cell's host pool is kilobytes, and SGLang's check otherwise
reads the machine's free RAM less a 10 GiB reserve, so a cell would fail on a machine busy with something else."""
HOST_BUDGET_DEVIATION = (
    "host pools: built inside SGLang's host_memory_budget_scope(1 GiB), so the pool's free-memory check books against "
    "that budget instead of the machine's free RAM less SGLang's 10 GiB reserve (a cell's pool is kilobytes)"
)


def install_cpu_shims() -> None:
    """Force unpinned host pools built against a fixed memory budget (`HOST_BUDGET_BYTES`), and bind torch
    equivalents of the direct-io transfer ops; idempotent."""
    if getattr(_host_base.HostKVCache.__init__, "_kvcert_unpinned", False):
        return
    original = _host_base.HostKVCache.__init__

    @functools.wraps(original)
    def unpinned_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False  # pin_memory=True calls cudaHostRegister (pool_host/common.py)
        with _host_base.host_memory_budget_scope(HOST_BUDGET_BYTES):
            original(self, *args, **kwargs)

    unpinned_init._kvcert_unpinned = True  # type: ignore[attr-defined]
    _host_base.HostKVCache.__init__ = unpinned_init  # type: ignore[method-assign]
    # Bound only `if _is_cuda or _is_hip` / `elif _is_xpu` (pool_host/mha.py:60-89): NameError on CPU otherwise.
    _host_mha.transfer_kv_direct = _transfer_kv_direct  # type: ignore[attr-defined]
    _host_mha.transfer_kv_all_layer_direct_lf_pf = _transfer_kv_all_layer_direct_lf_pf  # type: ignore[attr-defined]
    _host_mha.transfer_kv_per_layer_direct_pf_lf = _transfer_kv_per_layer_direct_pf_lf  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- deferred acks


@dataclass
class Op:
    """One merged transfer SGLang submitted: a D2H write-through/back or an H2D load-back."""

    op_id: int
    kind: str  # "write" | "load"
    node_ids: tuple[int, ...]
    released: bool = False
    forced: bool = False
    copies: list[Callable[[], None]] = field(default_factory=list, repr=False)


class _HeldEvent:
    """A finish_event that reports done only once the harness (or a blocking synchronize) releases it."""

    def __init__(self, real: Any, op: Op, owner: SGLangHiCache) -> None:
        self._real, self._op, self._owner = real, op, owner

    def query(self) -> bool:
        return self._op.released

    def synchronize(self) -> None:
        if not self._op.released:  # a blocking wait: on a GPU it returns once the copy is done
            self._op.forced = True
            self._owner.forced.append(self._op.op_id)
            self._owner._release(self._op)
        self._real.synchronize()

    def __getattr__(self, name: str) -> Any:  # record, wait, elapsed_time, ...
        return getattr(self._real, name)


class _AckQueue(list):  # type: ignore[type-arg]
    """Stands in for HiCacheController.ack_{write,load}_queue: every appended ack gets a held finish_event."""

    def __init__(self, owner: SGLangHiCache, kind: str) -> None:
        super().__init__()
        self._owner, self._kind = owner, kind

    def append(self, ack: Any) -> None:
        op = self._owner._new_op(self._kind, ack.node_ids)
        super().append(ack._replace(finish_event=_HeldEvent(ack.finish_event, op, self._owner)))


# --------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class HiCacheConfig:
    """What to build. Capacities are in tokens; the device pool has `device_pages * page_size` slots."""

    page_size: int = 1
    device_pages: int = 16
    host_ratio: float = 2.0
    """Host pool = ratio x device tokens, plus one padding page (pool_host/base.py:219-227)."""
    write_policy: str = "write_through"
    core: str = "python"
    layout: str = "layer_first"
    eviction_policy: str = "lru"
    eviction_policy_config: tuple[tuple[str, int], ...] = ()
    """--radix-eviction-policy-config as (key, value) pairs; () passes none (each parameter's SGLang default)."""
    layer_num: int = 2
    head_num: int = 1
    head_dim: int = 4
    copy_at: str = "submit"
    """"submit": bytes move at submission (the CPU truth); "ack": only when the op completes."""
    auto_submit: bool = True
    """Submit queued writes after insert and queued loads after init_load_back, as the scheduler does."""
    storage_dir: Optional[str] = None
    """Attach the L3 `file` backend at this directory (starts SGLang's storage threads)."""
    file_backend: bool = False
    """Stepped storage over SGLang's own `file` backend (HiCacheFile) in a temporary directory, not the bridge."""
    stepped_storage: bool = False
    """Attach L3 with SGLang's storage threads stepped by the driver
    (:class:`~kvcert.conformance.adapters.sglang.storage.stepped.SteppedStorage`, at :attr:`SGLangHiCache.l3`):
    over a bridge to a kvcert store, or with ``storage_dir`` set, over SGLang's own `file` backend there."""
    prefetch_policy: str = "best_effort"
    """hicache_storage_prefetch_policy: best_effort | wait_complete | timeout."""
    kv_events: bool = False
    """--kv-events-config: the cache records KV events (`CacheInitParams.enable_kv_cache_events`)."""
    prefetch_timeout: tuple[float, float] = (4.0, 1.0)
    """timeout policy: (base, per page), in ticks of the driver's logical clock."""
    model_id: str = "kvcert-synthetic"
    """Stepped storage: the model id of the spec's compatibility digest (page keys)."""
    host_tier: bool = True
    """False: a device-only UnifiedRadixCache (``init_hicache`` is not called; no host pool, no copies)."""


class Match(NamedTuple):
    device_len: int
    host_hit_len: int
    last_device_node: int
    last_host_node: int
    """Also the best match (unified_tree_core.py:1039-1041): the anchor init_load_back wants."""


class _Req:
    """The fields init_load_back / load_back read off a Req (FULL-only tree)."""

    def __init__(self, last_node: int) -> None:
        self.rid = "kvcert"
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.kv = type("Kv", (), {"mamba_pool_idx": None})()


_PRETTY = re.compile(r"^( *)\[(\d+)\] (\d+) full_lock=(-?\d+) (?:Full|full)=(yes|no)")


class SGLangHiCache:
    """One UnifiedRadixCache with HiCache over real CPU pools; nodes are SGLang NodeIds."""

    def __init__(self, config: HiCacheConfig = HiCacheConfig()) -> None:
        if config.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        if config.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        if config.core not in CORES:
            raise ValueError(f"core must be one of {CORES}")
        install_cpu_shims()
        self.config = config
        self.page_size = config.page_size
        self.capacity = config.device_pages * config.page_size
        self.ops: dict[int, Op] = {}
        self.forced: list[int] = []
        """Ops a blocking synchronize completed before the harness did."""
        self._locks: dict[int, tuple[str, int, Any]] = {}
        self._next_lock = 0
        self._next_op = 0
        self._node_counter = 0
        self._time_counter = _comp_base.float64(1.0)  # the module's initial value
        self._uuid_counters: dict[Any, int] = {
            ct: (i + 1) * _comp_base._COMPONENT_UUID_RANGE_SIZE
            for ct, i in _comp_base._COMPONENT_UUID_RANGE_INDEX.items()
        }
        self._op_counter = 0
        self._inserted: dict[Optional[str], set[tuple[int, ...]]] = {}
        """Every key inserted, per namespace: the candidates for the tokens of a node (_snapshot_interface)."""
        self._paths: dict[int, tuple[Optional[str], tuple[int, ...]]] = {}
        """Interface reader: node id -> (namespace, its root path), once learned (a node's path never changes)."""
        if config.stepped_storage and config.storage_dir is None:
            config = dataclasses.replace(config, storage_dir="")  # SGLang builds `file` first; the bridge replaces it
            self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix="kvcert-hicache-") if config.storage_dir == "" else None
        storage_dir = self._tmp.name if self._tmp is not None else config.storage_dir

        self.args = ServerArgs(
            model_path="dummy",
            device="cpu",
            page_size=config.page_size,
            enable_hierarchical_cache=config.host_tier,
            hicache_ratio=config.host_ratio,
            hicache_io_backend="direct",
            hicache_mem_layout=config.layout,
            hicache_write_policy=config.write_policy,
            hicache_storage_backend="file" if storage_dir is not None else None,
            file_storage_path=storage_dir,
            hicache_storage_prefetch_policy=config.prefetch_policy,
            # The operator's knob (SGLang's default is 256 tokens): prefetch a request of one page or more.
            hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": config.page_size}),
            radix_eviction_policy=config.eviction_policy,
            radix_eviction_policy_config=dict(config.eviction_policy_config) or None,
        )
        self.kv_pool = SG.MHATokenToKVPool(
            size=self.capacity,
            page_size=config.page_size,
            dtype=torch.float32,
            head_num=config.head_num,
            head_dim=config.head_dim,
            layer_num=config.layer_num,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        if config.page_size == 1:
            self.allocator = SG.TokenToKVPoolAllocator(
                self.capacity, dtype=torch.float32, device="cpu", kvcache=self.kv_pool, need_sort=False
            )
        else:
            self.allocator = SG.PagedTokenToKVPoolAllocator(
                self.capacity,
                config.page_size,
                dtype=torch.float32,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=False,
            )
        self.params = SG.CacheInitParams(
            disable=False,
            req_to_token_pool=None,  # only request-level helpers read it
            token_to_kv_pool_allocator=self.allocator,
            page_size=config.page_size,
            eviction_policy=config.eviction_policy,
            eviction_policy_config=dict(config.eviction_policy_config) or None,
            tree_components=(FULL,),
            tree_core_backend=config.core,
            enable_kv_cache_events=config.kv_events,
        )
        with self._in_sglang():
            # Process-global: the last published ServerArgs wins for every cache in the process.
            runtime_context.publish(self.args, role="scheduler")
            if storage_dir is not None:
                # Without it the L3 path fails: "parallel name 'tp_rank' has not been written". Permanent, as
                # the storage threads read it too.
                runtime_context.get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
            self.cache = UnifiedRadixCache(self.params)
            if config.host_tier:
                with stepped_threads() if config.stepped_storage else contextlib.nullcontext():
                    self.cache.init_hicache(self.args, self.params)
        self.is_rust = type(self.cache.tree_core).__name__.startswith("Rust")
        if not self.is_rust:
            # Sets of nodes hashed by address: eviction heapifies them in set order, so equal-rank candidates
            # would leave in an order that changes from process to process. Insertion order is one a set could give.
            core = self.cache.tree_core
            core.evictable_device_leaves = OrderedSet(core.evictable_device_leaves)
            core.evictable_host_leaves = OrderedSet(core.evictable_host_leaves)
        self.host_lock_ledger = HostLockLedger(self.cache.tree_core)
        """host_lock_ref as SGLang's own inc/dec_host_lock_ref calls leave it (the Rust core hides the counter)."""
        self.load_ledger = LoadLedger(self.cache.tree_core)
        """The nodes each in-flight load moves (its ack names only the anchor)."""
        self.l3: Optional[SteppedStorage] = None
        """The stepped L3 path (``stepped_storage``); None otherwise."""
        if not config.host_tier:
            return
        # init_hicache registers cache.shutdown with atexit (unified_radix_cache.py:577), which pins every
        # cache (and its host pool) for the life of the process; the driver owns shutdown instead.
        atexit.unregister(self.cache.shutdown)
        self.cc = self.cache.cache_controller
        self.host_pool = self.cc.mem_pool_host
        self.cc.ack_write_queue = _AckQueue(self, "write")
        self.cc.ack_load_queue = _AckQueue(self, "load")
        if config.stepped_storage:
            self.l3 = SteppedStorage(
                self,
                self.cache,
                config.page_size,
                config.layer_num,
                config.model_id,
                bridge=not (config.storage_dir or config.file_backend),
            )
            self.cache.prefetch_stop_policy = config.prefetch_policy
            assert self.cache.prefetch_threshold == config.page_size, "the extra config's prefetch_threshold"
            self.cache.prefetch_timeout_base, self.cache.prefetch_timeout_per_page = config.prefetch_timeout

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _in_sglang(self) -> Iterator[None]:
        """Run SGLang on this driver's id/time/uuid/op counters; defer copies when copy_at="ack"."""
        node_cls = _comp_base_node_cls()
        saved = (
            node_cls.counter,
            _comp_base._LAST_ACCESS_TIME_COUNTER_FLOAT,
            dict(_comp_base._COMPONENT_UUID_COUNTERS),
            _cc_mod.CacheOperation.counter,
            _COPY_SINK[0],
        )
        node_cls.counter = self._node_counter
        _comp_base._LAST_ACCESS_TIME_COUNTER_FLOAT = self._time_counter
        _comp_base._COMPONENT_UUID_COUNTERS.clear()
        _comp_base._COMPONENT_UUID_COUNTERS.update(self._uuid_counters)
        _cc_mod.CacheOperation.counter = self._op_counter
        _COPY_SINK[0] = [] if self.config.copy_at == "ack" else None
        try:
            yield
        finally:
            self._node_counter = node_cls.counter
            self._time_counter = _comp_base._LAST_ACCESS_TIME_COUNTER_FLOAT
            self._uuid_counters = dict(_comp_base._COMPONENT_UUID_COUNTERS)
            self._op_counter = _cc_mod.CacheOperation.counter
            leftover = _COPY_SINK[0]
            node_cls.counter, _comp_base._LAST_ACCESS_TIME_COUNTER_FLOAT = saved[0], saved[1]
            _comp_base._COMPONENT_UUID_COUNTERS.clear()
            _comp_base._COMPONENT_UUID_COUNTERS.update(saved[2])
            _cc_mod.CacheOperation.counter, _COPY_SINK[0] = saved[3], saved[4]
            assert not leftover, "a transfer ran outside a submission that records an ack"

    def _new_op(self, kind: str, node_ids: Sequence[int]) -> Op:
        op = Op(self._next_op, kind, tuple(int(n) for n in node_ids))
        sink = _COPY_SINK[0]
        if sink is not None:  # the copies this submission just made belong to this op
            op.copies, sink[:] = list(sink), []
        self.ops[op.op_id] = op
        self._next_op += 1
        return op

    def _release(self, op: Op) -> None:
        op.released = True
        copies, op.copies = op.copies, []
        for copy in copies:
            copy()

    def _key(self, ns: Optional[str], tokens: Sequence[int]) -> Any:
        return RadixKey(array("q", tokens), extra_key=ns)

    def _tensor(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64)

    # ------------------------------------------------------------------ pools

    def alloc(self, n: int) -> list[int]:
        """Device slots from the real allocator (n a multiple of page_size for paged allocators)."""
        out = self.allocator.alloc(n)
        if out is None:
            raise MemoryError(f"device allocator has no {n} free slots")
        return [int(x) for x in out.tolist()]

    def free(self, slots: Sequence[int]) -> None:
        if slots:
            self.allocator.free(self._tensor(slots))

    def write_kv(self, slots: Sequence[int], seed: int) -> None:
        """Fill device K/V of `slots` with distinct values (what a forward pass would write)."""
        idx = self._tensor(slots)
        for layer in range(self.config.layer_num):
            for kv, buf in enumerate((self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer])):
                n = len(idx) * buf[0].numel()
                base = float(seed * 1000 + layer * 100 + kv * 10)
                buf[idx] = (torch.arange(n, dtype=buf.dtype) + base).view(len(idx), *buf.shape[1:])

    def read_device_kv(self, slots: Sequence[int]) -> torch.Tensor:
        """[2, layers, len(slots), heads, dim] K/V of device slots."""
        idx = self._tensor(slots)
        return torch.stack(
            [
                torch.stack([self.kv_pool.k_buffer[layer][idx] for layer in range(self.config.layer_num)]),
                torch.stack([self.kv_pool.v_buffer[layer][idx] for layer in range(self.config.layer_num)]),
            ]
        ).clone()

    def read_host_kv(self, slots: Sequence[int]) -> torch.Tensor:
        """[2, layers, len(slots), heads, dim] K/V of host slots, whatever the host layout."""
        idx = self._tensor(slots)
        hp = self.host_pool
        if hp.layout == "layer_first":  # kv_buffer [2, L, size, H, D]
            return hp.kv_buffer[:, :, idx].clone()
        # page_first_direct: kv_buffer [2, pages, L, page, H, D]
        ps = self.page_size
        return hp.kv_buffer.permute(0, 2, 1, 3, 4, 5)[:, :, idx // ps, idx % ps].clone()

    def device_free(self) -> int:
        return int(self.allocator.available_size())

    def host_free(self) -> int:
        return int(self.host_pool.available_size()) if self.config.host_tier else 0

    # ------------------------------------------------------------------ cache ops

    def insert(
        self, ns: Optional[str], tokens: Sequence[int], slots: Sequence[int], protected: int = 0
    ) -> tuple[int, int]:
        """Insert tokens -> device slots; returns (prefix_len, last_device_node).

        The unified cache frees the duplicate slots of the matched prefix itself (unlike RadixCache), past the
        first `protected` (a running request's prefix, the tree's own slots: `prev_prefix_len`).
        """
        params = SG.InsertParams(key=self._key(ns, tokens), value=self._tensor(slots), prev_prefix_len=protected)
        with self._in_sglang():
            res = self.cache.insert(params)
            if self.config.auto_submit:
                self.cache.flush_pending_backups()
        self._inserted.setdefault(ns, set()).add(tuple(int(t) for t in tokens))
        return int(res.prefix_len), int(res.last_device_node)

    def match_prefix(self, ns: Optional[str], tokens: Sequence[int]) -> Match:
        """Longest cached prefix; may split a node (and touch LRU stamps) as a side effect."""
        with self._in_sglang():
            res = self.cache.match_prefix(SG.MatchPrefixParams(key=self._key(ns, tokens)))
        self.last_match = res
        return Match(
            int(res.device_prefix_len), int(res.host_hit_length), int(res.last_device_node), int(res.last_host_node)
        )

    def device_slots(self, node_id: int) -> list[int]:
        """Device slots root..node (what prefix_device_indices gives a request)."""
        with self._in_sglang():
            return [int(x) for x in self.cache.path_device_indices(node_id).tolist()]

    def inc_lock_ref(self, node_id: int) -> int:
        """Lock root..node; returns a handle for dec_lock_ref (the unified tree wants its receipt back)."""
        with self._in_sglang():
            receipt = self.cache.inc_lock_ref(node_id).to_dec_params()
        return self._remember_lock("device", node_id, receipt)

    def inc_host_lock_ref(self, node_id: int) -> int:
        with self._in_sglang():
            receipt = self.cache.inc_host_lock_ref(node_id).to_dec_params()
        return self._remember_lock("host", node_id, receipt)

    def _remember_lock(self, kind: str, node_id: int, receipt: Any) -> int:
        handle = self._next_lock
        self._next_lock += 1
        self._locks[handle] = (kind, node_id, receipt)
        return handle

    def dec_lock_ref(self, handle: int) -> None:
        kind, node_id, receipt = self._locks.pop(handle)
        with self._in_sglang():
            if kind == "device":
                self.cache.dec_lock_ref(node_id, receipt)
            else:
                self.cache.dec_host_lock_ref(node_id, receipt)

    def evict(self, n: int) -> int:
        """Device eviction of n tokens (demote backed-up leaves, drop or write back the rest)."""
        with self._in_sglang():
            return int(self.cache.evict(SG.EvictParams(num_tokens=n)).num_tokens_evicted)

    def evict_host(self, n: int) -> int:
        with self._in_sglang():
            return int(self.cache.evict_host(n))

    def init_load_back(
        self, node_id: int, host_hit_len: int, mem_quota: Optional[int] = None, last_device: Optional[int] = None
    ) -> tuple[int, int]:
        """Scheduler's load-back entry: returns (tokens loaded, new last device node).

        `node_id` is the match's last_host_node (= best match); the request's `last_node` is
        `last_device`, by default the device anchor of the most recent match_prefix, as the scheduler sets it.
        """
        if last_device is None:
            last_device = int(self.last_match.last_device_node) if hasattr(self, "last_match") else node_id
        params = _bpc.InitLoadBackParams(
            best_match_node=node_id, host_hit_length=host_hit_len, mem_quota=mem_quota, req=_Req(last_device)
        )
        with self._in_sglang():
            out = self.cache.init_load_back(params)
            if self.config.auto_submit:
                self.cache.ready_to_load_host_cache()
        assert out is not None  # only buffer mode returns None
        return int(out[0]), int(out[1])

    def submit(self) -> None:
        """Submit queued D2H writes and H2D loads (flush_pending_backups + ready_to_load_host_cache)."""
        with self._in_sglang():
            self.cache.flush_pending_backups()
            self.cache.ready_to_load_host_cache()

    def complete(self, op_id: int, poll: bool = True) -> None:
        """Let op `op_id`'s transfer finish; with poll, run the scheduler's per-step check_hicache_events."""
        op = self.ops[op_id]
        if not op.released:
            self._release(op)
        if poll:
            self.poll()

    def poll(self) -> None:
        """check_hicache_events: flush pending backups, consume ready acks front to back (FIFO)."""
        with self._in_sglang():
            self.cache.check_hicache_events()

    def pending(self) -> list[int]:
        """Op ids whose acks SGLang has not consumed yet, oldest first."""
        if not self.config.host_tier:
            return []
        live = [ack.finish_event._op.op_id for ack in (*self.cc.ack_write_queue, *self.cc.ack_load_queue)]
        return sorted(live)

    def copies(self, parents: Optional[dict[int, int]] = None) -> list[tuple[int, str, tuple[int, ...], bool]]:
        """Unconsumed acks, oldest first: (op id, "write" | "load", the nodes the copy moves, finished).

        A write ack's ``node_ids`` are write-through ack ids; the nodes are SGLang's own
        ``ongoing_write_through[ack_id].publish_node_ids`` (ancestors first, rewritten by SGLang on a split).
        A load ack's ``node_ids`` are anchors; the nodes come from :class:`LoadLedger`. `parents` (id ->
        parent id, root absent) saves a tree read.
        """
        if not self.config.host_tier:
            return []
        if parents is None:
            parents = {nid: v["parent"] for nid, v in self.nodes().items() if v["parent"] is not None}
        out = []
        for ack in self.cc.ack_write_queue:
            nodes: list[int] = []
            for ack_id in ack.node_ids:
                pending = self.cache.ongoing_write_through.get(ack_id)
                nodes += [int(ack_id)] if pending is None else [int(n) for n in pending.publish_node_ids]
            op = ack.finish_event._op
            out.append((op.op_id, "write", tuple(nodes), op.released))
        anchors: set[int] = set()
        for ack in self.cc.ack_load_queue:
            nodes = []
            for anchor in ack.node_ids:
                anchors.add(int(anchor))
                nodes += self.load_ledger.nodes(int(anchor), parents)
            op = ack.finish_event._op
            out.append((op.op_id, "load", tuple(nodes), op.released))
        self.load_ledger.forget_except(anchors)
        return sorted(out)

    def sanity_check(self) -> None:
        with self._in_sglang():
            self.cache.sanity_check()

    def close(self) -> None:
        """Stop storage threads and free host pools (once: a second call does nothing)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.l3 is not None:
            self.l3.close()
        with contextlib.suppress(Exception):
            self.cache.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view of the tree and pools.

        nodes: id -> {parent, namespace, key, device, host, lock_ref, host_lock_ref, backed_up, hash,
        last_access_time, hit_count, in_flight}; see :meth:`nodes`. copies: see :meth:`copies`.
        """
        nodes = self.nodes()
        parents = {nid: v["parent"] for nid, v in nodes.items() if v["parent"] is not None}
        writes = {int(n): ack for ack, wt in self.cache.ongoing_write_through.items() for n in wt.publish_node_ids}
        loads = {int(n) for n in self.cache.ongoing_load_back}
        for nid, view in nodes.items():
            view["in_flight"] = "write" if nid in writes else "load" if nid in loads else None
        return {
            "page_size": self.page_size,
            "root": int(self.cache.root_node_handle()),
            "nodes": nodes,
            "device_free": self.device_free(),
            "host_free": self.host_free(),
            "evictable_size": int(self.cache.evictable_size()),
            "protected_size": int(self.cache.protected_size()),
            "pending_ops": self.pending(),
            "copies": self.copies(parents),
        }

    def nodes(self) -> dict[int, dict[str, Any]]:
        """Every node of the tree: the Python core's node objects, or the Rust core through its interface.

        Python core: read off the node objects (:meth:`_snapshot_python`). Rust core: the backend-neutral
        reader :meth:`_snapshot_interface` (node objects do not exist there); it reports
        ``host_lock_ref`` from the host-lock ledger and ``last_access_time`` / ``hit_count`` as None.
        """
        return self._snapshot_interface() if self.is_rust else self._snapshot_python()

    def _snapshot_python(self) -> dict[int, dict[str, Any]]:
        core = self.cache.tree_core
        out: dict[int, dict[str, Any]] = {}
        stack = [core.root_node]
        while stack:
            node = stack.pop()
            cd = node.component_data[FULL]
            out[int(node.id)] = {
                "parent": None if node.parent is None else int(node.parent.id),
                "namespace": node.key.extra_key,
                "key": tuple(int(t) for t in node.key.raw_token_ids()),
                "device": None if cd.value is None else [int(x) for x in torch.as_tensor(cd.value).tolist()],
                "host": None if cd.host_value is None else [int(x) for x in cd.host_value.tolist()],
                "lock_ref": int(cd.lock_ref),
                "host_lock_ref": int(cd.host_lock_ref),
                "backed_up": bool(node.backuped),
                "hash": list(node.hash_value) if node.hash_value else None,
                "last_access_time": float(node.last_access_time),
                "hit_count": int(node.hit_count),
                "tlru_history_len": int(node._tlru_history_len),  # T-LRU's branch high-water depth (0 otherwise)
            }
            stack.extend(reversed(list(node.children.values())))
        return out

    def _pretty(self) -> str:
        """The tree core's pretty_print: Rust writes to fd 1, Python through print()."""
        sys.stdout.flush()
        captured = io.StringIO()
        with tempfile.TemporaryFile(mode="w+b") as tmp:
            saved = os.dup(1)
            try:
                os.dup2(tmp.fileno(), 1)
                with contextlib.redirect_stdout(captured):
                    self.cache.tree_core.pretty_print()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            tmp.seek(0)
            return tmp.read().decode() + captured.getvalue()

    def _snapshot_interface(self) -> dict[int, dict[str, Any]]:
        """The tree read through the tree-core interface only (what the Rust core offers); see NOTES §8.

        * ids, tree order and the FULL ``lock_ref``: ``pretty_print`` (the only enumerator; ``full_lock=``);
        * parent and the node's span on its root path: ``collect_path_info``;
        * device slots: ``get_component_device_value(id, FULL)`` (None when evicted; unlike
          ``collect_full_device_indices`` it does not panic on an evicted node, hazard H4);
        * backed up, host slots and, for a backed-up node, its own tokens: ``is_backuped`` and
          ``build_storage_backup_spec`` (host_value, token_ids);
        * namespace: ``prefetch_anchor_info`` (the key's extra_key);
        * tokens of a node that is not backed up (it is on the device, and so is its whole path): the
          candidates are the keys this driver inserted; a candidate is accepted only when the core's own
          read-only ``match_full_device_prefix`` walks it to exactly this node and this depth. A node's
          root path never changes (a split gives the prefix a new id), so it is cached per id.
        * ``host_lock_ref``: not exposed by the Rust core; taken from :attr:`host_lock_ledger`.
        """
        core = self.cache.tree_core
        root = int(core.root_node_handle())
        listed: list[tuple[int, int]] = []  # (id, lock_ref) in pretty_print (preorder) order
        for line in self._pretty().splitlines():
            m = _PRETTY.match(line)
            if m is not None:
                listed.append((int(m.group(2)), int(m.group(4))))
        ids = [nid for nid, _ in listed]
        assert ids and ids[0] == root, f"pretty_print does not start at the root {root}: {ids[:3]}"
        # Only ids pretty_print listed are queried: a Rust panic on a bad id poisons the core (H4).
        spans = {int(i.node_id): i for path in core.collect_path_info(ids[1:]) for i in path}
        host_refs = self.host_lock_ledger.counts({nid: int(spans[nid].parent_id) for nid in ids[1:]})
        self._paths = {nid: p for nid, p in self._paths.items() if nid in spans}
        out: dict[int, dict[str, Any]] = {}
        for nid, lock_ref in listed:
            view: dict[str, Any] = {
                "parent": None,
                "namespace": None,
                "key": (),
                "device": [],
                "host": None,
                "lock_ref": lock_ref,
                "host_lock_ref": host_refs.get(nid, 0),
                "backed_up": False,
                "hash": None,
                "last_access_time": None,  # not exposed by the Rust core
                "hit_count": None,  # not exposed by the Rust core
                "tlru_history_len": None,  # not exposed by the Rust core
            }
            out[nid] = view
            if nid == root:
                continue
            info = spans[nid]
            parent, start, end = int(info.parent_id), int(info.path_start), int(info.path_end)
            view["parent"] = parent
            view["namespace"] = core.prefetch_anchor_info(nid)[0]
            value = core.get_component_device_value(nid, FULL)
            view["device"] = None if value is None else [int(x) for x in value.tolist()]
            assert (value is None) == (info.full_value_len is None), (nid, info)
            view["backed_up"] = bool(core.is_backuped(nid))
            hashes = core.get_hash_values(nid)
            view["hash"] = list(hashes) if hashes else None
            own: Optional[tuple[int, ...]] = None
            if view["backed_up"]:
                spec = core.build_storage_backup_spec(nid, False)
                view["host"] = [int(x) for x in spec.host_value.tolist()]
                own = tuple(int(t) for t in spec.token_ids)
            view["key"] = self._node_key(nid, view["namespace"], parent, root, start, end, own)
        return out

    def _node_key(
        self,
        nid: int,
        ns: Optional[str],
        parent: int,
        root: int,
        start: int,
        end: int,
        own: Optional[tuple[int, ...]],
    ) -> tuple[int, ...]:
        """The node's own tokens (path[start:end]); learns and caches its root path (see _snapshot_interface)."""
        known = self._paths.get(nid)
        if known is not None:
            assert known[0] == ns and len(known[1]) == end, (nid, known, ns, end)
            key = known[1][start:end]
            assert own is None or own == key, f"node {nid}: backup tokens {own} != learned {key}"
            return key
        prefix: tuple[int, ...] = () if parent == root else self._paths[parent][1]
        assert len(prefix) == start, (nid, parent, len(prefix), start)
        if own is not None:
            assert len(own) == end - start, (nid, own, start, end)
            self._paths[nid] = (ns, prefix + own)
            return own
        # Its path is a prefix of a key the trace inserted, or of a path learned before: a node split off the
        # top of a node that came from storage (a prefetch; no Insert names its tokens) and lost its host copy.
        known_keys = self._inserted.get(ns, set()) | {p for pns, p in self._paths.values() if pns == ns}
        for cand in sorted({k[start:end] for k in known_keys if len(k) >= end and k[:start] == prefix}):
            path = prefix + cand
            matched, node, _ = self.cache.tree_core.match_full_device_prefix(self._key(ns, path))
            if int(matched) == end and int(node) == nid:
                self._paths[nid] = (ns, path)
                return cand
        raise AssertionError(f"the tokens of node {nid} ({ns!r}, span {start}:{end}) match no inserted key")


class _Segment:
    """Contiguous nodes on one anchor's root path, anchor first: a host lock's segment, or what a load moves.

    Splits keep the deeper half's id and put a fresh node above it, with the same state (lock counts,
    pending ids): a split inside the segment lands between anchor and top, and a split of the top node
    puts a node directly above the top that was not on the anchor's path before. :meth:`update` takes
    both in; nothing else can add a node to a locked, in-flight path (evicting it is refused).
    """

    __slots__ = ("anchor", "nodes", "chain")

    def __init__(self, anchor: int, nodes: Sequence[int], chain: Sequence[int]) -> None:
        self.anchor = anchor
        self.nodes = list(nodes)
        """Anchor first; the last one is the top (a host lock's boundary, the node holding its uuid)."""
        self.chain = set(chain)
        """Ids on the anchor's root path when the segment was last brought up to date."""

    def update(self, parents: dict[int, int]) -> list[int]:
        """Bring the segment up to date with the tree (`parents`: id -> parent id, root absent)."""
        assert self.anchor in parents, f"segment anchor {self.anchor} left the tree"
        top, nodes, cur = self.nodes[-1], [self.anchor], self.anchor
        while cur != top:  # nodes split off inside the segment lie between anchor and top
            cur = parents[cur]
            assert cur in parents, f"segment top {top} is not above anchor {self.anchor}"
            nodes.append(cur)
        while parents[cur] in parents and parents[cur] not in self.chain:  # split off the top
            cur = parents[cur]
            nodes.append(cur)
        chain, node = set(), self.anchor
        while node in parents:
            chain.add(node)
            node = parents[node]
        self.nodes, self.chain = nodes, chain
        return nodes


def _root_path(core: Any, node_id: int) -> list[int]:
    """Ids root-excluded, root first, on the path to `node_id` (collect_path_info: read-only on both cores)."""
    return [int(i.node_id) for i in core.collect_path_info([node_id])[0]]


class HostLockLedger:
    """``host_lock_ref`` per node, derived from the host locks SGLang takes and releases on the tree core.

    The Rust core keeps ``host_lock_ref`` but has no accessor for it (not in ``pretty_print``, no getter;
    see NOTES §8). The ledger wraps the core's ``inc_host_lock_ref`` / ``dec_host_lock_ref`` (every caller,
    load-back and L3, goes through them) and applies the FULL component's segment rule
    (``components/full.py`` acquire/release/``redistribute_on_node_split``, which the Rust port mirrors: same
    receipts, same uuid boundary, same "release hit host_lock_ref=0" message):

    * a lock is taken iff the receipt names a FULL host uuid; it covers its anchor only;
    * a split copies ``host_lock_ref`` to the new parent and moves the boundary uuid there, so a node that
      appears directly above a segment's boundary (i.e. between it and its old parent) joins the segment;
    * a release walks anchor -> boundary, so it removes the lock from every node of its segment.

    Checked against the Python core's real counters (tests/test_sglang_hicache_smoke.py).
    """

    def __init__(self, core: Any) -> None:
        self.locks: list[tuple[int, _Segment]] = []
        """(receipt uuid, segment) of every host lock taken and not released, oldest first."""
        inc, dec = core.inc_host_lock_ref, core.dec_host_lock_ref
        # A prefetch anchored at the root host-locks it (the Rust core mints a uuid for it): not a segment.
        root = int(core.root_node_handle())

        def inc_host_lock_ref(node_id: int) -> Any:
            result = inc(node_id)
            uuid = result.component_host_lock_uuids.get(FULL)
            if uuid is not None and int(node_id) != root:
                self.locks.append((int(uuid), _Segment(int(node_id), [int(node_id)], _root_path(core, node_id))))
            return result

        def dec_host_lock_ref(node_id: int, params: Any) -> Any:
            result = dec(node_id, params)
            uuid = params.component_host_lock_uuids.get(FULL)
            if uuid is not None and int(node_id) != root:
                for i, (held, segment) in enumerate(self.locks):
                    if segment.anchor == int(node_id) and held == int(uuid):
                        del self.locks[i]
                        break
                else:
                    raise AssertionError(f"host lock release on {node_id} (uuid {uuid}) that the ledger never saw")
            return result

        core.inc_host_lock_ref = inc_host_lock_ref
        core.dec_host_lock_ref = dec_host_lock_ref

    def counts(self, parents: dict[int, int]) -> dict[int, int]:
        """host_lock_ref of every node that has one (`parents`: id -> parent id, root absent)."""
        out: dict[int, int] = {}
        for _, segment in self.locks:
            for node in segment.update(parents):
                out[node] = out.get(node, 0) + 1
        return out


class LoadLedger:
    """The nodes each in-flight load-back moves, by anchor.

    SGLang's load ack names only the anchor (``HiCacheAck.node_ids``). The nodes are the transfer's
    ``nodes_to_load`` (``tree_core.commit_load_back(anchor, ..., kv_xfer, ...)``, recorded by a wrapper)
    plus the fragments later splits cut from them (:class:`_Segment`); that is the set ``finish_load_back``
    walks ("split fragments stay on the path") and, under write_back, the nodes pinned with
    ``load_back_pending_id`` (checked against the Python core).
    """

    def __init__(self, core: Any) -> None:
        self.loads: dict[int, _Segment] = {}
        commit = core.commit_load_back

        def commit_load_back(node_id: int, device_indices: Any, kv_xfer: Any, comp_xfers: Any) -> Any:
            result = commit(node_id, device_indices, kv_xfer, comp_xfers)
            chain = _root_path(core, node_id)
            moved = {int(n) for n in kv_xfer.nodes_to_load or ()}
            nodes = [n for n in reversed(chain) if n in moved]
            assert nodes and nodes[0] == int(node_id) and nodes == list(reversed(chain))[: len(nodes)], (
                f"load of {node_id}: nodes_to_load {sorted(moved)} are not the bottom of its path {chain}"
            )
            self.loads[int(node_id)] = _Segment(int(node_id), nodes, chain)
            return result

        core.commit_load_back = commit_load_back

    def nodes(self, anchor: int, parents: dict[int, int]) -> list[int]:
        segment = self.loads.get(anchor)
        return [anchor] if segment is None else segment.update(parents)

    def forget_except(self, anchors: set[int]) -> None:
        for anchor in [a for a in self.loads if a not in anchors]:
            del self.loads[anchor]


def _comp_base_node_cls() -> Any:
    """UnifiedTreeNode (its class-wide id counter); imported lazily to keep the module import light."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeNode

    return UnifiedTreeNode
