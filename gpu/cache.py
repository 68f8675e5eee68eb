"""The production cache: a radix tree over torch KV pools, with incremental metadata.

Written from SPEC.md alone (it shares no code with `kvcert.refimpl`, which the suite compares it
with). What makes it production-shaped rather than a model:

- KV lives in torch tensors (`kvcert.gpu.kv`), on CUDA when there is one, the host pool pinned;
  bytes really move between the tiers through a copy engine (`kvcert.gpu.copy_engine`).
- Keys and slot runs are `bytes` of little-endian int64 (8 bytes a token or slot, the layout of
  `array("q")` and of an int64 tensor): comparing an edge is one `bytes.startswith` (a memcmp), a
  split is a slice, a match's slots are one join. The tensor API's hot path loops over no token
  or slot in Python; an insert right after its match reuses the match's path (`_walked`).
- A tensor-native API (`alloc_tensor`, `match_prefix_fast`, `insert_fast`, `free_tensor`) is what
  an engine calls; the Backend protocol's methods (`alloc`, `match_prefix`, `insert`, `free`)
  are thin wrappers over the same internals, converting tuples at the edge. One tree, one
  allocator: the code the suite certifies is the code a scheduler runs.
- Slots come from page allocators (`kvcert.gpu.alloc`) that track ownership per page: O(pages)
  set operations per call.
- Children are found by a hash of the first page's bytes (and the namespace, under the root): O(1)
  per edge.
- Eviction candidates are kept *exact and incrementally*: the set of device leaves (on device,
  unlocked, no child on device), the set of host leaves (host only, childless, unlocked, not host
  protected) and write-back's settled duplicates. Each of the first two has a min-heap keyed by
  the policy rank with lazy deletion (a node's one live entry is `dev_pushed` / `host_pushed`;
  any other is stale); `_refresh(node)` re-derives one node's memberships in O(1) and is called
  wherever a node's residency, children, locks, host locks or copies change.
- Priority tiers (SPEC.md §11): sessions are counted on the nodes of their paths (`high_ref`,
  `low_ref`, `tier`) and indexed at the node they end at; each ref tier has its own candidate heap
  (UNUSED's is the plain one, so traffic without sessions pays nothing) and its own evictable-size
  counter, read in O(1). Only session calls walk a path for refs; a split copies them, a deletion
  hands its sessions to the surviving parent. Host pressure scans the sessions (see
  `_demote_idle_session`); `plan_admission` reads counters only.
- Nothing on the hot path scans the tree. The only walks are the ones the spec implies: a key's
  path (match, insert), a node's path to the root (locks), and, for a device candidate without a
  backup, its host-only subtree (is it pinned, SPEC.md §9.3; empty except under write-back).
  `snapshot()` is O(tree): it is observation, and converts bytes back to tuples.

Time is the harness's logical clock (`set_clock`); nothing reads a wall clock.
"""

from __future__ import annotations

import ctypes
import heapq
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, TypeGuard, Union

import torch

