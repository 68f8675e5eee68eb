"""SGLang's real RadixCache behind the Backend protocol: translation, determinism, and a short certification.

Skipped as a whole when sglang (the `sglang` extra, see requirements/sglang.txt)
cannot be imported.
"""

from __future__ import annotations

import random
import sys

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang.env import import_sglang, install_shims  # noqa: E402

SG = import_sglang()

from kvcert.conformance.adapters.sglang.radix import factory, factory_need_sort  # noqa: E402
from kvcert.conformance.backend import Backend  # noqa: E402
from kvcert.refimpl import RefCache  # noqa: E402
from kvcert.spec import contracts  # noqa: E402
from kvcert.spec.invariants import check_snapshot  # noqa: E402
from kvcert.spec.types import CacheConfig, PoolExhausted, StaleHandle  # noqa: E402

pytestmark = pytest.mark.sglang


def make(page_size: int = 1, policy: str = "lru", pages: int = 8):
    return factory(CacheConfig(page_size=page_size, policy=policy, capacity=pages * page_size))


def put(backend, tokens, namespace=None, priority=0):
    """The caller's side of an insert: allocate, insert, free the duplicates."""
    slots = backend.alloc(len(tokens))
    out = backend.insert(namespace, tokens, slots, priority)
    backend.free(slots[: out.prefix_len])
    return out


def test_shims_are_idempotent_and_give_transformers_its_enum() -> None:
    install_shims()
    install_shims()
    import torchvision.transforms as T

    assert T.InterpolationMode.NEAREST_EXACT.value == "nearest-exact"
    assert "triton" in sys.modules


def test_capabilities_and_protocol() -> None:
    caps = factory.capabilities
    assert caps.name.startswith("sglang.RadixCache") and not caps.strict_input
    assert isinstance(make(), Backend)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_empty_snapshot_reserves_slot_zero(page_size: int) -> None:
    snap = make(page_size).snapshot()
    assert check_snapshot(snap) == []
    assert [n.id for n in snap.nodes] == [snap.root] == [0]
    assert snap.slot_limit == snap.capacity + page_size
    assert snap.free_slots == tuple(range(page_size, snap.capacity + page_size))


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_exhaustion_and_free(page_size: int, need_sort: bool) -> None:
    """With need_sort, freed pages wait in release_pages / staged_pages: the snapshot must still count them."""
    b = (factory_need_sort if need_sort else factory)(CacheConfig(page_size=page_size, capacity=2 * page_size))
    slots = b.alloc(2 * page_size)
    assert sorted(slots) == list(range(page_size, 3 * page_size))
    with pytest.raises(PoolExhausted):
        b.alloc(page_size)
    b.free(slots)
    assert b.snapshot().free_slots == tuple(range(page_size, 3 * page_size))
    assert sorted(b.alloc(2 * page_size)) == sorted(slots)


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_match_split_lock_evict(page_size: int) -> None:
    ps = page_size
    b = make(ps)
    first = put(b, (1,) * ps + (2,) * ps)
    assert first.prefix_len == 0
    m = b.match_prefix(None, (1,) * ps + (3,) * ps + (9,) * (ps - 1))
    assert m.length == ps and len(m.slots) == ps
    snap = b.snapshot()
    assert check_snapshot(snap) == []
    assert snap.path_of(m.node) == (None, (1,) * ps)  # the match split the edge
    assert snap.path_of(first.node) == (None, (1,) * ps + (2,) * ps)  # the tail kept its id
    b.inc_lock_ref(m.node)
    assert (b.snapshot().evictable_size, b.snapshot().protected_size) == (ps, ps)
    assert b.evict(10 * ps) == ps  # only the unlocked tail can go
    b.dec_lock_ref(m.node)
    assert b.evict(1) == ps  # whole leaves: asked 1, freed a page
    assert len(b.snapshot().free_slots) == b.snapshot().capacity


def test_root_lock_is_a_noop_and_unknown_handles_are_stale() -> None:
    b = make()
    root = b.snapshot().root
    b.inc_lock_ref(root)
    b.dec_lock_ref(root)
    assert b.snapshot().nodes[0].lock_ref == 1  # SGLang keeps the root locked once, for good
    with pytest.raises(StaleHandle):
        b.inc_lock_ref(12345)


def test_namespaces_do_not_share_prefixes() -> None:
    b = make()
    put(b, (1, 2, 3), namespace="lora-a")
    assert b.match_prefix(None, (1, 2, 3)).length == 0
    assert b.match_prefix("lora-a", (1, 2, 3)).length == 3
    assert put(b, (1, 2, 3)).prefix_len == 0
    assert check_snapshot(b.snapshot()) == []


def test_logical_clock_and_ids_are_per_adapter_and_restored() -> None:
    clock_before, counter_before = SG.radix_cache.time, SG.TreeNode.counter
    a, other = make(policy="lru"), make(policy="lru")
    a.set_clock(7)
    out = put(a, (5, 6))
    put(other, (1,))  # interleaved work on another adapter does not shift a's ids
    a.set_clock(9)
    out2 = put(a, (5, 6, 7))
    assert (out.node, out2.node) == (1, 2)
    node = a._node(out.node)
    assert (node.creation_time, node.last_access_time) == (7, 9)
    assert SG.radix_cache.time is clock_before and SG.TreeNode.counter == counter_before


