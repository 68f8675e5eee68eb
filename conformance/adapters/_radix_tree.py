"""What an adapter around an SGLang-style `RadixCache` needs whatever the SGLang version: a logical clock to
stand in for the `time` module its nodes are stamped with, node handles by `TreeNode.id`, and slots from a
torch allocator. Plain Python and torch: no SGLang import, so 0.5.23's adapter and the 0.5.10 RefAware fork's
share it."""

from __future__ import annotations

import time as _real_time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from kvcert.spec.types import PoolExhausted, StaleHandle


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
        out: list[tuple[Any, Optional[Any]]] = []
        stack: list[tuple[Any, Optional[Any]]] = [(self.cache.root_node, None)]
        while stack:
            node, parent = stack.pop()
            self._remember(node)
            out.append((node, parent))
            stack.extend((child, node) for child in reversed(list(node.children.values())))
        return out

    def set_clock(self, now: int) -> None:
        self._now = now

    def alloc(self, n: int) -> tuple[int, ...]:
        out = self.allocator.alloc(n)
        if out is None:
            raise PoolExhausted(f"{self.ALLOCATOR} returned None for {n} slots")
        return tuple(int(x) for x in out.tolist())

    def free(self, slots: Sequence[int]) -> None:
        self.allocator.free(torch.tensor(list(slots), dtype=torch.int64))
