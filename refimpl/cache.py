"""The reference model of the device tier: a deliberately plain radix tree.

Readability first: dicts, lists and full scans, no heaps or indexes. Every rule
is the one SPEC.md states, in the order it states it; where SPEC.md says
"engines may choose" (which tied leaf to evict), `evict` takes a `choose`
callback so the harness can steer this model to a backend's legal choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvcert.spec import pages
from kvcert.spec.types import (
    POLICIES,
    CacheConfig,
    Capabilities,
    InsertOut,
    InvalidCount,
    InvalidToken,
    LengthMismatch,
    LockUnderflow,
    MatchOut,
    Namespace,
    NodeView,
    PoolExhausted,
    SlotNotOwned,
    Snapshot,
    StaleHandle,
    Tokens,
    UnalignedKey,
)

_DEFAULT_CONFIG = CacheConfig()


class SlotPool:
    """A fixed pool of device slots: a free list, and the slots lent to callers.

    Slots the tree owns are simply in neither. Pages are handed out lowest
    first, so runs are reproducible.
    """

    def __init__(self, capacity: int, page_size: int) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.free_list: list[int] = list(range(capacity))
        self.lent: set[int] = set()

    def free_slots(self) -> tuple[int, ...]:
        return tuple(sorted(self.free_list))

    def alloc(self, n: int) -> tuple[int, ...]:
        _check_count(n)
        if n % self.page_size:
            raise UnalignedKey(f"alloc of {n} slots is not whole pages of {self.page_size}")
        if n > len(self.free_list):
            raise PoolExhausted(f"asked for {n} slots, {len(self.free_list)} free")
        self.free_list.sort()
        taken = tuple(self.free_list[:n])
        del self.free_list[:n]
        self.lent.update(taken)
        return taken

    def require_lent(self, slots: Sequence[int], action: str) -> None:
        if any(not isinstance(x, int) or isinstance(x, bool) for x in slots):
            raise SlotNotOwned(f"cannot {action} slots {tuple(slots)[:8]}: slot ids are ints")
        if len(set(slots)) != len(slots) or not self.lent.issuperset(slots):
            raise SlotNotOwned(f"cannot {action} slots {tuple(slots)[:8]}: not all lent to the caller")

    def give_back(self, slots: Sequence[int]) -> None:
        """A caller frees slots it was lent."""
        self.require_lent(slots, "free")
        self.lent.difference_update(slots)
        self.free_list.extend(slots)

    def adopt(self, slots: Sequence[int]) -> None:
        """The tree takes ownership of lent slots."""
        self.require_lent(slots, "adopt")
        self.lent.difference_update(slots)

    def release(self, slots: Sequence[int]) -> None:
        """The tree drops slots it owned (eviction)."""
        self.free_list.extend(slots)


@dataclass(eq=False)
class Node:
    id: int
    parent: Optional[Node]
    namespace: Namespace
    key: Tokens
    slots: tuple[int, ...]
    children: dict[tuple[Namespace, Tokens], Node] = field(default_factory=dict)
    lock_ref: int = 0
    own_locks: int = 0
    """Locks taken on this very node (so dec_lock_ref can refuse an unlock nobody took)."""
    last_access: int = 0
    hit_count: int = 0
    creation: int = 0
    priority: int = 0


def _check_count(n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidCount(f"count must be a non-negative int, got {n!r}")


def _check_tokens(tokens: Sequence[object]) -> Tokens:
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InvalidToken(f"token ids must be non-negative ints, got {t!r}")
    return tuple(tokens)  # type: ignore[arg-type]


class RefCache:
    """The oracle, and a Backend in its own right (strict input checking)."""

    capabilities = Capabilities(
        name="kvcert.refimpl",
        page_sizes=(1, 2, 4, 8, 16),
        policies=POLICIES,
        namespaces=True,
        strict_input=True,
    )

    def __init__(self, config: CacheConfig = _DEFAULT_CONFIG) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}")
        if config.page_size < 1 or config.capacity % config.page_size:
            raise ValueError("capacity must be whole pages")
        self.page_size = config.page_size
        self.policy = config.policy
        self.pool = SlotPool(config.capacity, config.page_size)
        self.now = 0
        self._next_id = 1
        self.root = Node(id=0, parent=None, namespace=None, key=(), slots=())
        self.nodes: dict[int, Node] = {0: self.root}
        self.evictable_size = 0
        self.protected_size = 0

    # ------------------------------------------------------------------ helpers

    def _new_node(self, **kw) -> Node:
        node = Node(id=self._next_id, **kw)
        self._next_id += 1
        self.nodes[node.id] = node
        return node

    def _selector(self, namespace: Namespace, key: Sequence[int]) -> tuple[Namespace, Tokens]:
        return namespace, pages.first_page(key, self.page_size)

    def _live(self, node_id: object) -> Node:
        if isinstance(node_id, bool):
            raise StaleHandle(f"no live node {node_id!r}: handles are node ids, not bools")
        node = self.nodes.get(node_id) if isinstance(node_id, int) else None
        if node is None:
            raise StaleHandle(f"no live node {node_id!r}")
        return node

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child` at `at` tokens; the new node takes the prefix and `child` keeps its identity."""
        head_key, tail_key = pages.split_key(child.key, at, self.page_size)
        parent = child.parent
        assert parent is not None
        head = self._new_node(
            parent=parent,
            namespace=child.namespace,
            key=head_key,
            slots=child.slots[:at],
            lock_ref=child.lock_ref,
            last_access=self.now,
            hit_count=child.hit_count,
            creation=self.now,
            priority=child.priority,
        )
        parent.children[self._selector(child.namespace, head_key)] = head
        child.key, child.slots, child.parent = tail_key, child.slots[at:], head
        head.children[self._selector(child.namespace, tail_key)] = child
        return head

    def _walk(self, namespace: Namespace, key: Tokens, on_node: Callable[[Node], None]) -> tuple[int, Node, list[int]]:
        """Follow `key` down the tree, splitting where it ends or diverges inside an edge.

        Calls `on_node` on every node entered (after any split). Returns the matched
        length, the last node and the matched slots.
        """
        slots: list[int] = []
        node, matched = self.root, 0
        while matched < len(key):
            child = node.children.get(self._selector(namespace, key[matched:]))
            if child is None:
                break
            child.last_access = self.now
            n = pages.match_len(child.key, key[matched:], self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            on_node(child)
            slots += child.slots
            matched += n
            node = child
        return matched, node, slots

    # ------------------------------------------------------------------ protocol

    def set_clock(self, now: int) -> None:
        self.now = now

    def alloc(self, n: int) -> tuple[int, ...]:
        return self.pool.alloc(n)

    def free(self, slots: Sequence[int]) -> None:
        self.pool.give_back(slots)

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchOut:
        key = _check_tokens(tokens)
        key = key[: pages.page_floor(len(key), self.page_size)]
        self.root.last_access = self.now
        matched, node, slots = self._walk(namespace, key, lambda n: None)
        return MatchOut(length=matched, slots=tuple(slots), node=node.id)

    def insert(self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int], priority: int = 0) -> InsertOut:
        key = _check_tokens(tokens)
        if not pages.is_aligned(len(key), self.page_size):
            raise UnalignedKey(f"key of {len(key)} tokens is not whole pages of {self.page_size}")
        if len(slots) != len(key):
            raise LengthMismatch(f"{len(key)} tokens but {len(slots)} slots")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidCount(f"priority must be an int, got {priority!r}")
        self.pool.require_lent(slots, "insert")

        def hit(node: Node) -> None:
            node.hit_count += 1
            node.priority = max(node.priority, priority)

        self.root.last_access = self.now
        matched, node, _ = self._walk(namespace, key, hit)
        if matched < len(key):
            leaf = self._new_node(
                parent=node,
                namespace=namespace,
                key=key[matched:],
                slots=tuple(slots[matched:]),
                last_access=self.now,
                hit_count=1,
                creation=self.now,
                priority=priority,
            )
            node.children[self._selector(namespace, leaf.key)] = leaf
            self.pool.adopt(leaf.slots)
            self.evictable_size += len(leaf.key)
            node = leaf
        return InsertOut(prefix_len=matched, node=node.id)

    def _path_to_root(self, node: Node) -> list[Node]:
        out = []
        cur: Optional[Node] = node
        while cur is not None and cur is not self.root:
            out.append(cur)
            cur = cur.parent
        return out

    def inc_lock_ref(self, node_id: int) -> None:
        node = self._live(node_id)
        node.own_locks += 1
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                self.evictable_size -= len(n.key)
                self.protected_size += len(n.key)
            n.lock_ref += 1

    def dec_lock_ref(self, node_id: int) -> None:
        node = self._live(node_id)
        if node.own_locks == 0:
            raise LockUnderflow(f"node {node_id} holds no lock of its own")
        node.own_locks -= 1
        for n in self._path_to_root(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_size += len(n.key)
                self.protected_size -= len(n.key)

    def evictable_leaves(self) -> list[Node]:
        return [
            n
            for n in self.nodes.values()
            if n is not self.root and not n.children and n.lock_ref == 0
        ]

    def rank(self, node: Node) -> tuple[int, ...]:
        return pages.policy_rank(self.policy, node.last_access, node.hit_count, node.creation, node.priority)

    def evict(self, n: int, choose: Optional[Callable[[list[int]], int]] = None) -> int:
        """Remove minimal-rank unlocked leaves until `n` tokens are freed or none is left."""
        _check_count(n)
        freed = 0
        while freed < n:
            leaves = self.evictable_leaves()
            if not leaves:
                break
            tied = pages.min_rank_ids([(self.rank(leaf), leaf.id) for leaf in leaves])
            victim = self.nodes[choose(tied) if choose else min(tied)]
            self._delete_leaf(victim)
            freed += len(victim.key)
        return freed

    def _delete_leaf(self, leaf: Node) -> None:
        assert leaf.parent is not None
        del leaf.parent.children[self._selector(leaf.namespace, leaf.key)]
        del self.nodes[leaf.id]
        self.pool.release(leaf.slots)
        self.evictable_size -= len(leaf.key)

    def snapshot(self) -> Snapshot:
        views = tuple(
            NodeView(
                id=n.id,
                parent=n.parent.id if n.parent is not None else None,
                namespace=n.namespace,
                key=n.key,
                slots=n.slots,
                lock_ref=n.lock_ref,
            )
            for n in self.nodes.values()
        )
        return Snapshot(
            page_size=self.page_size,
            capacity=self.pool.capacity,
            slot_limit=self.pool.capacity,
            root=self.root.id,
            nodes=views,
            free_slots=self.pool.free_slots(),
            evictable_size=self.evictable_size,
            protected_size=self.protected_size,
        )


def factory(config: CacheConfig) -> RefCache:
    """`kvcert certify kvcert.refimpl:factory` entry point."""
    return RefCache(config)


factory.capabilities = RefCache.capabilities  # type: ignore[attr-defined]
