# Over 600 lines: one model class written as the spec reads, not yet split by tier (tree and device, host, storage, sessions).
"""The reference model: a deliberately plain radix tree over a device pool and an optional host pool.

Readability first: dicts, lists and full scans, no heaps or indexes. Every rule
is the one SPEC.md states, in the order it states it; where SPEC.md says
"engines may choose" (which tied leaf to evict), `evict` takes a `choose`
callback so the harness can steer this model to a backend's legal choice.

With `host_capacity > 0` it models the host tier (SPEC.md §9): backups to host
slots under a write policy, demotion on eviction, host eviction, load-back, and
asynchronous copies that stay pending until `complete` and `poll` say otherwise.

It also holds KV bytes (SPEC.md §9.12): two plain dicts, device slot -> entry and host slot ->
entry, filled by the caller's `write_kv` and moved by every copy exactly where a real cache's
bytes move (`_move_kv`). As the oracle it is never written to, so its dicts stay near empty.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.types import (
    FAULTS,
    HIGH_REF,
    POLICIES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    WRITE_THROUGH_THRESHOLD,
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    Capabilities,
    InsertOut,
    InvalidCount,
    InvalidPlan,
    LengthMismatch,
    LockUnderflow,
    MatchOut,
    Namespace,
    NodeView,
    PendingCopy,
    PendingPrefetch,
    PoolExhausted,
    RetractionView,
    Running,
    SessionView,
    SlotNotOwned,
    Snapshot,
    StaleHandle,
    Tokens,
    UnalignedKey,
    UnknownCopy,
    UnknownFault,
    UnknownPrefetch,
    UnknownRetraction,
    UnknownSession,
    check_count,
    check_priority,
    check_scope,
    check_session,
    check_tokens,
    tier_of,
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
        check_count(n)
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
    slots: Optional[tuple[int, ...]]
    """Device slots; None once the node is evicted to the host."""
    children: dict[tuple[Namespace, Tokens], Node] = field(default_factory=dict)
    lock_ref: int = 0
    own_locks: int = 0
    """Locks taken on this very node (so dec_lock_ref can refuse an unlock nobody took)."""
    host_slots: Optional[tuple[int, ...]] = None
    host_lock_ref: int = 0
    last_access: int = 0
    hit_count: int = 0
    creation: int = 0
    priority: int = 0
    high_ref: int = 0
    """High-priority sessions whose path holds this node (SPEC.md §11.1)."""
    low_ref: int = 0


@dataclass(eq=False)
class Copy:
    """An asynchronous copy between the tiers, pending until completed and polled."""

    id: int
    kind: str
    """"write" (device to host) or "load" (host to device)."""
    nodes: list[Node]
    """The nodes whose bytes it moves; a split of one of them adds the new half."""
    anchors: list[Node]
    """The nodes whose path lock the ack releases."""
    host_locked: list[Node] = field(default_factory=list)
    """A load's host-lock segment: its node, and every head split off it while pending."""
    finished: bool = False
    given_up: bool = False
    """A failed write copy invalidated instead of retried (`copy_failure`): its ack stores nothing."""


@dataclass(eq=False)
class Prefetching:
    """A storage prefetch: host slots reserved for `keys`, filled page by page (SPEC.md §10.4)."""

    id: int
    anchor: Node
    namespace: Namespace
    tokens: Tokens
    """The anchor's path followed by the requested pages."""
    start: int
    """Where the requested pages begin in `tokens` (the anchor path's length)."""
    keys: tuple[str, ...]
    host_slots: tuple[int, ...]
    issued_at: int
    host_locked: list[Node] = field(default_factory=list)
    """The anchor's host-lock segment: the anchor, and every head split off it meanwhile."""
    fetched: int = 0
    """Pages fetched and verified, from the first."""
    published: int = 0
    """Of those, the pages whose progress the engine has seen (FETCH: per batch); an end keeps these."""
    failed: bool = False
    span_pages: int = 0
    """Pages the request asked for after the anchor, stored or not: the timeout's budget (D11)."""
    waiting_since: Optional[int] = None
    """When the first check_prefetch that kept it running ran: the timeout's start (D11)."""


@dataclass(eq=False)
class Session:
    """A registered session (SPEC.md §11.1): it holds the path from the root to `node`."""

    id: str
    node: Node
    priority: int
    seq: int
    """When it was (re-)registered: ties between idle sessions go to the earliest (§11.4)."""
    demoted: bool = False


@dataclass(eq=False)
class Retraction:
    """A retracted request's KV on host slots outside the tree, until it is restored or discarded."""

    id: int
    tokens: int
    host_slots: tuple[int, ...]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_count(x: object) -> bool:
    return _is_int(x) and x >= 0  # type: ignore[operator]


def _retraction_picks(low: list[Running], short: int) -> Optional[list[Running]]:
    """The fewest low-priority requests freeing `short` tokens (SPEC.md §11.5): the largest first, the last
    pick the smallest that closes the gap; None if all of them cannot."""
    largest = sorted(low, key=lambda r: (-r.tokens, r.id))
    total, k = 0, 0
    while k < len(largest) and total < short:
        total += largest[k].tokens
        k += 1
    if total < short:
        return None
    first = largest[: k - 1]
    base = sum(r.tokens for r in first)
    rest = [r for r in low if r not in first and base + r.tokens >= short]
    return first + [min(rest, key=lambda r: (r.tokens, r.id))]


def _check_ids(slots: Sequence[int], limit: int) -> None:
    """Slot ids a KV read may name: ints in [0, limit); `SlotNotOwned` otherwise (a read changes nothing)."""
    if isinstance(slots, (str, bytes)) or any(not _is_int(x) or not 0 <= x < limit for x in slots):
        raise SlotNotOwned(f"slots {tuple(slots)[:8]} are not slot ids of this pool")


def _move_kv(src: dict[int, bytes], src_slots: Sequence[int], dst: dict[int, bytes], dst_slots: Sequence[int]) -> None:
    """One copy job: slot `src_slots[i]`'s entry into `dst_slots[i]`; an unwritten slot copies as unwritten.

    Bytes move when a copy is issued, not when it completes (SGLang on CPU): the harness reads
    no device slot of a pending load and no host slot of a pending write, so nobody can tell,
    and no bytes need to wait in flight. A freed slot keeps its stale bytes, as memory does.
    """
    for s, d in zip(src_slots, dst_slots):
        if s in src:
            dst[d] = src[s]
        else:
            dst.pop(d, None)


