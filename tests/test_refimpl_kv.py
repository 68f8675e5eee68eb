"""KV bytes in the reference model (SPEC.md §9.12): they move exactly where a real cache's move.

The caller plays the model (`write_kv` before `insert`); every test then reads the slots back and
compares with the content function (`kvcert.spec.storage.token_entries`), never with the model.
"""

from __future__ import annotations

from typing import Optional

import pytest
from _refcache import settle

from kvcert.conformance.harness.storage import FaultyStorage, MemoryStorage
from kvcert.refimpl import RefCache
from kvcert.spec import storage as l3
from kvcert.spec.decisions import Decisions, Fetch
from kvcert.spec.types import CacheConfig, LengthMismatch, SlotNotOwned


def make(write_policy: str = "write_through", page: int = 1, prefetch: str = "") -> RefCache:
    config = CacheConfig(
        page_size=page,
        capacity=16,
        host_capacity=16,
        write_policy=write_policy,
        load_back_threshold=1,
        prefetch_policy=prefetch,
    )
    return RefCache(config)


def entries(tokens: list[int], ns: Optional[str] = None) -> list[bytes]:
    return list(l3.token_entries(ns, tokens, 2))


def put(cache: RefCache, tokens: list[int], ns: Optional[str] = None) -> int:
    """The caller's side of an insert with its forward pass: allocate, write the KV, insert, free duplicates."""
    slots = cache.alloc(len(tokens))
    cache.write_kv(slots, entries(tokens, ns))
    out = cache.insert(ns, tokens, slots)
    cache.free(slots[: out.prefix_len])
    return out.node


def node_at(cache: RefCache, tokens: list[int]) -> int:
    """The node whose path is exactly `tokens`."""
    return next(n.id for n in cache.nodes.values() if n is not cache.root and list(cache._full_path(n)) == tokens)


def wrong_bytes(cache: RefCache) -> list[str]:
    """INV-KV-1/2 as the harness reads them: every node's slots of both tiers hold its path's entries."""
    out = []
    for n in cache.nodes.values():
        if n is cache.root:
            continue
        path = list(cache._full_path(n))
        want = entries(path, n.namespace)[len(path) - len(n.key) :]
        if n.slots is not None and cache.read_kv(n.slots) != want:
            out.append(f"device KV of {path}")
        if n.host_slots is not None and cache.read_host_kv(n.host_slots) != want:
            out.append(f"host KV of {path}")
    return out


def test_write_through_backup_copies_the_device_bytes_to_the_host() -> None:
    c = make()
    node = c.nodes[put(c, [1, 2, 3])]
    assert node.host_slots is not None and [p.kind for p in c.snapshot().pending] == ["write"]
    assert c.read_host_kv(node.host_slots) == entries([1, 2, 3]), "bytes move when the copy is issued"
    settle(c)
    assert wrong_bytes(c) == []


def test_demotion_keeps_the_host_bytes_and_load_back_brings_them_to_fresh_slots() -> None:
    c = make()
    leaf = put(c, [1, 2, 3, 4])
    settle(c)
    assert c.evict(16) == 4 and c.nodes[leaf].slots is None
    c.write_kv(c.alloc(16), [b"\xff" * 32] * 16)  # a later request overwrites the freed device slots
    assert c.read_host_kv(c.nodes[leaf].host_slots or ()) == entries([1, 2, 3, 4])
    c.free(tuple(range(16)))
    assert c.load_back(leaf) == 4 and c.nodes[leaf].slots is not None
    assert c.read_kv(c.nodes[leaf].slots or ()) == entries([1, 2, 3, 4])
    settle(c)
    assert wrong_bytes(c) == []


def test_load_back_of_a_chain_fills_each_node_with_its_own_bytes() -> None:
    c = make()
    put(c, [1, 2])
    leaf = put(c, [1, 2, 3, 4, 5])
    settle(c)
    c.evict(16)
    assert sum(n.slots is None for n in c.nodes.values()) == 2, "two host-only nodes: one load of both"
    assert c.load_back(leaf) == 5
    assert wrong_bytes(c) == []


def test_a_split_of_a_backed_up_node_keeps_each_half_on_its_own_bytes() -> None:
    c = make()
    put(c, [1, 2, 3, 4])
    settle(c)
    c.evict(16)  # host only
    put(c, [1, 2, 7])  # splits [1, 2, 3, 4] at 2 on the host tier
    head = c.nodes[node_at(c, [1, 2])]
    assert head.host_slots is not None and len(head.host_slots) == 2
    assert wrong_bytes(c) == []
    settle(c)
    assert c.load_back(node_at(c, [1, 2, 3, 4])) == 2
    assert wrong_bytes(c) == []


def test_write_back_eviction_backs_up_before_demoting() -> None:
    c = make("write_back")
    leaf = put(c, [4, 5, 6])
    assert c.nodes[leaf].host_slots is None, "write-back backs up only at eviction"
    assert c.evict(3) == 3
    node = c.nodes[leaf]
    assert node.slots is None and c.read_host_kv(node.host_slots or ()) == entries([4, 5, 6])
    assert wrong_bytes(c) == []