from kvcert.gpu.agreement import Agreement
from kvcert.gpu.alloc import FREE, PageAllocator, to_bytes, to_tuple
from kvcert.gpu.copy_engine import CopyEngine, CopyJob, Ticket, make_engine
from kvcert.gpu.kv import KVGeometry, KVPool, make_pool
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.types import (
    FAULTS,
    HIGH_REF,
    LOW_REF,
    POLICIES,
    PREFETCH_POLICIES,
    UNUSED,
    WRITE_POLICIES,
    WRITE_THROUGH_THRESHOLD,
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    InsertOut,
    InvalidCount,
    InvalidPlan,
    InvalidToken,
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

Selector = Union[bytes, tuple[Namespace, bytes]]
"""A child's entry in its parent's table: its first page as int64 bytes, and under the root its namespace too
(every node below a root child shares that child's namespace)."""

TokenKey = Union[bytes, bytearray, memoryview, array, torch.Tensor, Sequence[int]]
"""What the fast API takes as a key: int64 bytes, an `array("q")`, a 1-D integer tensor, or ints."""

SlotRun = Union[torch.Tensor, array, bytes, bytearray, Sequence[int]]
"""What the fast API takes as slots: a 1-D integer tensor (what `alloc_tensor` returns), an `array("q")`, bytes."""


class Matched(NamedTuple):
    """`match_prefix_fast`'s answer: SGLang's `MatchResult` (device indices, last device node, host hit)."""

    slots: torch.Tensor
    """int64, on the CPU: the device slots of the matched prefix (its length is the match length)."""
    node: int
    """The node where the device match ends (the root for none)."""
    host_length: int
    """Tokens after the device match that are on the host only (a load-back could restore them)."""
    host_node: int
    """The deepest node of the match with a host copy (the root for none): `load_back`'s argument."""


class Inserted(NamedTuple):
    """`insert_fast`'s answer."""

    prefix_len: int
    """Tokens of the key already cached: `slots[:prefix_len]` stay the caller's to free."""
    node: int
    """The node ending exactly at the key."""


class Node:
    """A radix-tree vertex. `key`, `slots`, `host_slots` are int64 bytes; the slots are None when absent on that tier."""

    __slots__ = (
        "id",
        "parent",
        "ns",
        "key",
        "size",
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
        "dev_pushed",
        "host_pushed",
        "copies",
        "hl_owners",
        "end",
        "high_ref",
        "low_ref",
        "tier",
        "ending",
    )

    def __init__(self, node_id: int, parent: Optional[Node], ns: Namespace, key: bytes) -> None:
        self.id = node_id
        self.parent = parent
        self.ns = ns
        self.key = key
        self.size = len(key) >> 3
        """Tokens on this edge."""
        self.slots: Optional[bytes] = None
        self.host_slots: Optional[bytes] = None
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
        self.dev_pushed: Optional[tuple[int, ...]] = None
        self.host_pushed: Optional[tuple[int, ...]] = None
        """This node's live entry in the device / host heap (None: none). Any other entry of it is
        stale: the node re-ranked since, and was pushed again if it was a candidate."""
        self.copies: list[Copy] = []
        """Pending copies that move this node."""
        self.hl_owners: list[Union[Copy, Prefetch]] = []
        """Owners of this node's host-lock segments (a load, a store, a prefetch)."""
        self.end: int = (parent.end if parent is not None else 0) + self.size
        """Tokens from the root to this node's end: fixed for life (a split keeps the deeper half's end)."""
        self.high_ref = 0
        """High-priority sessions whose path holds this node (SPEC.md §11.1)."""
        self.low_ref = 0
        """Low-priority sessions whose path holds this node."""
        self.tier = UNUSED
        """`tier_of(high_ref, low_ref)`, kept with the refs: the hot path reads one int (0: no session holds it)."""
        self.ending: Optional[dict[str, Session]] = None
        """Sessions whose path ends here (None: none): a deletion hands them to the surviving parent in O(1) each."""


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
class Session:
    """A registered session (SPEC.md §11.1): it holds the path from the root to `node`."""

    id: str
    node: Node
    priority: int
    seq: int
    """Registration stamp: ties between idle sessions go to the earliest (re-)registered (§11.4)."""
    high: bool
    """Counts as high now: priority at or above the threshold and not demoted."""
    demoted: bool = False


@dataclass(eq=False)
class Retraction:
    id: int
    tokens: int
    host_slots: tuple[int, ...]


def _is_id(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_count(x: object) -> bool:
    return _is_id(x) and x >= 0


def _fewest_covering(low: Sequence[Running], short: int) -> Optional[list[Running]]:
    """SPEC.md §11.5's retraction: the fewest requests freeing `short` tokens, None if all of them cannot.

    With `k` the fewest that can cover `short`, the first `k - 1` picks are the largest (tokens
    descending, then id ascending); the last is the smallest request left (tokens ascending, then id
    ascending) that closes the gap. O(r log r).
    """
    by_size = sorted(low, key=lambda r: (-r.tokens, r.id))
    k = covered = 0
    while k < len(by_size) and covered < short:
        covered += by_size[k].tokens
        k += 1
    if covered < short or not k:
        return None
    gap = short - (covered - by_size[k - 1].tokens)  # what the last pick must free
    last = min((r for r in by_size[k - 1 :] if r.tokens >= gap), key=lambda r: (r.tokens, r.id))
    return [*by_size[: k - 1], last]


def _lru_entry(n: Node) -> tuple[int, ...]:
    return (n.last_access, n.id)


_INT_ARRAY = frozenset("bBhHiIlLqQ")
_INT_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


def _tensor_raw(t: torch.Tensor) -> bytes:
    """A 1-D integer tensor's values as int64 bytes: one memcpy of a contiguous CPU int64 tensor's memory."""
    if t.dtype is not torch.int64 or not t.is_cpu or not t.is_contiguous():
        t = t.to(device="cpu", dtype=torch.int64).contiguous()
    n = t.numel()
    return ctypes.string_at(t.data_ptr(), 8 * n) if n else b""


def _tensor_of(raw: Union[bytes, bytearray]) -> torch.Tensor:
    """int64 bytes as a CPU tensor that owns its memory."""
    if not raw:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(raw if isinstance(raw, bytearray) else bytearray(raw), dtype=torch.int64)


def _int64(values: Sequence[int]) -> bytes:
    """Token ids the protocol checked (non-negative ints) as int64 bytes; `InvalidToken` past int64."""
    try:
        return array("q", values).tobytes()
    except OverflowError:
        raise InvalidToken("this cache stores token ids as int64: ids must be below 2**63") from None


def _key_raw(key: object) -> bytes:
    """A fast-API key as int64 bytes; `InvalidToken` for anything but non-negative integer ids."""
    if type(key) is array and key.typecode == "q":  # what a scheduler holds (SGLang's requests do)
        raw = key.tobytes()
    elif isinstance(key, bytes):
        raw = key
    elif isinstance(key, array):
        if key.typecode not in _INT_ARRAY:
            raise InvalidToken(f"token ids must be integers, got an array of {key.typecode!r}")
        raw = key.tobytes() if key.typecode == "q" else _int64(key)
    elif isinstance(key, torch.Tensor):
        if key.dtype not in _INT_DTYPES or key.dim() != 1:
            raise InvalidToken(f"token ids must be a 1-D integer tensor, got {key.dtype} of shape {tuple(key.shape)}")
        raw = _tensor_raw(key)
    elif isinstance(key, (bytearray, memoryview)):
        raw = bytes(key)
    elif isinstance(key, Sequence) and not isinstance(key, str):
        raw = _int64(check_tokens(key))
    else:
        raise InvalidToken(f"not a key: {type(key).__name__}")
    if len(raw) % 8:
        raise InvalidToken(f"a key of int64 bytes has a multiple of 8 bytes, got {len(raw)}")
    if not raw[7::8].isascii():  # the top byte of every little-endian int64: its high bit is the sign
        raise InvalidToken("token ids must be non-negative")
    return raw


def _slot_run(slots: object) -> tuple[int, Optional[bytes]]:
    """(how many slots, their int64 bytes); bytes None when `slots` is not a run of slot ids."""
    if type(slots) is torch.Tensor and slots.dtype is torch.int64 and slots.is_cpu and slots.dim() == 1:
        if slots.is_contiguous():  # what `alloc_tensor` hands out, and its slices: one memcpy
            n = slots.numel()
            return n, ctypes.string_at(slots.data_ptr(), 8 * n) if n else b""
    if isinstance(slots, torch.Tensor):
        if slots.dtype not in _INT_DTYPES or slots.dim() != 1:
            return slots.numel(), None
        return slots.numel(), _tensor_raw(slots)
    if isinstance(slots, array):
        if slots.typecode == "q":
            return len(slots), slots.tobytes()
        return len(slots), to_bytes(slots) if slots.typecode in _INT_ARRAY else None
    if isinstance(slots, (bytes, bytearray, memoryview)):
        raw = bytes(slots)
        return len(raw) >> 3, raw if len(raw) % 8 == 0 else None
    if isinstance(slots, Sequence) and not isinstance(slots, str):
        return len(slots), to_bytes(slots)
    return 0, None


class GpuCache:
    """Device, host and storage tiers over torch pools, with priority tiers (SPEC.md §4, §9, §10, §11)."""

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
        if self.policy == "lru":  # the default policy's rank without the dispatch (tests hold it to the spec's)
            self._entry = _lru_entry  # type: ignore[method-assign]
        self.now = 0
        self._next_id = 1
        self._shape = 0
        """Bumped whenever a node is created or removed (a split creates one): the tree's shape changed."""
        self._walked: tuple[int, Namespace, bytes, int, list[Node]] = (-1, None, b"", 0, [])
        """The last walk: (shape, namespace, key, bytes matched, path). The same key over the same shape
        follows the same path (its splits are done), so the insert that follows a match skips the lookups."""
        self._pb = 8 * ps
        """Bytes of one page of a key or a slot run."""
        self.root = Node(0, None, None, b"")
        self.root.slots = b""
        self.nodes: dict[int, Node] = {0: self.root}
        self.evictable_size = 0
        self.protected_size = 0
        # eviction candidates, exact; heaps ordered by (rank, id), lazily pruned
        self.dev_leaves: set[int] = set()
        self.host_leaves: set[int] = set()
        self.dev_heap: list[tuple[int, ...]] = []
        self.host_heap: list[tuple[int, ...]] = []
        """Entries are a rank with the node id appended: flat tuples of ints, cheap to compare. These two
        hold the UNUSED tier (no session holds the node): the only tier without sessions, so the hot path
        pushes exactly what it pushed before tiers existed."""
        self.dev_heap_low: list[tuple[int, ...]] = []
        self.dev_heap_high: list[tuple[int, ...]] = []
        self.host_heap_low: list[tuple[int, ...]] = []
        """Ref-tier heaps (SPEC.md §11.3): LOW_REF entries are `(low_ref, *policy_rank, id)`, HIGH_REF ones
        `(high_ref, low_ref, *policy_rank, id)` — the rank `(tier, high_ref, low_ref, *policy_rank)` with the
        tier made the heap. Host eviction never takes a HIGH_REF copy, so a host HIGH_REF leaf is pushed nowhere
        until a demotion drops it to LOW_REF (its refresh pushes it then)."""
        # sessions (SPEC.md §11)
        self.high_threshold = config.high_priority_threshold
        self.sessions: dict[str, Session] = {}
        """Registered sessions in registration order (a re-registration moves one to the end)."""
        self._next_seq = 0
        self.demotions: OrderedDict[str, None] = OrderedDict()
        """Sessions adaptive demotion demoted, latest last (a session demoted again moves to the end)."""
        self.held_sizes = [0, 0, 0]
        """Device tokens of unlocked nodes by tier, kept for LOW_REF and HIGH_REF only (index 0 stays 0): UNUSED's
        is `evictable_size` less both (§11.2), so a node no session holds costs the counters nothing."""
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

    def _entry(self, n: Node) -> tuple[int, ...]:
        """`n`'s heap entry: its eviction rank (`kvcert.spec.pages.policy_rank`), then its id (LRU's is inlined)."""
        return (*pages.policy_rank(self.policy, n.last_access, n.hit_count, n.creation, n.priority), n.id)

    def _refresh(self, n: Node) -> None:
        """Re-derive `n`'s candidate memberships (O(1)); push a heap entry when it joins or re-ranks."""
        if n is self.root:
            return
        nid = n.id
        if n.lock_ref:
            self.dev_leaves.discard(nid)
            self.host_leaves.discard(nid)
        elif n.slots is not None:
            self.host_leaves.discard(nid)
            if n.dev_children == 0:
                self.dev_leaves.add(nid)
                if n.tier:
                    self._push_tiered(n, True)
                else:
                    entry = self._entry(n)
                    if n.dev_pushed != entry:
                        heapq.heappush(self.dev_heap, entry)
                        n.dev_pushed = entry
            else:
                self.dev_leaves.discard(nid)
        else:
            self.dev_leaves.discard(nid)
            if not n.children and n.host_lock_ref == 0:
                self.host_leaves.add(nid)
                if n.tier:
                    self._push_tiered(n, False)
                else:
                    entry = self._entry(n)
                    if n.host_pushed != entry:
                        heapq.heappush(self.host_heap, entry)
                        n.host_pushed = entry
            else:
                self.host_leaves.discard(nid)
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

    def _tier_entry(self, n: Node) -> tuple[int, ...]:
        """A held node's entry in its ref tier's heap: `(low_ref, *rank, id)` or `(high_ref, low_ref, *rank, id)`.

        Entries of different tiers differ in length, so an entry equal to a node's live one is in the right heap.
        """
        if n.high_ref:
            return (n.high_ref, n.low_ref, *self._entry(n))
        return (n.low_ref, *self._entry(n))

    def _push_tiered(self, n: Node, device: bool) -> None:
        """Push a held candidate's entry into its tier's heap (a host HIGH_REF leaf goes in none: §11.4)."""
        entry = self._tier_entry(n)
        if device:
            if n.dev_pushed != entry:
                heapq.heappush(self.dev_heap_high if n.high_ref else self.dev_heap_low, entry)
                n.dev_pushed = entry
        elif n.high_ref:
            n.host_pushed = None  # any entry it had is stale: host eviction may not take it now
        elif n.host_pushed != entry:
            heapq.heappush(self.host_heap_low, entry)
            n.host_pushed = entry

    def _pop_held(self, allow_high: bool) -> Optional[Node]:
        """The minimal-rank device candidate some session holds: LOW_REF, then HIGH_REF if allowed (SPEC.md §11.3)."""
        n = self._pop(self.dev_heap_low, self.dev_leaves, True) if self.dev_heap_low else None
        if n is None and allow_high and self.dev_heap_high:
            n = self._pop(self.dev_heap_high, self.dev_leaves, True)
        return n

    def _pop_host(self) -> Optional[Node]:
        """The minimal-rank host candidate: UNUSED, then LOW_REF; never HIGH_REF (SPEC.md §11.4)."""
        n = self._pop(self.host_heap, self.host_leaves, False)
        if n is None and self.host_heap_low:
            n = self._pop(self.host_heap_low, self.host_leaves, False)
        return n

    def _pop(self, heap: list[tuple[int, ...]], members: set[int], device: bool) -> Optional[Node]:
        """The minimal-rank member of `members`, popped from `heap` (stale entries dropped)."""
        while heap:
            entry = heapq.heappop(heap)
            node_id = entry[-1]
            n = self.nodes.get(node_id)
            if n is None:
                continue
            if device:
                if n.dev_pushed is not entry:
                    continue
                n.dev_pushed = None
            else:
                if n.host_pushed is not entry:
                    continue
                n.host_pushed = None
            if node_id in members:
                return n
        return None

    def _compact(self) -> None:
        """Rebuild heaps whose stale entries outnumber the live ones (amortised O(1) per push)."""
        if len(self.dev_heap) + len(self.dev_heap_low) + len(self.dev_heap_high) > 4 * len(self.dev_leaves) + 64 or (
            self.host_kv is not None
            and (
                len(self.host_heap) + len(self.host_heap_low) > 4 * len(self.host_leaves) + 64
                or len(self.dup_heap) > 4 * len(self.dups) + 64
            )
        ):
            self._rebuild()

    def _rebuild(self) -> None:
        for heaps, members, device in (
            ((self.dev_heap, self.dev_heap_low, self.dev_heap_high), self.dev_leaves, True),
            ((self.host_heap, self.host_heap_low), self.host_leaves, False),
        ):
            if sum(map(len, heaps)) > 4 * len(members) + 64:
                for heap in heaps:
                    for old in heap:  # entries about to vanish: their nodes must push again
                        gone = self.nodes.get(old[-1])
                        if gone is not None:
                            if device:
                                gone.dev_pushed = None
                            else:
                                gone.host_pushed = None
                live: tuple[list[tuple[int, ...]], ...] = ([], [], [])
                for node_id in members:
                    n = self.nodes[node_id]
                    tier = n.tier
                    if tier == HIGH_REF and not device:
                        continue  # a host HIGH_REF leaf waits for a demotion (`_push_tiered`)
                    entry = self._entry(n) if tier == UNUSED else self._tier_entry(n)
                    live[tier].append(entry)
                    if device:
                        n.dev_pushed = entry
                    else:
                        n.host_pushed = entry
                for heap, entries in zip(heaps, live):
                    heapq.heapify(entries)
                    heap[:] = entries
        if len(self.dup_heap) > 4 * len(self.dups) + 64:
            self.dup_heap = sorted(self.dups)

    def _new_node(self, parent: Node, ns: Namespace, key: bytes) -> Node:
        n = Node(self._next_id, parent, ns, key)
        self._next_id += 1
        self.nodes[n.id] = n
        self._shape += 1
        return n

    def _forget(self, n: Node, heir: Node) -> None:
        """`n` leaves the tree; sessions that ended at it now end at `heir`, its deepest surviving ancestor.

        Eviction deletes leaves only, so `n` is the end of every path that holds it: no other node's
        refs change, and `heir` already counts those sessions (SPEC.md §11.1). O(sessions ending at `n`).
        """
        self._shape += 1
        del self.nodes[n.id]
        if n.ending:
            into = heir.ending
            if into is None:
                into = heir.ending = {}
            for sid, session in n.ending.items():
                session.node = heir
                into[sid] = session
            n.ending = None
        self.dev_leaves.discard(n.id)
        if self.host_leaves:
            self.host_leaves.discard(n.id)
        if self.dups:
            self.dups.pop(n.id, None)

    def _selector(self, parent: Node, n: Node) -> Selector:
        """`n`'s entry in `parent`'s children: its first page (and namespace, under the root)."""
        page = n.key[: self._pb]
        return (n.ns, page) if parent is self.root else page

    def _account(self, n: Node, sign: int) -> None:
        if n.lock_ref > 0:
            self.protected_size += sign * n.size
        else:
            self.evictable_size += sign * n.size
            if n.tier:
                self.held_sizes[n.tier] += sign * n.size

    def _set_device(self, n: Node, slots: Optional[bytes]) -> None:
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
        """Add `delta` to `lock_ref` from `node` up to the root; only a count that leaves or reaches 0 moves tokens."""
        cur: Optional[Node] = node
        root = self.root
        moved = 0
        """Device tokens that went from evictable to protected (negative: back)."""
        held = self.held_sizes
        dev_leaves, host_leaves = self.dev_leaves, self.host_leaves
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
                        self._refresh(cur)
                else:
                    self._refresh(cur)
            cur = cur.parent
        self.evictable_size -= moved
        self.protected_size += moved

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

    def _path_raw(self, n: Node) -> bytes:
        """The tokens from the root to `n`'s end, as int64 bytes."""
        parts: list[bytes] = []
        cur: Optional[Node] = n
        while cur is not None and cur is not self.root:
            parts.append(cur.key)
            cur = cur.parent
        parts.reverse()
        return b"".join(parts)

    def _path(self, n: Node) -> tuple[int, ...]:
        return to_tuple(self._path_raw(n))

    def _live(self, node_id: object) -> Node:
        n = self.nodes.get(node_id) if type(node_id) is int or _is_id(node_id) else None
        if n is None:
            raise StaleHandle(f"no live node {node_id!r}")
        return n

    # ================================================================== tree walk

    def _split(self, child: Node, cut: int) -> Node:
        """Cut `child` `cut` bytes in: a new head takes the prefix, `child` keeps its identity (SPEC.md §4.3)."""
        parent = child.parent
        assert parent is not None
        head = self._new_node(parent, child.ns, child.key[:cut])
        head.slots = None if child.slots is None else child.slots[:cut]
        head.host_slots = None if child.host_slots is None else child.host_slots[:cut]
        head.lock_ref, head.host_lock_ref = child.lock_ref, child.host_lock_ref
        head.last_access, head.creation = self.now, self.now
        head.hit_count, head.priority = child.hit_count, child.priority
        # the head lies on every path the suffix lies on: it takes its refs (SPEC.md §11.1)
        head.high_ref, head.low_ref, head.tier = child.high_ref, child.low_ref, child.tier
        parent.children[self._selector(parent, child)] = head
        child.key = child.key[cut:]
        child.size = len(child.key) >> 3
        if child.slots is not None:
            child.slots = child.slots[cut:]
        if child.host_slots is not None:
            child.host_slots = child.host_slots[cut:]
        child.parent = head
        head.children[self._selector(head, child)] = child
        head.dev_children = 1 if child.slots is not None else 0
        for c in child.copies:  # a copy in flight moves both halves
            c.nodes.append(head)
            head.copies.append(c)
        for owner in child.hl_owners:  # a host-lock segment lengthens
            owner.host_locked.append(head)
            head.hl_owners.append(owner)
        self._refresh(head)
        self._refresh(child)
        return head

    def _common(self, edge: bytes, key: bytes, at: int, end: int) -> int:
        """Bytes of the longest whole-page common prefix of `edge` and `key[at:end]`, given that one page matches.

        Bisects over pages with `startswith` (a memcmp each): O(|edge| log pages), no per-token loop.
        """
        pb = self._pb
        view = memoryview(edge)
        lo, hi = 1, min(len(edge), end - at) // pb  # lo pages match; hi pages might
        if key.startswith(view[: hi * pb], at):
            return hi * pb
        while hi - lo > 1:  # lo pages match, hi pages do not
            mid = (lo + hi) // 2
            if key.startswith(view[: mid * pb], at):
                lo = mid
            else:
                hi = mid
        return lo * pb

    def _walk(
        self, ns: Namespace, key: bytes, priority: Optional[int], rerank_last: bool = True
    ) -> tuple[int, list[Node], bool]:
        """Follow `key` (whole pages of int64 bytes) from the root, splitting where it ends or diverges inside an edge.

        Stamps every node entered; with `priority` (an insert) also counts a hit on it. Returns the
        bytes matched, the nodes entered (the caller must not change the list: the next walk may reuse
        it), and whether one of them is host only. `rerank_last=False`: the caller refreshes the last
        node itself (an insert, which may hang a leaf below it).
        """
        size = len(key)
        if not size:
            return 0, [], False
        now = self.now
        shape, walked_ns, walked_key, at, path = self._walked
        if shape == self._shape and walked_ns == ns and walked_key == key:  # the last walk's path, unchanged
            for n in path:
                n.last_access = now
                if priority is not None:
                    n.hit_count += 1
                    if priority > n.priority:
                        n.priority = priority
        else:
            pb, at, path = self._pb, 0, []
            startswith, append = key.startswith, path.append
            child = self.root.children.get((ns, key[:pb]))
            while child is not None:
                child.last_access = now
                edge = child.key
                if startswith(edge, at):
                    at += len(edge)
                else:  # the key ends or diverges inside this edge
                    step = self._common(edge, key, at, size)
                    child = self._split(child, step)
                    at += step
                if priority is not None:
                    child.hit_count += 1
                    if priority > child.priority:
                        child.priority = priority
                append(child)
                if at == size:
                    break
                child = child.children.get(key[at : at + pb])
            self._walked = (self._shape, ns, key, at, path)
        # Stamps change ranks. A node's old heap entries go stale by themselves (their rank is not the
        # node's); a candidate must be pushed again. On a path, only the last node can be a candidate,
        # or one whose child on the path is host only: every other node has a child on device.
        hosted = False
        if self.host_kv is not None:  # only a host tier has host-only nodes
            for i, n in enumerate(path):
                if n.slots is None:
                    hosted = True
                    if i:
                        self._refresh(path[i - 1])
        if path and rerank_last:
            self._refresh(path[-1])
        return at, path, hosted

    # ================================================================== device tier (SPEC.md §4)

    def set_clock(self, now: int) -> None:
        self.now = now

    def free_count(self) -> int:
        """Free device slots, in O(1): what a scheduler reads before it allocates (not in the protocol)."""
        return self.alloc_dev.available

    def _lend(self, n: object) -> bytes:
        n = check_count(n)
        if n % self.page_size:
            raise UnalignedKey(f"alloc of {n} slots is not whole pages of {self.page_size}")
        if n > self.alloc_dev.available:
            raise PoolExhausted(f"asked for {n} slots, {self.alloc_dev.available} free")
        return self.alloc_dev.lend_raw(n)

    def _give_back(self, raw: Optional[bytes], shown: object) -> None:
        if raw is None or not self.alloc_dev.give_back_checked(raw):
            raise SlotNotOwned(f"cannot free slots {shown!r:.80}: not all lent to the caller")

    def _match(self, ns: Namespace, key: bytes) -> tuple[list[bytes], int, Node, int, Node]:
        """Match `key` (int64 bytes, cut here to whole pages): (slot runs, length, node, host length, host node)."""
        if len(key) % self._pb:
            key = key[: len(key) - len(key) % self._pb]
        self.root.last_access = self.now
        at, path, hosted = self._walk(ns, key, None)
        length, node, host_length, host_node = 0, self.root, 0, self.root
        runs: list[bytes] = []
        if not hosted:  # every node on device: the whole match is a device hit
            runs = [n.slots or b"" for n in path]
            length = at >> 3
            if path:
                node = path[-1]
            if self.alloc_host is not None:
                host_node = next((n for n in reversed(path) if n.host_slots is not None), self.root)
        else:
            for n in path:
                if n.slots is not None and host_length == 0:
                    length += n.size
                    runs.append(n.slots)
                    node = n
                else:
                    host_length += n.size
                if n.host_slots is not None:
                    host_node = n
        self._compact()
        return runs, length, node, host_length, host_node

    def _check_insert(self, key: bytes, count: int, raw: Optional[bytes], priority: object) -> Optional[Sequence[int]]:
        """The insert preconditions after the tokens', in the protocol's order (SPEC.md §4.2).

        Returns the slots' page ids when they are whole lent pages (`PageAllocator.lent_pages`), for the adoption.
        """
        tokens = len(key) >> 3
        if tokens % self.page_size:
            raise UnalignedKey(f"key of {tokens} tokens is not whole pages of {self.page_size}")
        if count != tokens:
            raise LengthMismatch(f"{tokens} tokens but {count} slots")
        if type(priority) is not int and not _is_id(priority):
            raise InvalidCount(f"priority must be an int, got {priority!r}")
        if raw is None:
            raise SlotNotOwned("cannot insert these slots: not slot ids")
        pages = self.alloc_dev.lent_pages(raw)
        if pages is None and not self.alloc_dev.are_lent_raw(raw):
            raise SlotNotOwned("cannot insert these slots: not all lent to the caller")
        return pages

    def _insert(
        self, ns: Namespace, key: bytes, slots: bytes, priority: int, pages: Optional[Sequence[int]] = None
    ) -> tuple[int, Node]:
        """Insert a checked key and slot run (int64 bytes): (prefix_len in tokens, the node ending at the key).

        `pages`: the run's page ids when it is whole lent pages (adopted by page id, no second look at the bytes).
        """
        self.root.last_access = self.now
        matched, path, hosted = self._walk(ns, key, priority, rerank_last=False)
        prefix = matched  # bytes; a key's and its slots' offsets agree (8 bytes each)
        if hosted:
            prefix = offset = 0
            for n in path:
                width = len(n.key)
                if n.slots is None:  # host only: the request's fresh KV restores it, the backup stays
                    mine = slots[offset : offset + width]
                    self.alloc_dev.adopt_raw(mine)
                    self._set_device(n, mine)
                elif offset == prefix:
                    prefix += width
                offset += width
        node = path[-1] if path else self.root
        if matched < len(key):
            leaf = self._new_node(node, ns, key[matched:])
            leaf.last_access = leaf.creation = self.now
            leaf.hit_count, leaf.priority = 1, priority
            node.children[self._selector(node, leaf)] = leaf
            rest = slots[matched:]
            if pages is not None:
                self.alloc_dev.adopt_pages(pages[(matched >> 3) // self.page_size :])
            else:
                self.alloc_dev.adopt_raw(rest)
            leaf.slots = rest  # `_set_device` for a new unlocked leaf
            self.evictable_size += leaf.size
            node.dev_children += 1
            self._refresh(node)  # it has a child on device now
            self._refresh(leaf)
            node = leaf
        elif path:
            self._refresh(node)
        if self.threshold is not None:  # (`path` is the walk's, kept for the next one: read only)
            written = path if node is self.root or (path and node is path[-1]) else [*path, node]
            self._write_through([n for n in written if self._wants_backup(n)])
        self._compact()
        return prefix >> 3, node

    # ------------------------------------------------------------------ the Backend protocol (tuples)

    def alloc(self, n: int) -> tuple[int, ...]:
        return to_tuple(self._lend(n))

    def free(self, slots: Sequence[int]) -> None:
        self._give_back(to_bytes(slots), slots)

    def match_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> MatchOut:
        runs, length, node, host_length, host_node = self._match(namespace, _int64(check_tokens(tokens)))
        return MatchOut(length, to_tuple(b"".join(runs)), node.id, host_length, host_node.id)

    def insert(self, namespace: Namespace, tokens: Sequence[int], slots: Sequence[int], priority: int = 0) -> InsertOut:
        key = _int64(check_tokens(tokens))
        raw = to_bytes(slots) if len(slots) == len(key) >> 3 else None
        pages = self._check_insert(key, len(slots), raw, priority)
        assert raw is not None
        prefix_len, node = self._insert(namespace, key, raw, priority, pages)
        return InsertOut(prefix_len, node.id)

    # ------------------------------------------------------------------ the engine's API (tensors)

    def alloc_tensor(self, n: int) -> torch.Tensor:
        """`n` device slots (whole pages) as an int64 CPU tensor: `alloc` without a Python int per slot."""
        return _tensor_of(self._lend(n))

    def free_tensor(self, slots: SlotRun) -> None:
        """Give lent slots back (e.g. `slots[:prefix_len]` after `insert_fast`); `SlotNotOwned` changes nothing."""
        self._give_back(_slot_run(slots)[1], slots)

    def match_prefix_fast(self, namespace: Namespace, key: TokenKey) -> Matched:
        """`match_prefix` for an engine: the key as int64 bytes/array/tensor, the slots back as one int64 tensor.

        Same walk, same splits and stamps as the protocol's `match_prefix` (it is a wrapper of the
        same `_match`); only the conversions at the edge differ.
        """
        runs, _, node, host_length, host_node = self._match(namespace, _key_raw(key))
        return Matched(_tensor_of(bytearray().join(runs)), node.id, host_length, host_node.id)

    def insert_fast(self, namespace: Namespace, key: TokenKey, slots: SlotRun, priority: int = 0) -> Inserted:
        """`insert` for an engine: key and slots as int64 tensors/arrays/bytes, checked as the protocol checks them.

        A rejected call raises the protocol's error (InvalidToken, UnalignedKey, LengthMismatch,
        InvalidCount, SlotNotOwned, in that order) and changes nothing.
        """
        raw_key = _key_raw(key)
        count, raw = _slot_run(slots)
        pages = self._check_insert(raw_key, count, raw, priority)
        assert raw is not None
        prefix_len, node = self._insert(namespace, raw_key, raw, priority, pages)
        return Inserted(prefix_len, node.id)

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

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:
        """Free at least `n` device tokens, touching only the ref tiers the scope allows (SPEC.md §4.5, §11.3).

        The scope is this call's: a parameter of `_evict`, never state, so it cannot outlive the call,
        and the evictions the cache makes for itself (load-back's room) use the full scope.
        """
        check_count(n)
        allow_low, allow_high = check_scope(allow_low, allow_high)
        freed = self._evict(n, allow_low, allow_high)
        self._compact()
        return freed

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

    def _evict(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:
        """Free device KV of minimal-rank candidates in scope until `n` tokens are freed or none is left."""
        freed = 0
        aside: list[Node] = []
        released: list[bytes] = []
        """The victims' device slots, given back to the allocator in one call at the end."""
        while freed < n:  # UNUSED first, then LOW_REF, then HIGH_REF, as the scope allows (SPEC.md §11.3)
            victim = self._pop(self.dev_heap, self.dev_leaves, True)
            if victim is None and allow_low and (self.dev_heap_low or self.dev_heap_high):
                victim = self._pop_held(allow_high)
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
                if self._backup_now(victim):
                    self._store([victim])
                elif self._drops_protected(victim):
                    aside.append(victim)
                    continue
            released.append(victim.slots or b"")
            if victim.host_slots is not None:
                self._set_device(victim, None)  # demoted: the host copy stays
            else:
                self._drop(victim)
            freed += victim.size
        if released:
            self.alloc_dev.release_raw(b"".join(released))
        for v in aside:  # pinned ones stay candidates-in-waiting
            if v.id in self.nodes:
                self._refresh(v)
        return freed

    def _drop(self, n: Node) -> None:
        """Remove an unlocked device node without a backup, with any host-only subtree below it.

        Its device slots are the caller's to release (`_evict` gives back all its victims' at once).
        """
        parent = n.parent
        assert parent is not None
        if n.children:
            for c in list(n.children.values()):
                self._delete_host_subtree(c)
        del parent.children[self._selector(parent, n)]
        self.evictable_size -= n.size  # a candidate: unlocked
        if n.tier:
            self.held_sizes[n.tier] -= n.size
        parent.dev_children -= 1
        self._forget(n, parent)
        self._refresh(parent)

    def _delete_host_subtree(self, top: Node) -> None:
        """Remove a host-only subtree; sessions that ended in it now end at `top`'s parent."""
        assert self.alloc_host is not None
        parent = top.parent
        assert parent is not None
        stack = [top]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.alloc_host.release_raw(n.host_slots or b"")
            self._forget(n, parent)
        del parent.children[self._selector(parent, top)]
        self._refresh(parent)

    # ================================================================== host tier (SPEC.md §9)

    def _wants_backup(self, n: Node) -> bool:
        assert self.threshold is not None
        return n.slots is not None and n.host_slots is None and n.hit_count >= self.threshold

    def _host_alloc(self, n: int, reclaim_all: bool = False) -> Optional[bytes]:
        """`n` host slots for the cache; host eviction makes room first (the shortfall, or all `n` with
        `reclaim_all`: a retraction backup, D17). None without room or on an armed fault."""
        assert self.alloc_host is not None
        if self.alloc_host.available < n:
            self._evict_host(n if reclaim_all else n - self.alloc_host.available)
        if self.alloc_host.consume_failure():
            return None
        if self.alloc_host.available < n:
            return None
        return self.alloc_host.take_raw(n)

    def _write_through(self, wanted: list[Node]) -> None:
        """Back up hot nodes of one insert, parents first, as one write copy with one ack (SPEC.md §9.2)."""
        written: list[Node] = []
        for n in wanted:
            parent = n.parent
            if parent is not None and (parent is self.root or parent.host_slots is not None):
                got = self._host_alloc(n.size)
                if got is None:
                    continue
                n.host_slots = got
                self._lock_path(n, +1)
                written.append(n)
        if written:
            src = to_tuple(b"".join(n.slots or b"" for n in written))
            dst = to_tuple(b"".join(n.host_slots or b"" for n in written))
            assert self.host_kv is not None
            self._issue("write", written, list(written), CopyJob(self.kv, src, self.host_kv, dst))

    def _backup_now(self, n: Node) -> bool:
        """Write-back: back a victim up synchronously (the engine waits for it), if host room allows."""
        got = self._host_alloc(n.size)
        if got is None:
            return False
        assert self.host_kv is not None and n.slots is not None
        self.engine.copy_now(self.kv, to_tuple(n.slots), self.host_kv, to_tuple(got))
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
        """Write-back's settled duplicates first, then host-only leaves by rank (SPEC.md §9.4, §11.4).

        Leaves go UNUSED first, then LOW_REF; a HIGH_REF copy never goes directly. With both exhausted
        short of `n`, an idle high session is demoted and the loop goes on (`_demote_idle_session`).

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
            self.alloc_host.release_raw(victim.host_slots or b"")
            victim.host_slots = None
            self._refresh(victim)
            freed += victim.size
        while freed < n:
            leaf = self._pop_host()
            if leaf is None:
                if self.sessions and self._demote_idle_session():
                    continue  # its host copies may be LOW_REF now (SPEC.md §11.4)
                break
            self._delete_host_subtree(leaf)
            freed += leaf.size
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
        size = sum(c.size for c in chain)
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
        got = self.alloc_dev.take_raw(size)
        offset = 0
        for c in chain:
            width = len(c.key)
            self._set_device(c, got[offset : offset + width])
            offset += width
        src = to_tuple(b"".join(c.host_slots or b"" for c in chain))
        copy = self._issue("load", chain, [n], CopyJob(self.host_kv, src, self.kv, to_tuple(got)))
        copy.host_locked = holder.host_locked  # hand the segment over to the real copy
        n.hl_owners[n.hl_owners.index(holder)] = copy
        self._compact()
        return size

    def in_flight(self) -> list[int]:
        """Ids of the copies issued and not finished yet, oldest first: what an engine's step completes.

        O(copies awaiting their ack); not in the protocol (a harness reads them off the snapshot).
        """
        return [c.id for c in self.copies.values() if not c.finished]

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

    # ================================================================== sessions (SPEC.md §11)
    #
    # A session holds the path from the root to its node. Each node counts the high and low sessions
    # whose path holds it (`high_ref`, `low_ref`) and indexes the sessions ending at it (`ending`).
    # A session call walks one path (O(depth)), moving the tier counters and re-ranking the nodes on
    # it; nothing else on the hot path touches refs: a split copies two ints, a deletion hands the
    # sessions ending at the node to its surviving parent.

    def _shift(self, node: Node, d_high: int, d_low: int) -> None:
        """Add `d_high` / `d_low` to the refs of every node from `node` up to the root, keeping the
        tier counters exact and re-ranking each node (a candidate pushes its new entry). O(depth)."""
        cur: Optional[Node] = node
        root, held = self.root, self.held_sizes
        while cur is not None and cur is not root:
            cur.high_ref += d_high
            cur.low_ref += d_low
            old, new = cur.tier, tier_of(cur.high_ref, cur.low_ref)
            if new != old:
                cur.tier = new
                if cur.slots is not None and cur.lock_ref == 0:  # counted evictable: it changes tier
                    if old:
                        held[old] -= cur.size
                    if new:
                        held[new] += cur.size
            self._refresh(cur)
            cur = cur.parent

    def _hold(self, session: Session, sign: int) -> None:
        """Add (+1) or remove (-1) the session's refs along its path."""
        if session.high:
            self._shift(session.node, sign, 0)
        else:
            self._shift(session.node, 0, sign)

    def _set_high(self, session: Session, high: bool) -> None:
        """The session counts as high (or low) now: its path's refs move between the two counts."""
        if session.high != high:
            session.high = high
            d = 1 if high else -1
            self._shift(session.node, d, -d)

    def _session(self, session: object) -> Session:
        found = self.sessions.get(session) if isinstance(session, str) else None
        if found is None:
            raise UnknownSession(f"no registered session {session!r}")
        return found

    def register_ref(self, session: str, node: int, priority: int) -> None:
        """`session` holds the path to `node` at `priority`; again: moved there, to the end of the order, undemoted."""
        check_session(session)
        n = self._live(node)
        check_priority(priority)
        old = self.sessions.pop(session, None)
        if old is not None:
            self._hold(old, -1)
            if old.node.ending is not None:
                old.node.ending.pop(session, None)
        s = Session(session, n, priority, self._next_seq, priority >= self.high_threshold)
        self._next_seq += 1
        self.sessions[session] = s
        if n.ending is None:
            n.ending = {}
        n.ending[session] = s
        self._hold(s, +1)
        self._compact()

    def update_ref(self, session: str, priority: int) -> None:
        """A new priority for the session's path; clears an adaptive demotion (SPEC.md §11.4)."""
        check_priority(priority)
        s = self._session(session)
        s.priority, s.demoted = priority, False
        self._set_high(s, priority >= self.high_threshold)
        self._compact()

    def release_ref(self, session: str) -> None:
        """The session holds nothing any more; a high one restores the latest demotion still in force."""
        s = self._session(session)
        self._hold(s, -1)
        del self.sessions[session]
        if s.node.ending is not None:
            s.node.ending.pop(session, None)
        if s.high:
            while self.demotions:
                back = self.sessions.get(self.demotions.popitem(last=True)[0])
                if back is not None and back.demoted:
                    back.demoted = False
                    self._set_high(back, back.priority >= self.high_threshold)
                    break
        self._compact()

    def _demote_idle_session(self) -> bool:
        """Host pressure (SPEC.md §11.4): demote the idle high session with the fewest tokens on its path,
        ties to the earliest (re-)registered; False if there is none.

        This scans the sessions (O(sessions)): it runs only under host pressure, once host eviction has
        run out of UNUSED and LOW_REF leaves. A session is idle when its path holds a host-only node; a
        device node's parent is on the device (INV-HOST-2), so that is when its own node is host only.
        A node's `end` is the tokens on its path.
        """
        victim: Optional[Session] = None
        for s in self.sessions.values():
            if s.high and s.node.slots is None:
                if victim is None or (s.node.end, s.seq) < (victim.node.end, victim.seq):
                    victim = s
        if victim is None:
            return False
        victim.demoted = True
        self._set_high(victim, False)
        self.demotions.pop(victim.id, None)
        self.demotions[victim.id] = None
        return True

    @property
    def tier_evictable(self) -> tuple[int, int, int]:
        """Device tokens of unlocked nodes per tier (UNUSED, LOW_REF, HIGH_REF), read in O(1) (SPEC.md §11.2)."""
        low, high = self.held_sizes[LOW_REF], self.held_sizes[HIGH_REF]
        return (self.evictable_size - low - high, low, high)

    # ================================================================== admission (SPEC.md §11.5, §11.6)

    @staticmethod
    def _free_slots_of(alloc: PageAllocator) -> int:
        """Free slots: whole free pages, plus free slots of pages a caller tore (`mixed`, almost always empty)."""
        torn = alloc.mixed
        return alloc.available + (sum(states.count(FREE) for states in torn.values()) if torn else 0)

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        """What admitting a request of `tokens` new device tokens at `priority` takes (SPEC.md §11.5, §11.6).

        A value computed from the counters (free slots, `tier_evictable`, free host slots) and the
        arguments: O(L × running log running); it changes nothing.
        """
        if not _is_count(tokens):
            raise InvalidPlan(f"a request needs a non-negative int of tokens, got {tokens!r}")
        check_priority(priority)
        if not isinstance(running, Sequence) or not all(
            isinstance(r, Running) and _is_count(r.id) and _is_count(r.tokens) and _is_id(r.priority) for r in running
        ):
            raise InvalidPlan(f"running requests must be Running(id, priority, tokens) of ints, got {running!r}")
        if len({r.id for r in running}) != len(running):
            raise InvalidPlan("running request ids repeat")
        if profile is not None and not (
            isinstance(profile, AdmissionProfile)
            and _is_count(profile.load)
            and _is_count(profile.store)
            and _is_count(profile.step)
            and _is_count(profile.target)
        ):
            raise InvalidPlan(f"a profile holds non-negative ints, got {profile!r}")
        ps, total = self.page_size, self.kv_layers
        high = priority >= self.high_threshold
        free = self._free_slots_of(self.alloc_dev)
        scope = self.evictable_size - (0 if high else self.held_sizes[HIGH_REF])  # UNUSED + LOW_REF (+ HIGH_REF)
        host_free = self._free_slots_of(self.alloc_host) if self.alloc_host is not None else 0
        low = [r for r in running if r.priority < self.high_threshold]  # a high-priority request is never retracted
        for layers in range(total, 0, -1):
            if layers < total and (
                profile is None
                or profile.step + (total - layers) * tokens * (profile.load + profile.store) > profile.target
            ):
                break  # fewer resident layers stream more: past the first refusal none is admitted (§11.6)
            need = pages.page_ceil(-(-tokens * layers // total), ps)
            if free + scope >= need:
                return AdmissionPlan(True, max(0, need - free), high, (), (), layers, need)
            if not high:
                continue
            picks = _fewest_covering(low, need - free - scope)
            if picks is None:
                continue
            keep: list[bool] = []
            room = host_free
            for r in picks:
                size = pages.page_ceil(r.tokens, ps)
                fits = 0 < size <= room
                keep.append(fits)
                if fits:
                    room -= size
            return AdmissionPlan(True, scope, True, tuple(r.id for r in picks), tuple(keep), layers, need)
        return AdmissionPlan(False, allow_high=high)

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
        raw = self._host_alloc(pages.page_ceil(len(slots), self.page_size), reclaim_all=True)  # D17
        if raw is None:
            self._compact()
            return None
        got = to_tuple(raw)
        loading = self._loading_slots()
        pairs = list(zip(slots, got))
        landed = [(x, h) for x, h in pairs if x not in loading]
        if landed:
            self.engine.copy_now(self.kv, tuple(x for x, _ in landed), self.host_kv, tuple(h for _, h in landed))
        early = [(loading[x], h) for x, h in pairs if x in loading]
        if early:  # a load-back's bytes have not landed there yet: its host copy (protected until the ack) has them
            self.host_kv.copy_from(self.host_kv, [x for x, _ in early], [h for _, h in early])
        r = Retraction(self._next_retraction, len(slots), got)
        self._next_retraction += 1
        self.retractions[r.id] = r
        self._compact()
        return r.id

    def _loading_slots(self) -> dict[int, int]:
        """Device slot -> host slot, for the slots of unfinished load-backs (their bytes are still on the host)."""
        out: dict[int, int] = {}
        for c in self.copies.values():
            if c.kind == "load" and not c.finished:
                for n in c.nodes:
                    if n.slots is not None and n.host_slots is not None:
                        out.update(zip(to_tuple(n.slots), to_tuple(n.host_slots)))
        return out

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
            first = (len(path) - n.size) // ps
            host = to_tuple(n.host_slots or b"")
            for i in range(n.size // ps):
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
        if anchor is not self.root and (anchor.ns != namespace or anchor.host_slots is None):
            return 0  # D18: an anchor that lost its backup since its match asks storage nothing
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
        return to_tuple(self.alloc_host.take_raw(take))

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
        added = self._end_prefetch(p, fetched * self.page_size, touch=True)
        self._compact()
        return added

    def abort_prefetch(self, prefetch: int) -> None:
        self._end_prefetch(self._prefetch(prefetch), 0)
        self._compact()

    def _end_prefetch(self, p: Prefetch, keep: int, touch: bool = False) -> int:
        """Hang the first `keep` fetched tokens below the anchor as host-only nodes; free the rest.

        `touch` (ended by check_prefetch): the anchor and every node the walk enters are accessed now (D16).
        """
        assert self.alloc_host is not None
        del self.prefetches[p.id]
        self._host_unlock_all(p)
        pb = self._pb
        tokens, host = _int64(p.tokens), array("q", p.host_slots).tobytes()
        node, added = p.anchor, 0
        base = at = 8 * p.start  # bytes into `tokens`; `host` starts at the anchor's end
        end = 8 * (p.start + keep)
        kept = array("q")
        if touch and node is not self.root:
            node.last_access = self.now
            self._refresh(node)
        while at < end:
            page = tokens[at : at + pb]
            child = node.children.get((p.ns, page) if node is self.root else page)
            if child is None:
                leaf = self._new_node(node, p.ns, tokens[at:end])
                leaf.host_slots = host[at - base : end - base]
                leaf.last_access = leaf.creation = self.now
                node.children[self._selector(node, leaf)] = leaf
                self._refresh(leaf)
                self._refresh(node)
                kept.frombytes(leaf.host_slots)
                added += (end - at) >> 3
                break
            if touch:
                child.last_access = self.now
                self._refresh(child)
            run = len(child.key) if tokens.startswith(child.key, at) and at + len(child.key) <= end else 0
            if not run:
                run = self._common(child.key, tokens, at, end)
                child = self._split(child, run)
            if child.host_slots is None and not self.write_back:
                # D15: a device node without a backup takes the fetched pages as its backup
                child.host_slots = host[at - base : at - base + run]
                kept.frombytes(child.host_slots)
                added += run >> 3
                self._refresh(child)
            node, at = child, at + run  # D15: write-back walks past a device node without a backup
        mine = set(kept)
        self.alloc_host.release(tuple(s for s in p.host_slots if s not in mine))
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
                key=to_tuple(n.key),
                slots=None if n.slots is None else to_tuple(n.slots),
                lock_ref=n.lock_ref,
                host_slots=None if n.host_slots is None else to_tuple(n.host_slots),
                host_lock_ref=n.host_lock_ref,
                high_ref=n.high_ref,
                low_ref=n.low_ref,
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
            sessions=tuple(SessionView(x.id, x.node.id, x.priority, x.high, x.demoted) for x in self.sessions.values()),
            tier_evictable=self.tier_evictable,
            high_priority_threshold=self.high_threshold,
        )

    def close(self) -> None:
        self.engine.close()
