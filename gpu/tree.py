"""The radix tree and the device tier: walk, split, match, insert, locks, device eviction.

`RadixTree` is `GpuCache`'s core (the facade subclasses it and wires the tiers in): it owns the
node table, the root, the device allocator and the device-side counters (`evictable_size`,
`protected_size`, `held_sizes`), and keeps the eviction index exact by calling `refresh(node)`
wherever a node's residency, children or locks change. `refresh` and `_entry` are the index's
methods bound as instance attributes (no extra frame on the hot path; a test may wrap them).

- Keys and slots are `Run`s (`kvcert.gpu.run`): every length and offset here counts tokens;
  bytes appear only as a dict selector and in the walk's memcmp loop (its local offsets are
  bytes, `at_b`, converted on return). Hot callers pass a key's token count (`size`) along.
- Children are found by a hash of the first page's bytes (and the namespace, under the root).
- The last walk is remembered with the tree's shape counter (bumped when a node is created or
  removed): the same key over the same shape follows the same path (its splits are done), so an
  insert right after its match re-stamps the path without the lookups (`_walked`).
- Nothing here scans the tree: the walks are a key's path, a node's path to the root (locks),
  and a device candidate's host-only subtree (is it pinned, SPEC.md §9.3; empty except under
  write-back).

The tiers above the device (`host`, `stores`, `refs`) are set by the facade; device eviction
and insertion call into them where the spec says (write-back backups, write-through, store copies).
They call back only into the section "the tiers' interface" (`refresh` and a dozen methods), typed
against protocols (`kvcert.gpu.tiers.TierTree`, ...): this module imports the tiers, never the reverse.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional

from kvcert.gpu.alloc import PageAllocator
from kvcert.gpu.copy_engine import CopyEngine, CopyJob
from kvcert.gpu.evict_index import Entry, EvictionIndex
from kvcert.gpu.kv import KVPool
from kvcert.gpu.node import Copy, Node, Prefetch, Selector, is_id
from kvcert.gpu.run import EMPTY, Run
from kvcert.gpu.sessions import Sessions, hand_over
from kvcert.gpu.watch import DEVICE, HOST, Watch
from kvcert.spec.types import (
    InvalidCount,
    LengthMismatch,
    Namespace,
    PoolExhausted,
    SlotNotOwned,
    StaleHandle,
    UnalignedKey,
    check_count,
    policy_params,
)

if TYPE_CHECKING:
    from kvcert.gpu.host import HostTier
    from kvcert.gpu.storage import StorageTier


CHOICES_KEPT = 4096
"""The most eviction choices a report keeps: a caller that never sets the clock (an engine) keeps a bounded log;
one that does (the harness, once a step) gets every choice of the step."""


class RadixTree:
    """The tree, its device pool and allocator, its eviction index and its pending copies."""

    host: Optional[HostTier]
    """The host tier (SPEC.md §9), None without one."""
    stores: StorageTier
    """The storage tier (SPEC.md §10)."""
    refs: Sessions
    """Sessions and ref tiers (SPEC.md §11)."""
    watch: Optional[Watch] = None
    """Told of every node's arrival on and departure from each tier (`kvcert.gpu.watch`): an engine's KV events."""

    def __init__(
        self,
        page_size: int,
        policy: str,
        capacity: int,
        kv: KVPool,
        engine: CopyEngine,
        write_back: bool,
        host: bool,
        alloc_dev: Optional[PageAllocator] = None,
        params: Optional[dict[str, int]] = None,
    ) -> None:
        """`params`: the policy's parameters (`CacheConfig.policy_params()`), its defaults for this page size if
        None; `alloc_dev`: the device allocator, a `PageAllocator` of `capacity` if None."""
        self.page_size, self.policy, self.capacity = page_size, policy, capacity
        self.kv = kv
        self.alloc_dev = alloc_dev if alloc_dev is not None else PageAllocator(capacity, page_size)
        self.engine = engine
        self.write_back = write_back
        self.now = 0
        self._next_id = 1
        self._shape = 0
        """Bumped whenever a node is created or removed (a split creates one): the tree's shape changed."""
        self._walked: tuple[int, Namespace, bytes, int, list[Node]] = (-1, None, b"", 0, [])
        """The last walk: (shape, namespace, the key's bytes, tokens matched, path)."""
        self._pb = 8 * page_size
        """Bytes of one page of a key: a selector's length."""
        self.root = Node(0, None, None, EMPTY)
        self.root.slots = EMPTY
        self.nodes: dict[int, Node] = {0: self.root}
        self.evictable_size = 0
        self.protected_size = 0
        self.held_sizes = [0, 0, 0]
        """Device tokens of unlocked nodes by tier, kept for LOW_REF and HIGH_REF only (index 0 stays 0): UNUSED's
        is `evictable_size` less both (§11.2), so a node no session holds costs the counters nothing."""
        self.index = EvictionIndex(
            self.root, policy, write_back, host, params if params is not None else policy_params(policy, page_size)
        )
        self.refresh: Callable[[Node], None] = self.index.refresh
        """Re-derive a node's candidate memberships (`EvictionIndex.refresh`), bound here (no extra frame on the hot
        path; a test may wrap it): the tree and every tier call it wherever they change a node."""
        self._entry: Callable[[Node], Entry] = self.index.entry
        self.copies: OrderedDict[int, Copy] = OrderedDict()
        self.queues: dict[str, deque[Copy]] = {"write": deque(), "load": deque(), "store": deque()}
        self._next_copy = 0
        self.chosen: deque[tuple[str, int]] = deque(maxlen=CHOICES_KEPT)
        """Eviction choices since the last `set_clock`, in order (`Snapshot.choices`, SPEC.md §6.1): device
        victims and write-back nodes tried and skipped, duplicate backups dropped, host-only nodes removed."""

    # ================================================================== the tiers' interface
    # What `HostTier`, `StorageTier` and `Sessions` call on their tree (typed as `kvcert.gpu.tiers.TierTree`,
    # `kvcert.gpu.storage.StorageTree` and `kvcert.gpu.sessions.RefTree`, so no tier imports this module):
    # `refresh` (the index's method, bound in `__init__`) and the methods below. The tree calls them too;
    # everything else here is the tree's own.

    def compact(self) -> None:
        """Rebuild the index's heaps if stale entries pile up (`EvictionIndex.compact`): a tier's operation that ends a
        call (load-back, retraction backup, prefetch, its check) ends with it, as the facade's calls do."""
        self.index.compact(self.nodes)

    def new_node(self, parent: Node, ns: Namespace, key: Run, size: int) -> Node:
        """A new node for edge `key` of `size` tokens (`len(key)`, which the caller knows) below `parent`: the
        storage tier hangs a prefetch's fetched pages as one (the caller links it in under `selector`, and
        refreshes `parent`). Under tlru the index keeps its branch's history (`EvictionIndex.made`)."""
        n = Node(self._next_id, parent, ns, key, size)
        self._next_id += 1
        self.nodes[n.id] = n
        self._shape += 1
        if self.index.tlru:
            self.index.made(n)
        return n

    def forget(self, n: Node, heir: Node) -> None:
        """`n` leaves the tree; sessions that ended at it now end at `heir`, its deepest surviving ancestor: the host
        tier removes host-only subtrees with it (the caller unlinks them from their parent)."""
        self._shape += 1
        watch = self.watch
        if watch is not None:
            if n.slots is not None:
                watch.removed(n, DEVICE)
            if n.host_slots is not None:
                watch.removed(n, HOST)
        del self.nodes[n.id]
        if n.ending:
            hand_over(n, heir)
        self.index.forget(n.id)

    def selector(self, parent: Node, n: Node) -> Selector:
        """`n`'s key in `parent.children`: its first page (and namespace, under the root). The tiers link (storage)
        and unlink (host) nodes with it."""
        page = n.key.raw[: self._pb]
        return (n.ns, page) if parent is self.root else page

    def set_device(self, n: Node, slots: Optional[Run]) -> None:
        """Move `n` on or off the device, keeping counters, the parent's device-child count and memberships exact:
        load-back restores host-only nodes with it."""
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
            self.refresh(parent)
        self.refresh(n)
        if was != now and self.watch is not None:
            (self.watch.stored if now else self.watch.removed)(n, DEVICE)

    def lock_path(self, node: Node, delta: int) -> None:
        """Add `delta` to `lock_ref` from `node` up to the root; only a count that leaves or reaches 0 moves tokens.
        The host tier locks a written node's or a load's path until its ack (`poll` unlocks copies' anchors)."""
        cur: Optional[Node] = node
        root = self.root
        moved = 0
        """Device tokens that went from evictable to protected (negative: back)."""
        held = self.held_sizes
        dev_leaves, host_leaves = self.index.dev_leaves, self.index.host_leaves
        while cur is not None and cur is not root:
            old = cur.lock_ref
            new = cur.lock_ref = old + delta
            if not old:  # locked now: counted protected, no candidate of either tier
                if cur.slots is not None:
                    moved += cur.size
                    if cur.tier:
                        held[cur.tier] -= cur.size
                    if not cur.dev_children:  # (one with a child on device is none already)
                        dev_leaves.discard(cur.id)
                elif host_leaves:
                    host_leaves.discard(cur.id)
            elif not new:  # unlocked: counted evictable; a device node with a device child is still no candidate
                if cur.slots is not None:
                    moved -= cur.size
                    if cur.tier:
                        held[cur.tier] += cur.size
                    if cur.dev_children == 0:
                        self.refresh(cur)
                else:
                    self.refresh(cur)
            cur = cur.parent
        self.evictable_size -= moved
        self.protected_size += moved

    def path_tokens(self, n: Node) -> tuple[int, ...]:
        """The tokens from the root to `n`'s end: the storage tier's page keys of a node or a prefetch's anchor."""
        return self._path_run(n).to_tuple()

    def issue_copy(self, kind: str, nodes: list[Node], anchors: list[Node], job: Optional[CopyJob]) -> Copy:
        """Submit a copy to the engine; it pins its nodes (`Node.copies`) until `poll` consumes its ack. The tiers
        issue theirs here (write and load: host; store: storage), so `poll` and the snapshot see one registry."""
        c = Copy(self._next_copy, kind, list(nodes), anchors, [], self.engine.submit(job))
        self._next_copy += 1
        self.copies[c.id] = c
        self.queues[kind].append(c)
        for n in nodes:
            n.copies.append(c)
            self.refresh(n)
        return c

    def host_lock(self, n: Node, owner: Copy | Prefetch) -> None:
        """`owner` (a load, a store, a prefetch) protects `n`'s host copy until `host_unlock_all`: the tiers
        host-lock what their copies and prefetches read or hang from."""
        n.host_lock_ref += 1
        n.hl_owners.append(owner)
        owner.host_locked.append(n)
        self.refresh(n)

    def host_unlock_all(self, owner: Copy | Prefetch) -> None:
        """Release every host lock `owner` holds: a tier's prefetch or load-back that ends or is refused."""
        for n in owner.host_locked:
            n.host_lock_ref -= 1
            n.hl_owners.remove(owner)
            self.refresh(n)
        owner.host_locked = []

    def split(self, child: Node, cut: int) -> Node:
        """Cut `child` `cut` tokens in: a new head takes the prefix, `child` keeps its identity (SPEC.md §4.3). The
        storage tier splits where a prefetch's pages end or diverge inside an edge."""
        parent = child.parent
        assert parent is not None
        head = self.new_node(parent, child.ns, child.key.head(cut), cut)
        head.slots = None if child.slots is None else child.slots.head(cut)
        head.host_slots = None if child.host_slots is None else child.host_slots.head(cut)
        head.lock_ref, head.host_lock_ref = child.lock_ref, child.host_lock_ref
        head.last_access, head.creation = self.now, self.now
        head.hit_count, head.priority = child.hit_count, child.priority
        head.history = child.history  # a split adds no depth to the branch: the head takes its high-water mark
        # the head lies on every path the suffix lies on: it takes its refs (SPEC.md §11.1)
        head.high_ref, head.low_ref, head.tier = child.high_ref, child.low_ref, child.tier
        head.retained = None if child.retained is None else dict(child.retained)
        parent.children[self.selector(parent, child)] = head
        child.key = child.key.tail(cut)
        child.size -= cut
        if child.slots is not None:
            child.slots = child.slots.tail(cut)
        if child.host_slots is not None:
            child.host_slots = child.host_slots.tail(cut)
        child.parent = head
        head.children[self.selector(head, child)] = child
        head.dev_children = 1 if child.slots is not None else 0
        for c in child.copies:  # a copy in flight moves both halves
            c.nodes.append(head)
            head.copies.append(c)
        for owner in child.hl_owners:  # a host-lock segment lengthens
            owner.host_locked.append(head)
            head.hl_owners.append(owner)
        self.refresh(head)
        self.refresh(child)
        return head

    def evict_device(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:
        """Free device KV of minimal-rank candidates in scope until `n` tokens are freed or none is left: the
        facade's `evict` (its scope) and load-back's room (the full scope); the caller compacts."""
        freed = 0
        aside: list[Node] = []
        released: list[bytes] = []
        """The victims' device slots, given back to the allocator in one call at the end."""
        index, nodes = self.index, self.nodes
        while freed < n:  # UNUSED first, then LOW_REF, then HIGH_REF, as the scope allows (SPEC.md §11.3)
            victim = index.pop_device(nodes, allow_low, allow_high)
            if victim is None:
                break
            if (
                not self.write_back
                and victim.host_slots is None
                and (victim.host_lock_ref or victim.children)
                and self._drops_protected(victim)
            ):
                aside.append(victim)  # pinned: no candidate
                continue
            if victim.host_slots is None and self.write_back:
                # Write-back tries it: a synchronous backup, then a store copy of it (D8); if the
                # backup fails and a drop would take a protected host copy, it stays (D14).
                assert self.host is not None
                if self.host.backup_now(victim):
                    self.stores.store([victim])
                elif self._drops_protected(victim):
                    aside.append(victim)
                    self.chosen.append(("skip", victim.id))
                    continue
            assert victim.slots is not None
            self.chosen.append(("evict", victim.id))
            released.append(victim.slots.raw)
            if victim.host_slots is not None:
                self.set_device(victim, None)  # demoted: the host copy stays
            else:
                self._drop(victim)
            freed += victim.size
        if released:
            self.alloc_dev.release_raw(b"".join(released))
        for v in aside:  # pinned ones stay candidates-in-waiting
            if v.id in self.nodes:
                self.refresh(v)
        return freed

    # ================================================================== metadata upkeep

    def _account(self, n: Node, sign: int) -> None:
        if n.lock_ref > 0:
            self.protected_size += sign * n.size
        else:
            self.evictable_size += sign * n.size
            if n.tier:
                self.held_sizes[n.tier] += sign * n.size

    def _path_run(self, n: Node) -> Run:
        """The tokens from the root to `n`'s end."""
        parts: list[bytes] = []
        cur: Optional[Node] = n
        while cur is not None and cur is not self.root:
            parts.append(cur.key.raw)
            cur = cur.parent
        parts.reverse()
        return Run(b"".join(parts))

    def _live(self, node_id: object) -> Node:
        n = self.nodes.get(node_id) if type(node_id) is int or is_id(node_id) else None
        if n is None:
            raise StaleHandle(f"no live node {node_id!r}")
        return n

    # ================================================================== tree walk

    def _walk(
        self, ns: Namespace, key: Run, size: int, priority: Optional[int], rerank_last: bool = True
    ) -> tuple[int, list[Node], bool]:
        """Follow `key` (whole pages, `size` tokens) from the root, splitting where it ends or diverges inside an edge.

        Stamps every node entered; with `priority` (an insert) also counts a hit on it. Returns the
        tokens matched, the nodes entered (the caller must not change the list: the next walk may reuse
        it), and whether one of them is host only. `rerank_last=False`: the caller refreshes the last
        node itself (an insert, which may hang a leaf below it).
        """
        if not size:
            return 0, [], False
        now = self.now
        raw = key.raw
        shape, walked_ns, walked_raw, at, path = self._walked
        if shape == self._shape and walked_ns == ns and walked_raw == raw:  # the last walk's path, unchanged
            if priority is None:
                for n in path:
                    n.last_access = now
            else:
                for n in path:
                    n.last_access = now
                    n.hit_count += 1
                    if priority > n.priority:
                        n.priority = priority
        else:
            ps, pb, path = self.page_size, self._pb, []
            at_b, end_b = 0, size << 3  # this loop's offsets are bytes into `raw` (one memcmp per edge)
            startswith, append = raw.startswith, path.append
            child = self.root.children.get((ns, raw[:pb]))
            while child is not None:
                child.last_access = now
                edge = child.key.raw
                if startswith(edge, at_b):  # the whole edge matches
                    at_b += len(edge)
                else:  # the key ends or diverges inside this edge
                    step = key.common(child.key, at_b >> 3, size, ps)
                    child = self.split(child, step)
                    at_b += step << 3
                if priority is not None:
                    child.hit_count += 1
                    if priority > child.priority:
                        child.priority = priority
                append(child)
                if at_b == end_b:
                    break
                child = child.children.get(raw[at_b : at_b + pb])
            at = at_b >> 3
            self._walked = (self._shape, ns, raw, at, path)
        # Stamps change ranks. A node's old heap entries go stale by themselves (their rank is not the
        # node's); a candidate must be pushed again. On a path, only the last node can be a candidate,
        # or one whose child on the path is host only: every other node has a child on device.
        hosted = False
        if self.host is not None:  # only a host tier has host-only nodes
            for i, n in enumerate(path):
                if n.slots is None:
                    hosted = True
                    if i:
                        self.refresh(path[i - 1])
        if path and rerank_last:
            self.refresh(path[-1])
        return at, path, hosted

    # ================================================================== device tier (SPEC.md §4)

    def _lend_raw(self, n: object) -> bytes:
        """`n` lent slots as int64 bytes: the caller turns them into a tuple or a tensor at once."""
        n = check_count(n)
        if n % self.page_size:
            raise UnalignedKey(f"alloc of {n} slots is not whole pages of {self.page_size}")
        if n > self.alloc_dev.available:
            raise PoolExhausted(f"asked for {n} slots, {self.alloc_dev.available} free")
        return self.alloc_dev.lend_raw(n)

    def _give_back_raw(self, raw: Optional[bytes], shown: object) -> None:
        if raw is None or not self.alloc_dev.give_back_checked(raw):
            raise SlotNotOwned(f"cannot free slots {shown!r:.80}: not all lent to the caller")

    def _match(self, ns: Namespace, key: Run, size: int) -> tuple[list[Node], int, Node, int, Node]:
        """Match `key` (`size` tokens, cut here to whole pages): (the nodes of the device hit, its length in
        tokens, its last node, the host length after it, the deepest node with a host copy).

        The device nodes' slots, joined in order, are the hit's slots. The list may be the walk's own
        (kept for the next walk): read only.
        """
        if size % self.page_size:
            size -= size % self.page_size
            key = key.head(size)
        self.root.last_access = self.now
        at, path, hosted = self._walk(ns, key, size, None)
        length, node, host_length, host_node = 0, self.root, 0, self.root
        if not hosted:  # every node on device: the whole match is a device hit
            device = path
            length = at
            if path:
                node = path[-1]
            if self.host is not None:
                host_node = next((n for n in reversed(path) if n.host_slots is not None), self.root)
        else:
            device = []
            for n in path:
                if n.slots is not None and host_length == 0:
                    length += n.size
                    device.append(n)
                    node = n
                else:
                    host_length += n.size
                if n.host_slots is not None:
                    host_node = n
        self.index.compact(self.nodes)
        return device, length, node, host_length, host_node

    def _check_insert(
        self, tokens: int, count: int, slots: Optional[Run], priority: object, ns: Namespace = None, key: Optional[Run] = None
    ) -> Optional[Sequence[int]]:
        """The insert preconditions after the tokens', in the protocol's order (SPEC.md §4.2), for a key of `tokens`.

        Returns the slots' page ids when they are whole lent pages (`PageAllocator.lent_pages`), for the adoption.
        Where the key is cached, a slot may be the tree's own for that position (a running request re-inserting a
        prefix it holds, §4.8): only the others must be lent.
        """
        if tokens % self.page_size:
            raise UnalignedKey(f"key of {tokens} tokens is not whole pages of {self.page_size}")
        if count != tokens:
            raise LengthMismatch(f"{tokens} tokens but {count} slots")
        if type(priority) is not int and not is_id(priority):
            raise InvalidCount(f"priority must be an int, got {priority!r}")
        if slots is None:
            raise SlotNotOwned("cannot insert these slots: not slot ids")
        pages = self.alloc_dev.lent_pages(slots.raw)
        if pages is None and not self.alloc_dev.are_lent_raw(slots.raw):
            held = self._held_prefix(ns, key, tokens) if key is not None else b""
            raw, k = slots.raw, len(held)
            if raw[:k] == held:  # the tree's own head, the rest lent (a checkpoint's insert): one compare
                rest = raw[k:]
            else:  # any slot the tree's own at its position, the others lent (a prompt's re-insert)
                rest = b"".join(raw[i : i + 8] for i in range(0, len(raw), 8) if raw[i : i + 8] != held[i : i + 8])
            if len(rest) == len(raw) or (rest and not self.alloc_dev.are_lent_raw(rest)):
                raise SlotNotOwned("cannot insert these slots: not all lent to the caller")
        return pages

    def _held_prefix(self, ns: Namespace, key: Run, size: int) -> bytes:
        """The device slots the tree holds for the longest cached prefix of `key`, as int64 bytes: a pure
        walk (no stamps, no splits), for the insert check only."""
        raw, pb, out = key.raw, self._pb, bytearray()
        at_b, end_b = 0, size << 3
        child = self.root.children.get((ns, raw[:pb])) if size else None
        while child is not None and child.slots is not None:
            edge = child.key.raw
            if not raw.startswith(edge, at_b):  # the key ends or diverges inside this edge
                out += child.slots.raw[: key.common(child.key, at_b >> 3, size, self.page_size) << 3]
                break
            out += child.slots.raw
            at_b += len(edge)
            if at_b == end_b:
                break
            child = child.children.get(raw[at_b : at_b + pb])
        return bytes(out)

    def _insert(
        self, ns: Namespace, key: Run, size: int, slots: Run, priority: int, pages: Optional[Sequence[int]] = None
    ) -> tuple[int, Node]:
        """Insert a checked key of `size` tokens and its slot run: (prefix_len, the node ending at the key).

        `pages`: the run's page ids when it is whole lent pages (adopted by page id, no second look at the bytes).
        """
        self.root.last_access = self.now
        matched, path, hosted = self._walk(ns, key, size, priority, rerank_last=False)
        prefix = matched
        if hosted:
            prefix = offset = 0
            for n in path:
                width = n.size
                if n.slots is None:  # host only: the request's fresh KV restores it, the backup stays
                    mine = slots.cut(offset, offset + width)
                    self.alloc_dev.adopt_raw(mine.raw)
                    self.set_device(n, mine)
                elif offset == prefix:
                    prefix += width
                offset += width
        node = path[-1] if path else self.root
        if matched < size:
            leaf = self.new_node(node, ns, key.tail(matched), size - matched)
            leaf.last_access = leaf.creation = self.now
            leaf.hit_count, leaf.priority = 1, priority
            node.children[self.selector(node, leaf)] = leaf
            rest = slots.tail(matched)
            if pages is not None:
                self.alloc_dev.adopt_pages(pages[matched // self.page_size :])
            else:
                self.alloc_dev.adopt_raw(rest.raw)
            leaf.slots = rest  # `set_device` for a new unlocked leaf
            self.evictable_size += leaf.size
            node.dev_children += 1
            self.refresh(node)  # it has a child on device now
            self.refresh(leaf)
            if self.watch is not None:
                self.watch.stored(leaf, DEVICE)
            node = leaf
        elif path:
            self.refresh(node)
        host = self.host
        if host is not None and host.threshold is not None:  # (`path` is the walk's, kept for the next one: read only)
            host.write_through(path if node is self.root or (path and node is path[-1]) else [*path, node])
        self.index.compact(self.nodes)
        return prefix, node

    def _drops_protected(self, n: Node) -> bool:
        """A node without a backup whose drop would take a protected host copy with it (SPEC.md §9.3)."""
        if n.host_slots is not None:
            return False
        if n.host_lock_ref > 0:
            return True
        if not n.children:
            return False
        stack = [c for c in n.children.values() if c.slots is None]
        while stack:
            c = stack.pop()
            if c.lock_ref > 0 or c.host_lock_ref > 0:
                return True
            stack.extend(g for g in c.children.values() if g.slots is None)
        return False

    def _drop(self, n: Node) -> None:
        """Remove an unlocked device node without a backup, with any host-only subtree below it.

        Its device slots are the caller's to release (`evict_device` gives back all its victims' at once).
        """
        parent = n.parent
        assert parent is not None
        if n.children:
            assert self.host is not None  # a device candidate's children are host only
            for c in list(n.children.values()):
                self.host.delete_subtree(c)
        del parent.children[self.selector(parent, n)]
        self.evictable_size -= n.size  # a candidate: unlocked
        if n.tier:
            self.held_sizes[n.tier] -= n.size
        parent.dev_children -= 1
        self.forget(n, parent)
        self.refresh(parent)
