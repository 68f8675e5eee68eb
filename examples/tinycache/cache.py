"""tinycache: a small page-granular prefix KV cache, as an engine team would write one.

A radix tree over token ids whose values are slots of a fixed-size KV pool:

- `SlotAllocator`: a free list of pages; a page is `page_size` consecutive slots starting at a
  multiple of `page_size`, so every page is one aligned device page.
- `RadixCache`: the tree. Edges are whole pages; a node's children are keyed by
  `(extra_key, first page of the edge)`, so requests in different namespaces (LoRA adapter, cache
  salt: SGLang's `extra_key`) never share a node. A request locks the node its match ended at; the
  lock counts on every node up to the root, and only unlocked leaves are evicted, least recently
  used first.

Ownership follows SGLang's `RadixCache`: `insert` takes the slots of the part of the key that was
not cached yet and returns how much was; the caller frees the slots of that prefix (duplicates of
KV the tree already holds). The cache trusts its caller: it checks nothing it does not need to
stay consistent.

This module has no dependency beyond the standard library (kvcert drives it through
`examples/tinycache/adapter.py`).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

ExtraKey = Optional[str]
"""A namespace: `None` is the default; any two different values never share cached KV."""

ChildKey = tuple[ExtraKey, tuple[int, ...]]
"""How a node finds a child: the child's namespace and the first page of its edge."""


