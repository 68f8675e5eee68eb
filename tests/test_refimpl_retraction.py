"""Retraction backups (SPEC.md §9.11) and injected copy failures (§10.5) in the reference model.

One rule per test; every bad call is checked to change nothing (snapshots before and after).
"""

from __future__ import annotations

import pytest
from _refcache import put, settle

from kvcert.conformance.harness.driver import Harness, run_trace
from kvcert.conformance.zoo import MUTANTS, build
from kvcert.refimpl import RefCache
from kvcert.refimpl.cache import factory
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.ops import Complete, Discard, InjectFault, Insert, Lock, Match, Poll, Restore, Retract, Unlock
from kvcert.spec.types import (
    BadInput,
    CacheConfig,
    InvalidCount,
    LengthMismatch,
    LockUnderflow,
    SlotNotOwned,
    UnknownRetraction,
)


def make(write_policy: str = "write_through", capacity: int = 16, host: int = 16, page: int = 1) -> RefCache:
    return RefCache(CacheConfig(page_size=page, capacity=capacity, host_capacity=host, write_policy=write_policy))


def path_slots(cache: RefCache, node_id: int) -> tuple[int, ...]:
    return tuple(x for n in reversed(cache._path_to_root(cache.nodes[node_id])) for x in n.slots or ())


def test_backup_copies_tree_and_own_slots_outside_the_tree() -> None:
    c = make()
    node = put(c, [1, 2, 3])
    settle(c)
    own = c.alloc(2)
    free_host = len(c.host.free_list)  # type: ignore[union-attr]
    backup = c.retraction_backup(path_slots(c, node) + own)
    assert backup == 0
    (view,) = c.snapshot().retractions
    assert view.tokens == 5 and len(view.host_slots) == 5
    assert len(c.host.free_list) == free_host - 5  # type: ignore[union-attr]
    c.free(own)  # the request's own slots go back; the backup keeps its copy
    assert check_snapshot(c.snapshot()) == []


def test_backup_rounds_up_to_whole_host_pages() -> None:
    c = make(capacity=16, host=16, page=4)
    own = c.alloc(8)
    backup = c.retraction_backup(own[:5])
    assert backup is not None
    assert len(c.snapshot().retractions[0].host_slots) == 8
    c.free(own)
    assert check_snapshot(c.snapshot()) == []


def test_backup_host_evicts_to_make_room_and_declines_without_it() -> None:
    c = make(capacity=8, host=4)
    put(c, [1, 2, 3, 4])
    settle(c)
    c.evict(4)  # demoted: the host holds the only copy, and it is a host-eviction candidate
    own = c.alloc(4)
    assert c.retraction_backup(own) == 0, "host eviction makes room"
    assert len(c.nodes) == 1, "the host-only node was host-evicted for it"
    more = c.alloc(4)
    before = c.snapshot()
    assert c.retraction_backup(more) is None, "no host room left: declined"
    assert c.snapshot() == before


def test_injected_host_alloc_fault_declines_the_backup() -> None:
    c = make()
    own = c.alloc(2)
    c.inject_fault("host_alloc")
    assert c.retraction_backup(own) is None
    assert c.retraction_backup(own) == 0, "one fault, one failure"


@pytest.mark.parametrize(
    ("slots", "error"),
    [((), InvalidCount), ((99,), SlotNotOwned), ((0, 0), SlotNotOwned), ((True,), SlotNotOwned), ((15,), SlotNotOwned)],
)
def test_bad_backup_slots_are_rejected_and_change_nothing(slots: tuple, error: type) -> None:
    c = make()
    c.alloc(2)  # slots 0 and 1 are lent; 15 is free
    before = c.snapshot()
    with pytest.raises(error):
        c.retraction_backup(slots)
    assert c.snapshot() == before


def test_restore_frees_the_backup_and_locks_the_root_for_the_request() -> None:
    c = make()
    own = c.alloc(3)
    backup = c.retraction_backup(own)
    c.free(own)
    fresh = c.alloc(3)
    assert c.retraction_restore(backup, fresh) == c.root.id  # type: ignore[arg-type]
    assert c.snapshot().retractions == () and len(c.host.free_list) == 16  # type: ignore[union-attr]
    c.dec_lock_ref(c.root.id)  # the resumed request's final unlock balances
    with pytest.raises(LockUnderflow):
        c.dec_lock_ref(c.root.id)


