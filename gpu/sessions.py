"""Sessions and ref tiers (SPEC.md §11): the registry, ref counts along paths, demotion under host pressure.

A session holds the path from the root to its node. Each node counts the high and low sessions
whose path holds it (`Node.high_ref`, `Node.low_ref`), keeps `Node.tier = tier_of(high_ref,
low_ref)` with them (the hot path reads one int) and indexes the sessions ending at it
(`Node.ending`). A session call walks one path (O(depth)), moving the tier counters and
re-ranking each node through the tree's refresh hook; nothing else on the hot path touches
refs: a split copies three ints, and a deletion hands the sessions ending at the node to its
surviving ancestor (`hand_over`).

`Sessions` needs three things of its tree (`RefTree`): the root, the per-tier evictable-token
counters `held_sizes` it keeps exact when a counted node changes tier, and `refresh`, looked up
on every call (a test may wrap it to count). The tree imports this module, not the reverse.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Optional, Protocol

from kvcert.gpu.node import Node, Session
from kvcert.spec.types import HIGH_REF, LOW_REF, UnknownSession, tier_of


class RefTree(Protocol):
    """What session calls touch of the tree."""

    root: Node
    held_sizes: list[int]
    """Device tokens of unlocked nodes by tier (index 0 unused: UNUSED's is the rest of `evictable_size`)."""
    refresh: Callable[[Node], None]


def hand_over(n: Node, heir: Node) -> None:
    """`n` leaves the tree: the sessions ending at it end at `heir`, its deepest surviving ancestor.

    Eviction deletes leaves only, so `n` is the end of every path that holds it: no other node's
    refs change, and `heir` already counts those sessions (SPEC.md §11.1). O(sessions ending at `n`).
    """
    if not n.ending:
        return
    into = heir.ending
    if into is None:
        into = heir.ending = {}
    for sid, session in n.ending.items():
        session.node = heir
        into[sid] = session
    n.ending = None


class Sessions:
    """The registered sessions of one tree, in registration order, and the demotions in force."""

    def __init__(self, tree: RefTree, high_threshold: int, demote: str = "idle_fewest") -> None:
        if demote not in ("idle_fewest", "queued"):
            raise ValueError(f"demote must be idle_fewest or queued, got {demote!r}")
        self.tree = tree
        self.high_threshold = high_threshold
        self.demote = demote
        """DEMOTE's order (SPEC.md §6.1): "idle_fewest", an idle high session with the fewest tokens on its path
        (§11.4); "queued", the RefAware fork's queue: every high session joins it when registered, raised or
        restored, keyed by its tokens then, and host pressure demotes the first still high, idle or not."""
        self._queue: list[tuple[int, str]] = []
        self._queued: set[str] = set()
        self.sessions: dict[str, Session] = {}
        """Registered sessions in registration order (a re-registration moves one to the end)."""
        self._next_seq = 0
        self.demotions: OrderedDict[str, None] = OrderedDict()
        """Sessions adaptive demotion demoted, latest last (a session demoted again moves to the end)."""
        self._deadlines: list[tuple[int, int, str]] = []
        """(deadline, seq, session) of retentions, earliest first; an entry whose session has moved on is stale."""

    def tier_evictable(self, evictable_size: int) -> tuple[int, int, int]:
        """Device tokens of unlocked nodes per tier (UNUSED, LOW_REF, HIGH_REF), in O(1) (SPEC.md §11.2)."""
        held = self.tree.held_sizes
        low, high = held[LOW_REF], held[HIGH_REF]
        return (evictable_size - low - high, low, high)

    def shift(self, node: Node, d_high: int, d_low: int) -> None:
        """Add `d_high` / `d_low` to the refs of every node from `node` up to the root, keeping the
        tier counters exact and re-ranking each node (a candidate pushes its new entry). O(depth)."""
        tree = self.tree
        cur: Optional[Node] = node
        root, held = tree.root, tree.held_sizes
        while cur is not None and cur is not root:
            cur.high_ref += d_high
            cur.low_ref += d_low
            old, new = cur.tier, tier_of(cur.high_ref, cur.low_ref)
            if new != old:
                cur.tier = new
                if cur.slots is not None and cur.lock_ref == 0:  # counted evictable: it changes tier
                    if old:
                        held[old] -= cur.size
                    if new:
                        held[new] += cur.size
            tree.refresh(cur)
            cur = cur.parent

    def _retain_path(self, node: Node, deadline: int, d: int) -> None:
        """Count `deadline` in (d = +1) or out of (d = -1) the retentions of every node from `node` up to the root,
        re-ranking each (SPEC.md §11.7: a node ranks by the earliest deadline of the retentions holding it).
        O(depth)."""
        tree = self.tree
        cur: Optional[Node] = node
        while cur is not None and cur is not tree.root:
            held = cur.retained
            if held is None:
                held = cur.retained = {}
            left = held.get(deadline, 0) + d
            if left:
                held[deadline] = left
            else:
                del held[deadline]
                if not held:
                    cur.retained = None
            tree.refresh(cur)
            cur = cur.parent

    def retain(self, session: object, ttl: int, now: int) -> None:
        """The session's path is retained until `now + ttl` (a checked ttl; a new deadline replaces the old)."""
        s = self.get(session)
        self._unretain(s)
        s.until = now + ttl
        self._retain_path(s.node, s.until, +1)
        heapq.heappush(self._deadlines, (s.until, s.seq, s.id))

    def retain_waiting(self, session: object, now: int) -> None:
        """The session's next turn waits: a live retention stops running out and ranks as back at `now` (its deadline
        entry goes stale), until the turn registers, a release or a new `retain`; a retention run out stays out."""
        s = self.get(session)
        if s.until is not None and not s.waiting:
            self._retain_path(s.node, s.until, -1)
            s.until, s.waiting = now, True
            self._retain_path(s.node, now, +1)

    def expire(self, now: int) -> None:
        """Retentions whose deadline `now` has reached end (the clock moved). O(log n) per retention."""
        while self._deadlines and self._deadlines[0][0] <= now:
            until, seq, sid = heapq.heappop(self._deadlines)
            s = self.sessions.get(sid)
            if s is not None and s.seq == seq and s.until == until and not s.waiting:
                self._unretain(s)

    def _unretain(self, s: Session) -> None:
        if s.until is not None:
            self._retain_path(s.node, s.until, -1)
            s.until, s.waiting = None, False

    def _hold(self, session: Session, sign: int) -> None:
        """Add (+1) or remove (-1) the session's refs along its path."""
        if session.high:
            self.shift(session.node, sign, 0)
        else:
            self.shift(session.node, 0, sign)

    def _set_high(self, session: Session, high: bool) -> None:
        """The session counts as high (or low) now: its path's refs move between the two counts."""
        if session.high != high:
            session.high = high
            d = 1 if high else -1
            self.shift(session.node, d, -d)

    def get(self, session: object) -> Session:
        """The registered session `session`; `UnknownSession` otherwise."""
        found = self.sessions.get(session) if isinstance(session, str) else None
        if found is None:
            raise UnknownSession(f"no registered session {session!r}")
        return found

    def register(self, session: str, node: Node, priority: int) -> None:
        """`session` (checked) holds the path to `node` at `priority`; again: moved, last in order, undemoted."""
        old = self.sessions.pop(session, None)
        if old is not None:
            self._unretain(old)  # its next turn came: the pause it declared is over
            self._hold(old, -1)
            if old.node.ending is not None:
                old.node.ending.pop(session, None)
        s = Session(session, node, priority, self._next_seq, priority >= self.high_threshold)
        self._next_seq += 1
        self.sessions[session] = s
        if node.ending is None:
            node.ending = {}
        node.ending[session] = s
        self._hold(s, +1)
        self._enqueue(s)

    def update(self, session: object, priority: int) -> None:
        """A new (checked) priority for the session's path; clears an adaptive demotion (SPEC.md §11.4)."""
        s = self.get(session)
        s.priority, s.demoted = priority, False
        self._set_high(s, priority >= self.high_threshold)
        self._enqueue(s)

    def release(self, session: object) -> None:
        """The session holds nothing any more; a high one restores the latest demotion still in force."""
        s = self.get(session)
        self._unretain(s)
        self._hold(s, -1)
        del self.sessions[s.id]
        if s.node.ending is not None:
            s.node.ending.pop(s.id, None)
        if s.high:
            while self.demotions:
                back = self.sessions.get(self.demotions.popitem(last=True)[0])
                if back is not None and back.demoted:
                    back.demoted = False
                    self._set_high(back, back.priority >= self.high_threshold)
                    self._enqueue(back)
                    break

    def demote_idle(self) -> bool:
        """Host pressure (SPEC.md §11.4): demote the idle high session with the fewest tokens on its path,
        ties to the earliest (re-)registered (under the "queued" order: the queue's first session still high,
        idle or not), an unretained one while there is one, else the retained one back last (§11.7); False if there is
        none.

        This scans the sessions (O(sessions)): it runs only under host pressure, once host eviction has
        run out of UNUSED and LOW_REF leaves. A session is idle when its path holds a host-only node; a
        device node's parent is on the device (INV-HOST-2), so that is when its own node is host only.
        A node's `end` is the tokens on its path.
        """
        victim: Optional[Session] = None
        if self.demote == "queued":
            victim = self._first_queued()
            if victim is not None and victim.until is not None:  # retained: an unretained one first (§11.7)
                victim = self._first_unretained() or self._latest_retained()
        else:
            for s in self.sessions.values():
                if s.high and s.node.slots is None:
                    key = (s.until is not None, -(s.until or 0), s.node.end, s.seq)
                    if victim is None or key < (victim.until is not None, -(victim.until or 0), victim.node.end,
                                                victim.seq):  # fmt: skip
                        victim = s
        if victim is None:
            return False
        victim.demoted = True
        self._set_high(victim, False)
        self.demotions.pop(victim.id, None)
        self.demotions[victim.id] = None
        return True

    def _enqueue(self, s: Session) -> None:
        """Under the "queued" order, a session high now joins the queue once (its tokens now are its key)."""
        if self.demote == "queued" and s.high and s.id not in self._queued:
            self._queued.add(s.id)
            heapq.heappush(self._queue, (s.node.end, s.id))

    def _first_unretained(self) -> Optional[Session]:
        """The queue's first session still high and not retained; the queue left as it is (O(n log n): under host
        pressure only, when the first is retained)."""
        for _, sid in sorted(self._queue):
            s = self.sessions.get(sid)
            if s is not None and s.high and s.until is None:
                return s
        return None

    def _latest_retained(self) -> Optional[Session]:
        """Of the queue's sessions still high (all retained), the one back last: the latest deadline, ties in queue
        order."""
        best: Optional[Session] = None
        for _, sid in sorted(self._queue):
            s = self.sessions.get(sid)
            if s is not None and s.high and (best is None or (s.until or 0) > (best.until or 0)):
                best = s
        return best

    def _first_queued(self) -> Optional[Session]:
        """The queue's first session still high; the stale entries before it leave the queue."""
        while self._queue:
            sid = self._queue[0][1]
            s = self.sessions.get(sid)
            if s is not None and s.high:
                return s
            heapq.heappop(self._queue)
            self._queued.discard(sid)
        return None