def test_retraction_backup_and_restore_carry_the_requests_bytes() -> None:
    c = make(page=2)
    node = put(c, [1, 2, 3, 4])
    settle(c)
    prefix = tuple(x for n in reversed(c._path_to_root(c.nodes[node])) for x in n.slots or ())
    own = c.alloc(2)
    made = entries([1, 2, 3, 4, 2, 2])
    c.write_kv(own, made[4:])  # the decoded tail
    backup = c.retraction_backup(prefix + own)
    assert backup is not None
    c.free(own)
    (view,) = c.snapshot().retractions
    assert c.read_host_kv(view.host_slots[: view.tokens]) == made
    c.evict(16)
    fresh = c.alloc(6)
    c.write_kv(fresh, [b"\x00" * 32] * 6)
    c.retraction_restore(backup, fresh)
    assert c.read_kv(fresh) == made, "the restore puts the backup in the request's slots, in order"


def test_a_fetched_page_fills_the_reserved_host_slots_and_the_node_keeps_them() -> None:
    c = make(prefetch="wait_complete", page=2)
    store = FaultyStorage(MemoryStorage())
    c.attach_storage(store)
    tokens = [1, 2, 3, 4, 5, 6]
    pairs = l3.stored_pages(None, tokens, 2, 2, c.digest)
    store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])
    put(c, [1, 2])
    settle(c)
    anchor = node_at(c, [1, 2])
    assert c.prefetch(anchor, None, tokens) == 4
    (p,) = c.prefetches
    c.fetch(p.id)
    assert c.read_host_kv(p.host_slots[:2]) == entries(tokens)[2:4], "page 1 of the path, after the anchor"
    c.fetch(p.id)
    assert c.check_prefetch(p.id) == 4
    leaf = node_at(c, tokens)
    assert c.nodes[leaf].slots is None and wrong_bytes(c) == []
    assert c.load_back(leaf) == 4 and wrong_bytes(c) == []


def test_a_prefetch_ended_early_keeps_the_slots_it_filled() -> None:
    c = make(prefetch="best_effort")
    c.own = c.decided = Decisions(fetch=Fetch(batch=1))  # progress published per page (FETCH), so the page that arrived is kept
    store = FaultyStorage(MemoryStorage())
    c.attach_storage(store)
    pairs = l3.stored_pages(None, [3, 4, 5], 1, 2, c.digest)
    store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])
    assert c.prefetch(c.root.id, None, [3, 4, 5]) == 3
    (p,) = c.prefetches
    c.fetch(p.id)
    assert c.check_prefetch(p.id) == 1, "best_effort ends with the one page it has"
    assert c.nodes[node_at(c, [3])].host_slots == p.host_slots[:1] and wrong_bytes(c) == []


def test_a_failed_page_fills_nothing() -> None:
    c = make(prefetch="best_effort")
    store = FaultyStorage(MemoryStorage())
    c.attach_storage(store)
    pairs = l3.stored_pages(None, [8, 9], 1, 2, c.digest)
    store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])
    assert c.prefetch(c.root.id, None, [8, 9]) == 2
    store.corrupt(pairs[0][0])
    (p,) = c.prefetches
    c.fetch(p.id)
    assert p.failed and c.host_kv == {}
    assert c.check_prefetch(p.id) == 0 and wrong_bytes(c) == []


def _state(c: RefCache) -> tuple[object, dict[int, bytes], dict[int, bytes]]:
    return c.snapshot(), dict(c.kv), dict(c.host_kv)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("fewer entries", LengthMismatch),
        ("more entries", LengthMismatch),
        ("short entry", LengthMismatch),
        ("str entry", LengthMismatch),
        ("free slot", SlotNotOwned),
        ("tree's slot", SlotNotOwned),
        ("repeated slot", SlotNotOwned),
        ("bool slot", SlotNotOwned),
    ],
)
def test_bad_write_kv_raises_and_changes_nothing(bad: str, error: type[Exception]) -> None:
    c = make()
    node = c.nodes[put(c, [1, 2])]
    settle(c)
    lent = c.alloc(2)
    good = entries([5, 6])
    calls = {
        "fewer entries": (lent, good[:1]),
        "more entries": (lent, good + good),
        "short entry": (lent, [good[0], good[1][:-1]]),
        "str entry": (lent, [good[0], "x"]),
        "free slot": ((lent[0], c.pool.free_slots()[0]), good),
        "tree's slot": ((lent[0], (node.slots or ())[0]), good),
        "repeated slot": ((lent[0], lent[0]), good),
        "bool slot": ((lent[0], True), good),
    }
    slots, values = calls[bad]
    before = _state(c)
    with pytest.raises(error):
        c.write_kv(slots, values)  # type: ignore[arg-type]
    assert _state(c) == before


def test_reads_name_slot_ids_of_the_pool() -> None:
    c = make()
    with pytest.raises(SlotNotOwned):
        c.read_kv([16])
    with pytest.raises(SlotNotOwned):
        c.read_host_kv([-1])
    with pytest.raises(SlotNotOwned):
        RefCache(CacheConfig(capacity=8)).read_host_kv([0])  # no host tier: no host slot ids
    assert c.read_kv([0]) == [b""], "a slot never written holds nothing"