def _cut(slots: Optional[tuple[int, ...]], at: int) -> tuple[Optional[tuple[int, ...]], Optional[tuple[int, ...]]]:
    return (None, None) if slots is None else (slots[:at], slots[at:])


Chooser = Callable[[list[int]], Optional[int]]
"""Picks an eviction victim among candidate ids; None leaves the pick to the model's own order."""
SessionChooser = Callable[[list[str]], Optional[str]]
"""Picks a session to demote or restore among candidate ids (DEMOTE); the harness seats the backend's choice."""


class RefCache:
    """The oracle, and a Backend in its own right (strict input checking)."""

    capabilities = Capabilities(
        name="kvcert.refimpl",
        page_sizes=(1, 2, 4, 8, 16),
        policies=POLICIES,
        namespaces=True,
        strict_input=True,
        write_policies=WRITE_POLICIES,
        prefetch_policies=PREFETCH_POLICIES,
        faults=FAULTS,
        retraction=True,
        kv_reads=True,
        priority_refs=True,
        still_between_calls=True,
        profile="sglang-0.5.23",
        reports_choices=True,
        kind="native",
    )

    def __init__(self, config: CacheConfig = _DEFAULT_CONFIG) -> None:
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
        self.steer: Optional[Chooser] = None
        """Tie-break for evictions made inside other operations (write-backup, load-back); the harness steers it."""
        self.reclaim: Optional[Chooser] = None
        """Which duplicate backup write-back's host eviction drops next (any order is legal); the harness steers it."""
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
        # Where SPEC.md §6's core leaves a choice (kvcert.spec.profiles), SGLang's is the default; the
        # alternative reference behaviour and the harness's core steering change these.
        self.rank_free = False
        """Choosers see every eviction candidate, not only the minimal-rank ones (profile choice RANK)."""
        self.host_order = "reclaim_first"
        """Write-back host eviction: "reclaim_first" drops duplicate backups before host-only leaves;
        "rank" takes both in one rank order (RECLAIM)."""
        self.copy_failure = "retry"
        """A failed write copy: "retry" keeps it pending; "invalidate" gives its backups up when it can (RETRY)."""
        self.host_room = "whole"
        """A prefetch or a retraction backup that does not fit: "whole" host-evicts its whole size (SGLang, D9 and
        D17); "shortfall" only what is missing (ROOM)."""
        self.batching = "sglang"
        """How copies are cut (BATCH): "sglang" (one write copy per insert, one store copy per node, shallowest
        first); "per_node" (one write copy per node, deepest first); "per_node_parents_first" (one per node, parents
        first: the RefAware fork, H11); "per_ack" (a write ack's nodes stored in one
        copy)."""
        self.backup_room = "shortfall"
        """A write-through or write-back backup short of host room: host eviction asks for the shortfall (SGLang) or
        for the node's "whole" size (ROOM)."""
        self.host_ask: Optional[int] = None
        """The host tokens the next prefetch or retraction backup that does not fit asks host eviction for, at most
        its size (the harness seats the backend's choice under the core); None: as `host_room` says."""
        self.host_steer: Optional[Chooser] = None
        """The chooser for host evictions made inside other operations, when it differs from `steer`."""
        self.backs_up_retractions = True
        """Whether an admission plan may keep a retracted request's KV on the host (SPEC.md §11.5): the harness
        turns it off for a backend with a host tier that declares no retraction backup."""
        self.load_host_lock = True
        """A pending load keeps its node's host copy host-locked until the ack (LOAD_LOCK); False: the load's own
        pins (both tiers, the device lock) protect it once its nodes are on the device."""
        self.restore_order = "latest"
        """Which demoted session a released high session restores (DEMOTE): "latest" (the most recently demoted,
        SPEC.md §11.4) or "earliest"."""
        self.demote_steer: Optional[SessionChooser] = None
        """The core's demotion chooser (DEMOTE): given every high session, oldest registration first, the one to
        demote, None for the model's own pick; the harness seats the backend's choice with it."""
        self.restore_steer: Optional[SessionChooser] = None
        """The core's restore chooser (DEMOTE): given the demoted sessions, the one a high release restores, or None
        for none; when set it decides."""
        self.load_scope: tuple[bool, bool] = (True, True)
        """The scope load-back makes its device room in (LOAD_ROOM): the full one (SPEC.md §11.3), or (True, False),
        a low-priority requester's (the RefAware fork's request-less load, H7)."""
        self.load_ask = "shortfall"
        """What load-back asks device eviction for (LOAD_ROOM): its "shortfall" (SGLang 0.5.23) or its "whole" size
        (0.5.10's `load_back`, H13)."""
        self.demote_order = "idle_fewest"
        """Which high session host pressure demotes (DEMOTE): "idle_fewest", an idle one with the fewest tokens on its
        path, ties to the earliest registered (SPEC.md §11.4); or "queued", the RefAware fork's: the one queued with
        the fewest tokens when it was queued, ties to the smaller id, idle or not (`idle_queue`)."""
        self.idle_queue: list[tuple[int, str]] = []
        """Under "queued": (tokens on its path when queued, id), a min-heap of high sessions, each queued at most once
        (`queued`) when it is registered, raised or restored as high; a stale entry leaves when it reaches the top."""
        self.queued: set[str] = set()
        self.restore_on_move = False
        """Whether a high session registered again (moved) counts as released and restores a demoted session
        (DEMOTE; the RefAware fork's composed move, H9): SGLang's profile says no."""
        self.fetch_batch = l3.FETCH_BATCH_PAGES
        """A prefetch publishes its progress per batch of this many pages, at a miss, or at its last page (FETCH)."""
        self.publish_steer: Optional[bool] = None
        """The core's FETCH choice for the next fetch that ends no batch: publish every page so far, or not."""
        self.admit_fraction: Optional[float] = l3.PREFETCH_ADMIT_FRACTION
        """A prefetch is declined while running prefetches' requested spans reach this share of the host pool
        (THROTTLE, SGLang's `prefetch_capacity_limit`); None: never."""
        self.admit_steer: Optional[bool] = None
        """The core's THROTTLE choice for the next prefetch made while others run: admit it (True) or decline."""
        self.chosen: list[tuple[str, int]] = []
        """The current operation's eviction choices, in order (`Snapshot.choices`); cleared by `set_clock`."""

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
        """SPEC.md §11.3: tier and refs first (fewer sessions hurt first), then the policy."""
        policy = pages.policy_rank(self.policy, node.last_access, node.hit_count, node.creation, node.priority)
        return (self.tier(node), node.high_ref, node.low_ref, *policy)

    def _pick(self, candidates: list[Node], choose: Optional[Chooser]) -> Node:
        if self.rank_free and choose is not None:
            ranked = [n.id for n in sorted(candidates, key=lambda n: (self.rank(n), n.id))]
            pick = choose(ranked)
            return self.nodes[ranked[0] if pick is None else pick]
        tied = pages.min_rank_ids([(self.rank(n), n.id) for n in candidates])
        pick = choose(tied) if choose else None
        return self.nodes[min(tied) if pick is None else pick]

    # ------------------------------------------------------------------ protocol

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

    # ------------------------------------------------------------------ host tier (SPEC.md §9)

    def _wants_backup(self, node: Node) -> bool:
        """Write-through: on the device, not backed up, hot enough (the parent is checked when it is written)."""
        threshold = WRITE_THROUGH_THRESHOLD.get(self.write_policy)
        return (
            threshold is not None and node.slots is not None and node.host_slots is None and node.hit_count >= threshold
        )

    def _write_through(self, path: list[Node]) -> None:
        """Back up hot nodes of one insert, parents first, as one copy (SPEC.md §9.2).

        A node is written only if its parent is the root or backed up, so the host copy
        stays a prefix. Every written node stays locked until the copy's one ack.
        """
        written: list[Node] = []
        for node in path:
            parent = node.parent
            if parent is not None and (parent is self.root or parent.host_slots is not None):
                if self._write_backup(node):
                    self._lock_path(node, +1)
                    written.append(node)
        if self.batching == "per_node":
            groups = [[n] for n in reversed(written)]
        elif self.batching == "per_node_parents_first":
            groups = [[n] for n in written]
        else:
            groups = [written] if written else []
        for group in groups:
            self.copies.append(Copy(self._next_copy, "write", list(group), anchors=list(group)))
            self._next_copy += 1

    def _write_backup(self, node: Node) -> bool:
        """Give `node` host slots for its KV; False if host eviction cannot make room (or the allocation fails)."""
        slots = self._host_alloc(len(node.key))
        if slots is None:
            return False
        node.host_slots = slots
        _move_kv(self.kv, node.slots or (), self.host_kv, slots)  # the backup's bytes, as it is issued
        return True

    def _host_alloc(self, n: int, reclaim_all: bool = False) -> Optional[tuple[int, ...]]:
        """`n` host slots for the tree, host eviction making room first; None without room or on an injected fault.

        Host eviction frees the shortfall, or with `reclaim_all` (a retraction backup, D17) all `n` tokens.
        """
        assert self.host is not None
        if reclaim_all:
            self._make_room(n)
        else:  # a node's backup: the shortfall (SGLang) or the whole size (ROOM), the seated room spent backup by backup
            self._make_room(n, whole=self.backup_room == "whole", spend=True)
        if self.armed_faults.get("host_alloc"):
            self.armed_faults["host_alloc"] -= 1
            return None
        if len(self.host.free_list) < n:
            return None
        slots = self.host.alloc(n)
        self.host.adopt(slots)
        return slots

    def _make_room(self, size: int, whole: Optional[bool] = None, spend: bool = False) -> None:
        """Host room for `size` tokens that do not fit: host eviction asks for all of them (`whole`; by default as
        `host_room` says for a prefetch or a retraction backup, SGLang's), or the shortfall, or what the harness
        seats (`host_ask`, at most `size`; with `spend`, what this eviction freed is taken off it)."""
        assert self.host is not None
        free = len(self.host.free_list)
        if free >= size:
            return
        if whole is None:
            whole = self.host_room == "whole"
        ask = size if whole else size - free
        if self.host_ask is not None:
            ask = min(self.host_ask, size)
        if ask:
            freed = self.evict_host(ask, choose=self.host_steer or self.steer)
            if spend and self.host_ask is not None:
                self.host_ask = max(0, self.host_ask - freed)

    def inject_fault(self, kind: str) -> None:
        """Arm one fault: the next allocation of `kind` fails (SPEC.md §10.5)."""
        if kind not in FAULTS:
            raise UnknownFault(f"no fault kind {kind!r}; this cache has {FAULTS}")
        self.armed_faults[kind] = self.armed_faults.get(kind, 0) + 1

    def host_leaves(self) -> list[Node]:
        """Host eviction candidates: on the host only, no children, unlocked, no host protection."""
        # fmt: off
        return [
            n
            for n in self.nodes.values()
            if n is not self.root
            and n.slots is None
            and not n.children
            and n.lock_ref == 0
            and n.host_lock_ref == 0
            and self.tier(n) != HIGH_REF
        ]
        # fmt: on

    def host_duplicates(self) -> list[Node]:
        """Write-back's first host victims: settled backups of device-resident nodes (SPEC.md §9.4)."""
        moving = {id(n) for c in self.copies for n in c.nodes}
        return [
            n
            for n in self.nodes.values()
            if n is not self.root
            and n.slots is not None
            and n.host_slots is not None
            and n.host_lock_ref == 0
            and id(n) not in moving
        ]

    def evict_host(self, n: int, choose: Optional[Chooser] = None) -> int:
        """Free `n` host tokens: write-back's duplicate backups (any order), then host-only leaves by rank."""
        check_count(n)
        freed = 0
        if self.host_order == "rank" and self.write_policy == "write_back":
            return self._evict_host_by_rank(n, choose)
        while freed < n and self.host is not None and self.write_policy == "write_back":
            duplicates = self.host_duplicates()
            if not duplicates:
                break
            ids = sorted(d.id for d in duplicates)
            pick = self.reclaim(ids) if self.reclaim else None
            victim = self.nodes[ids[0] if pick is None else pick]
            self.chosen.append(("reclaim", victim.id))
            self.host.release(victim.host_slots or ())
            victim.host_slots = None
            freed += len(victim.key)
        while freed < n and self.host is not None:
            leaves = self.host_leaves()
            if not leaves:
                if self._demote_idle_session():
                    continue  # its host copies may be LOW_REF now (SPEC.md §11.4)
                break
            victim = self._pick(leaves, choose)
            self.chosen.append(("host_evict", victim.id))
            self._delete_host_leaf(victim)
            freed += len(victim.key)
        return freed

    def _evict_host_by_rank(self, n: int, choose: Optional[Chooser]) -> int:
        """The alternative write-back host eviction: duplicate backups and host-only leaves in one rank order."""
        assert self.host is not None
        freed = 0
        while freed < n:
            candidates = self.host_duplicates() + self.host_leaves()
            if not candidates:
                if self._demote_idle_session():
                    continue
                break
            victim = self._pick(candidates, choose)
            self.chosen.append(("reclaim" if victim.slots is not None else "host_evict", victim.id))
            if victim.slots is not None:
                self.host.release(victim.host_slots or ())
                victim.host_slots = None
            else:
                self._delete_host_leaf(victim)
            freed += len(victim.key)
        return freed

    def load_back(self, node_id: int) -> int:
        """Bring the host-only part of the path ending at `node_id` back to the device.

        All or nothing: refused (0) below the threshold or when the device cannot make
        room. The loaded path stays locked, and its host copy protected, until the ack.
        """
        node = self._live(node_id)
        chain = [n for n in self._path_to_root(node) if n.slots is None]
        if not chain:
            return 0
        chain.reverse()
        size = sum(len(n.key) for n in chain)
        if size < self.load_back_threshold:
            return 0
        node.host_lock_ref += 1  # the host copy must survive eviction made for room
        self._lock_path(node, +1)  # and so must the device path it hangs from
        if len(self.pool.free_list) < size:
            ask = size if self.load_ask == "whole" else size - len(self.pool.free_list)
            self.evict(ask, *self.load_scope, choose=self.steer)  # LOAD_ROOM
        if len(self.pool.free_list) < size:
            self._lock_path(node, -1)
            node.host_lock_ref -= 1
            return 0
        slots = self.pool.alloc(size)
        self.pool.adopt(slots)
        offset = 0
        for n in chain:
            n.slots = tuple(slots[offset : offset + len(n.key)])
            offset += len(n.key)
            self._account(n, +1)  # locked: protected
        _move_kv(self.host_kv, [x for n in chain for x in n.host_slots or ()], self.kv, slots)  # one job
        if not self.load_host_lock:  # from here the copy's own pins protect the host copy (LOAD_LOCK)
            node.host_lock_ref -= 1
        held = [node] if self.load_host_lock else []
        self.copies.append(Copy(self._next_copy, "load", chain, anchors=[node], host_locked=held))
        self._next_copy += 1
        return size

    def complete(self, copy_id: int) -> None:
        """The copy engine finished copy `copy_id`; its ack waits for `poll`.

        A store copy writes its pages to storage now, in one `batch_set` (SPEC.md §10.3).
        """
        ok = isinstance(copy_id, int) and not isinstance(copy_id, bool)
        copy = next((c for c in self.copies if ok and c.id == copy_id and not c.finished), None)
        if copy is None:
            raise UnknownCopy(f"no pending copy {copy_id!r}")
        if self.armed_faults.get("copy"):
            self.armed_faults["copy"] -= 1
            if copy.kind != "store":
                if copy.kind == "write" and self.copy_failure == "invalidate" and self._give_up(copy):
                    return  # the backups are invalidated, the ack still releases the copy's locks
                return  # a failed device<->host copy is retried: both ends stay pinned, the copy unfinished
            copy.finished = True
            return  # a failed store copy ends without writing: its pages are simply not in storage
        copy.finished = True
        if copy.kind == "store" and self.storage is not None:
            keys, values = self._pages_of(copy.nodes)
            try:
                self.storage.batch_set(keys, values)
            except l3.StorageError:
                pass  # a failed write is simply not stored: later lookups miss

    def _give_up(self, copy: Copy) -> bool:
        """Invalidate a failed write copy: its nodes and every host copy below them lose their backups, host-only
        nodes leaving the tree. False (retry instead) when one of those is moving, host-locked, locked or held by
        a high-priority session: dropping it would lose KV someone still reads."""
        assert self.host is not None
        moving = {id(n) for c in self.copies if c is not copy for n in c.nodes}
        below: list[Node] = []
        todo = list(copy.nodes)
        while todo:
            n = todo.pop()
            if n.host_slots is not None and n not in below:
                below.append(n)
            todo += n.children.values()
        for n in below:
            if id(n) in moving or n.host_lock_ref or (n.slots is None and (n.lock_ref or self.tier(n) == HIGH_REF)):
                return False
        copy.finished = copy.given_up = True
        copy.nodes = []  # it moves nothing now; its ack still releases its locks
        for n in sorted(below, key=lambda n: -len(self._full_path(n))):  # deepest first: leaves before parents
            if n.id not in self.nodes:
                continue
            if n.slots is None:
                self._delete_host_leaf(n)
            else:
                self.host.release(n.host_slots or ())
                n.host_slots = None
        return True

    def poll(self) -> int:
        """Consume finished acks in issue order, per kind, stopping at the first unfinished one."""
        consumed = 0
        for kind in ("write", "load", "store"):
            for copy in [c for c in self.copies if c.kind == kind]:
                if not copy.finished:
                    break
                self.copies.remove(copy)
                for anchor in copy.anchors:
                    self._lock_path(anchor, -1)
                for n in copy.host_locked:
                    n.host_lock_ref -= 1
                consumed += 1
                if kind == "write" and not copy.given_up:
                    ordered = sorted(copy.nodes, key=lambda n: len(self._full_path(n)))
                    for group in [ordered] if self.batching == "per_ack" else [[n] for n in ordered]:
                        self._store(group)  # D7: one store copy per node (SGLang)
        return consumed

    def regroup(self, count: int, groups: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Re-cut the last `count` copies issued into `groups` (kind, node ids), in that order: the backend's
        grouping of the same nodes (SPEC.md §6.1 BATCH). A write copy locks the path of each of its nodes and a
        store copy host-locks each, so the locks carry over unchanged; load copies keep theirs, in order."""
        cut = len(self.copies) - count
        old = self.copies[cut:]
        loads = iter([c for c in old if c.kind == "load"])
        new: list[Copy] = []
        for kind, ids in groups:
            if kind == "load":
                new.append(next(loads))
                continue
            nodes = [self.nodes[i] for i in ids]
            if kind == "write":
                new.append(Copy(self._next_copy, kind, nodes, anchors=list(nodes)))
            else:
                new.append(Copy(self._next_copy, kind, nodes, anchors=[], host_locked=list(nodes)))
            self._next_copy += 1
        moved = sorted((c.kind, n.id) for c in old if c.kind != "load" for n in c.nodes)
        assert moved == sorted((c.kind, n.id) for c in new if c.kind != "load" for n in c.nodes), "not a re-cut"
        del self.copies[cut:]
        self.copies += new

    # ------------------------------------------------------------------ sessions (SPEC.md §11)

    def _is_high(self, session: Session) -> bool:
        return session.priority >= self.threshold and not session.demoted

    def _hold(self, session: Session, sign: int) -> None:
        """Add (+1) or remove (-1) the session's refs along its path, keeping the tier counters exact."""
        high = self._is_high(session)
        for node in self._path_to_root(session.node):
            if node.slots is not None:
                self._account(node, -1)
            if high:
                node.high_ref += sign
            else:
                node.low_ref += sign
            if node.slots is not None:
                self._account(node, +1)

    def _session(self, session_id: object) -> Session:
        found = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if found is None:
            raise UnknownSession(f"no registered session {session_id!r}")
        return found

    def _sessions_leave(self, node: Node) -> None:
        """`node` left the tree: sessions that ended there now end at its parent (SPEC.md §11.1)."""
        for session in self.sessions.values():
            if session.node is node:
                session.node = node.parent or self.root

    def register_ref(self, session_id: str, node_id: int, priority: int) -> None:
        """The session holds the path to `node_id` at `priority` (again: moved there, undemoted)."""
        check_session(session_id)
        node = self._live(node_id)
        check_priority(priority)
        old = self.sessions.pop(session_id, None)
        if old is not None:
            was_high = self._is_high(old)
            self._hold(old, -1)
            if was_high and (self.restore_steer is not None or self.restore_on_move):  # DEMOTE: a move may count
                self._restore_one(self._restore_pick(self._still_demoted()))  # as the high session's release
        session = Session(session_id, node, priority, self._next_seq)
        self._next_seq += 1
        self.sessions[session_id] = session
        self._hold(session, +1)
        self._queue(session)

    def update_ref(self, session_id: str, priority: int) -> None:
        """A new priority for the session's path; clears an adaptive demotion."""
        check_priority(priority)
        session = self._session(session_id)
        self._hold(session, -1)
        session.priority, session.demoted = priority, False
        self._hold(session, +1)
        self._queue(session)

    def release_ref(self, session_id: str) -> None:
        """The session holds nothing any more; a high one gives its room back to a demoted one."""
        session = self._session(session_id)
        was_high = self._is_high(session)
        self._hold(session, -1)
        del self.sessions[session_id]
        if not was_high:
            return
        self._restore_one(self._restore_pick(self._still_demoted()))

    def _restore_pick(self, demoted: list[str]) -> Optional[str]:
        """The demoted session high-priority room goes back to: the steered one, else by `restore_order`."""
        if self.restore_steer is not None:
            return self.restore_steer(demoted)
        if not demoted:
            return None
        return demoted[-1] if self.restore_order == "latest" else demoted[0]

    def _still_demoted(self) -> list[str]:
        """Sessions demoted and not since restored, re-registered or released, earliest demoted first."""
        return [d for d in self.demotions if d in self.sessions and self.sessions[d].demoted]

    def _restore_one(self, pick: Optional[str]) -> None:
        """High-priority room came back: `pick` (a demoted session, or None) is high again (SPEC.md §11.4)."""
        if pick is None:
            return
        back = self.sessions[pick]
        self.demotions = [d for d in self._still_demoted() if d != pick]
        self._hold(back, -1)
        back.demoted = False
        self._hold(back, +1)
        self._queue(back)

    def _queue(self, session: Session) -> None:
        """Under the "queued" demotion order, a session high now joins the queue, unless it is in it already."""
        if self.demote_order != "queued" or not self._is_high(session) or session.id in self.queued:
            return
        self.queued.add(session.id)
        heapq.heappush(self.idle_queue, (len(self._full_path(session.node)), session.id))

    def _queued_high(self) -> Optional[Session]:
        """The queue's first session that is still high; the stale entries before it leave the queue."""
        while self.idle_queue:
            _, sid = self.idle_queue[0]
            session = self.sessions.get(sid)
            if session is not None and self._is_high(session):
                return session
            heapq.heappop(self.idle_queue)
            self.queued.discard(sid)
        return None

    def _demote_idle_session(self) -> bool:
        """Host pressure: demote the idle high session with the fewest tokens (SPEC.md §11.4); False if none."""
        high = sorted((s for s in self.sessions.values() if self._is_high(s)), key=lambda s: s.seq)
        pick = self.demote_steer([s.id for s in high]) if self.demote_steer is not None else None
        if pick is not None:
            victim = self.sessions[pick]
        elif self.demote_order == "queued":
            queued = self._queued_high()
            if queued is None:
                return False
            victim = queued
        else:
            idle = [s for s in high if any(n.slots is None for n in self._path_to_root(s.node))]
            if not idle:
                return False
            victim = min(idle, key=lambda s: (len(self._full_path(s.node)), s.seq))
        self._hold(victim, -1)
        victim.demoted = True
        self._hold(victim, +1)
        self.demotions = [d for d in self.demotions if d != victim.id] + [victim.id]
        return True

    # ------------------------------------------------------------------ admission (SPEC.md §11.5, §11.6)

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        """What admitting `tokens` new tokens at `priority` takes: evict in scope, retract, or keep fewer layers."""
        if not _is_count(tokens):
            raise InvalidPlan(f"a request needs a non-negative int of tokens, got {tokens!r}")
        check_priority(priority)
        if not isinstance(running, Sequence) or not all(
            isinstance(r, Running) and _is_count(r.id) and _is_count(r.tokens) and _is_int(r.priority) for r in running
        ):
            raise InvalidPlan(f"running requests must be Running(id, priority, tokens) of ints, got {running!r}")
        if len({r.id for r in running}) != len(running):
            raise InvalidPlan("running request ids repeat")
        if profile is not None and not (
            isinstance(profile, AdmissionProfile)
            and all(_is_count(v) for v in (profile.load, profile.store, profile.step, profile.target))
        ):
            raise InvalidPlan(f"a profile holds non-negative ints, got {profile!r}")
        high = priority >= self.threshold
        free = len(self.pool.free_list)
        in_scope = self.tier_evictable[0] + self.tier_evictable[1] + (self.tier_evictable[2] if high else 0)
        host_room = len(self.host.free_list) if self.host is not None and self.backs_up_retractions else 0
        layers_all = self.kv_layers
        low = [r for r in running if r.priority < self.threshold]  # a high-priority request is never retracted
        for layers in range(layers_all, 0, -1):
            if layers < layers_all and (
                profile is None
                or profile.step + (layers_all - layers) * tokens * (profile.load + profile.store) > profile.target
            ):
                break  # fewer layers stream more: past the first refusal none is admitted
            need = pages.page_ceil(-(-tokens * layers // layers_all), self.page_size)
            if free + in_scope >= need:
                return AdmissionPlan(True, max(0, need - free), high, (), (), layers, need)
            if not high:
                continue
            picks = _retraction_picks(low, need - free - in_scope)
            if picks is None:
                continue
            keep = []
            for r in picks:
                size = pages.page_ceil(r.tokens, self.page_size)
                keep.append(0 < size <= host_room)
                host_room -= size if keep[-1] else 0
            return AdmissionPlan(True, in_scope, True, tuple(r.id for r in picks), tuple(keep), layers, need)
        return AdmissionPlan(False, allow_high=high)

    # ------------------------------------------------------------------ retraction (SPEC.md §9.11)

    def retraction_backup(self, slots: Sequence[int]) -> Optional[int]:
        """Back a retracted request's KV up to host slots outside the tree; the backup's id.

        `slots` are the device slots the request reads: the tree's (its prefix) and its own.
        Synchronous, as in SGLang (the engine waits for the copy). Host eviction makes room;
        None when there is none even then: the request will recompute, nothing is half-saved.
        """
        if not isinstance(slots, Sequence) or isinstance(slots, (str, bytes)) or not slots:
            raise InvalidCount(f"a retraction backs up at least one slot, got {slots!r}")
        free = set(self.pool.free_list)
        if any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < self.pool.capacity for x in slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: not device slot ids")
        if len(set(slots)) != len(slots) or free.intersection(slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: repeated or free")
        if self.host is None:
            return None
        host_slots = self._host_alloc(pages.page_ceil(len(slots), self.page_size), reclaim_all=True)  # D17
        if host_slots is None:
            return None
        _move_kv(self.kv, slots, self.host_kv, host_slots)  # synchronous: the engine waits for it
        backup = Retraction(self._next_retraction, len(slots), host_slots)
        self._next_retraction += 1
        self.retractions.append(backup)
        return backup.id

    def _retraction(self, backup_id: object) -> Retraction:
        ok = isinstance(backup_id, int) and not isinstance(backup_id, bool)
        found = next((r for r in self.retractions if ok and r.id == backup_id), None)
        if found is None:
            raise UnknownRetraction(f"no retraction backup {backup_id!r}")
        return found

    def retraction_restore(self, backup_id: int, slots: Sequence[int]) -> int:
        """Copy a backup into the caller's fresh `slots` and free it; the resumed request's last node.

        That node is the root, locked once for the request: its later `dec_lock_ref` must
        balance (SGLang's decode path once resumed with no last node and crashed unlocking it).
        """
        backup = self._retraction(backup_id)
        self.pool.require_lent(slots, "restore into")
        if len(slots) != backup.tokens:
            raise LengthMismatch(f"backup {backup_id} holds {backup.tokens} tokens, restore gave {len(slots)} slots")
        _move_kv(self.host_kv, backup.host_slots[: backup.tokens], self.kv, slots)  # in the request's order
        self._drop_retraction(backup)
        self.root.own_locks += 1
        return self.root.id

    def retraction_discard(self, backup_id: int) -> None:
        """The retracted request is gone for good: free its backup."""
        self._drop_retraction(self._retraction(backup_id))

    def _drop_retraction(self, backup: Retraction) -> None:
        assert self.host is not None
        self.retractions.remove(backup)
        self.host.release(backup.host_slots)

    # ------------------------------------------------------------------ storage tier (SPEC.md §10)

    def attach_storage(self, storage: l3.StorageBackend) -> None:
        """The harness hands over the L3 store (it owns it, to inject faults)."""
        self.storage = storage

    def _full_path(self, node: Node) -> Tokens:
        return tuple(t for n in reversed(self._path_to_root(node)) for t in n.key)

    def _pages_of(self, nodes: list[Node]) -> tuple[list[str], list[bytes]]:
        """Keys and records of every page of `nodes`, shallowest first."""
        keys: list[str] = []
        values: list[bytes] = []
        for node in sorted((n for n in nodes if n.id in self.nodes), key=lambda n: len(self._full_path(n))):
            path = self._full_path(node)
            all_keys = l3.page_keys(node.namespace, path, self.page_size, self.digest)
            for page in range((len(path) - len(node.key)) // self.page_size, len(path) // self.page_size):
                payload = l3.page_payload(node.namespace, path, page, self.page_size, self.kv_layers)
                keys.append(all_keys[page])
                values.append(l3.encode_page(all_keys[page], payload))
        return keys, values

    def _store(self, nodes: list[Node]) -> None:
        """Back freshly written host copies up to storage: one store copy, host-locking its nodes."""
        if self.storage is None or not nodes:
            return
        for n in nodes:
            n.host_lock_ref += 1
        self.copies.append(Copy(self._next_copy, "store", list(nodes), anchors=[], host_locked=list(nodes)))
        self._next_copy += 1

    def _prefetching(self, prefetch_id: object) -> Prefetching:
        ok = isinstance(prefetch_id, int) and not isinstance(prefetch_id, bool)
        found = next((p for p in self.prefetches if ok and p.id == prefetch_id), None)
        if found is None:
            raise UnknownPrefetch(f"no running prefetch {prefetch_id!r}")
        return found

    def prefetch(self, node_id: int, namespace: Namespace, tokens: Sequence[int]) -> int:
        """Reserve host room for the stored pages that follow `node_id`'s path in `tokens`.

        Returns the tokens requested: the run of consecutive pages storage holds, or 0
        (nothing stored, or no host room even after host eviction: declined). The anchor
        is host-protected until the prefetch ends.
        """
        anchor = self._live(node_id)
        key = check_tokens(tokens)
        key = key[: pages.page_floor(len(key), self.page_size)]
        start = len(self._full_path(anchor))
        if self.storage is None or key[:start] != self._full_path(anchor) or len(key) <= start:
            return 0
        if anchor is not self.root and anchor.namespace != namespace:
            return 0
        if anchor is not self.root and anchor.host_slots is None:
            return 0  # D18: it lost its backup since its match (§9.4's reclaim); no storage call
        if self._throttled():
            return 0  # THROTTLE: declined for admission, no storage call
        keys = l3.page_keys(namespace, key, self.page_size, self.digest)[start // self.page_size :]
        try:
            hit = self.storage.batch_exists(keys)
        except l3.StorageError:
            hit = 0  # a failed lookup is a miss (SPEC.md §10.2)
        size = hit * self.page_size
        if size == 0 or self.host is None:
            return 0
        if anchor is not self.root:
            anchor.host_lock_ref += 1  # before making room: the anchor must not be the room made
        slots = self._prefetch_alloc(size)
        if slots is None:
            if anchor is not self.root:
                anchor.host_lock_ref -= 1
            return 0
        size = len(slots)  # D9: the part that fits
        span_pages, hit = len(keys), size // self.page_size
        locked = [anchor] if anchor is not self.root else []
        self.prefetches.append(
            Prefetching(
                self._next_prefetch, anchor, namespace, key[: start + size], start, keys[:hit], slots, self.now, locked
            )
        )
        self.prefetches[-1].span_pages = span_pages
        self._next_prefetch += 1
        return size

    def _throttled(self) -> bool:
        """Whether admission declines the next prefetch (THROTTLE): only ever while another one runs under the core."""
        if self.admit_steer is not None and self.prefetches:
            return not self.admit_steer
        if self.admit_fraction is None or self.host is None:
            return False
        occupied = sum(p.span_pages for p in self.prefetches) * self.page_size
        return occupied >= int(self.admit_fraction * self.host.capacity)

    def _prefetch_alloc(self, size: int) -> Optional[tuple[int, ...]]:
        """D9: if `size` does not fit, host-evict `size` tokens (`_make_room`); reserve the longest whole-page part
        that fits."""
        assert self.host is not None
        self._make_room(size)
        if self.armed_faults.get("host_alloc"):  # an injected failure declines the prefetch (SPEC.md §10.5)
            self.armed_faults["host_alloc"] -= 1
            return None
        take = min(size, pages.page_floor(len(self.host.free_list), self.page_size))
        if take < self.page_size:
            return None
        slots = self.host.alloc(take)
        self.host.adopt(slots)
        return slots

    def fetch(self, prefetch_id: int) -> None:
        """Storage delivers the prefetch's next page: one `batch_get`, verified before it counts."""
        p = self._prefetching(prefetch_id)
        if p.failed or p.fetched == len(p.keys):
            raise UnknownPrefetch(f"prefetch {prefetch_id} has no page left to fetch")
        assert self.storage is not None
        key = p.keys[p.fetched]
        page = p.start // self.page_size + p.fetched
        raised = False
        try:
            blob = self.storage.batch_get([key])[0]
        except l3.StorageError:
            blob, raised = None, True
        payload = l3.decode_page(key, blob)
        if payload is not None and payload == l3.page_payload(
            p.namespace, p.tokens, page, self.page_size, self.kv_layers
        ):
            self._fill_page(p, page)
            p.fetched += 1
        else:
            p.failed = True  # a miss, a torn or corrupt page: never wrong KV
            if raised:  # a read that raises loses its batch: the pages not yet published (FETCH)
                p.fetched = p.published
        ends = p.failed or p.fetched == len(p.keys)  # a batch's miss or the last page publishes everything
        publish = ends or (p.fetched % self.fetch_batch == 0 if self.publish_steer is None else self.publish_steer)
        if publish:
            p.published = p.fetched

    def _fill_page(self, p: Prefetching, page: int) -> None:
        """A verified page lands in the prefetch's next reserved host page: its entries, token by token.

        The payload was checked equal to the content function's, so its entries are `token_entries`
        of the path up to the page's end, sliced to the page.
        """
        start = p.fetched * self.page_size
        entries = l3.token_entries(p.namespace, p.tokens[: (page + 1) * self.page_size], self.kv_layers)
        self.host_kv.update(zip(p.host_slots[start : start + self.page_size], entries[page * self.page_size :]))

    def check_prefetch(self, prefetch_id: int) -> Optional[int]:
        """End the prefetch if its stop policy allows; then insert what was fetched.

        None: still running. Otherwise the host tokens the tree gained (new host-only nodes,
        and backups of device nodes the walk met, SPEC.md §10.4).
        """
        p = self._prefetching(prefetch_id)
        done = p.failed or p.fetched == len(p.keys)
        base, per_page = self.timeout
        expired = (
            self.prefetch_policy == "timeout"
            and p.waiting_since is not None
            and self.now - p.waiting_since > base + per_page * p.span_pages
        )
        if not (done or self.prefetch_policy == "best_effort" or expired):
            if p.waiting_since is None:
                p.waiting_since = self.now  # D11: the deadline starts at the first check that keeps it running
            return None
        return self._end_prefetch(p, keep=p.published * self.page_size, touch=True)

    def abort_prefetch(self, prefetch_id: int) -> None:
        """The request is gone: release everything, insert nothing."""
        self._end_prefetch(self._prefetching(prefetch_id), keep=0)

    def _end_prefetch(self, p: Prefetching, keep: int, touch: bool = False) -> int:
        """Insert the first `keep` prefetched tokens below the anchor; free the rest.

        The walk backs up a device node without a backup with the fetched pages under the
        write-through policies and walks past it under write-back (calibration D15). With
        `touch` (the prefetch ended by `check_prefetch`, not aborted) the insertion is an
        access: the anchor and every node the walk enters become the most recent (D16).
        """
        assert self.host is not None
        self.prefetches.remove(p)
        for n in p.host_locked:
            n.host_lock_ref -= 1
        node, at, added = p.anchor, p.start, 0
        end = p.start + keep
        kept: set[int] = set()
        if touch:
            node.last_access = self.now
        while at < end:
            child = node.children.get(self._selector(p.namespace, p.tokens[at:end]))
            if child is None:
                leaf = self._new_node(
                    parent=node,
                    namespace=p.namespace,
                    key=p.tokens[at:end],
                    slots=None,
                    host_slots=p.host_slots[at - p.start : keep],
                    last_access=self.now,
                    creation=self.now,
                )
                node.children[self._selector(p.namespace, leaf.key)] = leaf
                kept.update(leaf.host_slots or ())
                added += end - at
                break
            if touch:
                child.last_access = self.now
            run = pages.match_len(child.key, p.tokens[at:end], self.page_size)
            if run < len(child.key):
                child = self._split(child, run)
            if child.host_slots is None and self.write_policy != "write_back":
                child.host_slots = p.host_slots[at - p.start : at - p.start + run]  # D15: a refill backs it up
                kept.update(child.host_slots)
                added += run
            node, at = child, at + run  # D15: write_back walks past a device node without a backup
        self.host.release(tuple(slot for slot in p.host_slots if slot not in kept))
        return added

    # ------------------------------------------------------------------ KV bytes (SPEC.md §9.12)

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        """The forward pass: `entries[i]` into device slot `slots[i]`, slots lent to the caller only.

        Bad input writes nothing: every check runs before the first byte lands.
        """
        if not isinstance(slots, Sequence) or not isinstance(entries, Sequence) or len(slots) != len(entries):
            raise LengthMismatch(f"write_kv takes one entry per slot, got {slots!r:.60} and {entries!r:.60}")
        self.pool.require_lent(slots, "write KV into")
        width = len(l3.KV_PARTS) * self.kv_layers * l3.KV_WIDTH
        if any(not isinstance(e, bytes) or len(e) != width for e in entries):
            raise LengthMismatch(f"an entry is {width} bytes: K and V of {self.kv_layers} layers")
        self.kv.update(zip(slots, entries))

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        """The entries device slots hold now (b"" for a slot never written)."""
        _check_ids(slots, self.pool.capacity)
        return [self.kv.get(s, b"") for s in slots]

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        """The entries host slots hold now (b"" for a slot never written)."""
        _check_ids(host_slots, self.host.capacity if self.host else 0)
        return [self.host_kv.get(s, b"") for s in host_slots]

    # ------------------------------------------------------------------ observation

    def snapshot(self) -> Snapshot:
        views = tuple(
            NodeView(
                id=n.id,
                parent=n.parent.id if n.parent is not None else None,
                namespace=n.namespace,
                key=n.key,
                slots=n.slots,
                lock_ref=n.lock_ref,
                host_slots=n.host_slots,
                host_lock_ref=n.host_lock_ref,
                high_ref=n.high_ref,
                low_ref=n.low_ref,
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
            host_capacity=self.host.capacity if self.host else 0,
            host_free_slots=self.host.free_slots() if self.host else (),
            write_policy=self.write_policy,
            pending=tuple(PendingCopy(c.id, c.kind, tuple(n.id for n in c.nodes), c.finished) for c in self.copies),
            prefetches=tuple(
                PendingPrefetch(
                    p.id,
                    p.anchor.id,
                    len(p.keys) * self.page_size,
                    p.published * self.page_size,
                    p.failed,
                    p.host_slots,
                )
                for p in self.prefetches
            ),
            retractions=tuple(RetractionView(r.id, r.tokens, r.host_slots) for r in self.retractions),
            sessions=tuple(
                SessionView(s.id, s.node.id, s.priority, self._is_high(s), s.demoted) for s in self.sessions.values()
            ),
            tier_evictable=(self.tier_evictable[0], self.tier_evictable[1], self.tier_evictable[2]),
            high_priority_threshold=self.threshold,
            choices=tuple(self.chosen),
        )


def factory(config: CacheConfig) -> RefCache:
    """`kvcert certify kvcert.refimpl:factory` entry point."""
    return RefCache(config)


factory.capabilities = RefCache.capabilities  # type: ignore[attr-defined]


def alternative(config: CacheConfig) -> RefCache:
    """`kvcert.refimpl:alternative`: the reference model built another correct way (SPEC.md §6). Write-back host
    eviction takes duplicate backups and host-only leaves in one rank order, a failed write copy is
    invalidated rather than retried, a prefetch or retraction backup that does not fit host-evicts only its
    shortfall, each written node is its own write copy, issued deepest first, a released (or moved) high
    session restores the earliest demoted session rather than the latest, a pending load's host copy is
    protected by the load's own pins rather than a host lock, a backup short of host room host-evicts its
    whole size, load-back evicts its whole size, in a low requester's scope, a prefetch publishes every page as it
    arrives, and admission never declines a prefetch. It passes the core and fails the sglang-0.5.23 profile."""
    cache = RefCache(config)
    cache.batching = "per_node"
    cache.restore_order = "earliest"
    cache.restore_on_move = True
    cache.load_scope = (True, False)
    cache.load_ask = "whole"
    cache.load_host_lock = False
    cache.host_order = "rank"
    cache.copy_failure = "invalidate"
    cache.host_room = "shortfall"
    cache.backup_room = "whole"
    cache.fetch_batch = 1
    cache.admit_fraction = None
    return cache


alternative.capabilities = replace(  # type: ignore[attr-defined]
    RefCache.capabilities, name="kvcert.refimpl:alternative", profile="core"
)
