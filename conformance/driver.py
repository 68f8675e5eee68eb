"""The harness: run one operation on a backend and on the oracle, then check every rule.

`Harness.step(op)` is the single place where an `Op` becomes protocol calls, so
Hypothesis rules, replayed traces and the bug zoo all exercise the same code.
After every step it checks the state invariants on the backend's snapshot, the
operation's contract, and the backend against the reference model (steering the
model to the backend's choice wherever SPEC.md §6 allows a choice).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvcert.conformance.backend import Backend
from kvcert.conformance.storage import FaultyStorage, MemoryStorage
from kvcert.refimpl import RefCache
from kvcert.refimpl.cache import Chooser
from kvcert.spec import contracts, pages
from kvcert.spec import storage as l3
from kvcert.spec.invariants import Violation, check_snapshot
from kvcert.spec.ops import (
    HANDLE_PRODUCERS,
    AbortPrefetch,
    Admit,
    CheckPrefetch,
    Complete,
    Discard,
    Evict,
    EvictHost,
    Fetch,
    InjectFault,
    Insert,
    LoadBack,
    Lock,
    Match,
    Op,
    Poll,
    Prefetch,
    Publish,
    RegisterRef,
    ReleaseRef,
    Restore,
    Retract,
    StorageFault,
    Unlock,
    UpdateRef,
)
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    Capabilities,
    InsertOut,
    KVCertError,
    MatchOut,
    PoolExhausted,
    Running,
    Snapshot,
)

UNKNOWN_NODE = -1
"""The id a trace's never-issued handle maps to: no conforming backend uses it."""


class ConformanceFailure(AssertionError):
    """A backend broke the spec at one step of a trace."""

    def __init__(self, step: int, op: Optional[Op], violations: list[Violation]) -> None:
        self.step, self.op, self.violations = step, op, violations
        lines = "\n".join(f"  {v}" for v in violations)
        where = f"step {step}: {op}" if op is not None else "initial state"
        super().__init__(f"{where}\n{lines}")


