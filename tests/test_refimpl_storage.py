"""The storage tier of the reference model (SPEC.md §10), one rule per test.

Expected pages come from `kvcert.spec.storage` directly (keys, records, content), never
from the model under test.
"""

from __future__ import annotations

from _refcache import put, settle

from kvcert.conformance.harness.storage import FaultyStorage, MemoryStorage
from kvcert.refimpl import RefCache
from kvcert.spec import storage as l3
from kvcert.spec.decisions import Decisions, Fetch, Throttle
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.types import CacheConfig


def make(
    policy: str = "wait_complete", host: int = 8, write_policy: str = "write_through"
) -> tuple[RefCache, FaultyStorage]:
    config = CacheConfig(
        capacity=8, host_capacity=host, write_policy=write_policy, load_back_threshold=1, prefetch_policy=policy
    )
    cache, store = RefCache(config), FaultyStorage(MemoryStorage())
    cache.attach_storage(store)
    return cache, store


def publish(store: FaultyStorage, tokens: list[int], namespace: str | None = None) -> None:
    pairs = l3.stored_pages(namespace, tokens, 1, 2, l3.canonical_digest(1, "kvcert-synthetic"))
    store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])


def expected(tokens: list[int]) -> dict[str, bytes]:
    return dict(l3.stored_pages(None, tokens, 1, 2, l3.canonical_digest(1, "kvcert-synthetic")))


def test_a_write_ack_issues_a_store_that_writes_canonical_pages_on_completion() -> None:
    c, store = make()
    node = c.nodes[put(c, [5, 6, 7])]
    c.complete(0)
    assert c.poll() == 1 and [p.kind for p in c.snapshot().pending] == ["store"]
    assert node.host_lock_ref == 1, "the host copy is protected until the store's ack"
    assert store.inner.contents() == {}, "nothing is stored before the copy engine finishes"
    c.complete(1)
    assert store.inner.contents() == expected([5, 6, 7])
    assert c.poll() == 1 and node.host_lock_ref == 0 and check_snapshot(c.snapshot()) == []


def test_a_failed_store_leaves_nothing_visible_and_still_releases() -> None:
    c, store = make()
    node = c.nodes[put(c, [5, 6])]
    c.complete(0)
    c.poll()
    store.arm("error")
    c.complete(1)
    assert store.inner.contents() == {} and c.poll() == 1 and node.host_lock_ref == 0


def test_prefetch_asks_for_the_consecutive_stored_pages_and_inserts_them_host_only() -> None:
    c, store = make()
    publish(store, [1, 2, 3, 4])
    store.drop(l3.page_keys(None, [1, 2, 3, 4], 1, c.digest)[2])  # page 3 is missing: the run stops at 2 pages
    assert c.prefetch(c.root.id, None, [1, 2, 3, 4]) == 2
    assert len(c.host.free_list) == 6  # type: ignore[union-attr]
    c.fetch(0)
    assert c.check_prefetch(0) is None, "wait_complete waits for every page"
    c.fetch(0)
    assert c.check_prefetch(0) == 2
    assert c.match_prefix(None, [1, 2, 3, 4]).host_length == 2 and not c.prefetches
    assert check_snapshot(c.snapshot()) == []


def test_a_corrupt_page_is_a_miss_never_kv() -> None:
    c, store = make()
    publish(store, [1, 2, 3])
    store.corrupt(l3.page_keys(None, [1, 2, 3], 1, c.digest)[1])
    assert c.prefetch(c.root.id, None, [1, 2, 3]) == 3
    c.fetch(0)
    c.fetch(0)
    assert c.snapshot().prefetches[0].failed and c.snapshot().prefetches[0].fetched == 1
    assert c.check_prefetch(0) == 1, "only the verified first page is kept"
    assert len(c.host.free_list) == 7  # type: ignore[union-attr]


