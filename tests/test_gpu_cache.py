"""kvcert.gpu's cache: bytes really move between tiers, the suite certifies it, hot paths never scan the tree."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvcert.conformance.certification.certify import certify
from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
from kvcert.conformance.harness.storage import MemoryStorage
from kvcert.gpu import CAPABILITIES, GpuCache, factory, make_factory
from kvcert.gpu.agreement import Agreement
from kvcert.gpu.copy_engine import DeferredCopyEngine
from kvcert.spec import storage as l3
from kvcert.spec.ops import (
    CheckPrefetch,
    Complete,
    Evict,
    EvictHost,
    Fetch,
    Insert,
    LoadBack,
    Lock,
    Match,
    Op,
    Poll,
    Prefetch,
    Publish,
    Restore,
    Retract,
    Unlock,
)
from kvcert.spec.types import CacheConfig, UnknownCopy

WT = CacheConfig(page_size=2, capacity=16, host_capacity=16, prefetch_policy="wait_complete", kv_layers=2)
WB = CacheConfig(page_size=2, capacity=8, host_capacity=16, write_policy="write_back", kv_layers=3)


def entries(tokens: tuple[int, ...], ns: Any = None, layers: int = 2) -> list[bytes]:
    return list(l3.token_entries(ns, tokens, layers))


def insert(cache: GpuCache, tokens: tuple[int, ...], ns: Any = None) -> int:
    """The harness's side of an insert: allocate, run the model, insert, free the duplicates."""
    slots = cache.alloc(len(tokens))
    cache.write_kv(slots, l3.token_entries(ns, tokens, cache.kv_layers))
    out = cache.insert(ns, tokens, slots)
    cache.free(slots[: out.prefix_len])
    return out.node


def node_view(cache: GpuCache, node: int) -> Any:
    return cache.snapshot().by_id()[node]


def test_write_through_moves_bytes_on_completion_then_stores_them() -> None:
    cache = factory(WT)
    storage = MemoryStorage()
    cache.attach_storage(storage)
    leaf = insert(cache, (1, 2, 3, 4))
    (write,) = cache.snapshot().pending
    host = node_view(cache, leaf).host_slots
    assert cache.read_host_kv(host) != entries((1, 2, 3, 4)), "nothing lands before complete"
    cache.complete(write.id)
    assert cache.read_host_kv(host) == entries((1, 2, 3, 4))
    with pytest.raises(UnknownCopy):
        cache.complete(write.id)
    assert cache.poll() == 1
    (store,) = cache.snapshot().pending
    assert store.kind == "store" and storage.contents() == {}
    cache.complete(store.id)
    digest = l3.canonical_digest(2, WT.model_id)
    assert storage.contents() == dict(l3.stored_pages(None, (1, 2, 3, 4), 2, 2, digest))


def test_demotion_and_load_back_move_bytes_down_and_up() -> None:
    cache = factory(WT)
    leaf = insert(cache, (1, 2, 3, 4))
    cache.complete(cache.snapshot().pending[0].id)
    cache.poll()
    assert cache.evict(4) == 4 and node_view(cache, leaf).slots is None
    cache.kv.u8.zero_()  # the device forgets everything: only the host copy is left
    assert cache.match_prefix(None, (1, 2, 3, 4)).host_length == 4
    assert cache.load_back(leaf) == 4
    (load,) = cache.snapshot().pending
    slots = node_view(cache, leaf).slots
    assert cache.read_kv(slots) != entries((1, 2, 3, 4))
    cache.inject_fault("copy")
    cache.complete(load.id)  # failed: retried, still pending and unfinished
    assert cache.snapshot().pending[0].finished is False and cache.poll() == 0
    cache.complete(load.id)
    assert cache.read_kv(slots) == entries((1, 2, 3, 4)) and cache.poll() == 1


def test_write_back_backs_victims_up_synchronously_and_reclaims_duplicates() -> None:
    cache = factory(WB)
    a = insert(cache, (1, 1, 2, 2))
    b = insert(cache, (3, 3, 4, 4))
    assert cache.evict(4) == 4  # one victim, demoted with a synchronous backup
    demoted = next(n for n in (a, b) if node_view(cache, n).slots is None)
    tokens = (1, 1, 2, 2) if demoted == a else (3, 3, 4, 4)
    assert cache.read_host_kv(node_view(cache, demoted).host_slots) == entries(tokens, layers=3)
    assert cache.load_back(demoted) == 4
    cache.complete(cache.snapshot().pending[0].id)
    cache.poll()
    assert cache.read_kv(node_view(cache, demoted).slots) == entries(tokens, layers=3)
    assert cache.evict_host(2) == 4  # the settled duplicate goes first, whole
    assert node_view(cache, demoted).host_slots is None and node_view(cache, demoted).slots is not None


