"""The harness: run one operation on a backend and on the oracle, then check every rule.

`Harness.step(op)` is the single place where an `Op` becomes protocol calls, so
Hypothesis rules, replayed traces and the bug zoo all exercise the same code.
After every step it checks the state invariants on the backend's snapshot, the
operation's contract, and the backend against the reference model (steering the
model to the backend's choice wherever SPEC.md §6 allows a choice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvcert.conformance.backend import Backend
from kvcert.refimpl import RefCache
from kvcert.spec import contracts
from kvcert.spec.invariants import Violation, check_snapshot
from kvcert.spec.ops import HANDLE_PRODUCERS, Evict, Insert, Lock, Match, Op, Unlock
from kvcert.spec.types import CacheConfig, Capabilities, InsertOut, KVCertError, MatchOut, Snapshot

UNKNOWN_NODE = -1
"""The id a trace's never-issued handle maps to: no conforming backend uses it."""


class ConformanceFailure(AssertionError):
    """A backend broke the spec at one step of a trace."""

    def __init__(self, step: int, op: Optional[Op], violations: list[Violation]) -> None:
        self.step, self.op, self.violations = step, op, violations
        lines = "\n".join(f"  {v}" for v in violations)
        where = f"step {step}: {op}" if op is not None else "initial state"
        super().__init__(f"{where}\n{lines}")


Outcome = Union[MatchOut, InsertOut, int, None, KVCertError]


