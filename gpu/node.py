"""The records the cache's components share: tree nodes, pending copies, prefetches, sessions, retractions.

Plain records with no behaviour: each component (`kvcert.gpu.tree`, `.evict_index`, `.host`,
`.storage`, `.sessions`) reads and writes the fields it owns, documented here once. `is_id` tests a
handle (here, below every component, so the tiers need not import the tree for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, TypeGuard, Union

from kvcert.gpu.copy_engine import Ticket
from kvcert.gpu.run import Run
from kvcert.spec.types import UNUSED, Namespace

Selector = Union[bytes, tuple[Namespace, bytes]]
"""A child's entry in its parent's table: its first page as int64 bytes (`Run.page`), and under the root its
namespace too (every node below a root child shares that child's namespace)."""


def is_id(x: object) -> TypeGuard[int]:
    """An int that is not a bool: a node, copy or prefetch handle, a slot id."""
    return isinstance(x, int) and not isinstance(x, bool)


class Node:
    """A radix-tree vertex. `key`, `slots`, `host_slots` are runs; the slots are None when absent on that tier."""

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
        "history",
        "dev_pushed",
        "host_pushed",
        "copies",
        "hl_owners",
        "end",
        "high_ref",
        "retained",
        "low_ref",
        "tier",
        "ending",
    )

    def __init__(
        self, node_id: int, parent: Optional[Node], ns: Namespace, key: Run, size: Optional[int] = None
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.ns = ns
        self.key = key
        self.size = len(key) if size is None else size
        """Tokens on this edge: `len(key)` (passed in by a caller that knows it), kept as an int for the hot path."""
        self.slots: Optional[Run] = None
        self.host_slots: Optional[Run] = None
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
        self.history = 0
        """T-LRU only: the branch's high-water depth in tokens, the deepest `end` any node made below it reached
        (SPEC.md §4.7); kept by the tree under tlru, 0 otherwise."""
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
        self.retained: Optional[dict[int, int]] = None
        """Deadline -> how many live retentions with it hold the node (SPEC.md §11.7); None if none: a retained node
        ranks after its tier's unretained ones, the earliest deadline holding it last."""
        self.tier = UNUSED
        """`tier_of(high_ref, low_ref)`, kept with the refs: the hot path reads one int (0: no session holds it)."""
        self.ending: Optional[dict[str, Session]] = None
        """Sessions whose path ends here (None: none): a deletion hands them to the surviving parent in O(1) each."""


@dataclass(eq=False)
class Copy:
    """A copy issued and not yet acknowledged (`poll` consumes it in its queue's order)."""

    id: int
    kind: str
    nodes: list[Node]
    anchors: list[Node]
    """Nodes whose path it locks until its ack."""
    host_locked: list[Node]
    """Its host-lock segment (a load's source, a store's nodes)."""
    ticket: Ticket
    finished: bool = False


@dataclass(eq=False)
class Prefetch:
    """A prefetch from storage into reserved host slots, hung below `anchor` when it ends."""

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
    published: int = 0
    """Fetched pages whose progress the engine has seen: per batch of `FETCH_BATCH_PAGES`, at a miss, at the end."""
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
    until: Optional[int] = None
    """Its live retention's deadline (SPEC.md §11.7); cleared when the clock reaches it, unless `waiting`."""
    waiting: bool = False
    """Its next turn waits (`retain_waiting`): the retention lasts until that turn registers; `until` its arrival."""


@dataclass(eq=False)
class Retraction:
    """A retracted request's KV, backed up in host slots (SPEC.md §9.11)."""

    id: int
    tokens: int
    host_slots: tuple[int, ...]
