"""Id bookkeeping: what a trace's indices name on the backend and on the oracle.

A trace names objects by position — a handle is the index of the op that returned a node, a copy
is the k-th copy issued — because backend ids are the backend's business. Each table here maps a
position to the pair (backend id, oracle id); a `Side`'s `column` picks its half. A position the
trace never produced resolves to `UNKNOWN_NODE`, which no conforming backend issues, so a
malformed trace reaches the cache as a stale id (and must be rejected) instead of crashing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

UNKNOWN_NODE = -1
"""The id a trace's never-issued handle maps to: no conforming backend uses it."""


def _is_index(k: Any) -> bool:
    return isinstance(k, int) and not isinstance(k, bool)


@dataclass
class Pairs:
    """Op index -> (backend id, oracle id): nodes that ops returned."""

    table: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __setitem__(self, k: int, pair: tuple[int, int]) -> None:
        self.table[k] = pair

    def __getitem__(self, k: int) -> tuple[int, int]:
        return self.table[k]

    def __contains__(self, k: object) -> bool:
        return k in self.table

    def id(self, k: Any, column: int) -> int:
        """The id op `k`'s node has in `column` (0 backend, 1 oracle), or UNKNOWN_NODE."""
        return self.table[k][column] if _is_index(k) and k in self.table else UNKNOWN_NODE

    def __iter__(self) -> Any:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def items(self) -> Any:
        return self.table.items()

    def keys(self) -> Any:
        return self.table.keys()


@dataclass
class Numbered:
    """Objects in issue order, numbered from 0 by the trace: (backend id, oracle id) of each."""

    pairs: list[tuple[int, int]] = field(default_factory=list)
    _oracle_ids: set[int] = field(default_factory=set)

    def id(self, k: Any, column: int) -> int:
        return self.pairs[k][column] if _is_index(k) and 0 <= k < len(self.pairs) else UNKNOWN_NODE

    def add(self, backend_id: int, oracle_id: int) -> None:
        self.pairs.append((backend_id, oracle_id))
        self._oracle_ids.add(oracle_id)

    def knows(self, oracle_id: int) -> bool:
        """Whether the oracle's object `oracle_id` already has a number."""
        return oracle_id in self._oracle_ids

    def number_of(self, backend_id: int) -> int | None:
        """The trace number of the backend's object `backend_id`, if it has one."""
        return next((k for k, (b, _) in enumerate(self.pairs) if b == backend_id), None)

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self) -> Any:
        return iter(self.pairs)

    def __getitem__(self, k: int) -> tuple[int, int]:
        return self.pairs[k]


@dataclass
class Ledger:
    """Every table a trace's positions resolve through."""

    handles: Pairs = field(default_factory=Pairs)
    """op index -> the node that op returned (inserts, matches, restores)."""
    host_handles: Pairs = field(default_factory=Pairs)
    """Match op index -> its `host_node`, for LoadBack: matches with a host hit only.

    Without a host hit `host_node` is backend-defined (SGLang: the deepest matched node; the
    spec: the deepest backed-up one), so such a match names nothing to load (StaleHandle)."""
    anchors: Pairs = field(default_factory=Pairs)
    """Match op index -> the `host_node` of every match that names one: prefetch anchors."""
    copies: Numbered = field(default_factory=Numbered)
    """Copies in issue order; `Complete(k)` names the k-th."""
    prefetches: Numbered = field(default_factory=Numbered)
    """Prefetches in issue order; `Fetch(k)` names the k-th."""
    retractions: Numbered = field(default_factory=Numbered)
    """Retraction backups in creation order; `Restore(k)` names the k-th."""
    running: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    """Start op index -> (backend's, oracle's) `conformance.harness.running.Request` while it runs (None on a side
    where it ended or never started)."""
    owners: dict[tuple[str, int], int] = field(default_factory=dict)
    """("prefetch" | "retraction", k) -> the handle of the request that started it (for aborts)."""
    retraction_kv: dict[int, tuple[bytes, ...]] = field(default_factory=dict)
    """Retraction number -> the entries its backup must hold (kv_reads backends)."""
