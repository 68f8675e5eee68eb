"""Steering: lead the oracle to the backend's choice wherever SPEC.md §6 leaves one.

The spec fixes what an eviction must achieve, not which of several tied victims goes; write-back's
host reclaim may drop duplicate backups in any order. The snapshots before and after a step show
what the backend chose; the choosers here make the oracle choose the same, so the comparison that
follows judges everything else. A choice no legal order explains is reported (INV-EVICT-4,
INV-HOST-9) instead of steered around.

`Steering` is built once per step attempt from the backend's two snapshots; the oracle may be
replaced between attempts (a deep copy put back), so it is passed in, never kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.refimpl import RefCache
from kvcert.refimpl.cache import Chooser
from kvcert.spec import contracts
from kvcert.spec.invariants import Violation
from kvcert.spec.ops import Evict, EvictHost, Op
from kvcert.spec.types import CacheConfig, Snapshot


def path_order(path: contracts.Path) -> tuple[str, tuple[int, ...]]:
    """A total order on paths (namespaces may be None)."""
    return (path[0] or "", path[1])


def oracle_path(oracle: RefCache, node_id: int) -> contracts.Path:
    node = oracle.nodes[node_id]
    edges = reversed(oracle._path_to_root(node))
    return node.namespace, tuple(t for n in edges for t in n.key)


def dropped_backups(before: Snapshot, after: Snapshot) -> set[contracts.Path]:
    """Paths whose host copy the backend's write-back reclaim dropped during this op.

    Dropped for good (`host_reclaimed`), or dropped for room and then made again when the same
    node became an eviction victim: its new host slots, or its new backup's store copy, give it away.
    """
    of = contracts.node_paths(before)
    dropped = {of[i] for i in contracts.host_reclaimed(before, after)}
    old = {of[n.id]: n.host_slots for n in before.nodes if n.id in of and n.host_slots is not None}
    now = contracts.node_paths(after)
    issued = {c.id for c in before.pending}
    stored = {now[i] for c in after.pending if c.kind == "store" and c.id not in issued for i in c.nodes if i in now}
    for n in after.nodes:
        p = now.get(n.id)
        if p in old and n.host_slots is not None and (n.host_slots != old[p] or p in stored):
            dropped.add(p)
    return dropped


@dataclass
class Steering:
    """The choosers for one step, from the backend's snapshots before and after it."""

    config: CacheConfig
    before: Snapshot
    after: Snapshot
    _dropped: Optional[set[contracts.Path]] = field(default=None, init=False)
    _gone: Optional[set[contracts.Path]] = field(default=None, init=False)

    def dropped(self) -> set[contracts.Path]:
        if self._dropped is None:
            self._dropped = dropped_backups(self.before, self.after)
        return self._dropped

    def reclaim_orders(self) -> list[Optional[tuple[contracts.Path, ...]]]:
        """The orders of write-back reclaim the oracle may try to reach the backend's state (SPEC.md §9.4:
        any order). One (the default preference) unless several dropped backups could have gone first;
        then each order of them, at most 24, tried until the oracle's state agrees with the backend's."""
        if self.config.write_policy != "write_back" or not self.config.host_capacity:
            return [None]
        dropped = sorted(self.dropped(), key=path_order)
        if len(dropped) < 2:
            return [None]
        return list(itertools.islice(itertools.permutations(dropped), 24))

    def skippable(self, op: Op) -> bool:
        """A write-back eviction that left a node it may have tried and skipped (SPEC.md §9.3)."""
        return (
            isinstance(op, Evict)
            and self.config.write_policy == "write_back"
            and bool(self.config.host_capacity)
            and bool(contracts.pinned_nodes(self.after))
        )

    def follow(self, oracle: RefCache) -> Chooser:
        """A tie-break for the oracle's internal evictions: prefer what the backend evicted.

        The evicted paths are computed on the first tie only: most operations evict nothing.
        """

        def choose(tied: list[int]) -> int:
            if self._gone is None:
                b, a = self.before, self.after
                lost_device = set(contracts.device_paths(b).values()) - set(contracts.device_paths(a).values())
                left_tree = set(contracts.node_paths(b).values()) - set(contracts.node_paths(a).values())
                self._gone = lost_device | left_tree
            gone = self._gone
            return next((i for i in sorted(tied) if oracle_path(oracle, i) in gone), min(tied))

        return choose

    def reclaimed(self, oracle: RefCache, order: Optional[tuple[contracts.Path, ...]] = None) -> Chooser:
        """Write-back host eviction drops duplicate backups in any order: prefer those the backend dropped
        (in `order` when given)."""
        paths: list[tuple[contracts.Path, ...]] = []

        def choose(tied: list[int]) -> int:
            if not paths:
                paths.append(order if order is not None else tuple(sorted(self.dropped(), key=path_order)))
            by_path = {oracle_path(oracle, i): i for i in tied}
            return next((by_path[p] for p in paths[0] if p in by_path), min(tied))

        return choose

    def witness(
        self,
        oracle: RefCache,
        spec: Snapshot,
        op: Op,
        got: Any,
        out: list[Violation],
        skipped_first: bool = False,
    ) -> tuple[Optional[Chooser], Optional[Callable[[Snapshot], list[Violation]]]]:
        """For Evict / EvictHost: check the backend's victims are a legal greedy choice; steer the oracle to them.

        Returns the oracle's chooser, and when no order over the ranks before the eviction explains it a
        judge of the oracle's own replay of the backend's victims (applied to its snapshot after the op).
        `spec` is the oracle's snapshot before the op.
        """
        if not isinstance(op, (Evict, EvictHost)) or not isinstance(got, int):
            return None, None
        before, after = self.before, self.after
        asked = op.n if isinstance(op.n, int) else 0
        host = isinstance(op, EvictHost)
        if host:  # host eviction sees the host-only nodes and their locks, after write-back's reclaim
            bounds = contracts.host_eviction_bounds(before, after, asked, got)
            nodes = before.by_id()
            asked = max(0, asked - sum(len(nodes[i].key) for i in contracts.host_reclaimed(before, after)))
            paths_of = contracts.node_paths
        else:  # device eviction sees the device tree and its locks
            scoped = isinstance(op, Evict) and (op.allow_low, op.allow_high) != (True, True)
            tiers = contracts.scope_tiers(op.allow_low, op.allow_high) if scoped else None  # type: ignore[union-attr]
            bounds = contracts.eviction_bounds(before, after, asked, got, tiers)
            paths_of = contracts.device_paths
        out += [Violation(i, m) for i, m in bounds]
        scope = (op.allow_low, op.allow_high) if isinstance(op, Evict) else (True, True)

        def competes(n: Any) -> bool:
            return n is oracle.root or (n.slots is None) == host

        def in_scope(n: Any) -> bool:
            tier = oracle.tier(n)
            return tier == 0 or (tier == 1 and scope[0] is True) or (tier == 2 and scope[1] is True)

        def locked(n: Any) -> bool:
            if host:
                return n.lock_ref > 0 or n.host_lock_ref > 0
            if n.lock_ref > 0 or oracle.pinned(n) or not in_scope(n):
                return True
            # Write-back tries a node that would drop a protected host copy and skips it only if its
            # backup fails (SPEC.md §9.3): the nodes pinned after the eviction are the ones it could skip.
            return oracle_path(oracle, n.id) in stuck_after

        gone = set(paths_of(before).values()) - set(paths_of(after).values())
        stuck_after: set[contracts.Path] = set()
        if not host and self.config.write_policy == "write_back":
            after_paths = contracts.node_paths(after)
            stuck_after = {after_paths[i] for i in contracts.pinned_nodes(after) if i in after_paths}
        removed = frozenset(i for i, p in paths_of(spec).items() if p in gone)
        view = {
            n.id: contracts.EvictNode(n.id, n.parent.id if n.parent else None, len(n.key), locked(n), oracle.rank(n))
            for n in oracle.nodes.values()
            if competes(n)
        }
        witness = contracts.eviction_witness(view, spec.root, asked, removed)
        if witness is None:
            # Ranks can change while an eviction runs (a write-back victim's backup host-evicts, host pressure
            # demotes an idle high session, its nodes drop a tier: SPEC.md §11.4), which a witness over the
            # ranks before the call cannot see. The oracle re-ranks at every pick: let it pick, among its own
            # minimal-rank candidates, the backend's victims first; the backend's choice was legal iff the
            # oracle then removed exactly what the backend removed.
            inv = "INV-HOST-9" if host else "INV-EVICT-4"

            def replayed(spec_after: Snapshot) -> list[Violation]:
                if set(paths_of(spec_after).values()) == set(paths_of(after).values()):
                    return []
                return [
                    Violation(
                        inv, f"no {self.config.policy} eviction order removes exactly {sorted(p[1] for p in gone)}"
                    )
                ]

            return self.follow(oracle), replayed
        remaining = list(witness)
        skippable = sorted(i for i in oracle.nodes if oracle_path(oracle, i) in stuck_after)

        def choose(tied: list[int]) -> int:
            """The first victim of the witness among the oracle's tied candidates. A write-back victim the
            backend tried and skipped (its backup failed) is no witness element, so the oracle's attempt
            on it must not consume one; with `skipped_first` such a node is tried before the witness's
            victim it ties with (its failed attempt consumed what the victim's would have: an armed
            fault, host room). Past the witness any pick will do; the comparison reports it."""
            if skipped_first:
                first = next((i for i in skippable if i in tied), None)
                if first is not None:
                    skippable.remove(first)
                    return first
            pick = next((i for i in remaining if i in tied), None)
            if pick is None:
                return min(tied)
            remaining.remove(pick)
            return pick

        return choose, None


def agrees(spec: Snapshot, after: Snapshot) -> bool:
    """The oracle reached the backend's state (tree, residency, copies): the steering found the backend's choice."""
    return contracts.shape(after) == contracts.shape(spec) and [(c.kind, c.finished) for c in after.pending] == [
        (c.kind, c.finished) for c in spec.pending
    ]