Outcome = Union[MatchOut, InsertOut, AdmissionPlan, int, None, KVCertError]


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
    host_handles: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Match op index -> (backend, oracle) id of its `host_node`, for LoadBack: matches with a host hit only.

    Without a host hit `host_node` is backend-defined (SGLang: the deepest matched node; the
    spec: the deepest backed-up one), so such a match names nothing to load (StaleHandle)."""
    anchors: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Match op index -> (backend, oracle) `host_node` of every match: prefetch anchors."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """Copies in issue order: (backend copy id, oracle copy id); `Complete(k)` names the k-th."""
    _oracle_copy_ids: set[int] = field(default_factory=set)
    prefetches: list[tuple[int, int]] = field(default_factory=list)
    """Prefetches in issue order: (backend id, oracle id); `Fetch(k)` names the k-th."""
    retractions: list[tuple[int, int]] = field(default_factory=list)
    """Retraction backups in creation order: (backend id, oracle id); `Restore(k)` names the k-th."""
    _kv_memo: dict[tuple[Any, tuple[Any, ...]], tuple[bytes, ...]] = field(default_factory=dict)
    _retraction_kv: dict[int, tuple[bytes, ...]] = field(default_factory=dict)
    """Retraction index -> the entries its backup must hold (kv_reads backends)."""
    _made_kv: Optional[tuple[bytes, ...]] = None
    _step_violations: list[Violation] = field(default_factory=list)
    owners: dict[tuple[str, int], int] = field(default_factory=dict)
    """("prefetch" | "retraction", k) -> the handle of the request that started it (for aborts)."""
    storages: tuple[FaultyStorage, ...] = ()
    """(backend's, oracle's) L3 stores when the config has a storage tier; faults hit both alike."""
    trace_hook: Optional[Callable[[int, Op, Outcome], None]] = None
    _planned: Optional[Snapshot] = None
    """The backend's state when it made this step's admission plan (after the running requests' allocations)."""
    admitted: list[bool] = field(default_factory=list)
    """Per admission that fit, whether the backend could then allocate the planned slots."""
    _replayed_victims: Optional[Callable[[Snapshot], list[Violation]]] = None
    """Set by `_witness` when no order over the ranks before an eviction explains it: judges the oracle's
    own replay of the backend's victims instead."""

    closed: bool = False

    def __post_init__(self) -> None:
        try:
            self.oracle = RefCache(self.config)
            if self.config.prefetch_policy:
                self.storages = (FaultyStorage(MemoryStorage()), FaultyStorage(MemoryStorage()))
                self.backend.attach_storage(self.storages[0])  # type: ignore[attr-defined]
                self.oracle.attach_storage(self.storages[1])
            self.check(0, None, self.backend.snapshot(), [])
        except BaseException:
            self.close()  # nobody else holds the backend yet
            raise

    def close(self) -> None:
        """Release the backend (its `close()`, if it has one: pools, threads) once; every path ends here."""
        if self.closed:
            return
        self.closed = True
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

    # ------------------------------------------------------------------ running

    def _node(self, handle: Any, side: int, table: Optional[dict[int, tuple[int, int]]] = None) -> int:
        table = self.handles if table is None else table
        if isinstance(handle, int) and not isinstance(handle, bool) and handle in table:
            return table[handle][side]
        return UNKNOWN_NODE

    def _copy(self, k: Any, side: int) -> int:
        if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(self.copies):
            return self.copies[k][side]
        return UNKNOWN_NODE

    def _prefetch(self, k: Any, side: int) -> int:
        if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(self.prefetches):
            return self.prefetches[k][side]
        return UNKNOWN_NODE

    def _retraction(self, k: Any, side: int) -> int:
        if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(self.retractions):
            return self.retractions[k][side]
        return UNKNOWN_NODE

    def _retract(self, cache: Any, op: Retract, side: int) -> Optional[int]:
        """The scheduler's side of a retraction: back up the request's KV, then free its own slots.

        Its KV is the device part of the handle's path (slots the tree holds) and `tail`
        fresh slots of its own (decoded tokens, `2` each), as SGLang backs up a request's whole
        `req_to_token` row.
        """
        snap = cache.snapshot()
        nodes = snap.by_id()
        path: list[int] = []
        cur = nodes.get(self._node(op.handle, side))
        while cur is not None and cur.id != snap.root:
            path.append(cur.id)
            cur = nodes.get(cur.parent) if cur.parent is not None else None
        device = [nodes[nid] for nid in reversed(path) if nodes[nid].slots is not None]
        prefix = [x for n in device for x in n.slots or ()]
        own = cache.alloc(op.tail)
        try:
            if side == 0 and self.capabilities.kv_reads and isinstance(op.tail, int):
                ns = device[0].namespace if device else None
                tokens = tuple(t for n in device for t in n.key) + (2,) * op.tail
                self._made_kv = self._entries(ns, tokens)
                cache.write_kv(own, self._made_kv[len(prefix) :])  # the decoded tail; the prefix is the tree's
            got: Optional[int] = cache.retraction_backup(tuple(prefix) + tuple(own))
        finally:
            cache.free(own)
        return got

    def _restore(self, cache: Any, op: Restore, side: int) -> int:
        """The scheduler's side of a resume: fresh slots for the backup, restore, then the request runs and frees them."""
        backup = self._retraction(op.retraction, side)
        views = {r.id: r for r in cache.snapshot().retractions}
        tokens = views[backup].tokens if backup in views else 0
        slots = cache.alloc(pages.page_ceil(tokens, self.config.page_size))
        try:
            node: int = cache.retraction_restore(backup, slots[:tokens])
            want = self._retraction_kv.get(op.retraction) if side == 0 else None
            if want is not None and list(cache.read_kv(slots[:tokens])) != list(want):
                self._step_violations.append(
                    Violation("INV-KV-3", f"restoring backup {op.retraction} put other KV in the request's slots")
                )
        finally:
            cache.free(slots)
        return node

    def _admit(self, cache: Any, op: Admit, side: int) -> AdmissionPlan:
        """The scheduler's side of admission (SPEC.md §11.5): the running requests hold their slots,
        the cache plans, and the plan is applied: a scoped evict, the retractions (a backup for a kept
        one, then its slots freed), the request's allocation. The request then finishes at once."""
        running = _running(op.running)
        held: list[tuple[int, ...]] = []
        try:
            for r in running:
                held.append(cache.alloc(r.tokens))
            if side == 0:
                self._planned = cache.snapshot()
            profile = (
                AdmissionProfile(*op.profile)
                if isinstance(op.profile, (tuple, list)) and len(op.profile) == 4
                else op.profile
            )
            plan: AdmissionPlan = cache.plan_admission(op.length, op.priority, running, profile)
            if not plan.fits:
                return plan
            cache.evict(plan.evict, allow_low=True, allow_high=plan.allow_high)
            for i, keep in zip(plan.retract, plan.keep):
                if keep:
                    cache.retraction_backup(held[i])
                cache.free(held[i])
                held[i] = ()
            try:
                cache.free(cache.alloc(plan.slots))
                admitted = True
            except PoolExhausted:
                admitted = False  # the plan counted KV eviction could not free (pinned, §9.3)
            if side == 0:
                self.admitted.append(admitted)
            return plan
        finally:
            for slots in held:
                if slots:
                    cache.free(slots)

    def _publish(self, op: Publish) -> None:
        """Write `op.tokens`' canonical pages into both stores, as a peer engine would."""
        tokens = tuple(t for t in op.tokens if isinstance(t, int) and not isinstance(t, bool) and t >= 0)
        digest = l3.canonical_digest(self.config.page_size, self.config.model_id)
        pairs = l3.stored_pages(op.namespace, tokens, self.config.page_size, self.config.kv_layers, digest)
        for store in self.storages:
            store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])

    def _fault(self, op: StorageFault) -> None:
        """Damage both stores alike; a page fault picks the `at`-th of the oracle's keys."""
        if op.kind in ("corrupt", "drop"):
            keys = sorted(self.storages[1].inner.contents())
            if not keys:
                return
            key = keys[op.at % len(keys)]
            for store in self.storages:
                store.corrupt(key) if op.kind == "corrupt" else store.drop(key)
            return
        for store in self.storages:
            store.arm(op.kind, at=op.at)

    def _insert(self, cache: Any, op: Insert, side: int) -> InsertOut:
        """The caller's side of SGLang's insert: allocate, run the model (write its KV), insert, free the duplicates."""
        n = len(op.tokens) if op.value_len is None else op.value_len
        slots = cache.alloc(n)
        if side == 0:
            self._write_kv(cache, slots, op.namespace, op.tokens)
        try:
            out: InsertOut = cache.insert(op.namespace, op.tokens, slots, op.priority)
        except KVCertError:
            cache.free(slots)
            raise
        cache.free(slots[: out.prefix_len])
        return out

    # ------------------------------------------------------------------ KV content (SPEC.md §9.12)

    def _entries(self, namespace: Any, tokens: tuple[Any, ...]) -> tuple[bytes, ...]:
        """`token_entries` of a path, memoised: every step re-reads the whole tree."""
        key = (namespace, tokens)
        if key not in self._kv_memo:
            if len(self._kv_memo) > 4096:
                self._kv_memo.clear()
            self._kv_memo[key] = l3.token_entries(namespace, tokens, self.config.kv_layers)
        return self._kv_memo[key]

    def _write_kv(self, cache: Any, slots: tuple[int, ...], namespace: Any, tokens: tuple[Any, ...]) -> None:
        """Play the model: fill the caller's fresh slots with the content of `tokens` (valid ones only)."""
        if not self.capabilities.kv_reads or not slots:
            return
        if _has_content(namespace, tokens):
            entries = self._entries(namespace, tuple(tokens))
            cache.write_kv(slots[: len(entries)], entries[: len(slots)])

    def _kv_violations(self, snap: Snapshot) -> list[Violation]:
        """INV-KV-1/2/3: every settled slot of both tiers, and every retraction backup, holds its content."""
        if not self.capabilities.kv_reads:
            return []
        loading = {n for c in snap.pending if c.kind == "load" for n in c.nodes}
        writing = {n for c in snap.pending if c.kind == "write" for n in c.nodes}
        paths = contracts.node_paths(snap)
        out: list[Violation] = []
        for node in snap.nodes:
            if node.id == snap.root or node.id not in paths or not node.key:
                continue
            ns, path = paths[node.id]
            if not _has_content(ns, path):
                continue  # a key the spec never caches (a lenient backend took bad input): it has no content
            want = self._entries(ns, path)[len(path) - len(node.key) :]
            if node.slots is not None and node.id not in loading:
                got = list(self.backend.read_kv(node.slots))  # type: ignore[attr-defined]
                if got != list(want):
                    bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w) if len(got) == len(want) else 0
                    out.append(
                        Violation(
                            "INV-KV-1",
                            f"device slot {node.slots[bad]} of the node ending at "
                            f"{len(path)} tokens holds other KV than token {len(path) - len(node.key) + bad}'s",
                        )
                    )
            if node.host_slots is not None and node.id not in writing:
                got = list(self.backend.read_host_kv(node.host_slots))  # type: ignore[attr-defined]
                if got != list(want):
                    out.append(
                        Violation("INV-KV-2", f"the host copy of the node ending at {len(path)} tokens holds other KV")
                    )
        for view in snap.retractions:
            k = next((i for i, (b, _) in enumerate(self.retractions) if b == view.id), None)
            want_r = self._retraction_kv.get(k) if k is not None else None
            if want_r is not None:
                got_r = list(self.backend.read_host_kv(view.host_slots[: view.tokens]))  # type: ignore[attr-defined]
                if got_r != list(want_r):
                    out.append(Violation("INV-KV-3", f"retraction backup {k} holds other KV than it was made from"))
        return out

    def _run(self, cache: Any, op: Op, side: int, choose: Optional[Chooser] = None) -> Outcome:
        """One op as protocol calls; `choose` steers the oracle's eviction ties (side 1 only)."""
        extra = {"choose": choose} if choose is not None else {}
        try:
            if isinstance(op, Insert):
                return self._insert(cache, op, side)
            if isinstance(op, Match):
                out: MatchOut = cache.match_prefix(op.namespace, op.tokens)
                return out
            if isinstance(op, Lock):
                return cache.inc_lock_ref(self._node(op.handle, side))
            if isinstance(op, Unlock):
                return cache.dec_lock_ref(self._node(op.handle, side))
            if isinstance(op, Evict):
                if op.allow_low is True and op.allow_high is True:  # the full scope: any backend's plain evict
                    return int(cache.evict(op.n, **extra))
                return int(cache.evict(op.n, allow_low=op.allow_low, allow_high=op.allow_high, **extra))
            if isinstance(op, EvictHost):
                return int(cache.evict_host(op.n, **extra))
            if isinstance(op, LoadBack):
                return int(cache.load_back(self._node(op.handle, side, self.host_handles)))
            if isinstance(op, Complete):
                return cache.complete(self._copy(op.copy, side))
            if isinstance(op, Poll):
                return int(cache.poll())
            if isinstance(op, Prefetch):
                request = self.ops[op.handle] if isinstance(op.handle, int) and 0 <= op.handle < len(self.ops) else None
                node = self._node(op.handle, side, self.anchors)
                if not isinstance(request, Match):
                    return cache.prefetch(node, None, ())  # an unknown handle: the cache rejects the node
                return int(cache.prefetch(node, request.namespace, request.tokens))
            if isinstance(op, Fetch):
                return cache.fetch(self._prefetch(op.prefetch, side))
            if isinstance(op, CheckPrefetch):
                got: Optional[int] = cache.check_prefetch(self._prefetch(op.prefetch, side))
                return got
            if isinstance(op, AbortPrefetch):
                return cache.abort_prefetch(self._prefetch(op.prefetch, side))
            if isinstance(op, InjectFault):
                return cache.inject_fault(op.kind)
            if isinstance(op, Retract):
                return self._retract(cache, op, side)
            if isinstance(op, Restore):
                return self._restore(cache, op, side)
            if isinstance(op, Discard):
                return cache.retraction_discard(self._retraction(op.retraction, side))
            if isinstance(op, Admit):
                return self._admit(cache, op, side)
            if isinstance(op, RegisterRef):
                return cache.register_ref(op.session, self._node(op.handle, side), op.priority)
            if isinstance(op, UpdateRef):
                return cache.update_ref(op.session, op.priority)
            if isinstance(op, ReleaseRef):
                return cache.release_ref(op.session)
            raise TypeError(f"not an op: {op!r}")
        except KVCertError as err:
            return err

    def _snapshot(self, index: int, op: Op) -> Snapshot:
        """The backend's snapshot; an exception reading it (the backend's or its adapter's) fails the step with
        the trace so far, as a crash in an operation does, instead of ending the run with no trace."""
        try:
            return self.backend.snapshot()
        except Exception as err:
            raise ConformanceFailure(
                index, op, [Violation("INV-ERR-3", f"snapshot raised untyped {type(err).__name__}: {err}")]
            ) from err

    def step(self, op: Op) -> Outcome:
        """Apply `op` to the backend, then to the oracle steered to the backend's legal choices; check."""
        index = len(self.ops)
        self.ops.append(op)
        self.clock += 1
        self.backend.set_clock(self.clock)
        self.oracle.set_clock(self.clock)
        before = self._snapshot(index, op)
        self._step_violations, self._made_kv, self._planned = [], None, None
        if isinstance(op, (StorageFault, Publish)):  # storage-side events: no cache call
            if self.storages:
                self._fault(op) if isinstance(op, StorageFault) else self._publish(op)
            self.check(index, op, before, [])
            return None
        try:
            got = self._run(self.backend, op, 0)
        except Exception as err:  # a crash is a finding, not a harness error
            raise ConformanceFailure(
                index, op, [Violation("INV-ERR-3", f"raised untyped {type(err).__name__}: {err}")]
            ) from err
        after = self._snapshot(index, op)
        violations: list[Violation] = []
        # Where the spec leaves the backend a choice the snapshots cannot show, try the oracle once per
        # candidate choice until it reaches the backend's state: write-back's reclaim order, and whether
        # a write-back eviction tried a node it then skipped before the victims it evicted.
        attempts = [(order, False) for order in self._reclaim_orders(before, after)]
        if self._skippable(op, after):
            attempts += [(order, True) for order, _ in attempts]
        saved = copy.deepcopy(self.oracle) if len(attempts) > 1 else None
        for attempt, (order, skipped_first) in enumerate(attempts):
            if attempt:  # the last choice disagreed with the backend: put the oracle back and try the next
                self.oracle = copy.deepcopy(saved)
                if self.storages:
                    self.storages = (self.storages[0], self.oracle.storage)  # type: ignore[assignment]
            found: list[Violation] = []
            self._replayed_victims = None
            choose = self._witness(op, before, after, got, found, skipped_first)
            self.oracle.steer = self._follow(before, after)
            self.oracle.reclaim = self._reclaimed(before, after, order)
            try:
                want = self._run(self.oracle, op, 1, choose)
            finally:
                self.oracle.steer = self.oracle.reclaim = None
            if self._replayed_victims is not None:
                found += self._replayed_victims(self.oracle.snapshot())
            if attempt == len(attempts) - 1 or self._agrees(after):
                break
        violations += found
        self._compare(op, before, after, got, want, violations)
        if (
            isinstance(op, HANDLE_PRODUCERS)
            and isinstance(got, (MatchOut, InsertOut))
            and isinstance(want, (MatchOut, InsertOut))
        ):
            self.handles[index] = (got.node, want.node)
        if isinstance(op, Restore) and isinstance(got, int) and isinstance(want, int):
            self.handles[index] = (got, want)
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
                self.anchors[index] = pair
            if want.host_length > 0:
                self.host_handles[index] = pair
        self._track_copies(before, after, violations)
        started = (len(self.prefetches), len(self.retractions))
        self._track_prefetches(before, after)
        self._track_retractions(before, after)
        if self._made_kv is not None and len(self.retractions) > started[1]:
            self._retraction_kv[started[1]] = self._made_kv
        violations += self._step_violations
        if isinstance(op, (Prefetch, Retract)) and isinstance(op.handle, int):
            kind, count, k = (
                ("prefetch", len(self.prefetches), started[0])
                if isinstance(op, Prefetch)
                else ("retraction", len(self.retractions), started[1])
            )
            for j in range(k, count):
                self.owners[(kind, j)] = op.handle
        if self.trace_hook is not None:
            self.trace_hook(index, op, got)
        self.check(index, op, after, violations)
        return got

    def _oracle_path(self, node_id: int) -> contracts.Path:
        node = self.oracle.nodes[node_id]
        edges = reversed(self.oracle._path_to_root(node))
        return node.namespace, tuple(t for n in edges for t in n.key)

    def _follow(self, before: Snapshot, after: Snapshot) -> Chooser:
        """A tie-break for the oracle's internal evictions: prefer what the backend evicted.

        The evicted paths are computed on the first tie only: most operations evict nothing.
        """
        gone: list[set[contracts.Path]] = []

        def choose(tied: list[int]) -> int:
            if not gone:
                lost_device = set(contracts.device_paths(before).values()) - set(contracts.device_paths(after).values())
                left_tree = set(contracts.node_paths(before).values()) - set(contracts.node_paths(after).values())
                gone.append(lost_device | left_tree)
            return next((i for i in sorted(tied) if self._oracle_path(i) in gone[0]), min(tied))

        return choose

    def _dropped_backups(self, before: Snapshot, after: Snapshot) -> set[contracts.Path]:
        """Paths whose host copy the backend's write-back reclaim dropped during this op.

        Dropped for good (`host_reclaimed`), or dropped for room and then made again when the same
        node became an eviction victim: its new host slots, or its new backup's store copy, give it away.
        """
        of = contracts.node_paths(before)
        dropped = {of[i] for i in contracts.host_reclaimed(before, after)}
        old = {of[n.id]: n.host_slots for n in before.nodes if n.id in of and n.host_slots is not None}
        now = contracts.node_paths(after)
        issued = {c.id for c in before.pending}
        stored = {
            now[i] for c in after.pending if c.kind == "store" and c.id not in issued for i in c.nodes if i in now
        }
        for n in after.nodes:
            p = now.get(n.id)
            if p in old and n.host_slots is not None and (n.host_slots != old[p] or p in stored):
                dropped.add(p)
        return dropped

    def _reclaim_orders(self, before: Snapshot, after: Snapshot) -> list[Optional[tuple[contracts.Path, ...]]]:
        """The orders of write-back reclaim the oracle may try to reach the backend's state (SPEC.md §9.4: any order).

        One (the default preference) unless several dropped backups could have gone first; then each
        order of them, at most 24, tried until the oracle's state agrees with the backend's.
        """
        if self.config.write_policy != "write_back" or not self.config.host_capacity:
            return [None]
        dropped = sorted(self._dropped_backups(before, after), key=_order)
        if len(dropped) < 2:
            return [None]
        return list(itertools.islice(itertools.permutations(dropped), 24))

    def _agrees(self, after: Snapshot) -> bool:
        """The oracle reached the backend's state (tree, residency, copies): the steering found the backend's choice."""
        spec = self.oracle.snapshot()
        return contracts.shape(after) == contracts.shape(spec) and [(c.kind, c.finished) for c in after.pending] == [
            (c.kind, c.finished) for c in spec.pending
        ]

    def _reclaimed(
        self, before: Snapshot, after: Snapshot, order: Optional[tuple[contracts.Path, ...]] = None
    ) -> Chooser:
        """Write-back host eviction drops duplicate backups in any order: prefer those the backend dropped
        (in `order` when given)."""
        paths: list[tuple[contracts.Path, ...]] = []

        def choose(tied: list[int]) -> int:
            if not paths:
                paths.append(
                    order if order is not None else tuple(sorted(self._dropped_backups(before, after), key=_order))
                )
            by_path = {self._oracle_path(i): i for i in tied}
            return next((by_path[p] for p in paths[0] if p in by_path), min(tied))

        return choose

    def _skippable(self, op: Op, after: Snapshot) -> bool:
        """A write-back eviction that left a node it may have tried and skipped (SPEC.md §9.3)."""
        return (
            isinstance(op, Evict)
            and self.config.write_policy == "write_back"
            and bool(self.config.host_capacity)
            and bool(contracts.pinned_nodes(after))
        )

    def _witness(
        self,
        op: Op,
        before: Snapshot,
        after: Snapshot,
        got: Outcome,
        out: list[Violation],
        skipped_first: bool = False,
    ) -> Optional[Chooser]:
        """For Evict / EvictHost: check the backend's victims are a legal greedy choice; steer the oracle to them."""
        if not isinstance(op, (Evict, EvictHost)) or not isinstance(got, int):
            return None
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

        def competes(n: Any) -> bool:
            return n is self.oracle.root or (n.slots is None) == host

        def locked(n: Any) -> bool:
            if host:
                return n.lock_ref > 0 or n.host_lock_ref > 0
            if n.lock_ref > 0 or self.oracle.pinned(n) or not in_scope(n):
                return True
            # Write-back tries a node that would drop a protected host copy and skips it only if its
            # backup fails (SPEC.md §9.3): the nodes pinned after the eviction are the ones it could skip.
            return self._oracle_path(n.id) in stuck_after

        scope = (op.allow_low, op.allow_high) if isinstance(op, Evict) else (True, True)

        def in_scope(n: Any) -> bool:
            tier = self.oracle.tier(n)
            return tier == 0 or (tier == 1 and scope[0] is True) or (tier == 2 and scope[1] is True)

        gone = set(paths_of(before).values()) - set(paths_of(after).values())
        stuck_after: set[contracts.Path] = set()
        if not host and self.config.write_policy == "write_back":
            after_paths = contracts.node_paths(after)
            stuck_after = {after_paths[i] for i in contracts.pinned_nodes(after) if i in after_paths}
        oracle_snap = self.oracle.snapshot()
        removed = frozenset(i for i, p in paths_of(oracle_snap).items() if p in gone)
        view = {
            n.id: contracts.EvictNode(
                n.id, n.parent.id if n.parent else None, len(n.key), locked(n), self.oracle.rank(n)
            )
            for n in self.oracle.nodes.values()
            if competes(n)
        }
        witness = contracts.eviction_witness(view, oracle_snap.root, asked, removed)
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
                    Violation(inv, f"no {self.config.policy} eviction order removes exactly {sorted(p[1] for p in gone)}")
                ]

            self._replayed_victims = replayed
            return self._follow(before, after)
        remaining = list(witness)
        skippable = sorted(i for i in self.oracle.nodes if self._oracle_path(i) in stuck_after)

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

        return choose

    def _track_copies(self, before: Snapshot, after: Snapshot, out: list[Violation]) -> None:
        """Number the copies this op issued, in issue order, on both sides (INV-COPY-1)."""
        mine = [c for c in after.pending if c.id not in {b.id for b in before.pending}]
        theirs = [c for c in self.oracle.copies if c.id not in self._oracle_copy_ids]
        if [c.kind for c in mine] != [c.kind for c in theirs]:
            out.append(
                Violation(
                    "INV-COPY-1", f"issued {[c.kind for c in mine]} copies, the spec issues {[c.kind for c in theirs]}"
                )
            )
        for b, o in zip(mine, theirs):
            self.copies.append((b.id, o.id))
            self._oracle_copy_ids.add(o.id)

    def _track_prefetches(self, before: Snapshot, after: Snapshot) -> None:
        """Number the prefetches this op issued on both sides (their lists are compared in `check`)."""
        mine = [p.id for p in after.prefetches if p.id not in {b.id for b in before.prefetches}]
        known = {o for _, o in self.prefetches}
        theirs = [p.id for p in self.oracle.prefetches if p.id not in known]
        self.prefetches += list(zip(mine, theirs))

    def _track_retractions(self, before: Snapshot, after: Snapshot) -> None:
        """Number the retraction backups this op made on both sides (their lists are compared in `check`)."""
        mine = [r.id for r in after.retractions if r.id not in {b.id for b in before.retractions}]
        known = {o for _, o in self.retractions}
        theirs = [r.id for r in self.oracle.retractions if r.id not in known]
        self.retractions += list(zip(mine, theirs))

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
        if self.capabilities.priority_refs and isinstance(op, Evict):
            scope = (op.allow_low, op.allow_high)
            out += [Violation(i, m) for i, m in contracts.tier_eviction_violations(before, after, *scope)]
        if isinstance(op, Admit) and isinstance(got, AdmissionPlan) and self._planned is not None:
            out += [
                Violation(i, m)
                for i, m in contracts.plan_violations(
                    self._planned,
                    op.length,
                    op.priority,
                    _running(op.running),
                    AdmissionProfile(*op.profile) if op.profile is not None else None,
                    self.config.kv_layers,
                    got,
                )
            ]
            if got != want:
                out.append(Violation("INV-ADMIT-4", f"plan {got}, the spec's {want}"))
        if self.capabilities.priority_refs and isinstance(op, EvictHost):
            out += [Violation(i, m) for i, m in contracts.host_tier_violations(before, after)]
        if isinstance(op, EvictHost) and got != want:
            out.append(Violation("INV-HOST-8", f"freed {got} host tokens, the oracle (same victims) freed {want}"))
        if isinstance(op, LoadBack) and got != want:
            out.append(Violation("INV-LOAD-1", f"loaded back {got} tokens, the spec loads {want}"))
        if isinstance(op, Poll) and got != want:
            out.append(
                Violation("INV-COPY-2", f"consumed {got} acks, the spec consumes {want} (finished, in issue order)")
            )
        if isinstance(op, Prefetch) and got != want:
            out.append(Violation("INV-PF-2", f"prefetch asked storage for {got} tokens, the spec asks {want}"))
        if isinstance(op, Retract) and (got is None) != (want is None):
            out.append(
                Violation(
                    "INV-RETRACT-2",
                    f"retraction backup {'declined' if got is None else 'made'}; the spec "
                    f"{'declines it' if want is None else 'makes it'}",
                )
            )
        if isinstance(op, Restore) and isinstance(got, int):
            self._check_handle(after, got, None, (), out)  # the root: the resumed request's last node
        if isinstance(op, CheckPrefetch) and got != want:
            say = {None: "kept it running"}
            out.append(
                Violation(
                    "INV-PF-3",
                    f"check_prefetch {say.get(got, f'ended it adding {got} tokens')}; "  # type: ignore[arg-type]
                    f"the spec {say.get(want, f'ends it adding {want} tokens')}",  # type: ignore[arg-type]
                )
            )

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
        if self.config.host_capacity:
            expect_host = contracts.host_hit_len(before, op.namespace, op.tokens, got.length)
            if got.host_length != expect_host:
                out.append(
                    Violation("INV-MATCH-3", f"host hit {got.host_length} tokens, {expect_host} are on the host only")
                )

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
            if {p: v.size for p, v in mine.items()} != {p: v.size for p, v in oracle.items()}:
                extra_paths = sorted(set(mine) - set(oracle), key=_order)[:2]
                missing = sorted(set(oracle) - set(mine), key=_order)[:2]
                violations.append(
                    Violation("INV-TREE-4", f"tree differs from the spec's: extra {extra_paths}, missing {missing}")
                )
            else:
                for p in sorted(mine, key=_order):
                    inv = contracts.shape_difference(mine[p], oracle[p])
                    if inv is not None:
                        violations.append(
                            Violation(inv, f"node at {p[1][-4:]}@{len(p[1])} is {mine[p]}, spec says {oracle[p]}")
                        )
                        break
            theirs = [(c.kind, c.finished) for c in self.oracle.copies]
            if [(c.kind, c.finished) for c in snap.pending] != theirs:
                violations.append(
                    Violation(
                        "INV-COPY-1",
                        f"pending copies {[(c.kind, c.finished) for c in snap.pending]}, spec says {theirs}",
                    )
                )
            else:
                violations += self._copy_contents(snap)
            mine_pf = [(p.requested, p.fetched, p.failed) for p in snap.prefetches]
            spec_pf = [(p.requested, p.fetched, p.failed) for p in self.oracle.snapshot().prefetches]
            if mine_pf != spec_pf:
                violations.append(
                    Violation("INV-PF-3", f"prefetches (requested, fetched, failed) {mine_pf}, spec says {spec_pf}")
                )
            mine_ss, spec_ss = contracts.session_paths(snap), contracts.session_paths(self.oracle.snapshot())
            if mine_ss != spec_ss:
                differ = next((a, b) for a, b in itertools.zip_longest(mine_ss, spec_ss) if a != b)
                violations.append(
                    Violation(
                        "INV-TIER-5", f"session (id, path, priority, high, demoted) {differ[0]}, spec says {differ[1]}"
                    )
                )
            mine_rt = [r.tokens for r in snap.retractions]
            spec_rt = [r.tokens for r in self.oracle.retractions]
            if mine_rt != spec_rt:
                violations.append(
                    Violation("INV-RETRACT-2", f"retraction backups (tokens) {mine_rt}, spec says {spec_rt}")
                )
            violations += self._storage_contents()
            violations += self._kv_violations(snap)
        if violations:
            raise ConformanceFailure(index, op, violations)

    def _copy_contents(self, snap: Snapshot) -> list[Violation]:
        """INV-COPY-1: each pending copy moves the spec's nodes (by path), splits included."""
        if not snap.pending:
            return []
        mine, spec = contracts.node_paths(snap), contracts.node_paths(self.oracle.snapshot())
        for got, want in zip(snap.pending, self.oracle.copies):
            have = {mine.get(i) for i in got.nodes}
            need = {spec[n.id] for n in want.nodes}
            if have != need:

                def ends(paths: Any) -> str:  # each node as its path's last tokens @ its length, with its namespace
                    names = sorted(
                        (len(p[1]), f"{p[1][-4:]}@{len(p[1])}" + (f" in {p[0]!r}" if p[0] is not None else ""))
                        for p in paths
                        if p
                    )
                    return "[" + ", ".join(n for _, n in names) + "]"

                return [
                    Violation(
                        "INV-COPY-1",
                        f"pending {got.kind} copy {got.id} moves the nodes {ends(have)}; the spec's moves "
                        f"{ends(need)} (missing {ends(need - have)}, extra {ends(have - need)})",
                    )
                ]
        return []

    def _storage_contents(self) -> list[Violation]:
        """INV-STORE-1: the backend stored exactly the spec's pages, under the spec's keys, with its bytes."""
        if not self.storages:
            return []
        mine, spec = self.storages[0].inner.contents(), self.storages[1].inner.contents()
        if mine == spec:
            return []
        extra, missing = sorted(set(mine) - set(spec)), sorted(set(spec) - set(mine))
        wrong = sorted(k for k in set(mine) & set(spec) if mine[k] != spec[k])
        return [
            Violation(
                "INV-STORE-1",
                f"storage differs from the spec's: {len(extra)} extra keys, {len(missing)} missing, "
                f"{len(wrong)} with other bytes" + (f" (e.g. {(extra + missing + wrong)[0][:16]}…)"),
            )
        ]

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

    def open_copies(self) -> list[int]:
        """Trace indices of copies the copy engine has not finished yet."""
        unfinished = {c.id for c in self.oracle.copies if not c.finished}
        return [k for k, (_, o) in enumerate(self.copies) if o in unfinished]

    def finished_copies(self) -> list[int]:
        """Trace indices of copies already finished (completing one again is bad input)."""
        pending_open = set(self.open_copies())
        return [k for k in range(len(self.copies)) if k not in pending_open]

    def host_hits(self) -> list[int]:
        """Match ops whose host node is still in the tree and on the host only: load-back candidates."""
        return [
            k
            for k, (_, o) in self.host_handles.items()
            if o in self.oracle.nodes and self.oracle.nodes[o].slots is None
        ]

    def prefetch_anchors(self) -> list[int]:
        """Match ops whose host node is still in the tree: prefetch requests."""
        return [k for k, (_, o) in self.anchors.items() if o in self.oracle.nodes]

    def open_prefetches(self) -> list[int]:
        """Trace indices of prefetches still running."""
        running = {p.id for p in self.oracle.prefetches}
        return [k for k, (_, o) in enumerate(self.prefetches) if o in running]

    def fetchable(self) -> list[int]:
        """Running prefetches with a page left to fetch."""
        live = {p.id: p for p in self.oracle.prefetches}
        return [
            k
            for k, (_, o) in enumerate(self.prefetches)
            if o in live and not live[o].failed and live[o].fetched < len(live[o].keys)
        ]

    def open_retractions(self) -> list[int]:
        """Trace indices of retraction backups not yet restored or discarded."""
        alive = {r.id for r in self.oracle.retractions}
        return [k for k, (_, o) in enumerate(self.retractions) if o in alive]

    def held_by(self, handle: int) -> tuple[list[int], list[int], int]:
        """What the request behind `handle` holds: its running prefetches, its retraction backups, its node's own locks."""
        prefetches = [k for k in self.open_prefetches() if self.owners.get(("prefetch", k)) == handle]
        backups = [k for k in self.open_retractions() if self.owners.get(("retraction", k)) == handle]
        node = self.oracle.nodes.get(self.handles[handle][1]) if handle in self.handles else None
        return prefetches, backups, node.own_locks if node is not None else 0

    def _drain(self) -> None:
        """Complete every copy and consume every ack, until none is left (a write ack may issue a store)."""
        while self.oracle.copies:
            for k, (_, oracle_id) in enumerate(self.copies):
                if any(c.id == oracle_id and not c.finished for c in self.oracle.copies):
                    self.step(Complete(k))
            self.step(Poll())

    def quiesce(self) -> None:
        """Finish every copy and prefetch, consume every ack, release every lock, evict both tiers.

        Afterwards nothing may be left: no node, no slot on either tier, no copy, no prefetch.
        """
        for k in self.open_prefetches():
            while k in self.fetchable():
                self.step(Fetch(k))
            self.step(CheckPrefetch(k))
        self._drain()
        for k in self.open_retractions():
            self.step(Discard(k))
        for k in self.locked_handles():
            for _ in range(self.oracle.nodes[self.handles[k][1]].own_locks):
                self.step(Unlock(k))
        self.step(Evict(self.config.capacity))
        if self.config.host_capacity:
            self._drain()  # write-back's backups at eviction issue store copies
            self.step(EvictHost(self.config.host_capacity))
        snap = self.backend.snapshot()
        left = {
            "nodes": len(snap.nodes) - 1,
            "device slots": snap.capacity - len(snap.free_slots),
            "host slots": snap.host_capacity - len(snap.host_free_slots),
            "pending copies": len(snap.pending),
            "prefetches": len(snap.prefetches),
            "retraction backups": len(snap.retractions),
        }
        if any(left.values()):
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