def test_best_effort_ends_at_once_and_keeps_what_was_published() -> None:
    """SGLang publishes progress per storage batch (FETCH): one page of a three-page batch is not yet seen."""
    c, store = make("best_effort")
    publish(store, [1, 2, 3])
    assert c.prefetch(c.root.id, None, [1, 2, 3]) == 3
    c.fetch(0)
    assert c.snapshot().prefetches[0].fetched == 0, "the batch is still being read"
    assert c.check_prefetch(0) == 0 and len(c.host.free_list) == 8  # type: ignore[union-attr]

    c, store = make("best_effort")
    c.own = c.decided = Decisions(fetch=Fetch(batch=1))  # a cache that publishes every page keeps the page that arrived
    publish(store, [1, 2, 3])
    assert c.prefetch(c.root.id, None, [1, 2, 3]) == 3
    c.fetch(0)
    assert c.snapshot().prefetches[0].fetched == 1
    assert c.check_prefetch(0) == 1 and len(c.host.free_list) == 7  # type: ignore[union-attr]


def test_a_batch_ends_at_its_last_page_or_first_miss_and_a_raising_read_loses_it() -> None:
    c, store = make()
    publish(store, [1, 2, 3])
    assert c.prefetch(c.root.id, None, [1, 2, 3]) == 3
    c.fetch(0)
    c.fetch(0)
    assert c.snapshot().prefetches[0].fetched == 0
    c.fetch(0)
    assert c.snapshot().prefetches[0].fetched == 3, "the last page publishes the batch"

    c, store = make()
    publish(store, [1, 2, 3])
    store.corrupt(l3.page_keys(None, [1, 2, 3], 1, c.digest)[2])
    c.prefetch(c.root.id, None, [1, 2, 3])
    c.fetch(0)
    c.fetch(0)
    c.fetch(0)
    pf = c.snapshot().prefetches[0]
    assert pf.failed and pf.fetched == 2, "a miss publishes the pages before it"

    c, store = make()
    publish(store, [1, 2, 3])
    c.prefetch(c.root.id, None, [1, 2, 3])
    c.fetch(0)
    store.arm("error")
    c.fetch(0)
    pf = c.snapshot().prefetches[0]
    assert pf.failed and pf.fetched == 0, "a read that raises loses its whole batch, as SGLang's does"
    assert c.check_prefetch(0) == 0 and len(c.host.free_list) == 8  # type: ignore[union-attr]


def test_admission_declines_while_running_spans_reach_half_the_host_pool() -> None:
    """THROTTLE: SGLang's prefetch_capacity_limit counts every page a running prefetch asked for, stored or not."""
    c, store = make(host=8)
    publish(store, [1, 2])
    publish(store, [5, 6])
    assert c.prefetch(c.root.id, None, [1, 2, 3, 4]) == 2, "two pages stored, four asked for: 4 of 8 held"
    asked: list[int] = []
    lookup = store.batch_exists
    store.batch_exists = lambda keys: asked.append(len(keys)) or lookup(keys)  # type: ignore[method-assign]
    assert c.prefetch(c.root.id, None, [5, 6]) == 0, "declined: the running span is half the pool"
    assert asked == [], "a declined prefetch asks storage nothing"
    c.abort_prefetch(0)
    assert c.prefetch(c.root.id, None, [5, 6]) == 2, "admitted once nothing runs"
    c.own = c.decided = Decisions(throttle=Throttle(fraction=None))
    assert c.prefetch(c.root.id, None, [1, 2]) == 2, "a cache without the limit admits it"


def test_timeout_is_linear_in_the_requested_pages_from_the_first_wait() -> None:
    """The deadline starts at the first check that keeps the prefetch running, and its budget counts
    every page the request asked for after the anchor, stored or not (SGLang's; calibration D11)."""
    c, store = make("timeout")
    publish(store, [1, 2, 3])
    c.set_clock(10)
    assert c.prefetch(c.root.id, None, [1, 2, 3, 4, 5]) == 3, "three pages stored, five asked for"
    c.set_clock(12)
    assert c.check_prefetch(0) is None  # the wait starts now
    c.set_clock(12 + 4 + 5)  # base 4 + 1 per requested page: not yet past it
    assert c.check_prefetch(0) is None
    c.set_clock(12 + 4 + 5 + 1)
    assert c.check_prefetch(0) == 0


def test_abort_frees_everything_and_keeps_nothing() -> None:
    c, store = make()
    anchor = c.nodes[put(c, [1])]
    settle(c)
    publish(store, [1, 2, 3])
    assert c.prefetch(anchor.id, None, [1, 2, 3]) == 2 and anchor.host_lock_ref == 1
    c.fetch(0)
    c.abort_prefetch(0)
    assert anchor.host_lock_ref == 0 and len(c.nodes) == 2 and not c.prefetches
    assert check_snapshot(c.snapshot()) == []


