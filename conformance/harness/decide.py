"""From a step's two snapshots to what the oracle follows: the `Decisions` of one attempt, and the attempts.

`conformance.harness.steering` reads the backend's choices off its snapshots (victims, dropped backups,
demotions, the host room it freed) as choosers and values. Here they become one `kvcert.spec.decisions.Decisions`
per attempt, handed to the oracle for the one operation (`RefCache.deciding`), and the victims `op` itself
evicts get their chooser and judge (`victims`). `attempts` is the one search the harness still makes, and says
why it is needed; a backend that reports its choices leaves it one eviction order to try.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Optional

from kvcert.conformance.harness.steering import Steering
from kvcert.refimpl import RefCache
from kvcert.spec import contracts
from kvcert.spec.decisions import Chooser, Decisions, LoadLock, LoadRoom, Retry
from kvcert.spec.invariants import Violation
from kvcert.spec.ops import Admit, Evict, EvictHost, Fetch, LoadBack, Op, Prefetch, ReleaseRef, Retract
from kvcert.spec.profiles import DEMOTE, FETCH, LOAD_LOCK, LOAD_ROOM, RANK, RECLAIM, RETRY, ROOM, THROTTLE, Profile
from kvcert.spec.types import Snapshot


@dataclass(frozen=True)
class Attempt:
    """One candidate for what the backend's snapshots do not show (`attempts`)."""

    order: Optional[tuple[contracts.Path, ...]] = None
    """The order of the host victims (RECLAIM under the core) or of write-back's dropped backups; None: rank order."""
    skipped_first: bool = False
    """A write-back eviction tried the nodes it skipped before the victims it evicted (SPEC.md §9.3)."""
    tail: bool = False
    """The largest victim went last (an eviction stops once it has freed enough)."""
    room: Optional[str] = None
    """ROOM: "freed" (ask for what the backend's host evictions freed), "whole" or "shortfall"; LOAD_ROOM on a
    load-back: "whole" (its whole size), "low" (its shortfall in a low requester's scope) or "low-whole"."""
    admit: Optional[bool] = None
    """THROTTLE: a prefetch made while others run admitted (True) or declined (False); None: SGLang's rule."""
    publish: Optional[bool] = None
    """FETCH: this fetch's progress published (True) or held (False); None: per batch."""


def attempts(
    steering: Steering, op: Op, got: Any, profile: Profile, priority_refs: bool, prefetching: bool
) -> list[Attempt]:
    """What the harness tries, in order, until the oracle reaches the backend's state: the one search.

    It exists because a backend that does not report its choices shows only its state before and after a
    step, and where an order decides the outcome (an eviction stops once it has freed enough; a write-back
    victim's backup needs the host room its predecessors made) several orders may or may not reach that
    state. A backend that reports its choices (`Snapshot.choices`) is followed in its own order: one
    eviction order to try. The host room a prefetch, a backup or a load asked for, and whether a fetch
    published or a prefetch was declined, are no eviction order: the snapshots do not show them either
    (`prefetching`: other prefetches run, so a decline was allowed)."""
    pinned = profile.pinned
    orders = steering.reclaim_orders() if pinned(RECLAIM) else steering.host_orders()
    tries = [Attempt(order=order) for order in orders]
    if steering.skippable(op):
        tries += [replace(a, skipped_first=True) for a in tries]
    if not pinned(RANK) and steering.moved():  # the backend's victims in rank order, else the largest last
        tries += [replace(a, tail=True) for a in tries]
    rooms: list[Optional[str]] = [None]  # a room-making step: what the backend freed, or else (ROOM)
    if not pinned(ROOM) and isinstance(op, (Prefetch, Retract)):
        rooms = ["freed", "whole", "shortfall"] if steering.demoted() else ["freed"]
    elif not pinned(ROOM) and not isinstance(op, EvictHost) and steering.host_freed():
        rooms = [None, "freed"]  # a backup may have made more host room than its shortfall
    if not pinned(LOAD_ROOM) and isinstance(op, LoadBack):  # its device room: the whole size, a low scope
        rooms = [*rooms, "whole", *(["low", "low-whole"] if priority_refs else [])]
    admits: list[Optional[bool]] = [None]
    if not pinned(THROTTLE) and isinstance(op, Prefetch) and prefetching:
        # Declined: by SGLang's rule, or admitted and then short of storage or host room (its lookup made, an
        # armed fault spent), or declined for admission; the last is what a disagreement is reported against.
        admits = [True] if got else [None, True, False]
    publishes: list[Optional[bool]] = [True, False] if not pinned(FETCH) and isinstance(op, Fetch) else [None]
    return [
        replace(a, room=room, admit=admit, publish=shares)
        for admit in admits
        for shares in publishes
        for room in rooms
        for a in tries
    ]


