"""What an adapter around an SGLang-style `RadixCache` needs whatever the SGLang version: a logical clock to
stand in for the `time` module its nodes are stamped with, node handles by `TreeNode.id`, and slots from a
torch allocator, the lock calls, and what every such adapter declares alike. Plain Python and torch: no SGLang
import, so 0.5.23's adapters, the 0.5.10 RefAware fork's and a fork's of either share it."""

from __future__ import annotations

import contextlib
import time as _real_time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.kit.tree import take_slots, walk_tree
from kvcert.spec.types import CacheConfig, Capabilities, NodeView, Snapshot, StaleHandle

RADIX_POLICIES = ("lru", "lfu", "fifo", "mru", "priority")
"""What every adapter over an SGLang-style RadixCache declares: the policies SGLang 0.5.10's and 0.5.23's
`RadixCache` rank by a node's own metadata. `slru` only where the engine's build takes its parameter (0.5.23's
`eviction_policy_config`); never `tlru`, which needs UnifiedRadixCache's per-node depths and histories (0.5.23's
registry refuses it on any other tree cache)."""

POOL_NOTES = (
    "real MHATokenToKVPool + (Paged)TokenToKVPoolAllocator on CPU; slot 0 / page 0 is reserved padding",
    "KV bytes: the harness writes the spec's entries into the pool's K/V buffers and reads them back",
)
"""What the KV of every adapter over a RadixCache and its CPU pools is."""


def radix_capabilities(name: str, **fields: Any) -> Capabilities:
    """What an adapter over an SGLang-style RadixCache declares alike (pages of 1, 4 and 16 tokens, `RADIX_POLICIES`,
    namespaces, lenient input, KV reads, exact metadata, `POOL_NOTES`), with `fields` on top."""
    base = Capabilities(
        name=name,
        page_sizes=(1, 4, 16),
        policies=RADIX_POLICIES,
        namespaces=True,
        strict_input=False,
        kv_reads=True,
        reports_metadata=True,
        metadata_exact=True,
        notes=POOL_NOTES,
    )
    return replace(base, **fields)


class LogicalTime:
    """Stands in for the `time` module inside radix_cache: clocks read the logical time."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:  # sleep, time, ...: the real thing
        return getattr(_real_time, name)


class RadixTreeAdapter:
    """Node handles, the clock and slots for an adapter over a `RadixCache` (`self.cache`) and its torch
    allocator (`self.allocator`); the adapter sets both, `_nodes = {}` and `_now = 0` in its constructor."""

    cache: Any
    allocator: Any
    config: CacheConfig
    page_size: int
    _nodes: dict[int, Any]
    _now: int
    ALLOCATOR = "SGLang allocator"
    """How `PoolExhausted` names the allocator."""

    def _remember(self, node: Any) -> int:
        self._nodes[node.id] = node
        return int(node.id)

    def _node(self, node_id: int) -> Any:
        node = self._nodes.get(node_id)
        if node is None:
            self._walk()  # a handle read off a snapshot
            node = self._nodes.get(node_id)
        if node is None:
            raise StaleHandle(f"no TreeNode with id {node_id!r} was ever seen")
        return node

    def _walk(self) -> list[tuple[Any, Optional[Any]]]:
        """(node, parent) for every node reachable from the root, parents first."""
        out = list(walk_tree(self.cache.root_node, lambda node: node.children.values()))
        for node, _ in out:
            self._remember(node)
        return out

    @staticmethod
    def _root_view(node: Any) -> NodeView:
        """The root as the spec sees it: no key, no slots (SGLang gives it an empty key and `value=[]`), its lock."""
        return NodeView(int(node.id), None, None, (), (), int(node.lock_ref))

    def _radix_snapshot(self, views: Sequence[NodeView], free: Sequence[int], **fields: Any) -> Snapshot:
        """The snapshot of the cache's tree (`views`, root first) and its free slots with the cache's own counters;
        slot 0 / page 0 is the engine's padding, so slot ids run 1..capacity. `fields`: what its tiers add."""
        ps = self.page_size
        return Snapshot(
            page_size=ps,
            capacity=self.config.capacity,
            slot_limit=self.config.capacity + ps,
            root=int(self.cache.root_node.id),
            nodes=tuple(views),
            free_slots=tuple(free),
            evictable_size=int(self.cache.evictable_size()),
            protected_size=int(self.cache.protected_size()),
            **fields,
        )

    def _in_engine(self) -> contextlib.AbstractContextManager[None]:
        """The context the engine's code runs in for one call (its clock, its counters): each adapter's own."""
        raise NotImplementedError

    def inc_lock_ref(self, node: int) -> None:
        target = self._node(node)
        with self._in_engine():
            self.cache.inc_lock_ref(target)

    def dec_lock_ref(self, node: int) -> None:
        target = self._node(node)
        with self._in_engine():
            self.cache.dec_lock_ref(target)

    def set_clock(self, now: int) -> None:
        self._now = now

    def alloc(self, n: int) -> tuple[int, ...]:
        out = self.allocator.alloc(n)
        return take_slots(None if out is None else out.tolist(), n, self.ALLOCATOR)

    def free(self, slots: Sequence[int]) -> None:
        self.allocator.free(torch.tensor(list(slots), dtype=torch.int64))
