"""What the tiers need of their tree: `TierTree`, the protocol `HostTier` and `StorageTier` are typed against.

The tiers hold the cache that owns them (`GpuCache`, a `RadixTree`) and work on it through the
tree's public section, "the tiers' interface", and nothing else: no tier calls a private method of
the tree, nor imports `kvcert.gpu.tree` or `kvcert.gpu.cache` (`tests/test_gpu_structure.py` checks
both). The tree imports the tiers, so the modules form no circle. mypy checks that `GpuCache`
satisfies the protocol where the facade builds each tier. `StorageTier` needs two more members
(`kvcert.gpu.storage.StorageTree`); `Sessions` needs far fewer (`kvcert.gpu.sessions.RefTree`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Optional, Protocol

from kvcert.gpu.alloc import PageAllocator
from kvcert.gpu.copy_engine import CopyEngine, CopyJob
from kvcert.gpu.evict_index import EvictionIndex
from kvcert.gpu.kv import KVPool
from kvcert.gpu.node import Copy, Node, Prefetch, Selector
from kvcert.gpu.run import Run
from kvcert.gpu.sessions import Sessions
from kvcert.gpu.watch import Watch
from kvcert.spec.types import Namespace


class TierTree(Protocol):
    """The tree as a tier sees it: its state (read, and the node fields the tier owns written) and its operations."""

    page_size: int
    now: int
    """The logical clock (`set_clock`): stamps and prefetch deadlines."""
    write_back: bool
    root: Node
    nodes: dict[int, Node]
    """The node table: a node is live while its id is in it."""
    kv: KVPool
    """The device pool: the source or target of a tier's copies."""
    alloc_dev: PageAllocator
    engine: CopyEngine
    index: EvictionIndex
    """The eviction index: host eviction pops its host candidates and duplicates."""
    copies: OrderedDict[int, Copy]
    chosen: deque[tuple[str, int]]
    """The eviction choices a report carries: host eviction appends its own."""
    refs: Sessions
    watch: Optional[Watch]
    """Told of every tier arrival and departure (`kvcert.gpu.watch`), when an engine set one."""
    refresh: Callable[[Node], None]
    """Re-rank a node after changing it (`EvictionIndex.refresh`, bound on the tree)."""

    def compact(self) -> None: ...

    def new_node(self, parent: Node, ns: Namespace, key: Run, size: int) -> Node: ...

    def forget(self, n: Node, heir: Node) -> None: ...

    def selector(self, parent: Node, n: Node) -> Selector: ...

    def set_device(self, n: Node, slots: Optional[Run]) -> None: ...

    def lock_path(self, node: Node, delta: int) -> None: ...

    def path_tokens(self, n: Node) -> tuple[int, ...]: ...

    def issue_copy(self, kind: str, nodes: list[Node], anchors: list[Node], job: Optional[CopyJob]) -> Copy: ...

    def host_lock(self, n: Node, owner: Copy | Prefetch) -> None: ...

    def host_unlock_all(self, owner: Copy | Prefetch) -> None: ...

    def split(self, child: Node, cut: int) -> Node: ...

    def evict_device(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int: ...
