"""`kvcert.gpu.sessions` on a hand-built path: ref counts, tier counters, the registry, demotion, hand-over."""

from __future__ import annotations

from kvcert.gpu.node import Node
from kvcert.gpu.run import EMPTY, Run
from kvcert.gpu.sessions import Sessions, hand_over
from kvcert.spec.types import HIGH_REF, LOW_REF, UNUSED, UnknownSession


class Tree:
    """What `Sessions` needs (`RefTree`): a root, the tier counters and a refresh hook (here: a log)."""

    def __init__(self) -> None:
        self.root = Node(0, None, None, EMPTY)
        self.held_sizes = [0, 0, 0]
        self.refreshed: list[int] = []
        self.refresh = lambda n: self.refreshed.append(n.id)
        self.next_id = 1

    def chain(self, *sizes: int, device: bool = True) -> list[Node]:
        """A path of nodes below the root, `sizes` tokens each, unlocked (counted evictable) when on device."""
        out, parent = [], self.root
        for size in sizes:
            n = Node(self.next_id, parent, None, Run.of_ints(range(size)))
            self.next_id += 1
            n.slots = Run.of_ints(range(size)) if device else None
            out.append(n)
            parent = n
        return out


def refs(path: list[Node]) -> list[tuple[int, int, int]]:
    return [(n.high_ref, n.low_ref, n.tier) for n in path]


def test_a_session_counts_on_its_whole_path_and_moves_the_tier_counters() -> None:
    t = Tree()
    a, b = t.chain(2, 3)
    s = Sessions(t, high_threshold=1)
    s.register("lo", b, 0)
    assert refs([a, b]) == [(0, 1, LOW_REF), (0, 1, LOW_REF)] and t.held_sizes == [0, 5, 0]
    assert t.refreshed == [b.id, a.id]  # each node of the path, once, deepest first
    s.register("hi", a, 3)
    assert refs([a, b]) == [(1, 1, HIGH_REF), (0, 1, LOW_REF)] and t.held_sizes == [0, 3, 2]
    assert s.tier_evictable(10) == (5, 3, 2)
    s.update("hi", 0)  # high -> low: the refs move between the two counts
    assert refs([a, b]) == [(0, 2, LOW_REF), (0, 1, LOW_REF)] and t.held_sizes == [0, 5, 0]
    s.release("lo")
    s.release("hi")
    assert refs([a, b]) == [(0, 0, UNUSED)] * 2 and t.held_sizes == [0, 0, 0] and not s.sessions
    assert a.ending == {} and b.ending == {}


def test_a_locked_or_host_only_node_is_in_no_tier_counter() -> None:
    t = Tree()
    (a,) = t.chain(4)
    (h,) = t.chain(4, device=False)
    a.lock_ref = 1
    s = Sessions(t, high_threshold=1)
    s.register("x", a, 2)
    s.register("y", h, 2)
    assert a.tier == h.tier == HIGH_REF and t.held_sizes == [0, 0, 0]


def test_re_registration_moves_a_session_to_the_end_and_clears_its_demotion() -> None:
    t = Tree()
    a, b = t.chain(1, 1)
    s = Sessions(t, high_threshold=1)
    s.register("a", a, 1)
    s.register("b", b, 1)
    s.register("a", b, 0)
    assert list(s.sessions) == ["b", "a"] and s.sessions["a"].seq == 2
    assert refs([a, b]) == [(1, 1, HIGH_REF), (1, 1, HIGH_REF)] and a.ending == {}
    try:
        s.update("nope", 1)
    except UnknownSession:
        pass
    else:
        raise AssertionError("an unknown session must raise")


def test_host_pressure_demotes_the_shortest_earliest_idle_session_and_a_release_restores() -> None:
    t = Tree()
    short = t.chain(2, device=False)[-1]
    long = t.chain(2, 3, device=False)[-1]
    busy = t.chain(1)[-1]  # on the device: not idle
    s = Sessions(t, high_threshold=1)
    s.register("long", long, 1)
    s.register("short", short, 1)
    s.register("short2", short, 1)
    s.register("busy", busy, 1)
    assert s.demote_idle() and s.sessions["short"].demoted  # fewest tokens, then earliest
    assert s.demote_idle() and s.sessions["short2"].demoted
    assert s.demote_idle() and s.sessions["long"].demoted
    assert not s.demote_idle() and list(s.demotions) == ["short", "short2", "long"]
    assert short.high_ref == 0 and short.low_ref == 2 and short.tier == LOW_REF
    s.release("busy")  # a high session ends: the latest demotion still in force is restored
    assert not s.sessions["long"].demoted and s.sessions["long"].high and list(s.demotions) == ["short", "short2"]


def test_hand_over_moves_the_sessions_to_the_heir() -> None:
    t = Tree()
    a, b = t.chain(1, 1)
    s = Sessions(t, high_threshold=1)
    s.register("x", b, 0)
    s.register("y", a, 0)
    hand_over(b, a)
    assert b.ending is None and set(a.ending or {}) == {"x", "y"} and s.sessions["x"].node is a
    hand_over(b, a)  # nothing ends there any more: a no-op


def test_the_queued_order_demotes_the_first_queued_high_session_idle_or_not() -> None:
    """DEMOTE "queued" (the RefAware fork's order): a high session joins the queue at its registration, keyed by its
    tokens then; host pressure demotes the queue's first session still high, even one whose KV is all on the device,
    which SGLang's idle-fewest order never takes."""
    t = Tree()
    (resident,) = t.chain(2)  # on the device: not idle
    far = Tree.chain(t, 5, device=False)[0]  # host only: idle
    for order, expect in (("idle_fewest", "far"), ("queued", "near")):
        for n in (resident, far):
            n.high_ref = n.low_ref = 0
            n.tier = UNUSED
        t.held_sizes = [0, 0, 0]
        s = Sessions(t, high_threshold=1, demote=order)
        s.register("near", resident, 2)
        s.register("far", far, 2)
        assert s.demote_idle()
        assert [x.id for x in s.sessions.values() if x.demoted] == [expect], order
    queued = Sessions(Tree(), high_threshold=1, demote="queued")
    assert not queued.demote_idle()  # nothing queued: nothing to demote


def test_an_unknown_demotion_order_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="demote must be"):
        Sessions(Tree(), high_threshold=1, demote="random")