def _has_content(namespace: Any, tokens: Any) -> bool:
    """Whether the content function is defined on this path: valid token ids and a namespace."""
    return (namespace is None or isinstance(namespace, str)) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < l3.TOKEN_LIMIT for t in tokens
    )


def _running(running: Any) -> tuple[Running, ...]:
    """An Admit op's running requests as the protocol's values: (priority, tokens) pairs, ids by position."""
    return tuple(Running(i, r[0], r[1]) for i, r in enumerate(running))


def _order(path: contracts.Path) -> tuple[str, tuple[int, ...]]:
    return (path[0] or "", path[1])


def _same_state(a: Snapshot, b: Snapshot) -> bool:
    """Equal as far as the spec can tell (ids and free-list order are the backend's business)."""
    return (
        contracts.shape(a) == contracts.shape(b)
        and contracts.page_slots(a) == contracts.page_slots(b)
        and set(a.free_slots) == set(b.free_slots)
        and set(a.host_free_slots) == set(b.host_free_slots)
        and [(c.kind, c.finished) for c in a.pending] == [(c.kind, c.finished) for c in b.pending]
        and [r.tokens for r in a.retractions] == [r.tokens for r in b.retractions]
        and contracts.session_paths(a) == contracts.session_paths(b)
        and a.tier_evictable == b.tier_evictable
        and (a.evictable_size, a.protected_size) == (b.evictable_size, b.protected_size)
    )


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
