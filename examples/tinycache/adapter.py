"""tinycache behind kvcert's `Backend` protocol (`kvcert.conformance.backend`).

    PYTHONPATH=. kvcert certify examples.tinycache.adapter:factory --examples 100

The adapter only translates; the suite judges `examples/tinycache/cache.py`:

- the logical clock: `set_clock(now)` stores `now` and the cache's clock returns it, so every stamp
  of one operation is the harness's time (SPEC.md §3);
- handles are `TreeNode.id`, kept by the adapter kit's `NodeHandles`: each node handed out is
  remembered (and, on a miss, every node in the tree) so a handle read off a snapshot resolves too;
- namespaces are the cache's `extra_key`, passed through unchanged (`None`, `""` and `"None"` stay
  three namespaces);
- `alloc` maps the allocator's None to `PoolExhausted` (the kit's `take_slots`);
- `snapshot` reports the cache's own counters and free list and every node's own lock count: it
  recomputes nothing, so INV-ACCT-* judge the cache's bookkeeping, not the adapter's.

No input checking (`strict_input=False`): tinycache trusts its caller, so the suite sends only
valid calls and the certificate lists bad input as not checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from examples.tinycache.cache import RadixCache, SlotAllocator, TreeNode
from kvcert.conformance.adapters.kit import NodeHandles, take_slots
from kvcert.spec.types import CacheConfig, Capabilities, InsertOut, MatchOut, NodeView, Snapshot

__all__ = ["TinyCacheBackend", "factory"]


class TinyCacheBackend:
    """One tinycache `RadixCache` over its `SlotAllocator`; node handles are `TreeNode.id`."""

    def __init__(self, config: CacheConfig) -> None:
        if config.policy != "lru" or config.host_capacity:
            raise ValueError(f"tinycache is a device-only LRU cache, asked for {config}")
        self._now = 0
        self.allocator = SlotAllocator(config.capacity, config.page_size)
        self.cache = RadixCache(self.allocator, clock=lambda: self._now)
        self.handles: NodeHandles[TreeNode] = NodeHandles(self.cache.walk)
        """Every node handed out or seen in a walk, by id (a node id is never reused)."""
        self._remember = self.handles.remember
        self._node = self.handles.resolve
        self._remember(self.cache.root)

    # ------------------------------------------------------------------ Backend

    def set_clock(self, now: int) -> None:
        self._now = now

    def alloc(self, n: int) -> tuple[int, ...]:
        return take_slots(self.allocator.alloc(n), n, f"tinycache's allocator ({self.allocator.available()} free)")

    def free(self, slots: Sequence[int]) -> None:
        self.allocator.free(slots)

    def match_prefix(self, namespace: Optional[str], tokens: Sequence[int]) -> MatchOut:
        res = self.cache.match_prefix(tokens, extra_key=namespace)
        return MatchOut(length=len(res.slots), slots=tuple(res.slots), node=self._remember(res.last_node))

    def insert(
        self, namespace: Optional[str], tokens: Sequence[int], slots: Sequence[int], priority: int = 0
    ) -> InsertOut:
        # `priority` only ranks victims under the priority policy, which tinycache does not offer.
        res = self.cache.insert(tokens, slots, extra_key=namespace)
        return InsertOut(prefix_len=res.prefix_len, node=self._remember(res.last_node))

    def inc_lock_ref(self, node: int) -> None:
        self.cache.inc_lock_ref(self._node(node))

    def dec_lock_ref(self, node: int) -> None:
        self.cache.dec_lock_ref(self._node(node))

    def evict(self, n: int) -> int:
        return self.cache.evict(n)

    def snapshot(self) -> Snapshot:
        root = self.cache.root
        views = []
        for node in self.cache.walk():
            self._remember(node)
            parent = node.parent
            views.append(
                NodeView(
                    id=node.id,
                    parent=None if parent is None else parent.id,
                    namespace=None if node is root else node.extra_key,
                    key=node.key,
                    slots=tuple(node.value),
                    lock_ref=node.lock_ref,
                )
            )
        return Snapshot(
            page_size=self.allocator.page_size,
            capacity=self.allocator.num_slots,
            slot_limit=self.allocator.num_slots,  # slot ids run 0 .. num_slots - 1: none reserved
            root=root.id,
            nodes=tuple(views),
            free_slots=tuple(self.allocator.free_slots()),
            evictable_size=self.cache.evictable_size(),
            protected_size=self.cache.protected_size(),
        )


def factory(config: CacheConfig) -> TinyCacheBackend:
    """`kvcert certify examples.tinycache.adapter:factory` entry point: a fresh cache per example."""
    return TinyCacheBackend(config)


factory.capabilities = Capabilities(  # type: ignore[attr-defined]
    name="tinycache 0.1 (examples/tinycache)",
    page_sizes=(1, 4, 16),
    policies=("lru",),
    namespaces=True,
    strict_input=False,
    profile="sglang-0.5.23",
    still_between_calls=True,
    notes=(
        "device tier only: no host tier, storage, retraction, priority tiers or KV bytes",
        "profile sglang-0.5.23 for its one device-tier choice, RANK: LRU victims in last-access order over "
        "SPEC.md §4.7's stamps; it certifies under --profile core too",
        "strict_input=False: it trusts its caller, so bad input is not sent",
    ),
)
