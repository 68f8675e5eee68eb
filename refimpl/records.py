"""The reference model's records: the slot pool, nodes, copies, prefetches, sessions, retraction backups,
and the small pure helpers the tiers share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from kvcert.spec.types import (
    CacheConfig,
    Namespace,
    PoolExhausted,
    Running,
    SlotNotOwned,
    Tokens,
    UnalignedKey,
    check_count,
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
    history: int = 0
    """The branch's high-water depth in tokens: the deepest end any node made below this one reached (SPEC.md §4.7;
    T-LRU's rank reads it)."""
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
    until: Optional[int] = None
    """Its retention's deadline (SPEC.md §11.7): retained while `now` is below it, or while `waiting`."""
    waiting: bool = False
    """Its next turn arrived within the retention and waits (`retain_waiting`): retained until that turn registers,
    the session is released or retained again; `until` is then the arrival time."""


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
