"""The priority-aware ("ref-aware") SGLang fork's device-only `RefAwareRadixCache` (base 0.5.10).

    .venv-refaware/bin/kvcert certify kvcert.conformance.adapters.refaware.radix:factory
    .venv-refaware/bin/kvcert certify kvcert.conformance.adapters.refaware.radix:factory_priority
    (and :factory_priority_moves, :factory_priority_class_moves, :factory_priority_default_scope)

Runs only in the fork's own environment (`scripts/install_refaware.sh` builds `.venv-refaware`;
`refaware.env` installs the CPU shims). Standalone on purpose: `sglang_radix.py` imports SGLang
0.5.23 through `_sglang_env.import_sglang()`, and 0.5.10's API differs where an adapter touches it
(no `checkpoint`, `insert` returns no node, no `path_device_indices`, no `get_all_free_pages`, no
page-aligning `insert`). Only version-free helpers are shared: `OrderedSet` (`sglang.env`, plain
Python) and the KV geometry (`kit.kv`).

The adapter only translates: real `MHATokenToKVPool` + `TokenToKVPoolAllocator` (page 1) or
`PagedTokenToKVPoolAllocator` (page > 1) on CPU, a real `RefAwareRadixCache`, no input checking.

* `factory`: the plain device ops (SPEC.md §4); `priority_refs=False`, so no session is ever
  registered and every node is in the UNUSED tier. `evict(n)` is the fork's plain `evict`.
* `factory_priority`: also SPEC.md §11 on the fork's calls. `register_ref(session, node, p)` is
  `register_ref(req)` with `req.rid = session`, `req.priority = p`, `req.last_node = node` (the
  root: a request with no committed tokens, which registers the session on no node);
  `update_ref` / `release_ref` are the fork's by rid; `evict(n, allow_low, allow_high)` is the
  fork's `evict` inside `scoped_evict(allow_low, allow_high)` (also for the full scope: the fork's
  own default is `(True, False)`); the snapshot reports every node's `high_ref` / `low_ref`, the
  fork's three tier counters as `tier_evictable`, and each rid as a session ending at the deepest
  node the fork tracks for it, in the order of the adapter's own `register_ref` calls (the fork keeps
  none that it uses: R9). The fork's device cache plans no admission (its scheduler does,
  `schedule_policy.py`): `plan_admission` runs SPEC.md §11.5 (`kvcert.spec.admission`) over the
  fork's own counters (free slots, `evictable_size_by_tier`). Where the fork and §11 differ is
  recorded in docs/calibration/refaware.md, not translated away.
* `factory_priority_moves`: as `factory_priority`, except that registering a session again releases
  it first (the composition a scheduler would use to move a session), to reach the differences
  that the fork's re-registration (docs/calibration/refaware.md R1, R2) otherwise hides.
* `factory_priority_class_moves`: releases first only when the class changes (past R1, to R2).
* `factory_priority_default_scope`: as `factory_priority`, except that SPEC.md's plain `evict(n)` is
  the fork's plain `evict`, whose scope is `(True, False)` (docs/calibration/refaware.md R3).

Determinism. The fork stamps nodes with `time.monotonic()` and numbers them from the process-wide
`TreeNode.counter`; while (and only while) a call into the fork runs, the adapter swaps the `time`
global of `sglang.srt.mem_cache.radix_cache` for its logical clock (the last `set_clock`) and
`TreeNode.counter` for its own, as `sglang.radix` does. The fork keeps candidate leaves in three
`set`s of TreeNodes (`unused/low_ref/high_ref_evictable_leaves`) plus the base `evictable_leaves`,
and each rid's nodes in `RefInfo.nodes`, all hashed by address: eviction heapifies a leaf set in
set order (ties between equal ranks), and `release_ref` / `update_ref` walk `RefInfo.nodes`, which
decides the order leaves enter the tier sets. The four leaf sets become insertion-ordered
(`OrderedSet`) at construction, and during each call `ref_aware_cache_core.RefInfo` is swapped
for a subclass whose `nodes` is an `OrderedSet`. `TreeNode.tracked_rids` (a set of rid strings)
stays a set: it is only iterated to discard or to add one node to each rid's own set, where order
does not matter. Not thread-safe: one call into the fork at a time.

KV bytes (SPEC.md §9.12): the pool has the spec's geometry (`kit.kv`); the harness writes
each request's KV into its slots and reads every cached slot back after every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.kit.cpu import OrderedSet
from kvcert.conformance.adapters.kit.kv import (
    HEAD_DIM,
    HEAD_NUM,
    KV_DTYPE,
    read_pool,
    write_pool,
)
from kvcert.conformance.adapters.kit.radix import LogicalTime, RadixTreeAdapter, radix_capabilities
from kvcert.conformance.adapters.refaware.env import REFAWARE_SGLANG_VERSION, import_refaware
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    InsertOut,
    MatchOut,
    NodeView,
    Running,
    SessionView,
    Snapshot,
    UnknownSession,
)

__all__ = [
    "RefAwareRadixBackend",
    "factory",
    "factory_priority",
    "factory_priority_default_scope",
    "factory_priority_class_moves",
    "factory_priority_moves",
]

RA = import_refaware()
"""The fork's classes; importing this module fails here, with an install hint, outside `.venv-refaware`."""

