"""The choices SPEC.md §6 leaves open, as values: one frozen type per choice, named as §6 names it.

A cache makes each choice its own way; a model of the spec makes it as its profile says (`Decisions`, SGLang
0.5.23's by default) and, for one operation, as it is told (`kvcert.refimpl.RefCache.deciding`). The harness's
steering reads a backend's snapshots before and after a step and turns them into the `Decisions` that lead the
model to the same legal choice, so the comparison that follows judges everything else.

Most decisions are plain values. RANK, RECLAIM and DEMOTE choose among candidates that exist only while an
operation runs (the tied leaves of an eviction's next pick, the high sessions when host room runs short), so
their steered form is a chooser: a function of the candidates the model offers, returning one of them or
None for the model's own pick.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Optional

from kvcert.spec import storage as l3

Chooser = Callable[[list[int]], Optional[int]]
"""Picks an eviction victim among candidate node ids; None leaves the pick to the model's own order."""
SessionChooser = Callable[[list[str]], Optional[str]]
"""Picks a session to demote or restore among candidate session ids."""


@dataclass(frozen=True)
class Rank:
    """RANK: which leaf an eviction takes next."""

    free: bool = False
    """The chooser sees every candidate in rank order, not only the minimal-rank ones (the core)."""
    pick: Optional[Chooser] = None
    """The tie-break for evictions made inside another operation (a backup's room, a load's room)."""


@dataclass(frozen=True)
class Reclaim:
    """RECLAIM: the order of write-back's host eviction over duplicate backups and host-only leaves."""

    first: bool = True
    """Every duplicate backup goes before any host-only leaf (SGLang, §9.4); False: both in one rank order."""
    drop: Optional[Chooser] = None
    """Which duplicate backup goes next, where they go first (any order is legal)."""
    host: Optional[Chooser] = None
    """The pick of host evictions made inside another operation, where it differs from `Rank.pick`."""


@dataclass(frozen=True)
class Retry:
    """RETRY: what a failed write copy does."""

    on_failure: Literal["retry", "invalidate"] = "retry"


@dataclass(frozen=True)
class Room:
    """ROOM: how much host eviction asks for when something does not fit on the host."""

    prefetch: Literal["whole", "shortfall"] = "whole"
    """A prefetch or a retraction backup: its whole size (SGLang, D9 and D17) or its shortfall."""
    backup: Literal["whole", "shortfall"] = "shortfall"
    """A node's backup (write-through, write-back): its shortfall (SGLang, §9.2) or its whole size."""
    ask: Optional[int] = None
    """What one operation's prefetch, retraction backup or node backups ask for together, at most each one's size
    (the host tokens the backend freed); None: as `prefetch` and `backup` say."""


@dataclass(frozen=True)
class Batch:
    """BATCH: how copies are cut."""

    cut: Literal["sglang", "per_node", "per_node_parents_first", "per_ack"] = "sglang"
    """"sglang": one write copy per insert, one store copy per node, shallowest first; "per_node": one write copy
    per node, deepest first; "per_node_parents_first": one per node, parents first (the RefAware fork, H11);
    "per_ack": a write ack's nodes stored in one copy."""


@dataclass(frozen=True)
class Demote:
    """DEMOTE: which high session host pressure demotes, and which demoted one a high release restores."""

    order: Literal["idle_fewest", "queued"] = "idle_fewest"
    """"idle_fewest": an idle one with the fewest tokens on its path, ties to the earliest registered (§11.4);
    "queued": the RefAware fork's queue, the one queued with the fewest tokens when it was queued."""
    restore: Literal["latest", "earliest"] = "latest"
    """A released high session restores the most recently demoted session (§11.4), or the earliest."""
    restore_on_move: bool = False
    """A high session registered again (moved) counts as released and restores one (the fork's composed move)."""
    pick: Optional[SessionChooser] = None
    """Given every high session, oldest registration first, the one to demote; None: as `order` says."""
    restore_pick: Optional[SessionChooser] = None
    """Given the demoted sessions, the one a high release restores, or None for none; when set, it decides (and a
    move may restore one)."""


@dataclass(frozen=True)
class LoadLock:
    """LOAD_LOCK: what keeps a pending load's host copy."""

    host_lock: bool = True
    """A host lock on the node it was issued for until the ack (SGLang, §9.7); False: the load's own pins."""


@dataclass(frozen=True)
class LoadRoom:
    """LOAD_ROOM: the device room a load-back makes."""

    scope: tuple[bool, bool] = (True, True)
    """(allow_low, allow_high) of its eviction: the full scope (§11.3), or (True, False), a low requester's."""
    ask: Literal["shortfall", "whole"] = "shortfall"
    """What it asks device eviction for: its shortfall (SGLang 0.5.23) or its whole size (0.5.10, H13)."""


@dataclass(frozen=True)
class Fetch:
    """FETCH: when a prefetch's progress reaches the engine."""

    batch: int = l3.FETCH_BATCH_PAGES
    """Per batch of this many fetched pages, at a miss, or at the last page."""
    publish: Optional[bool] = None
    """For the next fetch that ends no batch: publish every page so far (True), hold (False); None: by `batch`."""


@dataclass(frozen=True)
class Throttle:
    """THROTTLE: whether a prefetch made while others run is declined."""

    fraction: Optional[float] = l3.PREFETCH_ADMIT_FRACTION
    """Declined while the running prefetches' requested spans reach this share of the host pool; None: never."""
    admit: Optional[bool] = None
    """For a prefetch made while others run: admit it (True) or decline it (False); None: by `fraction`."""


@dataclass(frozen=True)
class Decisions:
    """One decision per open choice: what a model follows for an operation."""

    rank: Rank = field(default_factory=Rank)
    reclaim: Reclaim = field(default_factory=Reclaim)
    retry: Retry = field(default_factory=Retry)
    room: Room = field(default_factory=Room)
    batch: Batch = field(default_factory=Batch)
    demote: Demote = field(default_factory=Demote)
    load_lock: LoadLock = field(default_factory=LoadLock)
    load_room: LoadRoom = field(default_factory=LoadRoom)
    fetch: Fetch = field(default_factory=Fetch)
    throttle: Throttle = field(default_factory=Throttle)


SGLANG_0523 = Decisions()
"""SGLang 0.5.23's choice at every open place: the reference model's own."""