class SlotAllocator:
    """A pool of `num_slots` KV slots handed out in whole pages from a free list.

    Slot ids run from 0 to `num_slots - 1`; page `p` holds slots `p * page_size ... p * page_size +
    page_size - 1`. Pages are reused in the order they were freed.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        if page_size < 1 or num_slots < 0 or num_slots % page_size:
            raise ValueError(f"a pool of {num_slots} slots cannot be cut into pages of {page_size}")
        self.num_slots = num_slots
        self.page_size = page_size
        self._free_pages: deque[int] = deque(range(num_slots // page_size))

    def available(self) -> int:
        """Free slots."""
        return len(self._free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> Optional[list[int]]:
        """Slots for `num_tokens` tokens (whole pages), or None if the pool is short (nothing taken)."""
        if num_tokens % self.page_size:
            raise ValueError(f"allocations are whole pages of {self.page_size}, got {num_tokens} tokens")
        pages = num_tokens // self.page_size
        if pages > len(self._free_pages):
            return None
        out: list[int] = []
        for _ in range(pages):
            first = self._free_pages.popleft() * self.page_size
            out.extend(range(first, first + self.page_size))
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Return slots to the pool. Pages are the unit: a page goes back once, whichever of its slots are named."""
        for page in dict.fromkeys(s // self.page_size for s in slots):
            self._free_pages.append(page)

    def free_slots(self) -> list[int]:
        """Every free slot, sorted (for debugging and metrics)."""
        ps = self.page_size
        return sorted(p * ps + i for p in self._free_pages for i in range(ps))


class TreeNode:
    """One edge of the radix tree: its tokens, their KV slots, and eviction bookkeeping."""

    __slots__ = ("id", "key", "value", "extra_key", "parent", "children", "lock_ref", "last_access")

    def __init__(
        self,
        node_id: int,
        key: tuple[int, ...],
        value: list[int],
        extra_key: ExtraKey,
        parent: Optional[TreeNode],
        now: float,
    ) -> None:
        self.id = node_id
        self.key = key
        """This edge's tokens (whole pages; empty for the root)."""
        self.value = value
        """`value[i]` is the KV slot of `key[i]`."""
        self.extra_key = extra_key
        self.parent = parent
        self.children: dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0
        """Locks held on this node or on any node below it."""
        self.last_access = now


@dataclass
class MatchResult:
    """The cached prefix of a query: its KV slots and the node it ends at (the root for a miss)."""

    slots: list[int]
    last_node: TreeNode


@dataclass
class InsertResult:
    """How many leading tokens were cached already, and the node the inserted key ends at."""

    prefix_len: int
    last_node: TreeNode


class RadixCache:
    """A prefix cache over `allocator`'s slots, evicting least recently used unlocked leaves.

    `clock` stamps accesses; it is read once per operation, so every node an operation touches gets
    the same stamp.
    """

    def __init__(self, allocator: SlotAllocator, clock: Callable[[], float] = time.monotonic) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._clock = clock
        self._next_id = 0
        self._evictable = 0
        self._protected = 0
        self.root = self._new_node((), [], None, None, clock())

    # ------------------------------------------------------------------ queries

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes: what `evict` could free."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def walk(self) -> Iterator[TreeNode]:
        """Every node, the root first, each parent before its children."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))

    # ------------------------------------------------------------------ operations

    def match_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> MatchResult:
        """The longest cached prefix of `tokens` in whole pages (a partial last page never matches).

        If the match ends inside an edge, the edge is split there so the result ends at a node.
        """
        usable = len(tokens) - len(tokens) % self.page_size
        _, path = self._descend(tuple(tokens[:usable]), extra_key, self._clock())
        return MatchResult([s for node in path for s in node.value], path[-1] if path else self.root)

    def insert(self, tokens: Sequence[int], slots: Sequence[int], extra_key: ExtraKey = None) -> InsertResult:
        """Cache `tokens` (whole pages) with their KV `slots`.

        The tree takes `slots[prefix_len:]`; `slots[:prefix_len]` cover tokens it already held and
        stay the caller's to free.
        """
        key = tuple(tokens)
        if len(key) % self.page_size or len(slots) != len(key):
            raise ValueError(f"insert needs whole pages and one slot per token, got {len(key)} and {len(slots)}")
        now = self._clock()
        matched, path = self._descend(key, extra_key, now)
        last = path[-1] if path else self.root
        if matched < len(key):
            leaf = self._new_node(key[matched:], list(slots[matched:]), extra_key, last, now)
            last.children[self._child_key(extra_key, leaf.key)] = leaf
            self._evictable += len(leaf.key)
            last = leaf
        return InsertResult(matched, last)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path from the root to `node` from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one `inc_lock_ref(node)`."""
        while node is not self.root:
            if node.lock_ref == 0:
                raise RuntimeError(f"node {node.id} is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tokens of unlocked leaves, least recently used first; return how many.

        Whole nodes go, so the count may pass `num_tokens` by less than the last node's size. A parent
        whose last child goes is a candidate in the same call.
        """
        heap = [(node.last_access, node.id, node) for node in self.walk() if self._is_evictable_leaf(node)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.extra_key, leaf.key)]
            self.allocator.free(leaf.value)
            self._evictable -= len(leaf.key)
            freed += len(leaf.key)
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ------------------------------------------------------------------ internals

    def _new_node(
        self, key: tuple[int, ...], value: list[int], extra_key: ExtraKey, parent: Optional[TreeNode], now: float
    ) -> TreeNode:
        node = TreeNode(self._next_id, key, value, extra_key, parent, now)
        self._next_id += 1
        return node

    def _child_key(self, extra_key: ExtraKey, key: Sequence[int]) -> ChildKey:
        return extra_key, tuple(key[: self.page_size])

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _shared_pages(self, edge: tuple[int, ...], key: tuple[int, ...]) -> int:
        """How many leading tokens `edge` and `key` share, in whole pages."""
        ps, n = self.page_size, 0
        while n + ps <= min(len(edge), len(key)) and edge[n : n + ps] == key[n : n + ps]:
            n += ps
        return n

    def _descend(self, key: tuple[int, ...], extra_key: ExtraKey, now: float) -> tuple[int, list[TreeNode]]:
        """Follow `key` from the root, stamping every node entered and splitting an edge the key ends or
        diverges inside. Returns the matched length and the nodes on the matched path (root excluded)."""
        node, matched = self.root, 0
        node.last_access = now
        path: list[TreeNode] = []
        while matched < len(key):
            child = node.children.get(self._child_key(extra_key, key[matched:]))
            if child is None:
                break
            child.last_access = now
            shared = self._shared_pages(child.key, key[matched:])
            if shared < len(child.key):
                child = self._split(child, shared, now)
            path.append(child)
            matched += shared
            node = child
        return matched, path

    def _split(self, child: TreeNode, at: int, now: float) -> TreeNode:
        """Cut `child`'s edge after `at` tokens. A new node takes the head (and `child`'s locks, which
        cover it too); `child` keeps the tail and its identity, so handles to it stay valid."""
        parent = child.parent
        assert parent is not None
        head = self._new_node(child.key[:at], child.value[:at], child.extra_key, parent, now)
        head.lock_ref = child.lock_ref
        parent.children[self._child_key(child.extra_key, head.key)] = head
        child.key, child.value, child.parent = child.key[at:], child.value[at:], head
        head.children[self._child_key(child.extra_key, child.key)] = child
        return head
