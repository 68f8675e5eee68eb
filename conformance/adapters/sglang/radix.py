"""SGLang's real device-tier `RadixCache` (0.5.23) behind kvcert's Backend protocol.

    kvcert certify kvcert.conformance.adapters.sglang.radix:factory

The adapter only translates: real `MHATokenToKVPool` + `TokenToKVPoolAllocator`
(page 1) or `PagedTokenToKVPoolAllocator` (page > 1) on CPU, a real
`RadixCache`, and no input checking (`strict_input=False`): the suite judges
SGLang, not this file.

Determinism. SGLang stamps nodes with `time.monotonic()` and numbers them from
the process-wide `TreeNode.counter`. While (and only while) a call into SGLang
runs, the adapter swaps the `time` global of `sglang.srt.mem_cache.radix_cache`
for its logical clock (`monotonic()` and `perf_counter()` return the value of
the last `set_clock`, so every stamp within one op is equal) and
`TreeNode.counter` for its own id counter; both are restored afterwards. Node
ids are therefore 0 (root), 1, 2, ... per adapter, whatever else ran in the
process. The cache's `evictable_leaves` set, whose order (TreeNodes hash by
address) decides ties between equal-rank leaves, becomes insertion-ordered.
Not thread-safe: one call into SGLang at a time.

KV bytes (SPEC.md §9.12). The pool has the spec's geometry (`kit.kv`): the harness writes
each request's KV into its slots before the insert and reads every cached slot back after
every step, so a slot SGLang hands to the wrong node, or frees while a node still maps it and
reuses, shows as wrong bytes (INV-KV-1).
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.kit.kv import (
    HEAD_DIM,
    HEAD_NUM,
    KV_DTYPE,
    read_pool,
    write_pool,
)
from kvcert.conformance.adapters.kit.radix import (
    POOL_NOTES,
    RADIX_POLICIES,
    LogicalTime,
    RadixTreeAdapter,
    radix_capabilities,
)
from kvcert.conformance.adapters.sglang.env import INSERTION_ORDERED_TIES, SGLANG_VERSION, OrderedSet, import_sglang
from kvcert.spec.types import (
    CacheConfig,
    InsertOut,
    MatchOut,
    NodeView,
    Snapshot,
)

__all__ = ["SGLangRadixBackend", "cpu_pools", "factory", "factory_need_sort"]

SG = import_sglang()
"""SGLang's classes; importing this module fails here, with an install hint, when sglang is missing."""