def test_making_room_never_evicts_the_anchor() -> None:
    c, store = make(host=3)
    anchor = c.nodes[put(c, [1])]
    settle(c)
    c.evict(1)  # the anchor is a host-only leaf: the only host-eviction candidate
    publish(store, [1, 2, 3, 4])
    # 3 pages do not fit beside the protected anchor: the 2 that do are reserved (calibration D9)
    assert c.prefetch(anchor.id, None, [1, 2, 3, 4]) == 2
    assert anchor.id in c.nodes and anchor.host_lock_ref == 1 and len(c.host.free_list) == 0  # type: ignore[union-attr]


def test_a_split_anchor_releases_both_halves() -> None:
    c, store = make()
    anchor = c.nodes[put(c, [1, 2])]
    settle(c)
    publish(store, [1, 2, 3])
    assert c.prefetch(anchor.id, None, [1, 2, 3]) == 1
    c.match_prefix(None, [1])  # splits the anchor: the new head shares its protection
    head = anchor.parent
    assert head is not None and head.host_lock_ref == 1 and anchor.host_lock_ref == 1
    c.fetch(0)
    assert c.check_prefetch(0) == 1
    assert head.host_lock_ref == 0 and anchor.host_lock_ref == 0


def test_an_anchor_that_lost_its_backup_asks_storage_nothing() -> None:
    """Write-back's reclaim strips the anchor's backup between match and prefetch: the prefetch gate (a
    backed-up anchor or the root) holds when the prefetch is made, so nothing is asked and nothing is
    host-protected (D18; an earlier spec prefetched from it and kept it protected)."""
    from kvcert.conformance.harness.driver import run_trace
    from kvcert.refimpl import factory
    from kvcert.spec.ops import CheckPrefetch, Evict, EvictHost, Fetch, Insert, Match, Prefetch, Publish

    config = CacheConfig(
        capacity=6, host_capacity=6, write_policy="write_back", load_back_threshold=1, prefetch_policy="wait_complete"
    )
    ops = [
        Publish(None, (1, 1)),
        Match(None, (1,)),
        Prefetch(1),
        Fetch(0),
        CheckPrefetch(0),  # [1] is in the tree, host only
        Insert(None, (1,)),  # restored: a settled duplicate
        Match(None, (1, 1)),  # host node [1]: an anchor (D13)
        EvictHost(1),  # write-back reclaims its backup
        Prefetch(6),  # the anchor has no backup now: the gate says no
    ]
    h = run_trace(factory(config), config, factory.capabilities, ops, quiesce=False)
    assert h.oracle.prefetches == []
    anchor = h.oracle.nodes[h.anchors[6][1]]
    assert anchor.host_slots is None and anchor.host_lock_ref == 0
    h.step(Evict(6))
    h.quiesce()


def test_harness_follows_a_write_back_attempt_that_was_skipped() -> None:
    """Found by the long run: under write-back an eviction tries a node whose backup fails (an armed
    fault) and skips it, then evicts a tied victim. The oracle must try the same node first, or the
    fault lands on the victim instead (SPEC.md §9.3; the harness tries both orders)."""
    from kvcert.conformance.harness.driver import run_trace
    from kvcert.refimpl import factory
    from kvcert.spec.ops import Evict, InjectFault, Insert

    config = CacheConfig(
        capacity=6, host_capacity=6, write_policy="write_back", load_back_threshold=1, prefetch_policy="timeout"
    )
    ops = [
        Insert(None, (2,)),
        Insert(None, (1, 1)),
        Evict(1),  # [2] backed up, stored, demoted: its store copy host-locks it
        Insert(None, (1, 1, 2)),
        Evict(1),  # the new [2] leaf likewise: [1, 1] now sits above a protected host copy
        InjectFault("host_alloc"),
        Evict(1),  # [1, 1]'s backup fails: skipped, nothing freed
        Insert(None, (1, 2)),  # splits [1, 1]; the new leaf ties with its tail
        InjectFault("host_alloc"),
        Evict(2),  # tries the tail first (the fault is spent on it), then evicts the leaf
    ]
    h = run_trace(factory(config), config, factory.capabilities, ops)
    assert not h.oracle.armed_faults.get("host_alloc")
