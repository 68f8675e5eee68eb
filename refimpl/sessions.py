"""Sessions and priority tiers (SPEC.md §11): refs along paths, demotion and restore, admission plans."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Optional

from kvcert.refimpl.records import (
    Node,
    Session,
    _is_count,
    _is_int,
    _retraction_picks,
)
from kvcert.refimpl.tree import Tree
from kvcert.spec import pages
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    InvalidPlan,
    Running,
    UnknownSession,
    check_priority,
    check_session,
    check_ttl,
)


class SessionTier(Tree):
    """Session refs, tiers, demotion under host pressure, admission plans."""

    def _is_high(self, session: Session) -> bool:
        return session.priority >= self.threshold and not session.demoted

    def _hold(self, session: Session, sign: int) -> None:
        """Add (+1) or remove (-1) the session's refs along its path, keeping the tier counters exact."""
        high = self._is_high(session)
        for node in self._path_to_root(session.node):
            if node.slots is not None:
                self._account(node, -1)
            if high:
                node.high_ref += sign
            else:
                node.low_ref += sign
            if node.slots is not None:
                self._account(node, +1)

    def retained(self, session: Session) -> bool:
        """Its retention is live (SPEC.md §11.7): a deadline still ahead of the clock, or a waiting turn holding it."""
        return session.until is not None and (session.waiting or self.now < session.until)

    def retained_deadline(self, node: Node) -> Optional[int]:
        """The earliest deadline of the live retentions whose path holds `node`; None if none holds it."""
        held = [s.until for s in self.sessions.values() if self.retained(s) and node in self._path_to_root(s.node)]
        return min(held) if held else None  # type: ignore[type-var]

    def _deadline(self, session: Session) -> int:
        """Its live retention's deadline, 0 when it has none: a retention that ran out orders nothing (§11.7)."""
        return session.until if session.until is not None and self.retained(session) else 0

    def retain(self, session_id: str, ttl: int) -> None:
        """The session will come back: its path is retained for `ttl` time units (SPEC.md §11.7)."""
        check_ttl(ttl)
        session = self._session(session_id)
        session.until, session.waiting = self.now + ttl, False

    def retain_waiting(self, session_id: str) -> None:
        """The session's next turn has arrived and waits: a live retention stops running out and ranks as back now,
        until the turn registers (SPEC.md §11.7, the engine's half); a retention already run out stays out."""
        session = self._session(session_id)
        if self.retained(session) and not session.waiting:
            session.until, session.waiting = self.now, True

    def _session(self, session_id: object) -> Session:
        found = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if found is None:
            raise UnknownSession(f"no registered session {session_id!r}")
        return found

    def _sessions_leave(self, node: Node) -> None:
        """`node` left the tree: sessions that ended there now end at its parent (SPEC.md §11.1)."""
        for session in self.sessions.values():
            if session.node is node:
                session.node = node.parent or self.root

    def register_ref(self, session_id: str, node_id: int, priority: int) -> None:
        """The session holds the path to `node_id` at `priority` (again: moved there, undemoted)."""
        check_session(session_id)
        node = self._live(node_id)
        check_priority(priority)
        old = self.sessions.pop(session_id, None)
        if old is not None:
            was_high = self._is_high(old)
            self._hold(old, -1)
            demote = self.decided.demote
            if was_high and (demote.restore_pick is not None or demote.restore_on_move):  # DEMOTE: a move may count
                self._restore_one(self._restore_pick(self._still_demoted()))  # as the high session's release
        session = Session(session_id, node, priority, self._next_seq)
        self._next_seq += 1
        self.sessions[session_id] = session
        self._hold(session, +1)
        self._queue(session)

    def update_ref(self, session_id: str, priority: int) -> None:
        """A new priority for the session's path; clears an adaptive demotion."""
        check_priority(priority)
        session = self._session(session_id)
        self._hold(session, -1)
        session.priority, session.demoted = priority, False
        self._hold(session, +1)
        self._queue(session)

    def release_ref(self, session_id: str) -> None:
        """The session holds nothing any more; a high one gives its room back to a demoted one."""
        session = self._session(session_id)
        was_high = self._is_high(session)
        self._hold(session, -1)
        del self.sessions[session_id]
        if not was_high:
            return
        self._restore_one(self._restore_pick(self._still_demoted()))

    def _restore_pick(self, demoted: list[str]) -> Optional[str]:
        """The demoted session high-priority room goes back to: the decided pick, else by `Demote.restore`."""
        demote = self.decided.demote
        if demote.restore_pick is not None:
            return demote.restore_pick(demoted)
        if not demoted:
            return None
        return demoted[-1] if demote.restore == "latest" else demoted[0]

    def _still_demoted(self) -> list[str]:
        """Sessions demoted and not since restored, re-registered or released, earliest demoted first."""
        return [d for d in self.demotions if d in self.sessions and self.sessions[d].demoted]

    def _restore_one(self, pick: Optional[str]) -> None:
        """High-priority room came back: `pick` (a demoted session, or None) is high again (SPEC.md §11.4)."""
        if pick is None:
            return
        back = self.sessions[pick]
        self.demotions = [d for d in self._still_demoted() if d != pick]
        self._hold(back, -1)
        back.demoted = False
        self._hold(back, +1)
        self._queue(back)

    def _queue(self, session: Session) -> None:
        """Under the "queued" demotion order, a session high now joins the queue, unless it is in it already."""
        if self.decided.demote.order != "queued" or not self._is_high(session) or session.id in self.queued:
            return
        self.queued.add(session.id)
        heapq.heappush(self.idle_queue, (len(self._full_path(session.node)), session.id))

    def _latest_retained(self) -> Session:
        """Of the queue's sessions still high (all retained), the one back last: the latest deadline, ties in queue
        order."""
        queued = [self.sessions[sid] for _, sid in sorted(self.idle_queue) if sid in self.sessions]
        return max((s for s in queued if self._is_high(s)), key=self._deadline)

    def _queued_high(self, spare_retained: bool = False) -> Optional[Session]:
        """The queue's first session that is still high; the stale entries before it leave the queue. With
        `spare_retained`, the first still high and not retained (§11.7), the queue left as it is."""
        if spare_retained:
            for _, sid in sorted(self.idle_queue):
                found = self.sessions.get(sid)
                if found is not None and self._is_high(found) and not self.retained(found):
                    return found
            return None
        while self.idle_queue:
            _, sid = self.idle_queue[0]
            session = self.sessions.get(sid)
            if session is not None and self._is_high(session):
                return session
            heapq.heappop(self.idle_queue)
            self.queued.discard(sid)
        return None

    def _demote_idle_session(self) -> bool:
        """Host pressure: demote the idle high session with the fewest tokens (SPEC.md §11.4), an unretained one
        while DEMOTE's order has one, else the retained one back last (§11.7); False if none."""
        high = sorted((s for s in self.sessions.values() if self._is_high(s)), key=lambda s: s.seq)
        demote = self.decided.demote
        if demote.order == "queued":
            first = self._queued_high()
            if first is not None and self.retained(first):
                first = self._queued_high(spare_retained=True) or first
            candidates = [] if first is None else [first]
        else:
            candidates = [s for s in high if any(n.slots is None for n in self._path_to_root(s.node))]
        spare = [s for s in candidates if not self.retained(s)]
        offered = [s for s in high if not self.retained(s)] if spare else high
        pick = demote.pick([s.id for s in offered]) if demote.pick is not None else None
        if pick is not None:
            victim = self.sessions[pick]
        elif not candidates:
            return False
        elif spare or demote.order != "queued":  # among retained ones, the latest back first (§11.7)
            victim = min(spare or candidates, key=lambda s: (-self._deadline(s), len(self._full_path(s.node)), s.seq))
        else:
            victim = self._latest_retained()
        self._hold(victim, -1)
        victim.demoted = True
        self._hold(victim, +1)
        self.demotions = [d for d in self.demotions if d != victim.id] + [victim.id]
        return True

    # ------------------------------------------------------------------ admission (SPEC.md §11.5, §11.6)

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        """What admitting `tokens` new tokens at `priority` takes: evict in scope, retract, or keep fewer layers."""
        if not _is_count(tokens):
            raise InvalidPlan(f"a request needs a non-negative int of tokens, got {tokens!r}")
        check_priority(priority)
        if not isinstance(running, Sequence) or not all(
            isinstance(r, Running) and _is_count(r.id) and _is_count(r.tokens) and _is_int(r.priority) for r in running
        ):
            raise InvalidPlan(f"running requests must be Running(id, priority, tokens) of ints, got {running!r}")
        if len({r.id for r in running}) != len(running):
            raise InvalidPlan("running request ids repeat")
        if profile is not None and not (
            isinstance(profile, AdmissionProfile)
            and all(_is_count(v) for v in (profile.load, profile.store, profile.step, profile.target))
        ):
            raise InvalidPlan(f"a profile holds non-negative ints, got {profile!r}")
        high = priority >= self.threshold
        free = len(self.pool.free_list)
        in_scope = self.tier_evictable[0] + self.tier_evictable[1] + (self.tier_evictable[2] if high else 0)
        host_room = len(self.host.free_list) if self.host is not None and self.backs_up_retractions else 0
        layers_all = self.kv_layers
        low = [r for r in running if r.priority < self.threshold]  # a high-priority request is never retracted
        for layers in range(layers_all, 0, -1):
            if layers < layers_all and (
                profile is None
                or profile.step + (layers_all - layers) * tokens * (profile.load + profile.store) > profile.target
            ):
                break  # fewer layers stream more: past the first refusal none is admitted
            need = pages.page_ceil(-(-tokens * layers // layers_all), self.page_size)
            if free + in_scope >= need:
                return AdmissionPlan(True, max(0, need - free), high, (), (), layers, need)
            if not high:
                continue
            picks = _retraction_picks(low, need - free - in_scope)
            if picks is None:
                continue
            keep = []
            for r in picks:
                size = pages.page_ceil(r.tokens, self.page_size)
                keep.append(0 < size <= host_room)
                host_room -= size if keep[-1] else 0
            return AdmissionPlan(True, in_scope, True, tuple(r.id for r in picks), tuple(keep), layers, need)
        return AdmissionPlan(False, allow_high=high)
