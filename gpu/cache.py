"""The production-shaped cache: a radix tree over torch KV pools, with incremental metadata.

Written from SPEC.md alone (it shares no code with `kvcert.refimpl`, which the suite compares it
with). What makes it production-shaped rather than a model:

- KV lives in torch tensors (`kvcert.gpu.kv`), on CUDA when there is one, the host pool pinned;
  bytes really move between the tiers through a copy engine (`kvcert.gpu.copy_engine`).
- Slots come from page allocators (`kvcert.gpu.alloc`): O(slots) per call.
- Children are found by a hash of (namespace, first page): O(1) per edge.
- Eviction candidates are kept *exact and incrementally*: the set of device leaves (on device,
  unlocked, no child on device), the set of host leaves (host only, childless, unlocked, not host
  protected) and write-back's settled duplicates (an insertion-ordered dict). Each of the first two
  has a min-heap keyed by the policy rank with lazy deletion (entries carry the node's metadata
  version); `_refresh(node)` re-derives one node's memberships in O(1) and is called wherever a
  node's residency, children, locks, host locks or copies change.
- Nothing on the hot path scans the tree. The only walks are the ones the spec implies: a key's
  path (match, insert), a node's path to the root (locks), and, for a device candidate without a
  backup, its host-only subtree (is it pinned, SPEC.md §9.3; empty except under write-back).
  `snapshot()` is O(tree): it is observation.

Time is the harness's logical clock (`set_clock`); nothing reads a wall clock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, TypeGuard, Union

import torch

from kvcert.gpu.agreement import Agreement
from kvcert.gpu.alloc import PageAllocator
from kvcert.gpu.copy_engine import CopyEngine, CopyJob, Ticket, make_engine
from kvcert.gpu.kv import KVGeometry, KVPool, make_pool
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.types import (
    FAULTS,
    POLICIES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    WRITE_THROUGH_THRESHOLD,
    CacheConfig,
    InsertOut,
    InvalidCount,
    LengthMismatch,
    LockUnderflow,
    MatchOut,
    Namespace,
    NodeView,
    PendingCopy,
    PendingPrefetch,
    PoolExhausted,
    RetractionView,
    SlotNotOwned,
    Snapshot,
    StaleHandle,
    UnalignedKey,
    UnknownCopy,
    UnknownFault,
    UnknownPrefetch,
    UnknownRetraction,
    check_count,
    check_tokens,
)

Selector = tuple[Namespace, tuple[int, ...]]


class Node:
    """A radix-tree vertex. `slots`/`host_slots` are None when absent on that tier."""

    __slots__ = (
        "id",
        "parent",
        "ns",
        "key",
        "slots",
        "host_slots",
        "children",
        "dev_children",
        "lock_ref",
        "own_locks",
        "host_lock_ref",
        "last_access",
        "hit_count",
        "creation",
        "priority",
        "ver",
        "dev_pushed",
        "host_pushed",
        "copies",
        "hl_owners",
        "end",
    )

    def __init__(self, node_id: int, parent: Optional[Node], ns: Namespace, key: tuple[int, ...]) -> None:
        self.id = node_id
        self.parent = parent
        self.ns = ns
        self.key = key
        self.slots: Optional[tuple[int, ...]] = None
        self.host_slots: Optional[tuple[int, ...]] = None
        self.children: dict[Selector, Node] = {}
        self.dev_children = 0
        """Children on the device: a node is a device leaf when this is 0."""
        self.lock_ref = 0
        self.own_locks = 0
        self.host_lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.creation = 0
        self.priority = 0
        self.ver = 0
        """Bumped on every rank change: heap entries with an older version are stale."""
        self.dev_pushed = -1
        self.host_pushed = -1
        """Version of this node's live entry in the device / host heap (-1: none)."""
        self.copies: list[Copy] = []
        """Pending copies that move this node."""
        self.hl_owners: list[Union[Copy, Prefetch]] = []
        """Owners of this node's host-lock segments (a load, a store, a prefetch)."""
        self.end: int = (parent.end if parent is not None else 0) + len(key)
        """Tokens from the root to this node's end: fixed for life (a split keeps the deeper half's end)."""


@dataclass(eq=False)
class Copy:
    id: int
    kind: str
    nodes: list[Node]
    anchors: list[Node]
    host_locked: list[Node]
    ticket: Ticket
    finished: bool = False


@dataclass(eq=False)
class Prefetch:
    id: int
    anchor: Node
    ns: Namespace
    tokens: tuple[int, ...]
    start: int
    keys: tuple[str, ...]
    host_slots: tuple[int, ...]
    issued_at: int
    host_locked: list[Node] = field(default_factory=list)
    fetched: int = 0
    failed: bool = False
    span_pages: int = 0
    """Pages the request asked for after the anchor, stored or not: the timeout's budget (D11)."""
    waiting_since: Optional[int] = None
    """The first check_prefetch that kept it running: the timeout's start (D11)."""


@dataclass(eq=False)
class Retraction:
    id: int
    tokens: int
    host_slots: tuple[int, ...]


