"""The page-level core (SPEC.md §13, `kvcert.spec.page_table`): a radix snapshot read as pages is judged by the page
rules exactly as the tree rules of the same IDs judge it — on sound states of the reference model and on states broken
one field at a time — so a radix cache certified under §5 holds the core a block-hash engine is held to."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvcert.refimpl import RefCache
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.page_table import PAGE_INVARIANTS, CachedPage, PageTable, check_pages, holders_exact, pages_of
from kvcert.spec.requests import RequestView
from kvcert.spec.types import CacheConfig, Snapshot

CORE = set(PAGE_INVARIANTS) - {"INV-PAGE-1"}
"""The page rules that keep a tree rule's ID (INV-PAGE-1 is INV-TREE-2's page form, which also judges edges)."""


def _states(page_size: int, seed: int, count: int = 60) -> list[Snapshot]:
    """Snapshots of the reference model along a random walk of inserts, matches, locks and evictions."""
    rng = random.Random(seed)
    cache = RefCache(CacheConfig(page_size=page_size, capacity=32 * page_size))
    locked: list[int] = []
    out = []
    for t in range(count):
        cache.set_clock(t)
        ns = rng.choice([None, "lora-a"])
        tokens = [rng.randrange(3) for _ in range(page_size * rng.randint(1, 5))]
        kind = rng.random()
        if kind < 0.5:
            m = cache.match_prefix(ns, tokens)
            need = len(tokens) - m.length
            if need and len(cache.snapshot().free_slots) < need:
                cache.evict(need)
            if len(cache.snapshot().free_slots) >= need:
                cache.insert(ns, tokens, tuple(m.slots) + cache.alloc(need))
        elif kind < 0.7:
            m = cache.match_prefix(ns, tokens)
            if m.length:
                cache.inc_lock_ref(m.node)
                locked.append(m.node)
        elif kind < 0.85 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randint(1, 8) * page_size)
        out.append(cache.snapshot())
    return out


def _broken(s: Snapshot, rng: random.Random) -> Snapshot:
    """`s` with one field wrong, as a faulty cache would report it."""
    nodes = [n for n in s.nodes if n.id != s.root and n.slots]
    how = rng.choice(["evictable", "protected", "leak", "double", "range", "lock", "swap"])
    if how == "evictable":
        return replace(s, evictable_size=s.evictable_size + s.page_size)
    if how == "protected":
        return replace(s, protected_size=s.protected_size + 1)
    if how == "leak" and s.free_slots:
        return replace(s, free_slots=s.free_slots[s.page_size :])
    if how == "double" and nodes and s.free_slots:
        return replace(s, free_slots=s.free_slots + (nodes[0].slots[0],))
    if how == "range":
        return replace(s, free_slots=s.free_slots + (s.slot_limit + 3,))
    if how == "lock" and nodes:
        n = rng.choice(nodes)
        others = tuple(x for x in s.nodes if x.id != n.id)
        return replace(s, nodes=others + (replace(n, lock_ref=-1),))
    if how == "swap" and nodes and s.page_size > 1:
        n = rng.choice(nodes)
        slots = (n.slots[1], n.slots[0]) + tuple(n.slots[2:])
        return replace(s, nodes=tuple(x for x in s.nodes if x.id != n.id) + (replace(n, slots=slots),))
    return replace(s, capacity=s.capacity + 1)


def _ids(found: list) -> set[str]:
    return {v.inv for v in found} & CORE


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_radix_snapshot_read_as_pages_is_judged_as_the_tree_judges_it(page_size: int) -> None:
    rng = random.Random(page_size)
    judged = broken = 0
    for seed in range(6):
        for s in _states(page_size, seed):
            assert check_pages(pages_of(s)) == [] and check_snapshot(s) == []
            bad = _broken(s, rng)
            tree, table = _ids(check_snapshot(bad)), _ids(check_pages(pages_of(bad)))
            assert tree == table, (tree, table)
            judged += 1
            broken += bool(tree)
    assert judged >= 300 and broken >= 250


def test_pages_carry_the_path_the_kv_depends_on() -> None:
    """Each page of a node holds its whole prefix (the tree's path), its slots and the node's lock as holders."""
    for s in _states(4, 7):
        by_id = s.by_id()
        for p in pages_of(s).pages:
            node = by_id[p.id // 2**20]
            i = (p.id % 2**20) * 4
            assert p.slots == node.slots[i : i + 4] and p.holders == node.lock_ref and len(p.tokens) % 4 == 0


def _table(holders: int) -> PageTable:
    page = CachedPage(7, None, (1, 2), (2, 3), holders)
    return PageTable(2, 6, 6, (page,), (0, 1), (4, 5), 2 if holders == 0 else 0, 0 if holders == 0 else 2)


def test_holders_are_exactly_the_running_requests_that_map_a_page() -> None:
    reader = RequestView("r", None, None, (1, 2, 3), 3, "running", 0, computed=3, row=(2, 3, 4), own=(4, 5))
    waiting = RequestView("w", None, None, (1, 2), 2, "waiting", 0)
    assert holders_exact(_table(1), [reader, waiting]) == []
    assert [v.inv for v in holders_exact(_table(2), [reader])] == ["INV-PAGE-2"]  # a reference nobody drops
    assert [v.inv for v in holders_exact(_table(0), [reader])] == ["INV-PAGE-2"]  # evictable under a reader
    assert check_pages(_table(1)) == []
    bad = replace(_table(1), pages=(CachedPage(7, None, (1, 2, 3), (2, 3), 1),))
    assert [v.inv for v in check_pages(bad)] == ["INV-PAGE-1"]
