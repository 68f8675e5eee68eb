"""Race windows: the in-flight states real cache races live in, and whether a step entered one.

A bug that needs a copy to overlap a split, or a lock to land before a load's ack, is found only by
a run that puts the cache there; an op mix cannot say whether it did. Each window here is a
predicate on one step's backend snapshots (what anyone can observe, no oracle), and the machine
counts the steps that entered each one per cell, into the certificate (`RunStats.ops`,
"window:<name>"): a cell that never entered a window did not test the races that live in it.
"""

from __future__ import annotations

from typing import Any, Optional

from kvcert.spec.contracts import newly_demoted, retained_nodes
from kvcert.spec.ops import (
    Checkpoint,
    Evict,
    EvictHost,
    Finish,
    Insert,
    Lock,
    Op,
    RegisterRef,
    ReleaseRef,
    Start,
    UpdateRef,
)
from kvcert.spec.types import Snapshot

WINDOWS = {
    "split-under-write": "a node a device-to-host copy is still moving is split",
    "split-under-load": "a node a host-to-device load is still moving is split",
    "split-under-store": "a node a host-to-storage copy is still moving is split",
    "split-locked": "a node a lock protects is split (a running request's path, another's insert)",
    "host-evict-in-flight": "host eviction while a copy is in flight",
    "lock-before-load-ack": "a lock taken on a path whose load has not been acknowledged",
    "lock-host-only": "a lock taken on a node that is on the host only (its device counters must not move)",
    "write-back-host-full": "write-back device eviction drops a node without a backup (the host was full)",
    "insert-over-host": "an insert puts device KV back under a host-only node",
}
"""Window name -> what it is (SPEC.md §9, §10; the names are the certificate's)."""
SHORT = {
    "split-under-write": "split/write",
    "split-under-load": "split/load",
    "split-under-store": "split/store",
    "split-locked": "split/lock",
    "host-evict-in-flight": "hevict/copy",
    "lock-before-load-ack": "lock/load",
    "lock-host-only": "lock/host",
    "write-back-host-full": "wb/full",
    "insert-over-host": "ins/host",
}
"""Column headers for the certificate's window table."""


def entered(op: Op, before: Snapshot, after: Snapshot, locked: Optional[int] = None) -> list[str]:
    """The windows `op` entered, from the backend's snapshots around it. `locked`: the node a Lock or Start
    locked (the backend's id), when known."""
    out: list[str] = []
    mine = before.by_id()
    now = after.by_id()
    moving = [c for c in before.pending if not c.finished]
    if moving or any(n.lock_ref > 0 for n in before.nodes):
        shorter = {nid for nid, n in mine.items() if nid in now and len(now[nid].key) < len(n.key)}
        if shorter:
            for c in moving:
                if shorter.intersection(c.nodes):
                    out.append(f"split-under-{c.kind}")
            if any(mine[nid].lock_ref > 0 for nid in shorter):
                out.append("split-locked")
    if moving and isinstance(op, (EvictHost, Evict)) and len(after.host_free_slots) > len(before.host_free_slots):
        out.append("host-evict-in-flight")
    if locked is not None and isinstance(op, (Lock, Start)):
        loading = {nid for c in moving if c.kind == "load" for nid in c.nodes}
        if loading and _path_meets(mine, locked, loading):
            out.append("lock-before-load-ack")
        if locked in mine and mine[locked].slots is None:
            out.append("lock-host-only")
    if isinstance(op, Evict) and before.write_policy == "write_back":
        if any(n.slots is not None and n.host_slots is None and nid not in now for nid, n in mine.items()):
            out.append("write-back-host-full")
    if isinstance(op, (Insert, Checkpoint, Finish)):
        if any(n.slots is None and nid in now and now[nid].slots is not None for nid, n in mine.items()):
            out.append("insert-over-host")
    return sorted(set(out))


EVENTS = {
    "high-session": "a session registered or updated to a priority that makes it high (SPEC.md §11.1)",
    "scoped-evict": "an eviction in a scope narrower than the full one (SPEC.md §11.3)",
    "demotion": "host pressure demoted a high session (SPEC.md §11.4)",
    "restore": "a released high session gave a demoted one its tier back (SPEC.md §11.4)",
    "move": "a registered session registered again off its own path's end (SPEC.md §11.1)",
    "retained-evict": "an eviction took a retained node's device KV, its tier's unretained ones gone (SPEC.md §11.7)",
    "retention-ends": "a retention ended with its session still registered: its deadline came, or its next turn "
    "(SPEC.md §11.7)",
    "retention-waits": "a live retention held for its session's next turn, which waits (`retain_waiting`, SPEC.md "
    "§11.7)",
}
"""§11 events the machine counts per cell ("event:<name>"), so a certificate shows they happened, not only that
their ops were sent."""


def events(op: Op, before: Snapshot, after: Snapshot) -> list[str]:
    """The §11 events `op` caused, from the backend's snapshots around it."""
    out: list[str] = []
    if isinstance(op, (RegisterRef, UpdateRef)) and any(x.id == op.session and x.high for x in after.sessions):
        out.append("high-session")
    if isinstance(op, Evict) and (op.allow_low, op.allow_high) != (True, True):
        out.append("scoped-evict")
    if newly_demoted(before, after):
        out.append("demotion")
    was = {x.id for x in before.sessions if x.demoted}
    if isinstance(op, ReleaseRef) and any(not x.demoted and x.id in was for x in after.sessions):
        out.append("restore")
    kept = retained_nodes(before)
    if kept:
        nodes_before, nodes_after = before.by_id(), after.by_id()
        gone = [i for i in kept if nodes_after.get(i) is None or nodes_after[i].slots is None]
        if any(nodes_before[i].slots is not None for i in gone):
            out.append("retained-evict")
        registered = {x.id for x in after.sessions}
        still = {x.id for x in after.sessions if x.retained_until is not None}
        if any(x.retained_until is not None and x.id in registered - still for x in before.sessions):
            out.append("retention-ends")
    waited = {x.id for x in before.sessions if x.waiting}
    if any(x.waiting and x.id not in waited for x in after.sessions):
        out.append("retention-waits")
    if isinstance(op, RegisterRef):
        old = next((x.node for x in before.sessions if x.id == op.session), None)
        new = next((x.node for x in after.sessions if x.id == op.session), None)
        if old is not None and new is not None and not _path_meets(after.by_id(), new, {old}):
            out.append("move")
    return out


def _path_meets(nodes: dict[int, Any], node: int, targets: set[int]) -> bool:
    cur: Optional[int] = node
    while cur is not None and cur in nodes:
        if cur in targets:
            return True
        cur = nodes[cur].parent
    return False
