"""What the generator may ask about the state a trace has reached: a narrow, cached query API.

The rules of `conformance.generation.machine` choose their next op from these answers only — positions a trace
can name (live handles, open copies, running prefetches, ...) and a few counts — never from the
oracle's private fields. Most answers come from the oracle's snapshot (the observable state);
`own_locks` and `host_alloc_armed` from the oracle's public attributes, because no snapshot shows a
node's own locks or an armed fault. Hypothesis evaluates every precondition before every rule
choice, so each answer is computed once per step (`Harness` clears the memo when a step runs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from kvcert.conformance.harness.ledger import Ledger
from kvcert.conformance.harness.storage import page_order
from kvcert.refimpl import RefCache
from kvcert.spec.ops import Op
from kvcert.spec.types import Capabilities, Snapshot

_T = TypeVar("_T")


class Queries:
    """Mixed into `Harness`: every query reads the state after the last step."""

    oracle: RefCache
    ledger: Ledger
    capabilities: Capabilities
    ops: list[Op]
    _queries: dict[Any, Any]
    _queries_at: int

    def spec_snapshot(self) -> Snapshot:  # pragma: no cover - the Harness's
        raise NotImplementedError

    def _memo(self, name: Any, build: Callable[[], _T]) -> _T:
        if self._queries_at != len(self.ops):
            self._queries.clear()
            self._queries_at = len(self.ops)
        if name not in self._queries:
            self._queries[name] = build()
        got: _T = self._queries[name]
        return got

    # ------------------------------------------------------------------ positions a trace can name

    def live_handles(self) -> list[int]:
        """Handles whose node is still in the oracle's tree."""
        return self._memo("live", lambda: [k for k, (_, o) in self.ledger.handles.items() if o in self.oracle.nodes])

    def lockable_handles(self) -> list[int]:
        """Live handles the backend's callers may lock: all, or only those on the device (`locks_host_only`)."""

        def build() -> list[int]:
            live = self.live_handles()
            if self.capabilities.locks_host_only:
                return live
            return [k for k in live if self.oracle.nodes[self.ledger.handles[k][1]].slots is not None]

        return self._memo("lockable", build)

    def locked_handles(self) -> list[int]:
        """Handles whose node holds at least one lock of its own.

        Two handles may name one node; the first one stands for it, so quiescing unlocks each node once per lock.
        """

        def build() -> list[int]:
            seen: set[int] = set()
            out = []
            held = self.request_locks()
            for k, (_, o) in self.ledger.handles.items():
                if o in self.oracle.nodes and self.oracle.nodes[o].own_locks > held[o] and o not in seen:
                    seen.add(o)
                    out.append(k)
            return out

        return self._memo("locked", build)

    def open_copies(self) -> list[int]:
        """Trace indices of copies the copy engine has not finished yet."""

        def build() -> list[int]:
            unfinished = {c.id for c in self.spec_snapshot().pending if not c.finished}
            return [k for k, (_, o) in enumerate(self.ledger.copies) if o in unfinished]

        return self._memo("open copies", build)

    def moving_edges(self) -> list[tuple[str, Any, tuple[int, ...], int]]:
        """(kind, namespace, path, edge length) of every node an unfinished copy moves, in issue order: what a
        split under a copy cuts (SPEC.md §9.8)."""

        def build() -> list[tuple[str, Any, tuple[int, ...], int]]:
            snap = self.spec_snapshot()
            nodes = snap.by_id()
            out = []
            for c in snap.pending:
                if not c.finished:
                    for nid in c.nodes:
                        if nid in nodes:
                            ns, path = snap.path_of(nid)
                            out.append((c.kind, ns, path, len(nodes[nid].key)))
            return out

        return self._memo("moving edges", build)

    def finished_copies(self) -> list[int]:
        """Trace indices of copies already finished (completing one again is bad input)."""
        pending_open = set(self.open_copies())
        return self._memo(
            "finished copies", lambda: [k for k in range(len(self.ledger.copies)) if k not in pending_open]
        )

    def host_hits(self) -> list[int]:
        """Match ops whose host node is still in the tree and on the host only: load-back candidates."""

        def build() -> list[int]:
            nodes = self.spec_snapshot().by_id()
            return [k for k, (_, o) in self.ledger.host_handles.items() if o in nodes and nodes[o].slots is None]

        return self._memo("host hits", build)

    def prefetch_anchors(self) -> list[int]:
        """Match ops whose host node is still in the tree: prefetch requests."""

        def build() -> list[int]:
            nodes = self.spec_snapshot().by_id()
            return [k for k, (_, o) in self.ledger.anchors.items() if o in nodes]

        return self._memo("anchors", build)

    def open_prefetches(self) -> list[int]:
        """Trace indices of prefetches still running."""

        def build() -> list[int]:
            running = {p.id for p in self.spec_snapshot().prefetches}
            return [k for k, (_, o) in enumerate(self.ledger.prefetches) if o in running]

        return self._memo("open prefetches", build)

    def next_page_at(self, k: int) -> int:
        """Where the page prefetch `k` reads next stands among the stored pages (a `StorageFault`'s `at`); -1 if
        it is not stored. From the oracle's public prefetches and store, as a fault at that page needs."""
        oracle = self.oracle
        o = self.ledger.prefetches.id(k, 1)
        p = next((q for q in oracle.prefetches if q.id == o), None)
        store = oracle.storage
        if p is None or store is None or p.fetched >= len(p.keys):
            return -1
        keys = page_order(store)  # type: ignore[arg-type]
        key = p.keys[p.fetched]
        return keys.index(key) if key in keys else -1

    def fetchable(self) -> list[int]:
        """Running prefetches with a page left to fetch."""

        def build() -> list[int]:
            live = {p.id: p for p in self.spec_snapshot().prefetches}
            return [
                k
                for k, (_, o) in enumerate(self.ledger.prefetches)
                if o in live and not live[o].failed and live[o].fetched < live[o].requested
            ]

        return self._memo("fetchable", build)

    def open_retractions(self) -> list[int]:
        """Trace indices of retraction backups not yet restored or discarded."""

        def build() -> list[int]:
            alive = {r.id for r in self.spec_snapshot().retractions}
            return [k for k, (_, o) in enumerate(self.ledger.retractions) if o in alive]

        return self._memo("open retractions", build)

    def held_by(self, handle: int) -> tuple[list[int], list[int], int]:
        """What the request behind `handle` holds: its running prefetches, its retraction backups, its node's own locks."""
        owners = self.ledger.owners
        prefetches = [k for k in self.open_prefetches() if owners.get(("prefetch", k)) == handle]
        backups = [k for k in self.open_retractions() if owners.get(("retraction", k)) == handle]
        return prefetches, backups, self.releasable_locks(handle)

    # ------------------------------------------------------------------ counts and sessions

    def own_locks(self, handle: int) -> int:
        """Locks the request behind `handle` holds on its node itself (0 for a node no longer in the tree)."""
        pairs = self.ledger.handles
        node = self.oracle.nodes.get(pairs[handle][1]) if handle in pairs else None
        return node.own_locks if node is not None else 0

    def releasable_locks(self, handle: int) -> int:
        """`own_locks` but those running requests hold there (theirs to drop when they finish)."""
        pairs = self.ledger.handles
        return self.own_locks(handle) - (self.request_locks()[pairs[handle][1]] if handle in pairs else 0)

    def running_requests(self) -> list[int]:
        """Requests started and not finished (SPEC.md §4.8), by their `Start` position."""
        return [k for k, (_, o) in self.ledger.running.items() if o is not None]

    def request_locks(self) -> Counter[int]:
        """Oracle node id -> locks running requests hold on it: theirs to drop, not the `unlock` rule's."""
        return self._memo("request locks", lambda: Counter(o.node for _, o in self.ledger.running.values() if o))

    def free_tokens(self) -> int:
        """Free device slots."""
        return len(self.spec_snapshot().free_slots)

    def evictable_tokens(self) -> int:
        """Device tokens eviction could free now."""
        return self.spec_snapshot().evictable_size

    def tier_tokens(self) -> tuple[int, int, int]:
        """Device tokens eviction could free now, per tier (UNUSED, LOW_REF, HIGH_REF)."""
        return self.spec_snapshot().tier_evictable or (0, 0, 0)

    def sessions(self) -> list[str]:
        """Registered session ids, in registration order."""
        return [x.id for x in self.spec_snapshot().sessions]

    def holding_sessions(self) -> list[str]:
        """Registered sessions whose path holds a node (a deletion can leave one at the root, holding nothing)."""
        snap = self.spec_snapshot()
        return [x.id for x in snap.sessions if x.node != snap.root]

    def high_sessions(self) -> list[str]:
        """Registered sessions of high priority."""
        return [x.id for x in self.spec_snapshot().sessions if x.high]

    def any_demoted(self) -> bool:
        """Whether host pressure demoted a high-priority session (SPEC.md §11.4)."""
        return any(x.demoted for x in self.spec_snapshot().sessions)

    def session_handles(self, session: str) -> list[int]:
        """Live handles of the node `session` holds (a fork registers a second session there)."""
        node = next(x.node for x in self.spec_snapshot().sessions if x.id == session)
        return [k for k in self.live_handles() if self.ledger.handles[k][1] == node]

    def continuations(self, session: str) -> list[int]:
        """Live handles at or below the node `session` holds: where its next turn registers it again."""
        node = next(x.node for x in self.spec_snapshot().sessions if x.id == session)

        def below(o: int) -> bool:
            cur = self.oracle.nodes.get(o)
            while cur is not None:
                if cur.id == node:
                    return True
                cur = cur.parent
            return False

        return [k for k in self.live_handles() if below(self.ledger.handles[k][1])]

    def retraction_tokens(self, k: int) -> int:
        """Tokens the k-th retraction backup holds."""
        backup = self.ledger.retractions[k][1]
        return next(r.tokens for r in self.spec_snapshot().retractions if r.id == backup)

    def host_alloc_armed(self) -> bool:
        """Whether a host-allocation fault is armed (the next host allocation fails)."""
        return bool(self.oracle.armed_faults.get("host_alloc"))
