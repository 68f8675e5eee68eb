"""The model's state and its tree: one radix tree over a device pool (and an optional host pool), the walk,
splits, lock paths, accounting and ranks every tier reads (SPEC.md §4, §5).

`Tree` holds every attribute of the model; each tier (`device`, `host`, `sessions`, `storage`) is a mixin over it,
and `cache.RefCache` is all of them. What one tier asks of another is declared at the end of `Tree`, so each
mixin reads as its own section of the spec while the calls between tiers stay visible."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

from kvcert.refimpl.records import (
    _DEFAULT_CONFIG,
    Copy,
    Node,
    Prefetching,
    Retraction,
    Session,
    SlotPool,
    _cut,
)
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.decisions import SGLANG_0523, Chooser, Decisions
from kvcert.spec.types import (
    POLICIES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    CacheConfig,
    Namespace,
    StaleHandle,
    Tokens,
    tier_of,
)


class Tree:
    """The model's state and the tree helpers every tier reads."""

    def __init__(self, config: CacheConfig = _DEFAULT_CONFIG, decisions: Decisions = SGLANG_0523) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}")
        if config.page_size < 1 or config.capacity % config.page_size or config.host_capacity % config.page_size:
            raise ValueError("capacities must be whole pages")
        if config.host_capacity and config.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {config.write_policy!r}")
        if config.prefetch_policy and (config.prefetch_policy not in PREFETCH_POLICIES or not config.host_capacity):
            raise ValueError(
                f"prefetch policy {config.prefetch_policy!r} needs a host tier and one of {PREFETCH_POLICIES}"
            )
        self.page_size = config.page_size
        self.policy = config.policy
        self.policy_params = config.policy_params()
        """The policy's parameters (SPEC.md §4.5), passed to `pages.policy_rank` as they are."""
        self.pool = SlotPool(config.capacity, config.page_size)
        self.host = SlotPool(config.host_capacity, config.page_size) if config.host_capacity else None
        self.write_policy = config.write_policy if self.host else ""
        self.load_back_threshold = config.load_back_threshold
        self.now = 0
        self._next_id = 1
        self.root = Node(id=0, parent=None, namespace=None, key=(), slots=())
        self.nodes: dict[int, Node] = {0: self.root}
        self.evictable_size = 0
        self.protected_size = 0
        self.copies: list[Copy] = []
        """Issued copies whose ack has not been consumed, in issue order."""
        self._next_copy = 0
        self.prefetch_policy = config.prefetch_policy
        self.timeout = (config.prefetch_timeout_base, config.prefetch_timeout_per_page)
        self.kv_layers = config.kv_layers
        self.kv: dict[int, bytes] = {}
        """Device slot -> the entry it holds (SPEC.md §9.12); a slot never written holds none."""
        self.host_kv: dict[int, bytes] = {}
        """Host slot -> the entry it holds."""
        self.digest = l3.canonical_digest(config.page_size, config.model_id)
        self.storage: Optional[l3.StorageBackend] = None
        self.prefetches: list[Prefetching] = []
        self._next_prefetch = 0
        self.armed_faults: dict[str, int] = {}
        """Injected faults not yet triggered, by kind."""
        self.retractions: list[Retraction] = []
        self._next_retraction = 0
        self.threshold = config.high_priority_threshold
        self.sessions: dict[str, Session] = {}
        """Registered sessions in registration order (SPEC.md §11.1)."""
        self._next_seq = 0
        self.demotions: list[str] = []
        """Sessions adaptive demotion demoted, oldest first (SPEC.md §11.4)."""
        self.tier_evictable = [0, 0, 0]
        """Device tokens of unlocked nodes per tier (SPEC.md §11.2)."""
        self.scope = (True, True)
        """The running eviction's scope (allow_low, allow_high); the full scope between calls."""
        self.own = decisions
        """The model's own decision at each choice SPEC.md §6 leaves open (its profile's; SGLang's by default)."""
        self.decided = decisions
        """What the running operation follows: `own`, or what `deciding` handed it for that operation."""
        self.room_left: Optional[int] = None
        """ROOM's `ask` while an operation runs, less what its node backups' host evictions have freed so far."""
        self.backs_up_retractions = True
        """Whether an admission plan may keep a retracted request's KV on the host (SPEC.md §11.5): the harness
        turns it off for a backend with a host tier that declares no retraction backup."""
        self.idle_queue: list[tuple[int, str]] = []
        """Under DEMOTE's "queued" order: (tokens on its path when queued, id), a min-heap of high sessions, each
        queued at most once (`queued`) when it is registered, raised or restored as high; a stale entry leaves when
        it reaches the top."""
        self.queued: set[str] = set()
        self.chosen: list[tuple[str, int]] = []
        """The current operation's eviction choices, in order (`Snapshot.choices`); cleared by `set_clock`."""

    @contextmanager
    def deciding(self, decisions: Decisions) -> Iterator[None]:
        """Follow `decisions` at SPEC.md §6's open choices for the operations run inside, then `own` again: the
        model keeps no choice of another's between operations."""
        self.decided, self.room_left = decisions, decisions.room.ask
        try:
            yield
        finally:
            self.decided, self.room_left = self.own, None

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
        head_slots, child_slots = _cut(child.slots, at)  # bytes stay in their slots: cutting moves none
        head_host, child_host = _cut(child.host_slots, at)
        head = self._new_node(
            parent=parent,
            namespace=child.namespace,
            key=head_key,
            slots=head_slots,
            lock_ref=child.lock_ref,
            host_slots=head_host,
            host_lock_ref=child.host_lock_ref,
            last_access=self.now,
            hit_count=child.hit_count,
            creation=self.now,
            priority=child.priority,
            history=child.history,
            high_ref=child.high_ref,
            low_ref=child.low_ref,
        )
        parent.children[self._selector(child.namespace, head_key)] = head
        child.key, child.slots, child.host_slots, child.parent = tail_key, child_slots, child_host, head
        head.children[self._selector(child.namespace, tail_key)] = child
        for copy in self.copies:  # a copy in flight moves both halves; a host lock covers both
            if child in copy.nodes:
                copy.nodes.append(head)
            if child in copy.host_locked:
                copy.host_locked.append(head)
        for p in self.prefetches:  # so does a prefetch's protection of its anchor
            if child in p.host_locked:
                p.host_locked.append(head)
        return head

    def _walk(self, namespace: Namespace, key: Tokens, on_node: Callable[[Node], None]) -> tuple[int, list[Node]]:
        """Follow `key` down the tree, splitting where it ends or diverges inside an edge.

        Calls `on_node` on every node entered (after any split). Returns the matched
        length and the nodes entered, root first excluded.
        """
        path: list[Node] = []
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
            path.append(child)
            matched += n
            node = child
        return matched, path

    def _held_prefix(self, namespace: Namespace, key: Tokens) -> tuple[int, ...]:
        """The device slots the tree holds for the longest cached prefix of `key` (no stamps, no splits)."""
        out: list[int] = []
        node, matched = self.root, 0
        while matched < len(key):
            child = node.children.get(self._selector(namespace, key[matched:]))
            if child is None or child.slots is None:
                break
            same = pages.match_len(child.key, key[matched:], self.page_size)
            out.extend(child.slots[:same])
            if same < len(child.key):
                break
            matched += same
            node = child
        return tuple(out)

    def _made(self, node: Node) -> None:
        """A new node is in the tree: its history is its depth, and every ancestor's history reaches it (SPEC.md §4.7)."""
        depth = self.depth(node)
        node.history = depth
        for n in self._path_to_root(node)[1:]:
            n.history = max(n.history, depth)

    def depth(self, node: Node) -> int:
        """Tokens from the root to the end of `node`."""
        return sum(len(n.key) for n in self._path_to_root(node))

    def _path_to_root(self, node: Node) -> list[Node]:
        out = []
        cur: Optional[Node] = node
        while cur is not None and cur is not self.root:
            out.append(cur)
            cur = cur.parent
        return out

    def _lock_path(self, node: Node, delta: int) -> None:
        """Move `node`'s path by one lock, keeping evictable/protected exact.

        Host-only nodes on the path take the lock too (SPEC.md §9.1) but hold no device
        tokens, so only device-resident ones move between the counters.
        """
        for n in self._path_to_root(node):
            if n.slots is not None:
                self._account(n, -1)
            n.lock_ref += delta
            if n.slots is not None:
                self._account(n, +1)

    def _account(self, node: Node, sign: int) -> None:
        """Add (+1) or remove (-1) a device-resident node's tokens to the counter its locks pick."""
        if node.lock_ref > 0:
            self.protected_size += sign * len(node.key)
        else:
            self.evictable_size += sign * len(node.key)
            self.tier_evictable[self.tier(node)] += sign * len(node.key)

    def tier(self, node: Node) -> int:
        return tier_of(node.high_ref, node.low_ref)

    def rank(self, node: Node) -> tuple[int, ...]:
        """SPEC.md §11.3: tier, retention (§11.7: unretained first, then the latest back) and refs first (fewer
        sessions hurt first), then the policy."""
        shape = {}
        if self.policy == "tlru":  # the only policy that reads the node's place in the tree
            shape = {"depth": self.depth(node), "size": len(node.key), "history": node.history}
        policy = pages.policy_rank(
            self.policy, node.last_access, node.hit_count, node.creation, node.priority, **self.policy_params, **shape
        )
        tier = self.tier(node)
        deadline = self.retained_deadline(node) if tier else None
        held = (0, 0) if deadline is None else (1, -deadline)
        return (tier, *held, node.high_ref, node.low_ref, *policy)

    def _pick(self, candidates: list[Node], choose: Optional[Chooser]) -> Node:
        if self.decided.rank.free and choose is not None:
            ranked = [n.id for n in sorted(candidates, key=lambda n: (self.rank(n), n.id))]
            pick = choose(ranked)
            return self.nodes[ranked[0] if pick is None else pick]
        tied = pages.min_rank_ids([(self.rank(n), n.id) for n in candidates])
        pick = choose(tied) if choose else None
        return self.nodes[min(tied) if pick is None else pick]

    def _full_path(self, node: Node) -> Tokens:
        return tuple(t for n in reversed(self._path_to_root(node)) for t in n.key)

    # ------------------------------------------------------------------ what one tier asks of another

    def _wants_backup(self, node: Node) -> bool:
        raise NotImplementedError("host.py")

    def _write_backup(self, node: Node) -> bool:
        raise NotImplementedError("host.py")

    def _write_through(self, path: list[Node]) -> None:
        raise NotImplementedError("host.py")

    def _host_alloc(self, n: int, reclaim_all: bool = False) -> Optional[tuple[int, ...]]:
        raise NotImplementedError("host.py")

    def _make_room(self, size: int, whole: Optional[bool] = None, spend: bool = False) -> None:
        raise NotImplementedError("host.py")

    def _delete_host_leaf(self, node: Node) -> None:
        raise NotImplementedError("device.py")

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True, choose: Optional[Chooser] = None) -> int:
        raise NotImplementedError("device.py")

    def _sessions_leave(self, node: Node) -> None:
        raise NotImplementedError("sessions.py")

    def _demote_idle_session(self) -> bool:
        raise NotImplementedError("sessions.py")

    def _is_high(self, session: Session) -> bool:
        raise NotImplementedError("sessions.py")

    def retained_deadline(self, node: Node) -> Optional[int]:
        raise NotImplementedError("sessions.py")

    def _store(self, nodes: list[Node]) -> None:
        raise NotImplementedError("storage.py")

    def _pages_of(self, nodes: list[Node]) -> tuple[list[str], list[bytes]]:
        raise NotImplementedError("storage.py")