def decide(steering: Steering, oracle: RefCache, op: Op, attempt: Attempt, profile: Profile, gave_up: bool) -> Decisions:
    """The decisions that lead the oracle to the backend's choice under `attempt`, for `op`: the oracle's own
    (its profile's) wherever the profile pins the choice. `gave_up`: the copy `op` completes ended on the
    backend (RETRY)."""
    pinned, own = profile.pinned, oracle.own
    room, load_room = own.room, own.load_room
    if isinstance(op, LoadBack) and attempt.room in ("whole", "low", "low-whole"):
        scope = (True, False) if attempt.room.startswith("low") else (True, True)
        load_room = LoadRoom(scope, "whole" if attempt.room.endswith("whole") else "shortfall")
    elif attempt.room == "freed":
        room = replace(own.room, ask=steering.host_freed())
    elif attempt.room == "whole" or attempt.room == "shortfall":  # a demotion: its host eviction ran dry early
        room = replace(own.room, prefetch="whole" if attempt.room == "whole" else "shortfall")
    return replace(
        own,
        rank=replace(own.rank, pick=steering.follow(oracle, tail=attempt.tail)),
        reclaim=replace(
            own.reclaim,
            drop=steering.reclaimed(oracle, attempt.order),
            host=None if pinned(RECLAIM) else steering.follow_host(oracle, attempt.tail, attempt.order),
        ),
        retry=own.retry if pinned(RETRY) else Retry("invalidate" if gave_up else "retry"),
        room=room,
        load_room=load_room,
        load_lock=own.load_lock if pinned(LOAD_LOCK) else LoadLock(steering.load_host_locked()),
        demote=own.demote
        if pinned(DEMOTE)
        else replace(own.demote, pick=steering.demote_pick(), restore_pick=steering.restore_pick(isinstance(op, ReleaseRef))),
        fetch=replace(own.fetch, publish=attempt.publish),
        throttle=replace(own.throttle, admit=attempt.admit),
    )


def victims(
    steering: Steering,
    oracle: RefCache,
    spec: Callable[[], Snapshot],
    op: Op,
    got: Any,
    attempt: Attempt,
    profile: Profile,
    out: list[Violation],
) -> tuple[Optional[Chooser], Optional[Callable[[Snapshot], list[Violation]]]]:
    """The chooser of the victims `op` itself evicts (RANK) and, for Evict / EvictHost, the judge of the
    oracle's replay: a witness over ranks where the profile pins RANK, else the backend's victims seated
    (`witness`, `seat`). `spec` gives the oracle's snapshot before the op, taken only for the witness; the bounds
    go to `out`."""
    if isinstance(op, (Evict, EvictHost)) and isinstance(got, int):
        if profile.pinned(RANK):
            return steering.witness(oracle, spec(), op, got, out, attempt.skipped_first)
        return steering.seat(oracle, op, got, out, attempt.skipped_first, attempt.tail, attempt.order)
    if isinstance(op, Admit):  # the plan's scoped eviction: among tied leaves, the backend's victims
        return steering.follow(oracle, tail=attempt.tail), None
    return None, None