def test_prefetch_verifies_pages_and_lands_them_on_the_host() -> None:
    cache = factory(WT)
    storage = MemoryStorage()
    cache.attach_storage(storage)
    digest = l3.canonical_digest(2, WT.model_id)
    pairs = l3.stored_pages("ns", (7, 7, 8, 8, 9, 9), 2, 2, digest)
    storage.batch_set([k for k, _ in pairs], [v if i != 2 else v[:-1] for i, (k, v) in enumerate(pairs)])
    assert cache.prefetch(cache.root.id, "ns", (7, 7, 8, 8, 9, 9)) == 6
    (p,) = cache.snapshot().prefetches
    cache.fetch(p.id)
    cache.fetch(p.id)
    cache.fetch(p.id)  # the torn third page fails the prefetch
    assert cache.snapshot().prefetches[0].failed and cache.check_prefetch(p.id) == 4
    out = cache.match_prefix("ns", (7, 7, 8, 8, 9, 9))
    assert (out.length, out.host_length) == (0, 4)
    host = node_view(cache, out.host_node).host_slots
    assert cache.read_host_kv(host) == entries((7, 7, 8, 8), ns="ns")


def test_retraction_copies_both_ways() -> None:
    cache = factory(WT)
    leaf = insert(cache, (1, 2, 3, 4))
    own = cache.alloc(2)
    cache.write_kv(own, entries((1, 2, 3, 4, 5, 6))[4:])
    backup = cache.retraction_backup(node_view(cache, leaf).slots + own)
    cache.free(own)
    assert backup is not None
    fresh = cache.alloc(6)
    assert cache.retraction_restore(backup, fresh) == cache.root.id
    assert cache.read_kv(fresh) == entries((1, 2, 3, 4, 5, 6))


TRACE: list[Op] = [
    Insert(None, (1, 1, 2, 2)),  # 0: write copy 0
    Complete(0),
    Poll(),  # store copy 1
    Complete(1),
    Poll(),
    Insert(None, (1, 1, 2, 2, 3, 3)),  # 5: write copy 2
    Match(None, (1, 1, 2, 2, 3, 3)),  # 6
    Lock(6),
    Retract(6, tail=2),
    Unlock(6),
    Complete(2),
    Poll(),
    Evict(16),
    Match(None, (1, 1, 2, 2, 3, 3)),  # 13: a host hit
    LoadBack(13),
    Restore(0),
    Publish("x", (5, 5, 6, 6)),
    Match("x", (5, 5, 6, 6)),  # 17
    Prefetch(17),
    Fetch(0),
    Fetch(0),
    CheckPrefetch(0),
    EvictHost(4),
]


@pytest.mark.parametrize("build", [factory, make_factory(layout="page_first", host_layout="page_first")])
def test_a_scripted_trace_passes_every_check_including_kv(build: Any) -> None:
    h = run_trace(build(WT), WT, CAPABILITIES, TRACE)
    assert len(h.ops) > len(TRACE)


def test_kv_checks_catch_a_copy_engine_that_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DeferredCopyEngine, "_land", lambda self, ticket: None)
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(factory(WT), WT, CAPABILITIES, TRACE)
    assert failure.value.violations[0].inv == "INV-KV-2"


def test_small_certificate_page_first_and_threaded(tmp_path: Path) -> None:
    for name, build, sizes in (
        ("page_first", make_factory(layout="page_first", host_layout="page_first"), [4]),
        ("threaded", make_factory(engine="threaded"), [1]),
    ):
        cert = certify(f"kvcert.gpu:{name}", factory=build, examples=6, steps=20, page_sizes=sizes, out_dir=tmp_path)
        assert cert.passed, [c.failure for c in cert.cells if not c.passed]
        assert len(cert.cells) == len(CAPABILITIES.policies) + 3 + 9


