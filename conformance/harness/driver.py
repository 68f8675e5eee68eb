"""The harness: run one operation on a backend and on the oracle, then check every rule.

`Harness.step(op)` is the single place where an `Op` becomes protocol calls, so Hypothesis rules,
replayed traces and the bug zoo all exercise the same code. A step is four jobs, each in its own
module:

- the caller's side of the op on each cache (`conformance.harness.scheduler`: a `Side` per cache, ops
  dispatched through one table),
- the ids a trace's positions name on each side (`conformance.harness.ledger`),
- steering the oracle to the backend's choice wherever SPEC.md §6 allows one
  (`conformance.harness.steering`),
- the checks (`conformance.harness.checks`): the op's contract, the state invariants of the backend's
  snapshot, and the backend against the oracle, every KV byte included.

It is incremental: the oracle's snapshot is taken once per step and reused as the next step's
"before"; derived structures are computed once per snapshot; KV is read in one batch per tier;
the generator's queries (`conformance.harness.queries`) are answered once per step.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from kvcert.conformance.backend import Backend, close_backend
from kvcert.conformance.harness.checks import Checks
from kvcert.conformance.harness.decide import attempts, decide, victims
from kvcert.conformance.harness.ledger import UNKNOWN_NODE, Ledger, Numbered, Pairs
from kvcert.conformance.harness.queries import Queries
from kvcert.conformance.harness.running import lent
from kvcert.conformance.harness.scheduler import Outcome, run_op
from kvcert.conformance.harness.side import KVModel, Side, StepNotes
from kvcert.conformance.harness.steering import Steering, agrees
from kvcert.conformance.harness.storage import FaultyStorage, MemoryStorage, damage, publish
from kvcert.conformance.harness.windows import entered, events
from kvcert.refimpl import RefCache
from kvcert.spec import contracts
from kvcert.spec.invariants import Violation, rooted
from kvcert.spec.ops import (
    HANDLE_PRODUCERS,
    CheckPrefetch,
    Complete,
    Discard,
    Evict,
    EvictHost,
    Fetch,
    Finish,
    Lock,
    Match,
    Op,
    Poll,
    Prefetch,
    Publish,
    Restore,
    Retract,
    Start,
    StorageFault,
    Unlock,
)
from kvcert.spec.profiles import (
    BATCH,
    RANK,
    RECLAIM,
    Profile,
    profile,
)
from kvcert.spec.types import BadInput, CacheConfig, Capabilities, InsertOut, MatchOut, Snapshot

__all__ = ["UNKNOWN_NODE", "ConformanceFailure", "Harness", "Outcome", "run_trace"]


class ConformanceFailure(AssertionError):
    """A backend broke the spec at one step of a trace."""

    def __init__(self, step: int, op: Optional[Op], violations: list[Violation]) -> None:
        self.step, self.op, self.violations = step, op, violations
        lines = "\n".join(f"  {v}" for v in violations)
        where = f"step {step}: {op}" if op is not None else "initial state"
        super().__init__(f"{where}\n{lines}")


@dataclass
class Harness(Queries):
    """A backend, the oracle beside it, and the ledger of what a trace has produced."""

    backend: Backend
    config: CacheConfig
    capabilities: Capabilities
    oracle: RefCache = field(init=False)
    ops: list[Op] = field(default_factory=list)
    clock: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    storages: tuple[FaultyStorage, ...] = ()
    """(backend's, oracle's) L3 stores when the config has a storage tier; faults hit both alike."""
    trace_hook: Optional[Callable[[int, Op, Outcome], None]] = None
    admitted: list[bool] = field(default_factory=list)
    """Per admission that fit, whether the backend could then allocate the planned slots."""
    closed: bool = False
    count_windows: bool = False
    """Whether each step works out the race windows it entered (`conformance.harness.windows`), into `windows`."""
    windows: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    """With `count_windows`, the §11 events the step caused (`conformance.harness.windows.events`)."""
    ignore: frozenset[str] = frozenset()
    """Rules whose violations this harness drops: the checker ablation that shows a rule alone kills a
    mutant (tests/test_profiles.py). Never set by `certify`."""
    _spec_snap: Optional[Snapshot] = None
    """The oracle's snapshot since it last changed: taken once per step, reused as the next step's before."""
    _last_after: Optional[Snapshot] = None
    """The backend's snapshot after the last step, its next before where it declares `still_between_calls`."""
    rejected: list[int] = field(default_factory=list)
    """Steps whose op the oracle rejected as bad input (`BadInput`): a trace with none is valid traffic, what a
    backend that does not declare `strict_input` is sent."""
    _queries: dict[Any, Any] = field(default_factory=dict)
    _queries_at: int = -1

    def __post_init__(self) -> None:
        try:
            self.profile: Profile = profile(self.capabilities.profile)
            # Under a profile that leaves a choice open the oracle takes whichever legal one the backend
            # reported (SPEC.md §6): every eviction candidate is open to its chooser, host eviction one order.
            own = self.profile.decisions
            self.oracle = RefCache(
                self.config,
                decisions=replace(
                    own,
                    rank=replace(own.rank, free=not self.profile.pinned(RANK)),
                    reclaim=replace(own.reclaim, first=self.profile.pinned(RECLAIM)),
                ),
            )
            self.oracle.backs_up_retractions = self.capabilities.retraction  # none declared: plans keep no backup
            self.model = KVModel(self.config.kv_layers)
            self.checks = Checks(
                self.backend, self.config, self.capabilities, self.ledger, self.model, self.profile.load_host_lock
            )
            if self.config.prefetch_policy:
                self.storages = (FaultyStorage(MemoryStorage()), FaultyStorage(MemoryStorage()))
                self.backend.attach_storage(self.storages[0])  # type: ignore[attr-defined]
                self.oracle.attach_storage(self.storages[1])
            self.check(0, None, self._remember(self._snapshot(0, None)), [])
        except BaseException:
            self.close()  # nobody else holds the backend yet
            raise

    def close(self) -> None:
        """Release the backend (its `close()`, if it has one: pools, threads) once; every path ends here."""
        if self.closed:
            return
        self.closed = True
        close_backend(self.backend)

    # ------------------------------------------------------------------ the ledger, as the rules and tests name it

    @property
    def handles(self) -> Pairs:
        return self.ledger.handles

    @property
    def host_handles(self) -> Pairs:
        return self.ledger.host_handles

    @property
    def anchors(self) -> Pairs:
        return self.ledger.anchors

    @property
    def copies(self) -> Numbered:
        return self.ledger.copies

    @property
    def prefetches(self) -> Numbered:
        return self.ledger.prefetches

    @property
    def retractions(self) -> Numbered:
        return self.ledger.retractions

    @property
    def owners(self) -> dict[tuple[str, int], int]:
        return self.ledger.owners

    def spec_snapshot(self) -> Snapshot:
        """The oracle's current snapshot, taken at most once between two of its changes."""
        if self._spec_snap is None:
            self._spec_snap = self.oracle.snapshot()
        return self._spec_snap

    # ------------------------------------------------------------------ one step

    def _snapshot(self, index: int, op: Optional[Op]) -> Snapshot:
        """The backend's snapshot; an exception reading it (the backend's or its adapter's) fails the step with
        the trace so far, as a crash in an operation does, instead of ending the run with no trace."""
        try:
            snap = self.backend.snapshot()
        except Exception as err:
            raise ConformanceFailure(
                index, op, [Violation("INV-ERR-3", f"snapshot raised untyped {type(err).__name__}: {err}")]
            ) from err
        if self.ledger.running:  # what running requests own is the caller's: the backend cannot report it
            snap = replace(snap, lent_slots=lent(self.ledger.running, 0))
        if "INV-TREE-1" in self.ignore:  # set aside: every other rule reads the tree the root reaches
            snap = rooted(snap)
        return snap

    def _remember(self, snap: Snapshot) -> Snapshot:
        if self.capabilities.still_between_calls:
            self._last_after = snap
        return snap

    def _before(self, index: int, op: Op) -> Snapshot:
        """The backend's state before `op`: the last step's after where the backend declares it cannot change
        between calls (its derived tables come with it), else read afresh."""
        if self._last_after is not None:
            return self._last_after
        return self._snapshot(index, op)

    def step(self, op: Op) -> Outcome:
        """Apply `op` to the backend, then to the oracle steered to the backend's legal choices; check."""
        index = len(self.ops)
        self.ops.append(op)
        self.clock += 1
        self.backend.set_clock(self.clock)
        self.oracle.set_clock(self.clock)
        before = self._before(index, op)
        self.windows, self.events = [], []
        if isinstance(op, (StorageFault, Publish)):  # storage-side events: no cache call
            if self.storages:
                damage(self.storages, op) if isinstance(op, StorageFault) else publish(self.storages, op, self.config)
            self.check(index, op, before, [])
            return None
        notes = StepNotes()
        looked = self.storages[0].lookups if self.storages else 0  # the backend's, before the op
        kv = self.model if self.capabilities.kv_reads else None
        lenient = self.capabilities.aligns_keys
        mine = Side(
            self.backend,
            0,
            self.ledger,
            self.config,
            kv=kv,
            notes=notes,
            admitted=self.admitted,
            unaligned=lenient,
            native_checkpoint=self.capabilities.checkpoints,
        )
        try:
            got = run_op(mine, op, self.ops)
        except Exception as err:  # a crash is a finding, not a harness error
            raise ConformanceFailure(
                index, op, [Violation("INV-ERR-3", f"raised untyped {type(err).__name__}: {err}")]
            ) from err
        after = self._remember(self._snapshot(index, op))
        if self.count_windows:
            locked = self.ledger.handles.id(op.handle, 0) if isinstance(op, Lock) else None
            if isinstance(op, Start) and isinstance(got, MatchOut):
                locked = got.node
            self.windows = entered(op, before, after, locked)
            if after.sessions or before.sessions:
                self.events = events(op, before, after)
        asked = self.storages[0].lookups - looked if self.storages else 0
        want, found = self._follow(op, before, after, got, asked)
        if isinstance(want, BadInput):
            self.rejected.append(index)
        violations = found
        self.checks.contract(op, before, after, got, want, violations, notes.planned, notes.inserted)
        self._record(index, op, before, after, got, want, notes, violations)
        violations += notes.violations
        if self.trace_hook is not None:
            self.trace_hook(index, op, got)
        self.check(index, op, after, violations)
        return got

    def _follow(
        self, op: Op, before: Snapshot, after: Snapshot, got: Outcome, asked: int
    ) -> tuple[Outcome, list[Violation]]:
        """Run `op` on the oracle under the decisions that lead it to the backend's choices; its outcome and the
        steering's findings. `asked`: the storage lookups the backend made during the op.

        Where the spec leaves the backend a choice the snapshots cannot show, the oracle is put back and tried
        once per candidate (`decide.attempts`, which says why) until it reaches the backend's state.
        """
        pinned = self.profile.pinned
        follows = self.capabilities.reports_choices and not (pinned(RANK) or pinned(RECLAIM))
        steering = Steering(self.config, before, after, follows_reports=follows)
        tries = attempts(steering, op, got, self.profile, self.capabilities.priority_refs, bool(self.oracle.prefetches))
        saved = copy.deepcopy(self.oracle) if len(tries) > 1 else None
        requests = dict(self.ledger.running) if saved is not None else {}  # the oracle's half goes back with it
        gave_up = self._gave_up(op, after)
        want: Outcome = None
        found: list[Violation] = []
        for index, attempt in enumerate(tries):
            if index:  # the last choice disagreed with the backend: put the oracle back and try the next
                self.oracle = copy.deepcopy(saved)  # type: ignore[assignment]
                self._spec_snap = None
                self.ledger.running = _oracle_half_back(self.ledger.running, requests)
                if self.storages:
                    self.storages = (self.storages[0], self.oracle.storage)  # type: ignore[assignment]
            found = []
            choose, replayed = victims(steering, self.oracle, self.spec_snapshot, op, got, attempt, self.profile, found)
            decisions = decide(steering, self.oracle, op, attempt, self.profile, gave_up)
            theirs = Side(
                self.oracle,
                1,
                self.ledger,
                self.config,
                choose=choose,
                unaligned=self.capabilities.aligns_keys,
                gated=self.capabilities.checkpoints,
            )
            looked = self.storages[1].lookups if self.storages else 0
            try:
                with self.oracle.deciding(decisions):
                    want = run_op(theirs, op, self.ops)
            finally:
                self._spec_snap = None
            # Storage lookups are compared too: a throttled prefetch makes none, a failed allocation one (its
            # armed fault then spent), and both leave the same snapshot.
            same_asks = not self.storages or self.storages[1].lookups - looked == asked
            if not pinned(BATCH):
                self._regroup(before, after)
            if replayed is not None:
                found += replayed(self.spec_snapshot())
            if index == len(tries) - 1 or (same_asks and agrees(self.spec_snapshot(), after)):
                break
        return want, found

    def _regroup(self, before: Snapshot, after: Snapshot) -> None:
        """Under the core, cut the oracle's new write and store copies as the backend cut the same nodes (BATCH).

        Only a re-cut: every node in one copy of its kind on both sides, the load copies the same in the same
        order, all still unfinished. Anything else is left for INV-COPY-1 to report."""
        known = {b.id for b in before.pending}
        mine = [c for c in after.pending if c.id not in known]
        theirs = [c for c in self.oracle.copies if not self.ledger.copies.knows(c.id)]
        if not mine or not theirs or any(c.finished for c in mine) or any(c.finished for c in theirs):
            return
        paths, spec = contracts.node_paths(after), contracts.node_paths(self.spec_snapshot())
        cut_mine = [(c.kind, [paths.get(i) for i in c.nodes]) for c in mine]
        cut_theirs = [(c.kind, [spec.get(n.id) for n in c.nodes]) for c in theirs]
        if [(k, set(p)) for k, p in cut_mine] == [(k, set(p)) for k, p in cut_theirs]:
            return  # the same cut
        if [p for k, p in cut_mine if k == "load"] != [p for k, p in cut_theirs if k == "load"]:
            return
        moved = [Counter((k, p) for k, ps in cut if k != "load" for p in ps) for cut in (cut_mine, cut_theirs)]
        if moved[0] != moved[1] or None in {p for _, p in moved[0]} or max(moved[0].values(), default=1) > 1:
            return
        node_of = {(c.kind, spec[n.id]): n.id for c in theirs for n in c.nodes}
        groups = [(k, [] if k == "load" else [node_of[(k, p)] for p in ps if p is not None]) for k, ps in cut_mine]
        self.oracle.regroup(len(theirs), groups)
        self._spec_snap = None

    def _gave_up(self, op: Op, after: Snapshot) -> bool:
        """Whether the copy `op` completes ended on the backend (the core lets a failed write copy be invalidated
        instead of retried: SPEC.md §6, RETRY); the oracle follows only when its own copy fails."""
        if not isinstance(op, Complete):
            return False
        mine = self.ledger.copies.id(op.copy, 0)
        return not any(c.id == mine and not c.finished for c in after.pending)

    def _record(
        self,
        index: int,
        op: Op,
        before: Snapshot,
        after: Snapshot,
        got: Outcome,
        want: Outcome,
        notes: StepNotes,
        out: list[Violation],
    ) -> None:
        """Enter what the step produced into the ledger: handles, anchors, copies, prefetches, backups."""
        ledger = self.ledger
        if (
            isinstance(op, HANDLE_PRODUCERS)
            and isinstance(got, (MatchOut, InsertOut))
            and isinstance(want, (MatchOut, InsertOut))
        ):
            ledger.handles[index] = (got.node, want.node)
        if isinstance(op, Restore) and isinstance(got, int) and isinstance(want, int):
            ledger.handles[index] = (got, want)
        if (
            isinstance(op, Match)
            and isinstance(got, MatchOut)
            and isinstance(want, MatchOut)
            and self.config.host_capacity
        ):
            pair = (
                UNKNOWN_NODE if got.host_node is None else got.host_node,
                UNKNOWN_NODE if want.host_node is None else want.host_node,
            )
            end = self.oracle.nodes.get(want.node)
            if want.host_length > 0 or end is self.oracle.root or (end is not None and end.host_slots is not None):
                # Without a host hit, host_node is the match's end (a backup, or the root) or unspecified
                # (SGLang: the deepest matched node, backed up or not; D6, D13): only then is it an anchor.
                ledger.anchors[index] = pair
            if want.host_length > 0:
                ledger.host_handles[index] = pair
        self._number_copies(before, after, out)
        started = (len(ledger.prefetches), len(ledger.retractions))
        self._number(ledger.prefetches, [p.id for p in before.prefetches], after.prefetches, self.oracle.prefetches)
        self._number(ledger.retractions, [r.id for r in before.retractions], after.retractions, self.oracle.retractions)
        if notes.made_kv is not None and len(ledger.retractions) > started[1]:
            ledger.retraction_kv[started[1]] = notes.made_kv
        if isinstance(op, (Prefetch, Retract)) and isinstance(op.handle, int):
            kind, count, k = (
                ("prefetch", len(ledger.prefetches), started[0])
                if isinstance(op, Prefetch)
                else ("retraction", len(ledger.retractions), started[1])
            )
            for j in range(k, count):
                ledger.owners[(kind, j)] = op.handle

    def _number_copies(self, before: Snapshot, after: Snapshot, out: list[Violation]) -> None:
        """Number the copies this op issued, in issue order, on both sides (INV-COPY-1)."""
        issued = {b.id for b in before.pending}
        mine = [c for c in after.pending if c.id not in issued]
        copies = self.ledger.copies
        theirs = [c for c in self.oracle.copies if not copies.knows(c.id)]
        if [c.kind for c in mine] != [c.kind for c in theirs]:
            out.append(
                Violation(
                    "INV-COPY-1", f"issued {[c.kind for c in mine]} copies, the spec issues {[c.kind for c in theirs]}"
                )
            )
        for b, o in zip(mine, theirs):
            copies.add(b.id, o.id)

    @staticmethod
    def _number(table: Numbered, before_ids: list[int], after: Any, oracle_objects: Any) -> None:
        """Number the prefetches or retraction backups this op started on both sides (compared in `check`)."""
        old = set(before_ids)
        mine = [x.id for x in after if x.id not in old]
        theirs = [x.id for x in oracle_objects if not table.knows(x.id)]
        for b, o in zip(mine, theirs):
            table.add(b, o)

    def check(self, index: int, op: Optional[Op], snap: Snapshot, found: list[Violation]) -> None:
        """The step's findings, then the backend's state against the spec and the oracle; raise on any."""
        violations = found + self.checks.state(snap, self.oracle, self.spec_snapshot(), self.storages)
        if self.ignore:
            violations = [v for v in violations if v.inv not in self.ignore]
        if violations:
            raise ConformanceFailure(index, op, violations)

    # ------------------------------------------------------------------ ending a trace

    def drain(self) -> None:
        """Complete every copy and consume every ack, until none is left (a write ack may issue a store).

        Each pass walks the copies in issue order, those issued during the pass included."""
        while self.oracle.copies:
            k = 0
            while k < len(self.ledger.copies):
                oracle_id = self.ledger.copies[k][1]
                if any(c.id == oracle_id and not c.finished for c in self.oracle.copies):
                    self.step(Complete(k))
                k += 1
            self.step(Poll())

    def quiesce(self) -> None:
        """Finish every copy and prefetch, consume every ack, release every lock, evict both tiers.

        Afterwards nothing may be left: no node, no slot on either tier, no copy, no prefetch.
        """
        for k in self.open_prefetches():
            while k in self.fetchable():
                self.step(Fetch(k))
            self.step(CheckPrefetch(k))
        self.drain()
        for k in self.open_retractions():
            self.step(Discard(k))
        for k in self.running_requests():
            self.step(Finish(k, cache=False))
        for k in self.locked_handles():
            for _ in range(self.releasable_locks(k)):
                self.step(Unlock(k))
        self.step(Evict(self.config.capacity))
        if self.config.host_capacity:
            self.drain()  # write-back's backups at eviction issue store copies
            self.step(EvictHost(self.config.host_capacity))
        snap = self._snapshot(len(self.ops) - 1, self.ops[-1])
        left = {
            "nodes": len(snap.nodes) - 1,
            "device slots": snap.capacity - len(snap.free_slots),
            "host slots": snap.host_capacity - len(snap.host_free_slots),
            "pending copies": len(snap.pending),
            "prefetches": len(snap.prefetches),
            "retraction backups": len(snap.retractions),
        }
        if any(left.values()) and "INV-LIVE-1" not in self.ignore:
            raise ConformanceFailure(
                len(self.ops) - 1,
                self.ops[-1],
                [
                    Violation(
                        "INV-LIVE-1",
                        "idle and fully evicted, yet "
                        + ", ".join(f"{v} {k}" for k, v in left.items() if v)
                        + " remain",
                    )
                ],
            )


def _oracle_half_back(now: dict[int, tuple[Any, Any]], saved: dict[int, tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """Running requests with the backend's half as it is `now` and the oracle's as `saved` before the op."""
    none = (None, None)
    pairs = {k: (now.get(k, none)[0], saved.get(k, none)[1]) for k in {*now, *saved}}
    return {k: pair for k, pair in pairs.items() if pair != none}


def run_trace(
    backend: Backend,
    config: CacheConfig,
    capabilities: Capabilities,
    ops: list[Op],
    hook: Optional[Callable[[int, Op, Outcome], None]] = None,
    quiesce: bool = True,
    close: bool = True,
) -> Harness:
    """Replay `ops`; raises ConformanceFailure at the first broken rule.

    The backend is closed afterwards, pass or fail; `close=False` leaves a passing run's backend
    open for the caller to inspect (and close: `Harness.close`).
    """
    h = Harness(backend, config, capabilities, trace_hook=hook)
    try:
        for op in ops:
            h.step(op)
        if quiesce:
            h.quiesce()
    except BaseException:
        h.close()
        raise
    if close:
        h.close()
    return h
