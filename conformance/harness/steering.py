"""Steering: lead the oracle to the backend's choice wherever SPEC.md §6 leaves one.

The spec fixes what an eviction must achieve, not which of several tied victims goes; write-back's
host reclaim may drop duplicate backups in any order. The snapshots before and after a step show
what the backend chose; the choosers here make the oracle choose the same, so the comparison that
follows judges everything else. A choice no legal order explains is reported (INV-EVICT-4,
INV-HOST-9) instead of steered around.

Under a profile that pins the eviction rank (SPEC.md §6, RANK) the backend's victims must be a
greedy order over the oracle's ranks, ties free (`witness`). Under the core the oracle sees every
candidate and takes the backend's victims first (`follow`, `follow_host`): whatever order the
backend used is seated, and the replay judges only that each victim was a legal candidate when it
went and that the eviction stopped where the core says.

`Steering` is built once per step from the backend's two snapshots. What it decides reaches the oracle as
`kvcert.spec.decisions.Decisions`, one value per open choice, handed to the operation (`RefCache.deciding`);
the oracle keeps none of it. Where the snapshots do not show a choice, `attempts` lists the candidates the
harness tries in turn (the one search; a backend that reports its choices leaves one eviction order to try);
the oracle may be replaced between attempts (a deep copy put back), so it is passed in, never kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.refimpl import RefCache
from kvcert.spec import contracts
from kvcert.spec.decisions import Chooser
from kvcert.spec.invariants import Violation, load_anchor
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


def _in_order(oracle: RefCache, order: tuple[contracts.Path, ...]) -> Chooser:
    """Pick the first of `order` among the tied candidates (None: none of them is a candidate)."""

    def choose(tied: list[int]) -> Optional[int]:
        by_path = {oracle_path(oracle, i): i for i in tied}
        return next((by_path[p] for p in order if p in by_path), None)

    return choose


def _lazy(build: Callable[[], Chooser]) -> Chooser:
    """A chooser built on the oracle's first tie: what it needs (the step's victims, reports) is worked out then,
    and most steps evict nothing."""
    built: list[Chooser] = []

    def choose(tied: list[int]) -> Optional[int]:
        if not built:
            built.append(build())
        return built[0](tied)

    return choose


@dataclass
class Steering:
    """The choosers for one step, from the backend's snapshots before and after it."""

    config: CacheConfig
    before: Snapshot
    after: Snapshot
    follows_reports: bool = False
    """The core, on a backend that reports its choices: follow `Snapshot.choices` instead of searching."""
    _dropped: Optional[set[contracts.Path]] = field(default=None, init=False)
    _gone: Optional[set[contracts.Path]] = field(default=None, init=False)
    _left: Optional[set[contracts.Path]] = field(default=None, init=False)
    _reported: Optional[tuple[list[contracts.Path], list[contracts.Path]]] = field(default=None, init=False)

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
        """A write-back eviction that left a node it may have tried and skipped (SPEC.md §9.3), from a backend
        that does not report what it skipped."""
        return (
            self.reported() is None
            and isinstance(op, Evict)
            and self.config.write_policy == "write_back"
            and bool(self.config.host_capacity)
            and bool(contracts.pinned_nodes(self.after))
        )

    def reported(self) -> Optional[tuple[list[contracts.Path], list[contracts.Path]]]:
        """The backend's device choices (victims and skipped nodes) and host choices (dropped backups, removed
        host-only nodes) in the order it made them, as paths; None without reports (or one naming no node)."""
        if not self.follows_reports:
            return None
        if self._reported is None:
            before, after = contracts.node_paths(self.before), contracts.node_paths(self.after)
            device: list[contracts.Path] = []
            host: list[contracts.Path] = []
            for kind, node in self.after.choices:
                path = before.get(node, after.get(node))
                if path is None or kind not in ("evict", "skip", "reclaim", "host_evict"):
                    self.follows_reports = False
                    return None
                (device if kind in ("evict", "skip") else host).append(path)
            self._reported = (device, host)
        return self._reported

    @staticmethod
    def _in_turn(oracle: RefCache, paths: list[contracts.Path]) -> Chooser:
        """Pick the backend's next reported choice when it is a candidate now; else leave the pick to the oracle
        (which then differs from the backend, and the comparison says where)."""
        queue = list(paths)

        def choose(tied: list[int]) -> Optional[int]:
            if not queue:
                return None
            pick = next((i for i in tied if oracle_path(oracle, i) == queue[0]), None)
            if pick is not None:
                queue.pop(0)
            return pick

        return choose

    def gone(self) -> set[contracts.Path]:
        """Paths whose device KV left, or that left the tree, during the step (computed once, on first use:
        most operations evict nothing)."""
        if self._gone is None:
            b, a = self.before, self.after
            lost_device = set(contracts.device_paths(b).values()) - set(contracts.device_paths(a).values())
            self._gone = lost_device | self.left_tree()
        return self._gone

    def left_tree(self) -> set[contracts.Path]:
        """Paths that left the tree during the step (computed once, on first use)."""
        if self._left is None:
            self._left = set(contracts.node_paths(self.before).values()) - set(
                contracts.node_paths(self.after).values()
            )
        return self._left

    def last(self, gone: set[contracts.Path], leaving: set[contracts.Path]) -> Optional[contracts.Path]:
        """The victim to take last: the largest of those whose parent is not `leaving` with it. An eviction
        stops once it has freed enough, so the order decides where it stops; if any order of `gone` ends where
        the backend's did, one that ends on the largest such victim does."""
        nodes, paths = self.before.by_id(), contracts.node_paths(self.before)
        tops = [
            (len(n.key), p)
            for i, p in paths.items()
            if p in gone
            for n in (nodes[i],)
            if n.parent is None or paths.get(n.parent) not in leaving
        ]
        return max(tops, key=lambda t: (t[0], path_order(t[1])))[1] if tops else None

    def _chooser(
        self,
        oracle: RefCache,
        gone: set[contracts.Path],
        leaving: Optional[set[contracts.Path]],
        first: Optional[list[int]] = None,
    ) -> Chooser:
        """Take the backend's victims (`gone`) first, in the order the candidates come (the oracle's rank order
        under the core, by id among tied ones under a profile); None: the oracle's own pick. With `leaving`
        (the core's second try) the largest victim whose parent is not `leaving` goes last (`last`). With
        `first` (write-back nodes the backend tried and skipped) those are tried before anything else."""
        end: list[Optional[contracts.Path]] = []
        ordered = oracle.own.rank.free

        def choose(tied: list[int]) -> Optional[int]:
            if first:
                pick = next((i for i in first if i in tied), None)
                if pick is not None:
                    first.remove(pick)
                    return pick
            if not end:
                end.append(self.last(gone, leaving) if leaving is not None else None)
            mine = [i for i in (tied if ordered else sorted(tied)) if oracle_path(oracle, i) in gone]
            early = [i for i in mine if oracle_path(oracle, i) != end[0]]
            return early[0] if early else mine[0] if mine else None

        return choose

    def follow(self, oracle: RefCache, first: Optional[list[int]] = None, tail: bool = False) -> Chooser:
        """A tie-break for the oracle's evictions: prefer what the backend evicted (None: the oracle's own pick).
        `tail`: the largest victim last (`_chooser`)."""

        def build() -> Chooser:
            reports = self.reported()
            if reports is not None:
                return self._in_turn(oracle, reports[0])
            gone = self.gone()
            return self._chooser(oracle, gone, gone if tail else None, first)

        return _lazy(build)

    def host_victims(self) -> set[contracts.Path]:
        """What the backend's host evictions took during the step: host-only nodes removed, backups dropped."""
        return self.left_tree() | self.dropped()

    def host_freed(self) -> int:
        """The host tokens the backend's host evictions freed during the step (host-only nodes removed, backups
        dropped): what a prefetch that did not fit asked for, seated in the oracle under the core (ROOM)."""
        victims = self.host_victims()
        paths = contracts.node_paths(self.before)
        return sum(len(n.key) for n in self.before.nodes if n.host_slots is not None and paths.get(n.id) in victims)

    def demoted(self) -> bool:
        """Whether host pressure demoted a session during the step (SPEC.md §11.4)."""
        return bool(contracts.newly_demoted(self.before, self.after))

    def load_host_locked(self) -> bool:
        """Whether the step's new load copy host-locked the node it was issued for (LOAD_LOCK): its host lock count
        rose during the step. True when the step issued no load."""
        known = {c.id for c in self.before.pending}
        now, was = self.after.by_id(), self.before.by_id()
        for copy in self.after.pending:
            deepest = load_anchor(now, copy) if copy.kind == "load" and copy.id not in known else None
            if deepest is not None:
                return now[deepest].host_lock_ref > (was[deepest].host_lock_ref if deepest in was else 0)
        return True

    def demote_pick(self) -> Callable[[list[str]], Optional[str]]:
        """The core's demotion chooser (DEMOTE): among the oracle's high sessions, one the backend demoted during
        the step; None (the oracle's own pick) once none is left, which the comparison then judges. The snapshots
        do not say in which order the backend demoted them, and the eviction stops once it has freed enough, so
        those with no node on the host only (whose demotion frees nothing) go first."""
        nodes = self.before.by_id()

        def idle(node: Optional[int]) -> bool:
            while node is not None and node in nodes:
                if nodes[node].slots is None:
                    return True
                node = nodes[node].parent
            return False

        ends = {x.id: x.node for x in self.before.sessions}
        queue = sorted(contracts.newly_demoted(self.before, self.after), key=lambda i: idle(ends.get(i)))

        def choose(high: list[str]) -> Optional[str]:
            pick = next((i for i in queue if i in high), None)
            if pick is not None:
                queue.remove(pick)
            return pick

        return choose

    def restore_pick(self, required: bool = False) -> Callable[[list[str]], Optional[str]]:
        """The core's restore chooser (DEMOTE): the demoted session the backend restored. A high session's
        release must restore one when one is demoted (`required`; the seed's rule: high-priority room goes back to
        a demoted session), so where the backend restored none the oracle restores the latest, and the comparison
        reports the difference; a move may restore one or none."""
        back = {x.id for x in self.after.sessions if not x.demoted}

        def choose(demoted: list[str]) -> Optional[str]:
            pick = next((i for i in demoted if i in back), None)
            return demoted[-1] if pick is None and required and demoted else pick

        return choose

    def host_orders(self) -> list[Optional[tuple[contracts.Path, ...]]]:
        """The core's orders of host victims to try (the order decides which backups a write-back eviction
        can still make): the oracle's rank order first, then at most 24 others."""
        if not self.config.host_capacity or self.reported() is not None:
            return [None]
        victims = sorted(self.host_victims(), key=path_order)
        if len(victims) < 2:
            return [None]
        # First (up to 12) the orders that drop every dropped backup before any removed host-only node, each order
        # of the dropped ones before the next of the removed: which duplicate a write-back backup reclaims first
        # decides whether a victim still on the device loses its copy (to be backed up and stored again) or
        # keeps it, as SGLang's reclaim-first eviction does. Then any order (the core lets the two interleave).
        gone = self.dropped()
        dropped = [v for v in victims if v in gone]
        removed = [v for v in victims if v not in gone]
        first = ((*d, *r) for r in itertools.permutations(removed) for d in itertools.permutations(dropped))
        orders = list(itertools.islice(first, 12)) if dropped else []
        tried = set(orders)
        orders += itertools.islice((o for o in itertools.permutations(victims) if o not in tried), 24 - len(orders))
        return [None, *orders]

    def follow_host(
        self, oracle: RefCache, tail: bool = False, order: Optional[tuple[contracts.Path, ...]] = None
    ) -> Chooser:
        """The core's host-eviction chooser: the backend's host victims first, its dropped backups and the
        host-only nodes it removed alike (SPEC.md §6, RECLAIM); in `order` when given."""

        def build() -> Chooser:
            reports = self.reported()
            if reports is not None:
                return self._in_turn(oracle, reports[1])
            if order is not None:
                return _in_order(oracle, order)
            left = self.left_tree()
            return self._chooser(oracle, left | self.dropped(), left if tail else None)

        return _lazy(build)

    def moved(self) -> bool:
        """Whether the backend evicted more than one node on either tier during the step and did not say in
        which order (the core's second try applies)."""
        return self.reported() is None and len(self.gone() | self.dropped()) > 1  # one victim: one order

    def reclaimed(self, oracle: RefCache, order: Optional[tuple[contracts.Path, ...]] = None) -> Chooser:
        """Write-back host eviction drops duplicate backups in any order: prefer those the backend dropped
        (in `order` when given)."""

        def build() -> Chooser:
            return _in_order(oracle, order if order is not None else tuple(sorted(self.dropped(), key=path_order)))

        return _lazy(build)

    def _bounds(self, op: Evict | EvictHost, got: int, out: list[Violation], reclaim_first: bool) -> int:
        """The bounds every eviction keeps, whatever its order (INV-EVICT-1/2/5 and the scope's tiers; INV-HOST-8
        on the host, with write-back's duplicates dropped first only where `reclaim_first`, the profile's
        RECLAIM), added to `out`; returns the size asked."""
        asked = op.n if isinstance(op.n, int) else 0
        if isinstance(op, EvictHost):
            bounds = contracts.host_eviction_bounds(self.before, self.after, asked, got, reclaim_first)
        else:
            scoped = (op.allow_low, op.allow_high) != (True, True)
            tiers = contracts.scope_tiers(op.allow_low, op.allow_high) if scoped else None
            bounds = contracts.eviction_bounds(self.before, self.after, asked, got, tiers)
        out += [Violation(i, m) for i, m in bounds]
        return asked

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
        asked = self._bounds(op, got, out, reclaim_first=True)
        host = isinstance(op, EvictHost)
        if host:  # host eviction sees the host-only nodes and their locks, after write-back's reclaim
            nodes = before.by_id()
            asked = max(0, asked - sum(len(nodes[i].key) for i in contracts.host_reclaimed(before, after)))
            paths_of = contracts.node_paths
        else:  # device eviction sees the device tree and its locks
            paths_of = contracts.device_paths
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

        def choose(tied: list[int]) -> Optional[int]:
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
            if pick is not None:
                remaining.remove(pick)
            return pick

        return choose, None

    def seat(
        self,
        oracle: RefCache,
        op: Op,
        got: Any,
        out: list[Violation],
        skipped_first: bool = False,
        tail: bool = False,
        order: Optional[tuple[contracts.Path, ...]] = None,
    ) -> tuple[Optional[Chooser], Optional[Callable[[Snapshot], list[Violation]]]]:
        """The core's Evict / EvictHost: the bounds every correct cache keeps, a chooser that seats the backend's
        victims in the oracle (whatever their rank), and the judge that the oracle, taking them first among its
        candidates, removed exactly them: each was an unlocked leaf when it went (SPEC.md §6, RANK, RECLAIM)."""
        if not isinstance(op, (Evict, EvictHost)) or not isinstance(got, int):
            return None, None
        after = self.after
        self._bounds(op, got, out, reclaim_first=False)
        if isinstance(op, EvictHost):

            def view(s: Snapshot) -> set[tuple[contracts.Path, bool]]:
                nodes = s.by_id()
                return {(p, nodes[i].host_slots is not None) for i, p in contracts.node_paths(s).items()}

            inv, choose = "INV-HOST-9", self.follow_host(oracle, tail, order)
        else:

            def view(s: Snapshot) -> set[tuple[contracts.Path, bool]]:
                return {(p, True) for p in contracts.device_paths(s).values()}

            first: Optional[list[int]] = None
            if skipped_first and self.config.write_policy == "write_back":
                paths = contracts.node_paths(after)
                stuck = {paths[i] for i in contracts.pinned_nodes(after) if i in paths}
                first = sorted(i for i in oracle.nodes if oracle_path(oracle, i) in stuck)
            inv, choose = "INV-EVICT-4", self.follow(oracle, first, tail)

        def replayed(spec_after: Snapshot) -> list[Violation]:
            if view(spec_after) == view(after):
                return []
            gone = sorted(p[1] for p in (self.left_tree() | self.dropped() if inv == "INV-HOST-9" else self.gone()))
            return [Violation(inv, f"no greedy eviction of unlocked leaves removes exactly {gone}")]

        return choose, replayed


def agrees(spec: Snapshot, after: Snapshot) -> bool:
    """The oracle reached the backend's state (tree, residency, copies, demotions, prefetch progress): the steering
    found the backend's choice."""
    return (
        contracts.shape(after) == contracts.shape(spec)
        and [(c.kind, c.finished) for c in after.pending] == [(c.kind, c.finished) for c in spec.pending]
        and [(x.id, x.demoted) for x in after.sessions] == [(x.id, x.demoted) for x in spec.sessions]
        and [(p.requested, p.fetched) for p in after.prefetches] == [(p.requested, p.fetched) for p in spec.prefetches]
    )