def test_equal_rank_ties_break_the_same_way_every_run() -> None:
    """SGLang's evictable_leaves is a set of address-hashed TreeNodes; the adapter makes its order reproducible."""
    outcomes = set()
    for _ in range(20):
        b = make(pages=16)
        b.set_clock(1)
        for t in range(6):  # six leaves of equal LRU rank
            put(b, (t,))
        b.evict(1)
        outcomes.add(tuple(n.key for n in b.snapshot().nodes))
    assert len(outcomes) == 1  # heapq's order of equal keys is a function of the list order: now fixed


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mru", "priority"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_agrees_with_the_reference_model(page_size: int, policy: str) -> None:
    """Random valid traffic; ties steered through the spec's eviction witness, as the harness does."""
    rng = random.Random(f"{page_size}-{policy}")
    cfg = CacheConfig(page_size=page_size, policy=policy, capacity=12 * page_size)
    sg, ref = factory(cfg), RefCache(cfg)
    handles: list[tuple[int, int]] = []
    locked: list[int] = []
    for t in range(1, 150):
        sg.set_clock(t)
        ref.set_clock(t)
        ns = rng.choice([None, "a"])
        tokens = tuple(rng.choice([1, 2, 3]) for _ in range(page_size * rng.randint(0, 4)))
        kind = rng.choice(["insert", "insert", "match", "lock", "unlock", "evict"])
        before = sg.snapshot()
        if kind == "insert" and len(before.free_slots) >= len(tokens):
            got, want = put(sg, tokens, ns, t % 3), put(ref, tokens, ns, t % 3)
            assert got.prefix_len == want.prefix_len
            handles.append((got.node, want.node))
        elif kind == "match":
            got_m, want_m = sg.match_prefix(ns, tokens + (9,)), ref.match_prefix(ns, tokens + (9,))
            assert (got_m.length, len(got_m.slots)) == (want_m.length, want_m.length)
            handles.append((got_m.node, want_m.node))
        elif kind == "lock" and handles:
            k = rng.randrange(len(handles))
            if handles[k][1] in ref.nodes:
                sg.inc_lock_ref(handles[k][0])
                ref.inc_lock_ref(handles[k][1])
                locked.append(k)
        elif kind == "unlock" and locked:
            k = locked.pop(rng.randrange(len(locked)))
            sg.dec_lock_ref(handles[k][0])
            ref.dec_lock_ref(handles[k][1])
        elif kind == "evict":
            n = rng.randint(0, 3 * page_size)
            freed = sg.evict(n)
            after = sg.snapshot()
            assert contracts.eviction_bounds(before, after, n, freed) == []
            gone = set(contracts.node_paths(before).values()) - set(contracts.node_paths(after).values())
            paths = contracts.node_paths(ref.snapshot())
            view = {
                i: contracts.EvictNode(
                    i, nd.parent.id if nd.parent else None, len(nd.key), nd.lock_ref > 0, ref.rank(nd)
                )
                for i, nd in ref.nodes.items()
            }
            order = contracts.eviction_witness(view, 0, n, frozenset(i for i, p in paths.items() if p in gone))
            assert order is not None, f"{policy}: SGLang evicted {sorted(gone)}, no legal order does"
            steer = iter(order)
            assert ref.evict(n, choose=lambda tied, s=steer: next(s)) == freed
        snap, rsnap = sg.snapshot(), ref.snapshot()
        assert check_snapshot(snap) == []
        assert contracts.shape(snap) == contracts.shape(rsnap)
        assert (snap.evictable_size, snap.protected_size, len(snap.free_slots)) == (
            rsnap.evictable_size,
            rsnap.protected_size,
            len(rsnap.free_slots),
        )


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_short_certification_passes(page_size: int, tmp_path) -> None:
    """CI's short certification: every declared policy at this page size (docs/sglang.md has the full run)."""
    from kvcert.conformance.certification.certify import certify

    cert = certify(
        "kvcert.conformance.adapters.sglang.radix:factory",
        examples=50,
        steps=30,
        page_sizes=[page_size],
        out_dir=tmp_path,
    )
    assert {c.policy for c in cert.cells} == set(factory.capabilities.policies)
    assert cert.passed, [c.failure for c in cert.cells if not c.passed]


def test_ordered_set_is_a_set_in_insertion_order() -> None:
    """The set SGLang's leaf sets are replaced with: a set's answers, insertion order, any process."""
    from kvcert.conformance.adapters.sglang.env import OrderedSet

    s = OrderedSet([3, 1])
    s.add(2)
    s.add(1)  # already there: its place stays
    assert list(s) == [3, 1, 2] and len(s) == 3 and 2 in s and 5 not in s
    s.remove(3)
    with pytest.raises(KeyError):
        s.remove(3)
    s.discard(3)  # absent: nothing
    s.discard(1)
    assert list(s) == [2] and s == {2} and {2} == s and s != {1}
    s.add(7)
    assert s - {7} == {2} and {2, 9} - s == {9} and s & {7, 8} == {7} and {7, 8} & s == {7}
    assert s | {1} == {1, 2, 7} and s <= {1, 2, 7} and s >= {2}
    c = s.copy()
    c.add(4)
    assert isinstance(c, OrderedSet) and list(c) == [2, 7, 4] and list(s) == [2, 7]
    with pytest.raises(RuntimeError):  # as a set: no mutation while iterating (the set hides no such bug)
        for x in s:
            s.discard(x)
    for x in list(s):
        s.discard(x)
    assert not s and s == set()
    s.clear()
    assert repr(OrderedSet([1])) == "OrderedSet([1])"
