"""The backend's snapshot beside the oracle's, as rows (`kvcert replay --diff-at`).

Node ids are each implementation's own, so nodes are matched by what the spec fixes about them: their
path key (namespace and every token from the root). Slot ids are private to each pool too, so slots are
shown as counts. Pure, so the comparison is tested without a terminal; `conformance.cli` renders it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from kvcert.spec import contracts
from kvcert.spec.types import NodeView, Snapshot

NODE_FIELDS = ("device slots", "host slots", "lock_ref", "host_lock_ref", "high,low ref")
"""The columns of a node row, in order."""
ABSENT = "-"
"""A node one side does not have, or a slot list it does not hold (host-only on device, no backup on host)."""


@dataclass(frozen=True)
class Row:
    """One node (matched by path) or one scalar field, with each side's value per field."""

    section: str
    """"node" or "state"."""
    key: str
    cells: tuple[tuple[str, str, str], ...]
    """(field, backend's value, oracle's value)."""

    @property
    def differs(self) -> bool:
        return any(b != o for _, b, o in self.cells)

    @property
    def differing(self) -> tuple[str, ...]:
        return tuple(f for f, b, o in self.cells if b != o)


def path_key(path: contracts.Path, width: int = 12) -> str:
    """A path as one short label: `ns:` then the tokens, long paths elided in the middle with their length."""
    ns, tokens = path
    shown = (
        " ".join(map(str, tokens))
        if len(tokens) <= width
        else (" ".join(map(str, tokens[:4])) + " … " + " ".join(map(str, tokens[-4:])) + f" (len {len(tokens)})")
    )
    return f"{ns}:{shown}" if ns is not None else shown


def _count(slots: Optional[tuple[int, ...]]) -> str:
    return ABSENT if slots is None else str(len(slots))


def _node_cells(node: Optional[NodeView]) -> tuple[str, ...]:
    if node is None:
        return (ABSENT,) * len(NODE_FIELDS)
    return (
        _count(node.slots),
        _count(node.host_slots),
        str(node.lock_ref),
        str(node.host_lock_ref),
        f"{node.high_ref},{node.low_ref}",
    )


def _by_path(s: Snapshot) -> dict[contracts.Path, NodeView]:
    """Non-root nodes by path; a second node at a path (a broken tree) keeps the first's place, marked apart."""
    nodes, out = s.by_id(), {}
    for nid, path in contracts.node_paths(s).items():
        key = path
        while key in out:  # duplicate path: give it a distinct key so it still shows up as one side's extra
            key = (f"{key[0]}#dup", key[1])
        out[key] = nodes[nid]
    return out


def node_rows(backend: Snapshot, oracle: Snapshot) -> list[Row]:
    """One row per path either side holds, in path order (namespace, then tokens)."""
    mine, spec = _by_path(backend), _by_path(oracle)
    order = sorted(set(mine) | set(spec), key=lambda p: (p[0] is not None, str(p[0]), p[1]))
    rows = []
    for path in order:
        b, o = _node_cells(mine.get(path)), _node_cells(spec.get(path))
        rows.append(Row("node", path_key(path), tuple(zip(NODE_FIELDS, b, o))))
    return rows


SCALARS: tuple[tuple[str, Callable[[Snapshot], object]], ...] = (
    ("nodes", lambda s: len(s.nodes) - 1),
    ("capacity", lambda s: s.capacity),
    ("free device slots", lambda s: len(s.free_slots)),
    ("lent slots", lambda s: len(s.lent_slots)),
    ("evictable_size", lambda s: s.evictable_size),
    ("protected_size", lambda s: s.protected_size),
    ("tier_evictable (unused, low, high)", lambda s: s.tier_evictable),
    ("host capacity", lambda s: s.host_capacity),
    ("free host slots", lambda s: len(s.host_free_slots)),
    ("write policy", lambda s: s.write_policy or "(device only)"),
    ("pending copies (kind, finished)", lambda s: [(c.kind, c.finished) for c in s.pending]),
    ("prefetches (requested, fetched, failed)", lambda s: [(p.requested, p.fetched, p.failed) for p in s.prefetches]),
    ("retraction backups (tokens)", lambda s: [r.tokens for r in s.retractions]),
    (
        "sessions (id, path, priority, high, demoted)",
        lambda s: [(i, path_key(p), pr, h, d) for i, p, pr, h, d in contracts.session_paths(s)],
    ),
    ("high priority threshold", lambda s: s.high_priority_threshold),
)
"""Snapshot fields comparable across implementations (no slot or node ids), as `conformance.harness.checks` compares them."""


def scalar_rows(backend: Snapshot, oracle: Snapshot) -> list[Row]:
    """One row per field of `SCALARS`. A backend without priority refs reports no tier counters: that row is
    left out when the backend has none, as the checks skip it."""
    rows = []
    for name, get in SCALARS:
        if name.startswith("tier_evictable") and backend.tier_evictable is None:
            continue
        rows.append(Row("state", name, ((name, str(get(backend)), str(get(oracle))),)))
    return rows


def snapshot_rows(backend: Snapshot, oracle: Snapshot) -> list[Row]:
    """The nodes (by path), then the scalar fields, each with the backend's and the oracle's value."""
    return node_rows(backend, oracle) + scalar_rows(backend, oracle)