@dataclass
class Harness:
    """A backend, the oracle beside it, and the ledger of handles a trace has produced."""

    backend: Backend
    config: CacheConfig
    capabilities: Capabilities
    oracle: RefCache = field(init=False)
    ops: list[Op] = field(default_factory=list)
    clock: int = 0
    handles: dict[int, tuple[int, int]] = field(default_factory=dict)
    """op index -> (backend node id, oracle node id) of the node that op returned."""
    trace_hook: Optional[Callable[[int, Op, Outcome], None]] = None

    def __post_init__(self) -> None:
        self.oracle = RefCache(self.config)
        self.check(0, None, self.backend.snapshot(), [])

    # ------------------------------------------------------------------ running

    def _node(self, handle: Any, side: int) -> int:
        if isinstance(handle, int) and not isinstance(handle, bool) and handle in self.handles:
            return self.handles[handle][side]
        return UNKNOWN_NODE

    @staticmethod
    def _insert(cache: Any, op: Insert) -> InsertOut:
        """The caller's side of SGLang's insert: allocate, insert, free the duplicates."""
        n = len(op.tokens) if op.value_len is None else op.value_len
        slots = cache.alloc(n)
        try:
            out: InsertOut = cache.insert(op.namespace, op.tokens, slots, op.priority)
        except KVCertError:
            cache.free(slots)
            raise
        cache.free(slots[: out.prefix_len])
        return out

    def _run(self, cache: Any, op: Op, side: int) -> Outcome:
        try:
            if isinstance(op, Insert):
                return self._insert(cache, op)
            if isinstance(op, Match):
                out: MatchOut = cache.match_prefix(op.namespace, op.tokens)
                return out
            if isinstance(op, Lock):
                return cache.inc_lock_ref(self._node(op.handle, side))
            if isinstance(op, Unlock):
                return cache.dec_lock_ref(self._node(op.handle, side))
            raise TypeError(f"not an op: {op!r}")
        except KVCertError as err:
            return err

    def step(self, op: Op) -> Outcome:
        """Apply `op` to backend and oracle; raise ConformanceFailure on any broken rule."""
        index = len(self.ops)
        self.ops.append(op)
        self.clock += 1
        self.backend.set_clock(self.clock)
        self.oracle.set_clock(self.clock)
        before = self.backend.snapshot()
        violations: list[Violation] = []
        if isinstance(op, Evict):
            got, want = self._evict(op, before, violations)
        else:
            want = self._run(self.oracle, op, 1)
            try:
                got = self._run(self.backend, op, 0)
            except Exception as err:  # a crash is a finding, not a harness error
                raise ConformanceFailure(
                    index, op, [Violation("INV-ERR-3", f"raised untyped {type(err).__name__}: {err}")]
                ) from err
        after = self.backend.snapshot()
        self._compare(op, before, after, got, want, violations)
        if (
            isinstance(op, HANDLE_PRODUCERS)
            and isinstance(got, (MatchOut, InsertOut))
            and isinstance(want, (MatchOut, InsertOut))
        ):
            self.handles[index] = (got.node, want.node)
        if self.trace_hook is not None:
            self.trace_hook(index, op, got)
        self.check(index, op, after, violations)
        return got

    def _evict(self, op: Evict, before: Snapshot, violations: list[Violation]) -> tuple[Outcome, Outcome]:
        """Evict on the backend first, check its choice is legal, then make the oracle choose the same."""
        try:
            got: Outcome = self.backend.evict(op.n)
        except KVCertError as err:
            got = err
        except Exception as err:
            raise ConformanceFailure(
                len(self.ops) - 1, op, [Violation("INV-ERR-3", f"raised untyped {type(err).__name__}: {err}")]
            ) from err
        if isinstance(got, KVCertError):
            try:
                return got, self.oracle.evict(op.n)
            except KVCertError as err:
                return got, err
        after = self.backend.snapshot()
        asked = op.n if isinstance(op.n, int) else 0
        violations += [Violation(i, m) for i, m in contracts.eviction_bounds(before, after, asked, int(got or 0))]
        oracle_snap = self.oracle.snapshot()
        paths = contracts.device_paths(oracle_snap)
        gone_paths = set(contracts.device_paths(before).values()) - set(contracts.device_paths(after).values())
        removed = frozenset(i for i, p in paths.items() if p in gone_paths)
        view = {  # eviction sees the device tree: nodes on the host only neither compete nor block
            n.id: contracts.EvictNode(
                id=n.id,
                parent=n.parent.id if n.parent else None,
                size=len(n.key),
                locked=n.lock_ref > 0,
                rank=self.oracle.rank(n),
            )
            for n in self.oracle.nodes.values()
            if n.slots is not None
        }
        witness = contracts.eviction_witness(view, oracle_snap.root, asked, removed)
        if witness is None:
            violations.append(
                Violation(
                    "INV-EVICT-4",
                    f"no {self.config.policy} eviction order removes exactly {sorted(p[1] for p in gone_paths)}",
                )
            )
            return got, self.oracle.evict(op.n)
        order = iter(witness)
        return got, self.oracle.evict(op.n, choose=lambda tied: next(order))

    # ------------------------------------------------------------------ checking

    def _compare(
        self, op: Op, before: Snapshot, after: Snapshot, got: Outcome, want: Outcome, out: list[Violation]
    ) -> None:
        """The operation's contract, and the backend's answer against the oracle's."""
        if isinstance(want, KVCertError) or isinstance(got, KVCertError):
            if not isinstance(got, KVCertError):
                out.append(Violation("INV-ERR-1", f"succeeded; the spec raises {type(want).__name__}: {want}"))
            elif not isinstance(want, KVCertError):
                out.append(Violation("INV-ERR-2", f"rejected a valid call with {type(got).__name__}: {got}"))
            elif type(got) is not type(want):
                out.append(Violation("INV-ERR-1", f"raised {type(got).__name__}, the spec says {type(want).__name__}"))
            if isinstance(got, KVCertError) and not _same_state(before, after):
                out.append(Violation("INV-ERR-1", f"{type(got).__name__} was raised but the state changed"))
            return
        out += [Violation("INV-SLOT-3", m) for m in contracts.slot_changes(before, after)]
        if isinstance(op, Match) and isinstance(got, MatchOut):
            self._check_match(op, before, after, got, out)
        if isinstance(op, Insert) and isinstance(got, InsertOut) and isinstance(want, InsertOut):
            self._check_insert(op, before, after, got, out)
        if isinstance(op, Evict) and got != want:
            out.append(Violation("INV-EVICT-5", f"freed {got}, the oracle (same victims) freed {want}"))

    def _check_handle(self, after: Snapshot, node: int, namespace: Any, tokens: tuple, out: list[Violation]) -> None:
        ids = after.by_id()
        if node not in ids:
            out.append(Violation("INV-HANDLE-1", f"returned node {node} is not in the tree"))
            return
        ns, path = after.path_of(node)
        if path != tokens:
            out.append(Violation("INV-HANDLE-1", f"returned node ends at {len(path)} tokens, not at {len(tokens)}"))
        elif tokens and ns != namespace:
            out.append(Violation("INV-NS-2", f"returned node is in namespace {ns!r}, asked {namespace!r}"))

    def _check_match(self, op: Match, before: Snapshot, after: Snapshot, got: MatchOut, out: list[Violation]) -> None:
        expect = contracts.cached_prefix_len(before, op.namespace, op.tokens)
        if got.length != expect:
            out.append(Violation("INV-MATCH-1", f"matched {got.length} tokens, {expect} are cached"))
            return
        slots = contracts.prefix_slots(after, op.namespace, op.tokens, got.length)
        if tuple(got.slots) != slots:
            out.append(Violation("INV-MATCH-2", f"returned slots {tuple(got.slots)[:8]}, the tree holds {slots[:8]}"))
        self._check_handle(after, got.node, op.namespace, tuple(op.tokens[: got.length]), out)

    def _check_insert(
        self, op: Insert, before: Snapshot, after: Snapshot, got: InsertOut, out: list[Violation]
    ) -> None:
        expect = contracts.cached_prefix_len(before, op.namespace, op.tokens)
        if got.prefix_len != expect:
            out.append(Violation("INV-INS-1", f"insert reported prefix {got.prefix_len}, {expect} was cached"))
            return
        if contracts.cached_prefix_len(after, op.namespace, op.tokens) != len(op.tokens):
            out.append(Violation("INV-INS-2", "the inserted key is not fully cached afterwards"))
            return
        self._check_handle(after, got.node, op.namespace, tuple(op.tokens), out)

    def check(self, index: int, op: Optional[Op], snap: Snapshot, found: list[Violation]) -> None:
        """State invariants, then shape and locks against the oracle."""
        violations = found + check_snapshot(snap)
        if not any(v.inv == "INV-TREE-1" for v in violations):
            mine, oracle = contracts.shape(snap), contracts.shape(self.oracle.snapshot())
            if {p: s for p, (s, _) in mine.items()} != {p: s for p, (s, _) in oracle.items()}:
                extra_paths = sorted(set(mine) - set(oracle), key=_order)[:2]
                missing = sorted(set(oracle) - set(mine), key=_order)[:2]
                violations.append(
                    Violation("INV-TREE-4", f"tree differs from the spec's: extra {extra_paths}, missing {missing}")
                )
            else:
                for p, (_, lock) in sorted(mine.items(), key=lambda item: _order(item[0])):
                    if lock != oracle[p][1]:
                        violations.append(
                            Violation(
                                "INV-LOCK-2",
                                f"node at {p[1][-4:]}@{len(p[1])} lock_ref {lock}, spec says {oracle[p][1]}",
                            )
                        )
                        break
        if violations:
            raise ConformanceFailure(index, op, violations)

    # ------------------------------------------------------------------ helpers for rules

    def live_handles(self) -> list[int]:
        """Handles whose node is still in the oracle's tree."""
        return [k for k, (_, o) in self.handles.items() if o in self.oracle.nodes]

    def locked_handles(self) -> list[int]:
        """Handles whose node holds at least one lock of its own.

        Two handles may name one node; the first one stands for it, so quiescing unlocks each node once per lock.
        """
        seen: set[int] = set()
        out = []
        for k, (_, o) in self.handles.items():
            if o in self.oracle.nodes and self.oracle.nodes[o].own_locks > 0 and o not in seen:
                seen.add(o)
                out.append(k)
        return out

    def quiesce(self) -> None:
        """Release every lock, then evict everything: the tree must empty and every slot come back."""
        for k in self.locked_handles():
            for _ in range(self.oracle.nodes[self.handles[k][1]].own_locks):
                self.step(Unlock(k))
        self.step(Evict(self.config.capacity))
        snap = self.backend.snapshot()
        if len(snap.nodes) != 1 or len(snap.free_slots) != snap.capacity:
            raise ConformanceFailure(
                len(self.ops) - 1,
                self.ops[-1],
                [
                    Violation(
                        "INV-LIVE-1",
                        f"idle and fully evicted, yet {len(snap.nodes) - 1} nodes and {snap.capacity - len(snap.free_slots)} slots remain",
                    )
                ],
            )


def _order(path: contracts.Path) -> tuple[str, tuple[int, ...]]:
    return (path[0] or "", path[1])


def _same_state(a: Snapshot, b: Snapshot) -> bool:
    """Equal as far as the spec can tell (ids and free-list order are the backend's business)."""
    return (
        contracts.shape(a) == contracts.shape(b)
        and contracts.page_slots(a) == contracts.page_slots(b)
        and set(a.free_slots) == set(b.free_slots)
        and (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size)
    )


def run_trace(
    backend: Backend,
    config: CacheConfig,
    capabilities: Capabilities,
    ops: list[Op],
    hook: Optional[Callable[[int, Op, Outcome], None]] = None,
    quiesce: bool = True,
) -> Harness:
    """Replay `ops`; raises ConformanceFailure at the first broken rule."""
    h = Harness(backend, config, capabilities, trace_hook=hook)
    for op in ops:
        h.step(op)
    if quiesce:
        h.quiesce()
    return h