class CountingDict(dict):  # type: ignore[type-arg]
    """A node table that counts whole-table iterations: a hot path must make none."""

    scans = 0

    def values(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().values()

    def items(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().items()

    def __iter__(self):  # type: ignore[no-untyped-def]
        CountingDict.scans += 1
        return super().__iter__()


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_hot_paths_never_scan_the_tree(write_policy: str) -> None:
    config = CacheConfig(page_size=1, capacity=4096, host_capacity=4096, write_policy=write_policy)
    cache = factory(config)
    cache.nodes = CountingDict(cache.nodes)
    refreshes = [0]
    original = cache.refresh

    def counted(n: Any) -> None:
        refreshes[0] += 1
        original(n)

    cache.refresh = counted  # type: ignore[method-assign]
    for i in range(1500):
        insert(cache, (i % 7, i, i + 1))
    for c in cache.snapshot().pending:
        cache.complete(c.id)
    cache.poll()
    CountingDict.scans, refreshes[0] = 0, 0
    cache.set_clock(10)
    handle = cache.match_prefix(None, (3, 3, 4)).node
    cache.inc_lock_ref(handle)
    insert(cache, (3, 3, 4, 5))
    cache.dec_lock_ref(handle)
    for c in cache.snapshot().pending:
        cache.complete(c.id)
    cache.snapshot()
    CountingDict.scans = 0
    cache.poll()
    assert cache.evict(3) >= 3
    assert cache.evict_host(2) >= 2
    assert CountingDict.scans == 0
    assert refreshes[0] < 60, refreshes[0]


def test_node_ends_stay_exact_through_splits() -> None:
    cache = factory(WT)
    for tokens in [(1, 1, 2, 2, 3, 3), (1, 1, 4, 4), (1, 1, 2, 2, 5, 5), (1, 1)]:
        insert(cache, tokens)
    cache.match_prefix(None, (1, 1, 2, 2, 3, 3, 7, 7))
    assert all(n.end == len(cache.path_tokens(n)) for n in cache.nodes.values())


class SlowPeer(Agreement):
    """Another rank that has finished nothing and fetched nothing: the minimum is always 0."""

    def agree(self, proposals: Sequence[int]) -> list[int]:
        return [0 for _ in proposals]


def test_ranks_consume_only_what_every_rank_finished() -> None:
    cache = GpuCache(WT, agreement=SlowPeer())
    insert(cache, (1, 2, 3, 4))
    cache.complete(cache.snapshot().pending[0].id)
    assert cache.poll() == 0 and cache.snapshot().pending[0].finished  # finished here, not on the peer
    cache.agreement = Agreement()
    assert cache.poll() == 1


def test_heaps_stay_complete_across_compaction() -> None:
    """A leaf locked while the heap is rebuilt must be evictable again once unlocked."""
    cache = factory(CacheConfig(page_size=1, capacity=64))
    for i in range(8):
        insert(cache, (i, i))
    held = cache.match_prefix(None, (0, 0)).node
    cache.inc_lock_ref(held)  # leaves the candidate set; its heap entry stays behind
    for t in range(400):  # re-ranking the others piles up stale entries: the heap is rebuilt
        cache.set_clock(t + 1)
        cache.match_prefix(None, (1 + t % 7, 1 + t % 7))
    cache.dec_lock_ref(held)  # back at the same version
    assert cache.evict(64) == 16 and len(cache.nodes) == 1


def test_retraction_backup_of_a_prefix_still_loading_holds_its_kv() -> None:
    """Found by certification (seed 0, page size 4, write-back): a request whose prefix is being
    loaded back is retracted before the load lands. The backup must hold the prefix's KV — read from
    its host copy, which the load protects — not the device slots the load has yet to fill."""
    from kvcert.conformance.harness.driver import run_trace
    from kvcert.gpu import factory
    from kvcert.spec.ops import Evict, Insert, LoadBack, Match, Retract

    config = CacheConfig(page_size=4, capacity=24, host_capacity=24, write_policy="write_back", load_back_threshold=4)
    key = (0, 0, 0, 1, 2, 2, 2, 2)
    ops = [Insert(None, key), Match(None, key), Evict(1), Match(None, key[:4]), LoadBack(3), Retract(1, 4)]
    run_trace(factory(config), config, factory.capabilities, ops)  # type: ignore[attr-defined]