def cpu_pools(config: CacheConfig, need_sort: bool = False) -> tuple[Any, Any]:
    """SGLang's MHA device pool in the spec's KV geometry (entries are bytes of it) and its token (page 1) or paged
    allocator, on CPU: (kv_pool, allocator)."""
    kv = SG.MHATokenToKVPool(
        size=config.capacity,
        page_size=config.page_size,
        dtype=KV_DTYPE,
        head_num=HEAD_NUM,
        head_dim=HEAD_DIM,
        layer_num=config.kv_layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    if config.page_size == 1:
        allocator = SG.TokenToKVPoolAllocator(
            config.capacity, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=need_sort
        )
    else:
        allocator = SG.PagedTokenToKVPoolAllocator(
            config.capacity, config.page_size, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=need_sort
        )
    return kv, allocator


class _Namespace:
    """Attributes only: the parts of SGLang's `Req` (and its `kv` record) that `RadixCache.checkpoint` reads."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:  # only for names never set: typed as open, absent as on any object
        raise AttributeError(name)


class SGLangRadixBackend(RadixTreeAdapter):
    """One `RadixCache` over real CPU pools; node handles are `TreeNode.id`."""

    def __init__(self, config: CacheConfig, need_sort: bool = False, kv_events: bool = False) -> None:
        """`kv_events`: built as with --kv-events-config (the request path replays them)."""
        self.sg = SG
        self.config = config
        self.page_size = config.page_size
        self._now = 0
        self._next_node_id = 0
        self._nodes: dict[int, Any] = {}
        """Every TreeNode the adapter has handed out or seen in the tree, by id."""
        self._records: dict[int, Any] = {}
        """Each running request's SGLang `kv` record, by the harness's request handle: it outlives a checkpoint."""
        self.kv_pool, self.allocator = cpu_pools(config, need_sort)
        params = self.sg.CacheInitParams(
            disable=False,
            req_to_token_pool=None,  # only the request-level helpers (cache_finished_req, ...) read it
            token_to_kv_pool_allocator=self.allocator,
            page_size=config.page_size,
            eviction_policy=config.policy,
            eviction_policy_config=config.policy_params() or None,  # --radix-eviction-policy-config
            enable_kv_cache_events=kv_events,
        )
        with self._in_engine():
            self.cache = self.sg.RadixCache(params)
        assert not self.cache.evictable_leaves
        self.cache.evictable_leaves = OrderedSet()
        self._remember(self.cache.root_node)

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _in_engine(self) -> Iterator[None]:
        """Run SGLang code on this adapter's logical clock and node-id counter."""
        mod, node_cls = self.sg.radix_cache, self.sg.TreeNode
        saved_time, saved_counter = mod.time, node_cls.counter
        mod.time, node_cls.counter = LogicalTime(self._now), self._next_node_id
        try:
            yield
        finally:
            self._next_node_id = node_cls.counter
            mod.time, node_cls.counter = saved_time, saved_counter

    def _key(self, namespace: Optional[str], tokens: Sequence[int]) -> Any:
        return self.sg.RadixKey(array("q", tokens), extra_key=namespace)

    # ------------------------------------------------------------------ protocol

    def match_prefix(self, namespace: Optional[str], tokens: Sequence[int]) -> MatchOut:
        with self._in_engine():
            res = self.cache.match_prefix(self.sg.MatchPrefixParams(key=self._key(namespace, tokens)))
            # What BasePrefixCache.prefix_device_indices does for a request.
            slots = self.cache.path_device_indices(res.last_device_node)[: res.device_prefix_len]
        return MatchOut(
            length=int(res.device_prefix_len),
            slots=tuple(int(x) for x in slots.tolist()),
            node=self._remember(res.last_device_node),
        )

    def insert(
        self, namespace: Optional[str], tokens: Sequence[int], slots: Sequence[int], priority: int = 0
    ) -> InsertOut:
        params = self.sg.InsertParams(
            key=self._key(namespace, tokens),
            value=torch.tensor(list(slots), dtype=torch.int64),
            priority=priority,
        )
        with self._in_engine():
            res = self.cache.insert(params)
        return InsertOut(prefix_len=int(res.prefix_len), node=self._remember(res.last_device_node))

    def evict(self, n: int) -> int:
        with self._in_engine():
            res = self.cache.evict(self.sg.EvictParams(num_tokens=n))
        return int(res.num_tokens_evicted)

    def checkpoint(
        self,
        namespace: Optional[str],
        tokens: Sequence[int],
        row: Sequence[int],
        protected: int,
        node: int,
        priority: int,
        *,
        prompt: int,
        request: int,
    ) -> tuple[InsertOut, tuple[int, ...], int]:
        """A running request's checkpoint (SPEC.md §4.8) through SGLang's own `RadixCache.checkpoint`.

        The request is the fields `checkpoint` / `_insert_cache` read: its row in a real `ReqToTokenPool`,
        `cache_protected_len`, the lock on `node`, its prompt (`origin_input_ids`: the first `prompt` tokens,
        so SGLang re-inserts the prompt at its boundary) and its `kv` record, kept per `request` across its
        checkpoints so that SGLang advances `cache_inserted_len` itself and gates its hits by it. Returns the
        insert's outcome, the row's repointed head and the node now locked.
        """
        target = self._node(node)
        pool = self._req_pool(len(row))
        pool.req_to_token[1, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
        kv = self._records.setdefault(
            request, _Namespace(req_pool_idx=1, cache_protected_len=0, cache_inserted_len=0, swa_evict_floor=0)
        )
        kv.cache_protected_len = protected
        toks = array("q", [int(t) for t in tokens])
        req = _Namespace(
            kv=kv,
            extra_key=namespace,
            cache_salt=None,
            priority=priority,
            origin_input_ids=toks[:prompt],
            full_untruncated_fill_ids=toks,
            lock=self.sg.TreeLock(target, None),
            last_node=target,
        )
        seen: list[int] = []
        insert = self.cache.insert

        def spy(params: Any) -> Any:  # the insert's own outcome, for the insert contract
            res = insert(params)
            seen.append(int(res.prefix_len))
            return res

        self.cache.insert = spy  # type: ignore[method-assign]
        try:
            with self._in_engine():
                self.cache.checkpoint(req, up_to=len(toks))
        finally:
            del self.cache.insert
        head = tuple(int(x) for x in pool.req_to_token[1, : kv.cache_protected_len].tolist())
        last = self._remember(req.last_node)
        return InsertOut(prefix_len=seen[0] if seen else 0, node=last), head, last

    def _req_pool(self, length: int) -> Any:
        pool = getattr(self, "_pool", None)
        if pool is None or pool.max_context_len < length:
            pool = self._pool = self.sg.ReqToTokenPool(
                size=1, max_context_len=max(length, self.config.capacity), device="cpu", enable_memory_saver=False
            )
            self.cache.req_to_token_pool = pool
        return pool

    # ------------------------------------------------------------------ KVBackend (SPEC.md §9.12)

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        """The forward pass: each entry into the K and V buffers of every layer at its slot."""
        write_pool(self.kv_pool, slots, entries, self.config.kv_layers)

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        return read_pool(self.kv_pool, slots, self.config.kv_layers)

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        return []  # no host tier: no node ever has host slots

    def snapshot(self) -> Snapshot:
        ps = self.page_size
        views = []
        for node, parent in self._walk():
            if parent is None:  # root: SGLang gives it an empty key, `value=[]` and a permanent lock_ref of 1
                views.append(self._root_view(node))
                continue
            views.append(
                NodeView(
                    id=int(node.id),
                    parent=int(parent.id),
                    namespace=node.key.extra_key,
                    key=tuple(int(t) for t in node.key.raw_token_ids()),
                    slots=tuple(int(x) for x in node.value.tolist()),
                    lock_ref=int(node.lock_ref),
                    meta=(
                        int(node.last_access_time),
                        int(node.hit_count),
                        int(node.creation_time),
                        int(node.priority),
                    ),
                )
            )
        pages = self.allocator.get_all_free_pages().tolist()
        free = sorted(p * ps + i for p in pages for i in range(ps))
        return self._radix_snapshot(views, free)


def factory(config: CacheConfig) -> SGLangRadixBackend:
    """`kvcert certify kvcert.conformance.adapters.sglang.radix:factory` entry point."""
    return SGLangRadixBackend(config)


def factory_need_sort(config: CacheConfig) -> SGLangRadixBackend:
    """The allocators as PD disaggregation builds them (`need_sort=True`, kv_cache_configurator.py:932):
    frees wait in `release_pages` / `staged_pages` until an allocation runs short."""
    return SGLangRadixBackend(config, need_sort=True)


factory.capabilities = radix_capabilities(  # type: ignore[attr-defined]
    f"sglang.RadixCache {SGLANG_VERSION}",
    policies=(*RADIX_POLICIES, "slru"),  # tlru: UnifiedRadixCache only (0.5.23's registry refuses it here)
    aligns_keys=True,
    checkpoints=True,
    profile="sglang-0.5.23",
    notes=POOL_NOTES
    + (
        "SGLang 0.5.23 builds this RadixCache only for all-sliding-window models and --enable-flexkv; its default "
        "is UnifiedRadixCache (sglang_hicache_backend, host_capacity 0)",
    ),
    deviations=(
        INSERTION_ORDERED_TIES,
        "clock: time.monotonic and TreeNode.counter are the harness's logical clock and a per-adapter counter during "
        "each call, so every stamp within one operation is equal",
        "requests: the API is driven by calls the suite composes in the scheduler's place (match, lock, alloc, "
        "insert, free); a checkpoint's request is a stand-in with the fields RadixCache.checkpoint reads, not "
        "SGLang's Req, and the scheduler's own request path (match_kv_cache, alloc_for_extend, release_kv_cache) "
        "does not run",
    ),
)

factory_need_sort.capabilities = replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=f"sglang.RadixCache {SGLANG_VERSION} (need_sort allocators)",
)