@pytest.mark.parametrize("defect", ["unknown", "length", "not_lent", "used"])
def test_bad_restore_is_rejected_and_changes_nothing(defect: str) -> None:
    c = make()
    own = c.alloc(3)
    backup = c.retraction_backup(own)
    assert backup is not None
    if defect == "used":
        c.retraction_discard(backup)
    before = c.snapshot()
    error: type[BadInput]
    if defect in ("unknown", "used"):
        args, error = (backup + 7 if defect == "unknown" else backup, own), UnknownRetraction
    elif defect == "length":
        args, error = (backup, own[:2]), LengthMismatch
    else:
        args, error = (backup, (10, 11, 12)), SlotNotOwned
    with pytest.raises(error):
        c.retraction_restore(*args)
    assert c.snapshot() == before


def test_discard_frees_the_backup_once() -> None:
    c = make()
    backup = c.retraction_backup(c.alloc(2))
    assert backup is not None
    c.retraction_discard(backup)
    assert c.snapshot().retractions == () and len(c.host.free_list) == 16  # type: ignore[union-attr]
    before = c.snapshot()
    with pytest.raises(UnknownRetraction):
        c.retraction_discard(backup)
    assert c.snapshot() == before


def test_failed_write_is_retried_not_acked() -> None:
    c = make()
    node = c.nodes[put(c, [1, 2])]
    c.inject_fault("copy")
    c.complete(0)
    assert [(p.kind, p.finished) for p in c.snapshot().pending] == [("write", False)]
    assert c.poll() == 0 and node.lock_ref == 1, "the node stays pinned: it cannot be demoted onto a failed copy"
    c.complete(0)
    assert c.poll() == 1 and node.lock_ref == 0 and node.host_slots is not None


def test_failed_load_is_retried_and_keeps_both_ends() -> None:
    c = make()
    node = put(c, [1, 2])
    settle(c)
    c.evict(2)
    assert c.load_back(node) == 2
    c.inject_fault("copy")
    c.complete(c.copies[0].id)
    (pending,) = c.snapshot().pending
    assert (pending.kind, pending.finished) == ("load", False)
    assert c.nodes[node].host_lock_ref == 1 and c.nodes[node].slots is not None


def test_failed_store_copy_ends_without_writing() -> None:
    from kvcert.conformance.harness.storage import MemoryStorage

    c = RefCache(CacheConfig(capacity=16, host_capacity=16, prefetch_policy="best_effort"))
    store = MemoryStorage()
    c.attach_storage(store)
    put(c, [1, 2])
    c.complete(0)
    c.poll()  # the write's ack issues the store copy
    (store_copy,) = c.copies
    c.inject_fault("copy")
    c.complete(store_copy.id)
    assert c.poll() == 1 and not c.copies
    assert store.contents() == {}, "nothing written: a later prefetch misses"


def test_harness_restore_hands_back_a_lockable_root() -> None:
    """Through the harness: retract, restore, then the request's unlock balances (seed 003's decode bug)."""
    config = CacheConfig(capacity=16, host_capacity=16, prefetch_policy="best_effort")
    h = run_trace(
        factory(config),
        config,
        factory.capabilities,  # type: ignore[attr-defined]
        [Insert(None, (1, 2)), Match(None, (1, 2)), Retract(1, tail=2), Restore(0), Unlock(3)],
    )
    assert isinstance(h, Harness) and not h.oracle.retractions


def test_the_seed_003_mutant_fails_that_trace() -> None:
    mutant = next(m for m in MUTANTS if m.name == "retracted_resume_without_last_node")
    config = CacheConfig(capacity=16, host_capacity=16, prefetch_policy="best_effort")
    bad = build(mutant)
    with pytest.raises(AssertionError, match="INV-ERR-2"):
        run_trace(
            bad(config),
            config,
            bad.capabilities,  # type: ignore[attr-defined]
            [Insert(None, (1, 2)), Match(None, (1, 2)), Retract(1, tail=2), Restore(0), Unlock(3)],
        )


def test_harness_copy_fault_then_drain() -> None:
    config = CacheConfig(capacity=16, host_capacity=16, prefetch_policy="best_effort")
    ops = [Insert(None, (1, 2)), InjectFault("copy"), Complete(0), Poll(), Lock(0), Discard(5)]
    h = run_trace(factory(config), config, factory.capabilities, ops)  # type: ignore[attr-defined]
    assert not h.oracle.copies