def _is_id(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


class GpuCache:
    """Device, host and storage tiers over torch pools (SPEC.md §4, §9, §10)."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        layout: str = "layer_first",
        host_layout: str = "layer_first",
        geometry: Optional[KVGeometry] = None,
        engine: str = "deferred",
        device: Optional[torch.device] = None,
        agreement: Optional[Agreement] = None,
    ) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}")
        ps = config.page_size
        if ps < 1 or config.capacity % ps or config.host_capacity % ps:
            raise ValueError("capacities must be whole pages")
        if config.host_capacity and config.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {config.write_policy!r}")
        if config.prefetch_policy and (config.prefetch_policy not in PREFETCH_POLICIES or not config.host_capacity):
            raise ValueError(f"prefetch policy {config.prefetch_policy!r} needs a host tier")
        cuda = torch.cuda.is_available()
        self.device = device if device is not None else torch.device("cuda" if cuda else "cpu")
        self.geometry = geometry if geometry is not None else KVGeometry(layers=config.kv_layers)
        if self.geometry.layers != config.kv_layers:
            raise ValueError("geometry.layers must equal config.kv_layers")
        self.page_size, self.policy = ps, config.policy
        self.capacity, self.host_capacity = config.capacity, config.host_capacity
        self.kv = make_pool(layout, config.capacity, ps, self.geometry, self.device)
        self.alloc_dev = PageAllocator(config.capacity, ps)
        self.host_kv: Optional[KVPool] = None
        self.alloc_host: Optional[PageAllocator] = None
        if config.host_capacity:
            pin = cuda
            self.host_kv = make_pool(host_layout, config.host_capacity, ps, self.geometry, torch.device("cpu"), pin)
            self.alloc_host = PageAllocator(config.host_capacity, ps)
        self.write_policy = config.write_policy if config.host_capacity else ""
        self.write_back = self.write_policy == "write_back"
        self.threshold = WRITE_THROUGH_THRESHOLD.get(self.write_policy)
        self.load_back_threshold = config.load_back_threshold
        self.engine: CopyEngine = make_engine(engine)
        self.agreement = agreement if agreement is not None else Agreement()
        """Tensor-parallel ranks agree (MIN) on the acks they consume and the pages a prefetch keeps."""
        self.now = 0
        self._next_id = 1
        self.root = Node(0, None, None, ())
        self.root.slots = ()
        self.nodes: dict[int, Node] = {0: self.root}
        self.evictable_size = 0
        self.protected_size = 0
        # eviction candidates, exact; heaps ordered by (rank, id, version), lazily pruned
        self.dev_leaves: set[int] = set()
        self.host_leaves: set[int] = set()
        self.dev_heap: list[tuple[tuple[int, ...], int, int]] = []
        self.host_heap: list[tuple[tuple[int, ...], int, int]] = []
        self.dups: dict[int, Node] = {}
        """Write-back's settled duplicates (on both tiers, no pending copy, no host lock)."""
        self.dup_heap: list[int] = []
        """Their ids, oldest node first (lazy deletion): reclaim takes the oldest (see `_evict_host`)."""
        # copies
        self.copies: OrderedDict[int, Copy] = OrderedDict()
        self.queues: dict[str, deque[Copy]] = {"write": deque(), "load": deque(), "store": deque()}
        self._next_copy = 0
        # storage
        self.prefetch_policy = config.prefetch_policy
        self.timeout = (config.prefetch_timeout_base, config.prefetch_timeout_per_page)
        self.kv_layers = config.kv_layers
        self.digest = l3.canonical_digest(ps, config.model_id)
        self.storage: Optional[l3.StorageBackend] = None
        self.prefetches: OrderedDict[int, Prefetch] = OrderedDict()
        self._next_prefetch = 0
        self.retractions: OrderedDict[int, Retraction] = OrderedDict()
        self._next_retraction = 0

    # ================================================================== metadata upkeep

    def _rank(self, n: Node) -> tuple[int, ...]:
        return pages.policy_rank(self.policy, n.last_access, n.hit_count, n.creation, n.priority)

    def _refresh(self, n: Node) -> None:
        """Re-derive `n`'s candidate memberships (O(1)); push a heap entry when it joins or re-ranks."""
        if n is self.root:
            return
        if n.slots is not None and n.lock_ref == 0 and n.dev_children == 0:
            self.dev_leaves.add(n.id)
            if n.dev_pushed != n.ver:
                heapq.heappush(self.dev_heap, (self._rank(n), n.id, n.ver))
                n.dev_pushed = n.ver
        else:
            self.dev_leaves.discard(n.id)
        if n.slots is None and not n.children and n.lock_ref == 0 and n.host_lock_ref == 0:
            self.host_leaves.add(n.id)
            if n.host_pushed != n.ver:
                heapq.heappush(self.host_heap, (self._rank(n), n.id, n.ver))
                n.host_pushed = n.ver
        else:
            self.host_leaves.discard(n.id)
        if (
            self.write_back
            and n.slots is not None
            and n.host_slots is not None
            and n.host_lock_ref == 0
            and not n.copies
        ):
            if n.id not in self.dups:
                self.dups[n.id] = n
                heapq.heappush(self.dup_heap, n.id)
        else:
            self.dups.pop(n.id, None)

    def _touch(self, n: Node) -> None:
        """`n`'s rank metadata changed: new version, so old heap entries go stale."""
        n.ver += 1
        self._refresh(n)

    def _pop(self, heap: list[tuple[tuple[int, ...], int, int]], members: set[int], device: bool) -> Optional[Node]:
        """The minimal-rank member of `members`, popped from `heap` (stale entries dropped)."""
        while heap:
            _, node_id, ver = heapq.heappop(heap)
            n = self.nodes.get(node_id)
            if n is None or ver != n.ver:
                continue
            if device:
                n.dev_pushed = -1
            else:
                n.host_pushed = -1
            if node_id in members:
                return n
        return None

    def _compact(self) -> None:
        """Rebuild a heap whose stale entries outnumber the live ones (amortised O(1) per push)."""
        for heap, members, device in (
            (self.dev_heap, self.dev_leaves, True),
            (self.host_heap, self.host_leaves, False),
        ):
            if len(heap) > 4 * len(members) + 64:
                for _, node_id, _ in heap:  # entries about to vanish: their nodes must push again
                    gone = self.nodes.get(node_id)
                    if gone is not None:
                        if device:
                            gone.dev_pushed = -1
                        else:
                            gone.host_pushed = -1
                live = []
                for node_id in members:
                    n = self.nodes[node_id]
                    live.append((self._rank(n), n.id, n.ver))
                    if device:
                        n.dev_pushed = n.ver
                    else:
                        n.host_pushed = n.ver
                heapq.heapify(live)
                heap[:] = live
        if len(self.dup_heap) > 4 * len(self.dups) + 64:
            self.dup_heap = sorted(self.dups)

    def _new_node(self, parent: Node, ns: Namespace, key: tuple[int, ...]) -> Node:
        n = Node(self._next_id, parent, ns, key)
        self._next_id += 1
        self.nodes[n.id] = n
        return n

    def _forget(self, n: Node) -> None:
        del self.nodes[n.id]
        self.dev_leaves.discard(n.id)
        self.host_leaves.discard(n.id)
        self.dups.pop(n.id, None)

    def _selector(self, ns: Namespace, key: Sequence[int], at: int = 0) -> Selector:
        return ns, tuple(key[at : at + self.page_size])

    def _account(self, n: Node, sign: int) -> None:
        if n.lock_ref > 0:
            self.protected_size += sign * len(n.key)
        else:
            self.evictable_size += sign * len(n.key)

    def _set_device(self, n: Node, slots: Optional[tuple[int, ...]]) -> None:
        """Move `n` on or off the device, keeping counters, the parent's device-child count and memberships exact."""
        was = n.slots is not None
        if was:
            self._account(n, -1)
        n.slots = slots
        now = slots is not None
        if now:
            self._account(n, +1)
        parent = n.parent
        if parent is not None and was != now:
            parent.dev_children += 1 if now else -1
            self._refresh(parent)
        self._refresh(n)

    def _lock_path(self, node: Node, delta: int) -> None:
        cur: Optional[Node] = node
        while cur is not None and cur is not self.root:
            on_device = cur.slots is not None
            if on_device:
                self._account(cur, -1)
            cur.lock_ref += delta
            if on_device:
                self._account(cur, +1)
            self._refresh(cur)
            cur = cur.parent

    def _host_lock(self, n: Node, owner: Union[Copy, Prefetch]) -> None:
        n.host_lock_ref += 1
        n.hl_owners.append(owner)
        owner.host_locked.append(n)
        self._refresh(n)

    def _host_unlock_all(self, owner: Union[Copy, Prefetch]) -> None:
        for n in owner.host_locked:
            n.host_lock_ref -= 1
            n.hl_owners.remove(owner)
            self._refresh(n)
        owner.host_locked = []

    def _path(self, n: Node) -> tuple[int, ...]:
        parts: list[tuple[int, ...]] = []
        cur: Optional[Node] = n
        while cur is not None and cur is not self.root:
            parts.append(cur.key)
            cur = cur.parent
        return tuple(t for part in reversed(parts) for t in part)

    def _live(self, node_id: object) -> Node:
        n = self.nodes.get(node_id) if _is_id(node_id) else None
        if n is None:
            raise StaleHandle(f"no live node {node_id!r}")
        return n

    # ================================================================== tree walk

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child` at `at` tokens: a new head takes the prefix, `child` keeps its identity (SPEC.md §4.3)."""
        parent = child.parent
        assert parent is not None
        head = self._new_node(parent, child.ns, child.key[:at])
        head.slots = None if child.slots is None else child.slots[:at]
        head.host_slots = None if child.host_slots is None else child.host_slots[:at]
        head.lock_ref, head.host_lock_ref = child.lock_ref, child.host_lock_ref
        head.last_access, head.creation = self.now, self.now
        head.hit_count, head.priority = child.hit_count, child.priority
        parent.children[self._selector(child.ns, child.key)] = head
        child.key = child.key[at:]
        if child.slots is not None:
            child.slots = child.slots[at:]
        if child.host_slots is not None:
            child.host_slots = child.host_slots[at:]
        child.parent = head
        head.children[self._selector(child.ns, child.key)] = child
        head.dev_children = 1 if child.slots is not None else 0
        for c in child.copies:  # a copy in flight moves both halves
            c.nodes.append(head)
            head.copies.append(c)
        for owner in child.hl_owners:  # a host-lock segment lengthens
            owner.host_locked.append(head)
            head.hl_owners.append(owner)
        self._refresh(head)
        self._touch(child)
        return head

    def _walk(self, ns: Namespace, key: tuple[int, ...], priority: Optional[int]) -> tuple[int, list[Node]]:
        """Follow `key` from the root, splitting where it ends or diverges inside an edge.

        Stamps every node entered; with `priority` (an insert) also counts a hit on it.
        """
        ps = self.page_size
        path: list[Node] = []
        node, matched, size = self.root, 0, len(key)
        while matched < size:
            child = node.children.get((ns, key[matched : matched + ps]))
            if child is None:
                break
            child.last_access = self.now
            edge = child.key
            n, limit = 0, min(len(edge), size - matched)
            while n < limit and edge[n] == key[matched + n]:
                n += 1
            n -= n % ps
            if n < len(edge):
                child = self._split(child, n)
            if priority is not None:
                child.hit_count += 1
                child.priority = max(child.priority, priority)
            self._touch(child)
            path.append(child)
            matched += n
            node = child
        return matched, path

    # ================================================================== device tier (SPEC.md §4)

    def set_clock(self, now: int) -> None:
        self.now = now

    def free_count(self) -> int:
        """Free device slots, in O(1): what a scheduler reads before it allocates (not in the protocol)."""
        return self.alloc_dev.available

    def alloc(self, n: int) -> tuple[int, ...]:
        check_count(n)
        if n % self.page_size:
            raise UnalignedKey(f"alloc of {n} slots is not whole pages of {self.page_size}")
        if n > self.alloc_dev.available:
            raise PoolExhausted(f"asked for {n} slots, {self.alloc_dev.available} free")
        return self.alloc_dev.lend(n)

    def free(self, slots: Sequence[int]) -> None:
        if not self.alloc_dev.are_lent(slots):
            raise SlotNotOwned(f"cannot free slots {tuple(slots)[:8]}: not all lent to the caller")
        self.alloc_dev.give_back(slots)

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchOut:
        key = check_tokens(tokens)
        key = key[: pages.page_floor(len(key), self.page_size)]
        self.root.last_access = self.now
        _, path = self._walk(namespace, key, None)
        length, node, host_length, host_node = 0, self.root, 0, self.root
        slots: list[int] = []
        for n in path:
            if n.slots is not None and host_length == 0:
                length += len(n.key)
                slots.extend(n.slots)
                node = n
            else:
                host_length += len(n.key)
            if n.host_slots is not None:
                host_node = n
        self._compact()
        return MatchOut(length, tuple(slots), node.id, host_length, host_node.id)

    def insert(self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int], priority: int = 0) -> InsertOut:
        key = check_tokens(tokens)
        if len(key) % self.page_size:
            raise UnalignedKey(f"key of {len(key)} tokens is not whole pages of {self.page_size}")
        if len(slots) != len(key):
            raise LengthMismatch(f"{len(key)} tokens but {len(slots)} slots")
        if not _is_id(priority):
            raise InvalidCount(f"priority must be an int, got {priority!r}")
        if not self.alloc_dev.are_lent(slots):
            raise SlotNotOwned(f"cannot insert slots {tuple(slots)[:8]}: not all lent to the caller")
        slots = tuple(slots)
        self.root.last_access = self.now
        matched, path = self._walk(namespace, key, priority)
        prefix_len, offset = 0, 0
        for n in path:
            if n.slots is None:  # host only: the request's fresh KV restores it, the backup stays
                mine = slots[offset : offset + len(n.key)]
                self.alloc_dev.adopt(mine)
                self._set_device(n, mine)
            elif offset == prefix_len:
                prefix_len += len(n.key)
            offset += len(n.key)
        node = path[-1] if path else self.root
        if matched < len(key):
            leaf = self._new_node(node, namespace, key[matched:])
            leaf.last_access = leaf.creation = self.now
            leaf.hit_count, leaf.priority = 1, priority
            node.children[self._selector(namespace, leaf.key)] = leaf
            self.alloc_dev.adopt(slots[matched:])
            self._set_device(leaf, slots[matched:])
            path.append(leaf)
            node = leaf
        if self.threshold is not None:
            self._write_through([n for n in path if self._wants_backup(n)])
        self._compact()
        return InsertOut(prefix_len, node.id)

    def inc_lock_ref(self, node: int) -> None:
        n = self._live(node)
        n.own_locks += 1
        self._lock_path(n, +1)

    def dec_lock_ref(self, node: int) -> None:
        n = self._live(node)
        if n.own_locks == 0:
            raise LockUnderflow(f"node {node} holds no lock of its own")
        n.own_locks -= 1
        self._lock_path(n, -1)

    def evict(self, n: int) -> int:
        check_count(n)
        freed = self._evict(n)
        self._compact()
        return freed

    def _drops_protected(self, n: Node) -> bool:
        """A node without a backup whose drop would take a protected host copy with it (SPEC.md §9.3)."""
        if n.host_slots is not None:
            return False
        if n.host_lock_ref > 0:
            return True
        stack = [c for c in n.children.values() if c.slots is None]
        while stack:
            c = stack.pop()
            if c.lock_ref > 0 or c.host_lock_ref > 0:
                return True
            stack.extend(g for g in c.children.values() if g.slots is None)
        return False

    def _evict(self, n: int) -> int:
        """Free device KV of minimal-rank candidates until `n` tokens are freed or none is left."""
        freed = 0
        aside: list[Node] = []
        while freed < n:
            victim = self._pop(self.dev_heap, self.dev_leaves, True)
            if victim is None:
                break
            if not self.write_back and self._drops_protected(victim):
                aside.append(victim)  # pinned: no candidate
                continue
            if victim.host_slots is None and self.write_back:
                # Write-back tries it: a synchronous backup, then a store copy of it (D8); if the
                # backup fails and a drop would take a protected host copy, it stays (D14).
                if self._backup_now(victim):
                    self._store([victim])
                elif self._drops_protected(victim):
                    aside.append(victim)
                    continue
            if victim.host_slots is not None:
                self.alloc_dev.release(victim.slots or ())
                self._set_device(victim, None)
            else:
                self._drop(victim)
            freed += len(victim.key)
        for v in aside:  # pinned ones stay candidates-in-waiting
            if v.id in self.nodes:
                self._refresh(v)
        return freed

    def _drop(self, n: Node) -> None:
        """Remove a device node without a backup, with any host-only subtree below it."""
        parent = n.parent
        assert parent is not None
        for c in list(n.children.values()):
            self._delete_host_subtree(c)
        del parent.children[self._selector(n.ns, n.key)]
        self.alloc_dev.release(n.slots or ())
        self._account(n, -1)
        parent.dev_children -= 1
        self._forget(n)
        self._refresh(parent)

    def _delete_host_subtree(self, top: Node) -> None:
        assert self.alloc_host is not None
        stack = [top]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.alloc_host.release(n.host_slots or ())
            self._forget(n)
        parent = top.parent
        assert parent is not None
        del parent.children[self._selector(top.ns, top.key)]
        self._refresh(parent)

    # ================================================================== host tier (SPEC.md §9)

    def _wants_backup(self, n: Node) -> bool:
        assert self.threshold is not None
        return n.slots is not None and n.host_slots is None and n.hit_count >= self.threshold

    def _host_alloc(self, n: int) -> Optional[tuple[int, ...]]:
        """`n` host slots for the cache; host eviction makes room first. None without room or on an armed fault."""
        assert self.alloc_host is not None
        if self.alloc_host.available < n:
            self._evict_host(n - self.alloc_host.available)
        if self.alloc_host.consume_failure():
            return None
        if self.alloc_host.available < n:
            return None
        return self.alloc_host.take(n)

    def _write_through(self, wanted: list[Node]) -> None:
        """Back up hot nodes of one insert, parents first, as one write copy with one ack (SPEC.md §9.2)."""
        written: list[Node] = []
        for n in wanted:
            parent = n.parent
            if parent is not None and (parent is self.root or parent.host_slots is not None):
                got = self._host_alloc(len(n.key))
                if got is None:
                    continue
                n.host_slots = got
                self._lock_path(n, +1)
                written.append(n)
        if written:
            src = tuple(s for n in written for s in n.slots or ())
            dst = tuple(s for n in written for s in n.host_slots or ())
            assert self.host_kv is not None
            self._issue("write", written, list(written), CopyJob(self.kv, src, self.host_kv, dst))

    def _backup_now(self, n: Node) -> bool:
        """Write-back: back a victim up synchronously (the engine waits for it), if host room allows."""
        got = self._host_alloc(len(n.key))
        if got is None:
            return False
        assert self.host_kv is not None and n.slots is not None
        self.engine.copy_now(self.kv, n.slots, self.host_kv, got)
        n.host_slots = got
        self._refresh(n)
        return True

    def _issue(self, kind: str, nodes: list[Node], anchors: list[Node], job: Optional[CopyJob]) -> Copy:
        c = Copy(self._next_copy, kind, list(nodes), anchors, [], self.engine.submit(job))
        self._next_copy += 1
        self.copies[c.id] = c
        self.queues[kind].append(c)
        for n in nodes:
            n.copies.append(c)
            self._refresh(n)
        return c

    def evict_host(self, n: int) -> int:
        check_count(n)
        freed = self._evict_host(n)
        self._compact()
        return freed

    def _evict_host(self, n: int) -> int:
        """Write-back's settled duplicates first, then host-only leaves by rank (SPEC.md §9.4).

        The spec leaves the reclaim order free; this takes the oldest node (lowest id) first:
        deterministic, and the model's own default, which matters where a harness cannot see a
        reclaim (a duplicate reclaimed and backed up again within one write-back eviction).
        """
        assert self.alloc_host is not None
        freed = 0
        while freed < n and self.dups:
            victim = self.dups.pop(heapq.heappop(self.dup_heap), None)
            if victim is None:
                continue  # stale: it stopped being a duplicate
            self.alloc_host.release(victim.host_slots or ())
            victim.host_slots = None
            self._refresh(victim)
            freed += len(victim.key)
        while freed < n:
            leaf = self._pop(self.host_heap, self.host_leaves, False)
            if leaf is None:
                break
            self._delete_host_subtree(leaf)
            freed += len(leaf.key)
        return freed

    def load_back(self, node: int) -> int:
        n = self._live(node)
        chain: list[Node] = []
        cur: Optional[Node] = n
        while cur is not None and cur is not self.root and cur.slots is None:
            chain.append(cur)
            cur = cur.parent
        if not chain:
            return 0
        chain.reverse()
        size = sum(len(c.key) for c in chain)
        if size < self.load_back_threshold:
            return 0
        assert self.host_kv is not None
        holder = Copy(-1, "load", [], [n], [], Ticket(-1, None))
        self._host_lock(n, holder)  # the host copy must survive the room-making eviction
        self._lock_path(n, +1)  # and so must the device path it hangs from
        if self.alloc_dev.available < size:
            self._evict(size - self.alloc_dev.available)
        if self.alloc_dev.available < size:
            self._lock_path(n, -1)
            self._host_unlock_all(holder)
            self._compact()
            return 0
        got = self.alloc_dev.take(size)
        offset = 0
        src: list[int] = []
        for c in chain:
            src.extend(c.host_slots or ())
            self._set_device(c, got[offset : offset + len(c.key)])
            offset += len(c.key)
        copy = self._issue("load", chain, [n], CopyJob(self.host_kv, tuple(src), self.kv, got))
        copy.host_locked = holder.host_locked  # hand the segment over to the real copy
        n.hl_owners[n.hl_owners.index(holder)] = copy
        self._compact()
        return size

    def complete(self, copy: int) -> None:
        c = self.copies.get(copy) if _is_id(copy) else None
        if c is None or c.finished:
            raise UnknownCopy(f"no pending copy {copy!r}")
        ok = self.engine.finish(c.ticket)
        if not ok and c.kind != "store":
            return  # retried: stays pending and unfinished, both ends pinned (SPEC.md §10.5)
        c.finished = True
        if ok and c.kind == "store" and self.storage is not None:
            keys, values = self._pages_of(c.nodes)
            try:
                self.storage.batch_set(keys, values)
            except l3.StorageError:
                pass  # not stored: later lookups miss

    def poll(self) -> int:
        consumed = 0
        kinds = ("write", "load", "store")
        local = []
        for kind in kinds:
            ready = 0
            for c in self.queues[kind]:
                if not c.finished:
                    break
                ready += 1
            local.append(ready)
        agreed = self.agreement.agree(local)  # every rank consumes the same acks
        for kind, count in zip(kinds, agreed):
            q = self.queues[kind]
            for _ in range(count):
                c = q.popleft()
                del self.copies[c.id]
                for n in c.nodes:
                    n.copies.remove(c)
                    self._refresh(n)
                for a in c.anchors:
                    self._lock_path(a, -1)
                self._host_unlock_all(c)
                consumed += 1
                if kind == "write" and self.storage is not None:
                    for n in sorted(c.nodes, key=lambda n: n.end):
                        self._store([n])  # one store copy per node, shallowest first (D7)
        self._compact()
        return consumed

    def inject_fault(self, kind: str) -> None:
        if not isinstance(kind, str) or kind not in FAULTS:
            raise UnknownFault(f"no fault kind {kind!r}; this cache has {FAULTS}")
        if kind == "copy":
            self.engine.arm_failure()
        elif self.alloc_host is not None:
            self.alloc_host.failures += 1
        # a device-only cache has no host allocation for the fault to hit: armed, it never fires

    # ================================================================== retraction (SPEC.md §9.11)

    def retraction_backup(self, slots: Sequence[int]) -> Optional[int]:
        if not isinstance(slots, Sequence) or isinstance(slots, (str, bytes)) or not slots:
            raise InvalidCount(f"a retraction backs up at least one slot, got {slots!r}")
        if any(not _is_id(x) or not 0 <= x < self.capacity for x in slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: not device slot ids")
        if len(set(slots)) != len(slots) or any(self.alloc_dev.is_free(x) for x in slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: repeated or free")
        if self.alloc_host is None or self.host_kv is None:
            return None
        got = self._host_alloc(pages.page_ceil(len(slots), self.page_size))
        if got is None:
            self._compact()
            return None
        self.engine.copy_now(self.kv, tuple(slots), self.host_kv, got[: len(slots)])
        r = Retraction(self._next_retraction, len(slots), got)
        self._next_retraction += 1
        self.retractions[r.id] = r
        self._compact()
        return r.id

    def _retraction(self, backup: object) -> Retraction:
        r = self.retractions.get(backup) if _is_id(backup) else None
        if r is None:
            raise UnknownRetraction(f"no retraction backup {backup!r}")
        return r

    def retraction_restore(self, backup: int, slots: Sequence[int]) -> int:
        r = self._retraction(backup)
        if not self.alloc_dev.are_lent(slots):
            raise SlotNotOwned(f"cannot restore into slots {tuple(slots)[:8]}: not all lent to the caller")
        if len(slots) != r.tokens:
            raise LengthMismatch(f"backup {backup} holds {r.tokens} tokens, restore gave {len(slots)} slots")
        assert self.host_kv is not None and self.alloc_host is not None
        self.engine.copy_now(self.host_kv, r.host_slots[: r.tokens], self.kv, tuple(slots))
        del self.retractions[r.id]
        self.alloc_host.release(r.host_slots)
        self.root.own_locks += 1  # the resumed request's last node, locked on its behalf
        return self.root.id

    def retraction_discard(self, backup: int) -> None:
        r = self._retraction(backup)
        assert self.alloc_host is not None
        del self.retractions[r.id]
        self.alloc_host.release(r.host_slots)

    # ================================================================== storage tier (SPEC.md §10)

    def attach_storage(self, storage: l3.StorageBackend) -> None:
        self.storage = storage

    def _store(self, nodes: list[Node]) -> None:
        """A write ack issues one store copy of the same nodes, each host-locked until its ack (§10.3)."""
        if self.storage is None or not nodes:
            return
        c = self._issue("store", nodes, [], None)
        for n in nodes:
            self._host_lock(n, c)

    def _pages_of(self, nodes: list[Node]) -> tuple[list[str], list[bytes]]:
        """Keys and records of every page of `nodes`, shallowest first, payloads read from the host pool."""
        assert self.host_kv is not None
        ps = self.page_size
        live = [(len(p), p, n) for n in nodes if n.id in self.nodes for p in (self._path(n),)]
        live.sort(key=lambda t: t[0])
        keys: list[str] = []
        values: list[bytes] = []
        for _, path, n in live:
            all_keys = l3.page_keys(n.ns, path, ps, self.digest)
            first = (len(path) - len(n.key)) // ps
            host = n.host_slots or ()
            for i in range(len(n.key) // ps):
                key = all_keys[first + i]
                payload = self.host_kv.read_page_payload(host[i * ps : (i + 1) * ps])
                keys.append(key)
                values.append(l3.encode_page(key, payload))
        return keys, values

    def _prefetch(self, prefetch: object) -> Prefetch:
        p = self.prefetches.get(prefetch) if _is_id(prefetch) else None
        if p is None:
            raise UnknownPrefetch(f"no running prefetch {prefetch!r}")
        return p

    def prefetch(self, node: int, namespace: Namespace, tokens: Sequence[int]) -> int:
        anchor = self._live(node)
        key = check_tokens(tokens)
        key = key[: pages.page_floor(len(key), self.page_size)]
        path = self._path(anchor)
        start = len(path)
        if self.storage is None or key[:start] != path or len(key) <= start:
            return 0
        if anchor is not self.root and anchor.ns != namespace:
            return 0
        keys = l3.page_keys(namespace, key, self.page_size, self.digest)[start // self.page_size :]
        try:
            hit = self.storage.batch_exists(keys)
        except l3.StorageError:
            hit = 0
        size = hit * self.page_size
        if size == 0 or self.alloc_host is None:
            return 0
        p = Prefetch(self._next_prefetch, anchor, namespace, (), start, (), (), self.now, span_pages=len(keys))
        if anchor is not self.root:
            self._host_lock(anchor, p)  # first: the anchor must not be the room made
        got = self._prefetch_alloc(size)
        if got is None:
            self._host_unlock_all(p)
            self._compact()
            return 0
        size = len(got)  # D9: the part that fits
        p.tokens, p.keys, p.host_slots = key[: start + size], keys[: size // self.page_size], got
        self._next_prefetch += 1
        self.prefetches[p.id] = p
        self._compact()
        return size

    def _prefetch_alloc(self, size: int) -> Optional[tuple[int, ...]]:
        """D9: short of room, host-evict `size` tokens, then reserve the longest whole-page part that fits."""
        assert self.alloc_host is not None
        if self.alloc_host.available < size:
            self._evict_host(size)
        if self.alloc_host.consume_failure():  # an injected failure declines the prefetch (SPEC.md §10.5)
            return None
        take = min(size, self.alloc_host.available)
        if take < self.page_size:
            return None
        return self.alloc_host.take(take)

    def fetch(self, prefetch: int) -> None:
        p = self._prefetch(prefetch)
        if p.failed or p.fetched == len(p.keys):
            raise UnknownPrefetch(f"prefetch {prefetch} has no page left to fetch")
        assert self.storage is not None and self.host_kv is not None
        ps = self.page_size
        key = p.keys[p.fetched]
        page = p.start // ps + p.fetched
        try:
            blob = self.storage.batch_get([key])[0]
        except l3.StorageError:
            blob = None
        payload = l3.decode_page(key, blob)
        if payload is None or payload != l3.page_payload(p.ns, p.tokens, page, ps, self.kv_layers):
            p.failed = True  # a miss, a torn or a corrupt page: never wrong KV
            return
        self.host_kv.write_page_payload(p.host_slots[p.fetched * ps : (p.fetched + 1) * ps], payload)
        p.fetched += 1

    def check_prefetch(self, prefetch: int) -> Optional[int]:
        p = self._prefetch(prefetch)
        done_here = p.failed or p.fetched == len(p.keys)
        done_all, fetched = self.agreement.agree([int(done_here), p.fetched])  # the slowest rank decides
        done = bool(done_all)
        base, per_page = self.timeout
        expired = (
            self.prefetch_policy == "timeout"
            and p.waiting_since is not None
            and self.now - p.waiting_since > base + per_page * p.span_pages
        )
        if not (done or self.prefetch_policy == "best_effort" or expired):
            if p.waiting_since is None:
                p.waiting_since = self.now  # D11: the deadline starts at the first check that waits
            return None
        added = self._end_prefetch(p, fetched * self.page_size)
        self._compact()
        return added

    def abort_prefetch(self, prefetch: int) -> None:
        self._end_prefetch(self._prefetch(prefetch), 0)
        self._compact()

    def _end_prefetch(self, p: Prefetch, keep: int) -> int:
        """Hang the first `keep` fetched tokens below the anchor as host-only nodes; free the rest."""
        assert self.alloc_host is not None
        del self.prefetches[p.id]
        self._host_unlock_all(p)
        ps = self.page_size
        node, at, added = p.anchor, p.start, 0
        end = p.start + keep
        kept: set[int] = set()
        while at < end:
            child = node.children.get((p.ns, p.tokens[at : at + ps]))
            if child is None:
                leaf = self._new_node(node, p.ns, p.tokens[at:end])
                leaf.host_slots = p.host_slots[at - p.start : keep]
                leaf.last_access = leaf.creation = self.now
                node.children[self._selector(p.ns, leaf.key)] = leaf
                self._refresh(leaf)
                self._refresh(node)
                kept.update(leaf.host_slots)
                added += end - at
                break
            edge = child.key
            run, limit = 0, min(len(edge), end - at)
            while run < limit and edge[run] == p.tokens[at + run]:
                run += 1
            run -= run % ps
            if run < len(edge):
                child = self._split(child, run)
            if child.host_slots is None and not self.write_back:
                # D15: a device node without a backup takes the fetched pages as its backup
                child.host_slots = p.host_slots[at - p.start : at - p.start + run]
                kept.update(child.host_slots)
                added += run
                self._refresh(child)
            node, at = child, at + run  # D15: write-back walks past a device node without a backup
        self.alloc_host.release(tuple(s for s in p.host_slots if s not in kept))
        return added

    # ================================================================== KV access (SPEC.md §9.12)

    def _check_slots(self, slots: Sequence[int], limit: int) -> None:
        if any(not _is_id(s) or not 0 <= s < limit for s in slots):
            raise SlotNotOwned(f"slots {tuple(slots)[:8]} are not slot ids of this pool")

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        self._check_slots(slots, self.capacity)
        if len(slots) != len(entries):
            raise LengthMismatch(f"{len(slots)} slots but {len(entries)} entries")
        try:
            self.kv.write_entries(list(slots), list(entries))
        except ValueError as err:
            raise LengthMismatch(str(err)) from err

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        self._check_slots(slots, self.capacity)
        return self.kv.read_entries(list(slots))

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        self._check_slots(host_slots, self.host_capacity)
        if self.host_kv is None:
            return []
        return self.host_kv.read_entries(list(host_slots))

    # ================================================================== observation

    def snapshot(self) -> Snapshot:
        views = tuple(
            NodeView(
                id=n.id,
                parent=n.parent.id if n.parent is not None else None,
                namespace=n.ns,
                key=n.key,
                slots=n.slots,
                lock_ref=n.lock_ref,
                host_slots=n.host_slots,
                host_lock_ref=n.host_lock_ref,
            )
            for n in self.nodes.values()
        )
        ps = self.page_size
        return Snapshot(
            page_size=ps,
            capacity=self.capacity,
            slot_limit=self.capacity,
            root=self.root.id,
            nodes=views,
            free_slots=self.alloc_dev.free_slots(),
            evictable_size=self.evictable_size,
            protected_size=self.protected_size,
            host_capacity=self.host_capacity,
            host_free_slots=self.alloc_host.free_slots() if self.alloc_host else (),
            write_policy=self.write_policy,
            pending=tuple(
                PendingCopy(c.id, c.kind, tuple(n.id for n in c.nodes), c.finished) for c in self.copies.values()
            ),
            prefetches=tuple(
                PendingPrefetch(p.id, p.anchor.id, len(p.keys) * ps, p.fetched * ps, p.failed, p.host_slots)
                for p in self.prefetches.values()
            ),
            retractions=tuple(RetractionView(r.id, r.tokens, r.host_slots) for r in self.retractions.values()),
        )

    def close(self) -> None:
        self.engine.close()