from sglang.srt.mem_cache import radix_cache as _radix_cache  # noqa: E402
from sglang.srt.mem_cache import ref_aware_cache_core as _core  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

FORK = "Zhangmj0621/sglang@48ae513a"


@dataclasses.dataclass
class _OrderedRefInfo(_core.RefInfo):
    """The fork's `RefInfo` with an insertion-ordered node set (see the module docstring)."""

    def __post_init__(self) -> None:
        self.nodes = OrderedSet(self.nodes)  # type: ignore[has-type]  # RefInfo is the fork's, untyped


def device_pools(config: CacheConfig) -> tuple[Any, Any, Any]:
    """What the fork's scheduler builds for one cache on the device, on CPU: the KV pool, its allocator
    (paged above page size 1) and the `CacheInitParams` over them (both RefAware adapters)."""
    ps = config.page_size
    kv = MHATokenToKVPool(
        config.capacity,
        ps,
        KV_DTYPE,
        HEAD_NUM,
        HEAD_DIM,
        config.kv_layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    if ps == 1:
        allocator: Any = TokenToKVPoolAllocator(config.capacity, torch.float32, "cpu", kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(config.capacity, ps, torch.float32, "cpu", kv, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,  # only the request-level helpers read it
        token_to_kv_pool_allocator=allocator,
        page_size=ps,
        eviction_policy=config.policy,
    )
    return kv, allocator, params


class RefAwareAdapter(RadixTreeAdapter):
    """What both RefAware adapters do alike: the fork's lock, ref and KV calls, its admission counters, and the
    snapshot (`RefAwareRadixBackend` over the device cache, `refaware_hicache.RefAwareHiRadixBackend` with the host
    tier). A subclass sets `config`, `page_size`, `priority_refs`, `cache`, `allocator`, `kv_pool` and
    `_registered`, and runs fork code inside its `_in_engine`."""

    config: CacheConfig
    page_size: int
    priority_refs: bool
    cache: Any
    allocator: Any
    kv_pool: Any
    _registered: dict[str, None]

    def _key(self, namespace: Optional[str], tokens: Sequence[int]) -> Any:
        return _radix_cache.RadixKey(array("q", tokens), extra_key=namespace)

    def _host_match(self, res: Any) -> dict[str, int]:
        """A match's host fields (`MatchOut.host_length`, `host_node`): none without a host tier."""
        return {}

    def match_prefix(self, namespace: Optional[str], tokens: Sequence[int]) -> MatchOut:
        with self._in_engine():
            res = self.cache.match_prefix(MatchPrefixParams(key=self._key(namespace, tokens)))
        return MatchOut(
            length=int(len(res.device_indices)),
            slots=tuple(int(x) for x in res.device_indices.tolist()),
            node=self._remember(res.last_device_node),
            **self._host_match(res),
        )

    def _released_first(self, priority: int, info: Any) -> bool:
        """Whether a session registered again (`info`: the fork's record of it) is released before it registers:
        each adapter says when it composes a move from a release and a registration instead of the fork's own."""
        raise NotImplementedError

    def register_ref(self, session: str, node: int, priority: int) -> None:
        """The fork's `register_ref` with a request built as its finish path leaves one: the rid, its priority, and the
        node the handle names as `last_node`."""
        target = self._node(node)
        req = SimpleNamespace(
            rid=session,
            priority=priority,
            last_node=target,
            # The root: what register_ref reads to walk a path by key; no committed tokens, no nodes.
            origin_input_ids=[],
            output_ids=[],
            kv_committed_len=0,
            extra_key=None,
        )
        self._registered.pop(session, None)  # (re-)registration order, SPEC.md §11.1 (see `_sessions`)
        self._registered[session] = None
        with self._in_engine():
            info = self.cache.rid_to_ref_info.get(session)
            if info is not None and self._released_first(priority, info):
                self.cache.release_ref(session)
            self.cache.register_ref(req)

    def update_ref(self, session: str, priority: int) -> None:
        with self._in_engine():
            ok, msg = self.cache.update_ref(session, priority)
        if not ok:
            raise UnknownSession(msg)

    def release_ref(self, session: str) -> None:
        with self._in_engine():
            self.cache.release_ref(session)  # an unknown rid is (True, "not tracked"): the fork's idempotence (R5)
        self._registered.pop(session, None)

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        """SPEC.md §11.5 over the fork's own counters: its caches have no planner of their own (R8)."""
        from kvcert.spec.admission import AdmissionCounters, plan_admission

        c = self.cache
        counters = AdmissionCounters(
            page_size=self.page_size,
            layers=self.config.kv_layers,
            high_threshold=self.config.high_priority_threshold,
            free=int(self.allocator.available_size()),
            evictable=int(c.evictable_size_by_tier(allow_low=True, allow_high=True)),
            held_high=int(c.high_ref_evictable_size_),
            host_free=0,  # no retraction backup in 0.5.10 (H10): a retracted request is discarded, never kept
        )
        return plan_admission(counters, tokens, priority, running, profile)

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        write_pool(self.kv_pool, slots, entries, self.config.kv_layers)

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        return read_pool(self.kv_pool, slots, self.config.kv_layers)

    def _sessions(self, depth: dict[int, int]) -> tuple[SessionView, ...]:
        """Each rid as a session ending at the deepest node the fork tracks for it (the root: none).

        In (re-)registration order, as the spec lists sessions: the fork's `rid_to_ref_info` keeps a rid
        where it was first registered, and its device cache never reads that order (docs/calibration/refaware.md
        R9), so the adapter keeps the order of the calls it made; rids it did not register come last.
        """
        table = self.cache.rid_to_ref_info
        order = [r for r in self._registered if r in table] + [r for r in table if r not in self._registered]
        return session_views(self.cache, order, depth)

    def _snapshot(self, walked: Sequence[tuple[Any, Any]], host_lock_of: Callable[[Any], int], **tier: Any) -> Snapshot:
        """The spec's view of the fork's tree, walked root first: its nodes (each node's host locks as
        `host_lock_of` counts them), free slots and counters, the sessions where the adapter drives §11, and `tier`:
        the host tier's fields where the cache has one."""
        ps = self.page_size
        views = []
        depth: dict[int, int] = {}
        for node, parent in walked:
            nid = int(node.id)
            if parent is None:
                depth[nid] = 0
                views.append(self._root_view(node))
                continue
            depth[nid] = depth[int(parent.id)] + 1
            views.append(node_view(node, parent, self.priority_refs, host_lock_of(node)))
        free = free_slots(self.allocator, ps)
        c = self.cache
        extra: dict[str, Any] = {}
        if self.priority_refs:
            extra = dict(
                sessions=self._sessions(depth),
                tier_evictable=tier_counters(c),
                high_priority_threshold=self.config.high_priority_threshold,
            )
        return self._radix_snapshot(views, free, **tier, **extra)


class RefAwareRadixBackend(RefAwareAdapter):
    """One `RefAwareRadixCache` over real CPU pools; node handles are `TreeNode.id`."""

    ALLOCATOR = "the fork's allocator"

    def __init__(
        self,
        config: CacheConfig,
        priority_refs: bool = False,
        moves: str = "",
        fork_default_scope: bool = False,
    ) -> None:
        self.config = config
        self.fork_default_scope = fork_default_scope
        """The full scope is the fork's plain `evict`, whose scope is (True, False) (`factory_priority_default_scope`)."""
        self.moves = moves
        """Registering a registered session first releases it: "all" always (`factory_priority_moves`), "class"
        only when its class changes (`factory_priority_class_moves`), "" never (the fork's own call)."""
        self.page_size = config.page_size
        self.priority_refs = priority_refs
        self._now = 0
        self._next_node_id = 0
        self._nodes: dict[int, Any] = {}
        self._registered: dict[str, None] = {}
        """Session ids in (re-)registration order: the fork keeps none (see `_sessions`)."""
        self.kv_pool, self.allocator, params = device_pools(config)
        # What the fork reads off ServerArgs, through getattr only (ref_aware_cache_core.py:55-61).
        server_args = SimpleNamespace(
            enable_priority_scheduling=True, high_priority_threshold=config.high_priority_threshold
        )
        with self._in_engine():
            self.cache = RA.RefAwareRadixCache(params, server_args)
        c = self.cache
        for name in (
            "evictable_leaves",
            "unused_evictable_leaves",
            "low_ref_evictable_leaves",
            "high_ref_evictable_leaves",
        ):
            assert not getattr(c, name), name
            setattr(c, name, OrderedSet())
        self._remember(c.root_node)

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _in_engine(self) -> Iterator[None]:
        """Run fork code on this adapter's logical clock, node-id counter and ordered RefInfo."""
        node_cls = _radix_cache.TreeNode
        saved = (_radix_cache.time, node_cls.counter, _core.RefInfo)
        _radix_cache.time, node_cls.counter, _core.RefInfo = (
            LogicalTime(self._now),
            self._next_node_id,
            _OrderedRefInfo,
        )
        try:
            yield
        finally:
            self._next_node_id = node_cls.counter
            _radix_cache.time, node_cls.counter, _core.RefInfo = saved

    def _node_at(self, key: Any) -> Any:
        """The node ending exactly at `key`, read without touching the fork (no stamps, no splits).

        0.5.10's `RadixCache.insert` reports no node (`InsertResult.last_node` is None), so the
        insert's handle is found here; the insert has just cached the whole key, ending at a node.
        """
        c = self.cache
        node = c.root_node
        while len(key) > 0:
            ck = c.get_child_key_fn(key)
            if ck not in node.children:  # never index: children is a defaultdict(TreeNode)
                break
            child = node.children[ck]
            n = c.key_match_fn(child.key, key)
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return node

    # ------------------------------------------------------------------ protocol

    def insert(
        self, namespace: Optional[str], tokens: Sequence[int], slots: Sequence[int], priority: int = 0
    ) -> InsertOut:
        key = self._key(namespace, tokens)
        params = InsertParams(key=key, value=torch.tensor(list(slots), dtype=torch.int64), priority=priority)
        with self._in_engine():
            res = self.cache.insert(params)
        return InsertOut(prefix_len=int(res.prefix_len), node=self._remember(self._node_at(key)))

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:
        with self._in_engine():
            full = allow_low is True and allow_high is True
            if not self.priority_refs or (full and self.fork_default_scope):  # no session: any scope is the same
                res = self.cache.evict(EvictParams(num_tokens=n))
            else:
                with self.cache.scoped_evict(allow_low=allow_low, allow_high=allow_high):
                    res = self.cache.evict(EvictParams(num_tokens=n))
        return int(res.num_tokens_evicted)

    # ------------------------------------------------------------------ SPEC.md §11 (factory_priority)

    def _released_first(self, priority: int, info: Any) -> bool:
        """Whether a session registered again (`info`: the fork's record of it) is released before it registers."""
        return self.moves == "all" or (self.moves == "class" and self.cache.is_high_priority(priority) != info.is_high)

    # ------------------------------------------------------------------ KVBackend (SPEC.md §9.12)

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        return []

    def snapshot(self) -> Snapshot:
        return self._snapshot(self._walk(), lambda node: 0)


def node_view(node: Any, parent: Any, priority_refs: bool, host_lock_ref: int = 0) -> NodeView:
    """A fork TreeNode below the root as the spec sees it (the Hi cache's host fields where it has them)."""
    host = getattr(node, "host_value", None)
    return NodeView(
        id=int(node.id),
        parent=int(parent.id),
        namespace=node.key.extra_key,
        key=tuple(int(t) for t in node.key.token_ids),
        slots=None if node.value is None else tuple(int(x) for x in node.value.tolist()),
        lock_ref=int(node.lock_ref),
        host_slots=None if host is None else tuple(int(x) for x in host.tolist()),
        host_lock_ref=host_lock_ref,
        high_ref=int(node.high_ref) if priority_refs else 0,
        low_ref=int(node.low_ref) if priority_refs else 0,
        meta=(int(node.last_access_time), int(node.hit_count), int(node.creation_time), int(node.priority)),
    )


def tier_counters(cache: Any) -> tuple[int, int, int]:
    """The fork's own device-tier counters: evictable tokens in UNUSED, LOW_REF and HIGH_REF nodes (SPEC.md §11.2)."""
    return int(cache.unused_evictable_size_), int(cache.low_ref_evictable_size_), int(cache.high_ref_evictable_size_)


def session_views(cache: Any, order: Sequence[str], depth: dict[int, int]) -> tuple[SessionView, ...]:
    """The fork's tracked rids in `order`, each as a session ending at the deepest node its refs hold (the root: none
    in the tree; ties to the lower id), demoted where the host-tier cache has demoted it."""
    root = int(cache.root_node.id)
    demoted = getattr(cache, "_adaptively_demoted_rids", {})
    out = []
    for rid in order:
        info = cache.rid_to_ref_info[rid]
        ids = [int(n.id) for n in info.nodes if int(n.id) in depth]
        end = max(ids, key=lambda i: (depth[i], -i)) if ids else root
        out.append(
            SessionView(id=rid, node=end, priority=int(info.priority), high=bool(info.is_high), demoted=rid in demoted)
        )
    return tuple(out)


def free_slots(allocator: Any, page_size: int) -> list[int]:
    """The allocator's free slots, parked release pages included (slot 0 / page 0 is the fork's padding)."""
    ids = torch.cat((allocator.free_pages, allocator.release_pages)).tolist()
    return sorted(p * page_size + i for p in ids for i in range(page_size)) if page_size > 1 else sorted(ids)


def factory(config: CacheConfig) -> RefAwareRadixBackend:
    """`kvcert certify kvcert.conformance.adapters.refaware.radix:factory`: the plain device ops."""
    return RefAwareRadixBackend(config)


def factory_priority(config: CacheConfig) -> RefAwareRadixBackend:
    """`... refaware_radix:factory_priority`: the plain device ops and SPEC.md §11 on the fork's calls."""
    return RefAwareRadixBackend(config, priority_refs=True)


def factory_priority_moves(config: CacheConfig) -> RefAwareRadixBackend:
    """`... refaware_radix:factory_priority_moves`: as `factory_priority`, but registering a session again
    is `release_ref` then `register_ref`, so the run gets past the fork's re-registration (R1, R2 in
    docs/calibration/refaware.md) to what follows it."""
    return RefAwareRadixBackend(config, priority_refs=True, moves="all")


def factory_priority_class_moves(config: CacheConfig) -> RefAwareRadixBackend:
    """`... refaware_radix:factory_priority_class_moves`: as `factory_priority`, but a re-registration that
    changes the session's class is `release_ref` then `register_ref` (past R1); one in the same class is
    the fork's own call, so generation meets R2."""
    return RefAwareRadixBackend(config, priority_refs=True, moves="class")


def factory_priority_default_scope(config: CacheConfig) -> RefAwareRadixBackend:
    """`... refaware_radix:factory_priority_default_scope`: as `factory_priority`, but SPEC.md's plain `evict(n)`
    (the full scope) is the fork's plain `evict`, with the fork's default scope (True, False): R3."""
    return RefAwareRadixBackend(config, priority_refs=True, fork_default_scope=True)


factory.capabilities = radix_capabilities(  # type: ignore[attr-defined]
    f"refaware.RefAwareRadixCache {REFAWARE_SGLANG_VERSION} ({FORK})",
    aligns_keys=False,  # 0.5.10's insert does not page-align a key: its callers do (cache_finished_req)
    checkpoints=False,  # 0.5.10 has cache_unfinished_req, no checkpoint: the harness composes it
    profile="sglang-0.5.23",  # 0.5.10's RadixCache makes 0.5.23's device choices: certified under it too
    deviations=(
        "eviction ties: the fork's leaf sets and RefInfo.nodes are insertion-ordered, so equally ranked leaves leave in insertion order; as shipped a set orders them by memory address, which differs from run to run",
        "clock: time.monotonic and TreeNode.counter are the harness's logical clock and a per-adapter counter during each call",
        "insert: 0.5.10's insert reports no node; the adapter finds the node the key ends at (_node_at)",
        "requests: the API is driven by calls the suite composes in the scheduler's place; the fork's request path "
        "(its PrefillAdder admission, cache_finished_req and the finish path that registers refs) does not run",
    ),
)

factory_priority.capabilities = replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=f"refaware.RefAwareRadixCache {REFAWARE_SGLANG_VERSION} ({FORK}), priority refs",
    priority_refs=True,
    notes=factory.capabilities.notes  # type: ignore[attr-defined]
    + ("evict(n, allow_low, allow_high) runs the fork's evict inside scoped_evict(allow_low, allow_high)",),
    deviations=factory.capabilities.deviations  # type: ignore[attr-defined]
    + (
        "register_ref: the adapter builds the request it registers (rid, priority, the node it names as last_node); "
        "the fork's scheduler registers what its own finish path left in the request",
        "plan_admission: kvcert's planner (SPEC.md §11.5, kvcert.spec.admission) over the fork's counters; the fork's "
        "own admission (its PrefillAdder) is not run",
    ),
)

factory_priority_moves.capabilities = replace(  # type: ignore[attr-defined]
    factory_priority.capabilities,  # type: ignore[attr-defined]
    name=f"refaware.RefAwareRadixCache {REFAWARE_SGLANG_VERSION} ({FORK}), priority refs, re-register = release + register",
    deviations=factory_priority.capabilities.deviations  # type: ignore[attr-defined]
    + (
        "a registered session registered again is released first, then registered: the fork's own re-registration "
        "(which keeps refs on the path it left, R2) is not run",
    ),
)

factory_priority_default_scope.capabilities = replace(  # type: ignore[attr-defined]
    factory_priority.capabilities,  # type: ignore[attr-defined]
    name=f"refaware.RefAwareRadixCache {REFAWARE_SGLANG_VERSION} ({FORK}), priority refs, the fork's default evict scope",
    deviations=factory_priority.capabilities.deviations  # type: ignore[attr-defined]
    + ("evict(n) in the full scope is the fork's plain evict, whose default scope spares HIGH_REF (R3)",),
)

factory_priority_class_moves.capabilities = replace(  # type: ignore[attr-defined]
    factory_priority.capabilities,  # type: ignore[attr-defined]
    name=f"refaware.RefAwareRadixCache {REFAWARE_SGLANG_VERSION} ({FORK}), priority refs, class change = release + register",
    deviations=factory_priority.capabilities.deviations  # type: ignore[attr-defined]
    + ("a session registered again in the other priority class is released first (the fork raises: R1)",),
)
