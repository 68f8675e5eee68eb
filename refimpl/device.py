"""The device tier (SPEC.md §4, §8): match, insert, locks and device eviction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from kvcert.refimpl.records import (
    Node,
)
from kvcert.refimpl.tree import Tree
from kvcert.spec import pages
from kvcert.spec.decisions import Chooser
from kvcert.spec.types import (
    InsertOut,
    InvalidCount,
    LengthMismatch,
    LockUnderflow,
    MatchOut,
    Namespace,
    UnalignedKey,
    check_count,
    check_scope,
    check_tokens,
)


class DeviceTier(Tree):
    """Match, insert, locks and eviction on the device pool."""

    def set_clock(self, now: int) -> None:
        self.now = now
        self.chosen = []

    def alloc(self, n: int) -> tuple[int, ...]:
        return self.pool.alloc(n)

    def free(self, slots: Sequence[int]) -> None:
        self.pool.give_back(slots)

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchOut:
        key = check_tokens(tokens)
        key = key[: pages.page_floor(len(key), self.page_size)]
        self.root.last_access = self.now
        _, path = self._walk(namespace, key, lambda n: None)
        device = [n for n in path if n.slots is not None]  # a prefix of the path (INV-HOST-2)
        on_host = path[len(device) :]
        backed = [n for n in path if n.host_slots is not None]
        return MatchOut(
            length=sum(len(n.key) for n in device),
            slots=tuple(x for n in device for x in n.slots or ()),
            node=device[-1].id if device else self.root.id,
            host_length=sum(len(n.key) for n in on_host),
            host_node=backed[-1].id if backed else self.root.id,
        )

    def insert(
        self,
        namespace: Namespace,
        tokens: Sequence[int],
        slots: Sequence[int],
        priority: int = 0,
        inserted_len: int = 0,
    ) -> InsertOut:
        """Cache `tokens` over `slots` (SPEC.md §4.2). `inserted_len`: how much of this key the same request
        inserted before, whose nodes its earlier checkpoints counted a hit for already (SGLang's gate, §4.8);
        0 counts a hit on every node the insert passes or makes."""
        key = check_tokens(tokens)
        if not pages.is_aligned(len(key), self.page_size):
            raise UnalignedKey(f"key of {len(key)} tokens is not whole pages of {self.page_size}")
        if len(slots) != len(key):
            raise LengthMismatch(f"{len(key)} tokens but {len(slots)} slots")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidCount(f"priority must be an int, got {priority!r}")
        held = self._held_prefix(namespace, key)  # a slot that is the tree's own there is a running request's (§4.8)
        self.pool.require_lent(
            [x for i, x in enumerate(slots) if i >= len(held) or type(x) is not int or x != held[i]], "insert"
        )

        reached = [0]  # tokens from the root to the end of the node entered last

        def hit(node: Node) -> None:
            reached[0] += len(node.key)
            if reached[0] > inserted_len:
                node.hit_count += 1
            node.priority = max(node.priority, priority)

        self.root.last_access = self.now
        matched, path = self._walk(namespace, key, hit)
        prefix_len, offset = 0, 0
        for node in path:
            if node.slots is None:  # evicted: the request's fresh KV restores it; the host copy stays
                node.slots = tuple(slots[offset : offset + len(node.key)])
                self.pool.adopt(node.slots)
                self._account(node, +1)
            elif offset == prefix_len:
                prefix_len += len(node.key)
            offset += len(node.key)
        node = path[-1] if path else self.root
        if matched < len(key):
            leaf = self._new_node(
                parent=node,
                namespace=namespace,
                key=key[matched:],
                slots=tuple(slots[matched:]),
                last_access=self.now,
                hit_count=int(len(key) > inserted_len),
                creation=self.now,
                priority=priority,
            )
            node.children[self._selector(namespace, leaf.key)] = leaf
            self._made(leaf)
            self.pool.adopt(leaf.slots or ())
            self._account(leaf, +1)
            path.append(leaf)
            node = leaf
        self._write_through([n for n in path if self._wants_backup(n)])
        return InsertOut(prefix_len=prefix_len, node=node.id)

    def inc_lock_ref(self, node_id: int) -> None:
        """Lock the path ending at `node_id`; a host-only node may be locked (SPEC.md §9.1)."""
        node = self._live(node_id)
        node.own_locks += 1
        self._lock_path(node, +1)

    def dec_lock_ref(self, node_id: int) -> None:
        node = self._live(node_id)
        if node.own_locks == 0:
            raise LockUnderflow(f"node {node_id} holds no lock of its own")
        node.own_locks -= 1
        self._lock_path(node, -1)

    def evictable_leaves(self) -> list[Node]:
        """Device eviction candidates: unlocked, on device, no child on device, in the eviction's scope.

        A node without a backup is dropped with its host-only subtree, so it is no
        candidate while that subtree holds a protected host copy (SPEC.md §9.3).
        """
        return [
            n
            for n in self.nodes.values()
            if n is not self.root
            and n.slots is not None
            and n.lock_ref == 0
            and not any(c.slots is not None for c in n.children.values())
            and not self.pinned(n)
            and self.in_scope(n)
        ]

    def in_scope(self, node: Node) -> bool:
        """May the running eviction touch this node's tier (SPEC.md §11.3)?"""
        allow_low, allow_high = self.scope
        tier = self.tier(node)
        return tier == 0 or (tier == 1 and allow_low) or (tier == 2 and allow_high)

    def pinned(self, node: Node) -> bool:
        """A node eviction may not even try: one that would drop a protected host copy (SPEC.md §9.3).

        Under write-back it is tried all the same: its backup is made first, and only if that
        fails does eviction skip it (`evict`; SGLang's order, calibration D14).
        """
        return self.write_policy != "write_back" and self.drops_protected(node)

    def drops_protected(self, node: Node) -> bool:
        """A node without a backup that eviction would drop along with a protected host copy.

        The protected copy is a host-only node below it (locked or host-protected), or the
        node's own host lock (a prefetch anchor under write-back).
        """
        return node.host_slots is None and (node.host_lock_ref > 0 or self._pins_subtree(node))

    def _pins_subtree(self, node: Node) -> bool:
        return any(
            c.lock_ref > 0 or c.host_lock_ref > 0 or self._pins_subtree(c)
            for c in node.children.values()
            if c.slots is None
        )

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True, choose: Optional[Chooser] = None) -> int:
        """Free device KV of minimal-rank candidates in scope until `n` tokens are freed or none is left."""
        check_count(n)
        scope = check_scope(allow_low, allow_high)
        if scope == (True, True):
            return self._evict(n, choose)  # the full scope: the one in force between calls
        outer, self.scope = self.scope, scope
        try:
            return self._evict(n, choose)
        finally:
            self.scope = outer  # the scope belongs to this call (SPEC.md §11.3)

    def _evict(self, n: int, choose: Optional[Chooser]) -> int:
        freed = 0
        skipped: set[int] = set()
        while freed < n:
            leaves = [v for v in self.evictable_leaves() if v.id not in skipped]
            if not leaves:
                break
            victim = self._pick(leaves, choose)
            if victim.host_slots is None and self.write_policy == "write_back":
                # the engine waits for this copy (writing_check(write_back=True))
                if self._write_backup(victim):
                    self._store([victim])  # D8: the eviction backup is stored
                elif self.drops_protected(victim):
                    skipped.add(victim.id)  # D14: "subtree drop declined"; it stays on the device
                    self.chosen.append(("skip", victim.id))
                    continue
            self.chosen.append(("evict", victim.id))
            if victim.host_slots is not None:
                self._demote(victim)
            else:
                self._delete_leaf(victim)
            freed += len(victim.key)
        return freed

    def _demote(self, node: Node) -> None:
        """Free a backed-up node's device KV; it stays in the tree on the host."""
        self._account(node, -1)
        self.pool.release(node.slots or ())
        node.slots = None

    def _delete_leaf(self, leaf: Node) -> None:
        """Remove a node without a backup (and whatever host-only subtree hangs below it)."""
        assert leaf.parent is not None
        for child in list(leaf.children.values()):
            self._delete_host_leaf(child)
        del leaf.parent.children[self._selector(leaf.namespace, leaf.key)]
        del self.nodes[leaf.id]
        self._account(leaf, -1)
        self.pool.release(leaf.slots or ())
        self._sessions_leave(leaf)

    def _delete_host_leaf(self, node: Node) -> None:
        for child in list(node.children.values()):
            self._delete_host_leaf(child)
        assert node.parent is not None and self.host is not None
        del node.parent.children[self._selector(node.namespace, node.key)]
        del self.nodes[node.id]
        self.host.release(node.host_slots or ())
        self._sessions_leave(node)
