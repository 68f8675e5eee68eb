"""Running requests (SPEC.md §4.8), unaligned inserts (§4.2) and odd namespaces: the protocol passes on correct
caches, and each new check fails on a cache that breaks it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import kvcert.gpu as gpu
from kvcert.conformance.certification.replay import replay_failure
from kvcert.conformance.harness.driver import ConformanceFailure, Harness, run_trace
from kvcert.refimpl import RefCache
from kvcert.refimpl import factory as ref_factory
from kvcert.spec.ops import Checkpoint, Evict, Extend, Finish, Insert, Lock, Match, Op, Start, Unlock
from kvcert.spec.types import CacheConfig, Capabilities, MatchOut

CAPS: Capabilities = ref_factory.capabilities  # type: ignore[attr-defined]


def T(n: int, base: int = 0) -> tuple[int, ...]:
    return tuple(range(base, base + n))


def life(ps: int) -> list[Op]:
    """Two requests share a cached prefix: prompts ending mid-page, decoding, checkpoints over a locked path,
    a checkpoint that finds its pages cached by the other (duplicates freed), one finish that caches, one not."""
    prompt = T(8) + T(5, 100)
    return [
        Insert(None, T(8)),
        Start(None, prompt, 1),
        Extend(1, T(7, 200)),
        Checkpoint(1),
        Extend(1, (1, 2, 3)),
        Start(None, prompt + T(7, 200)),
        Finish(1),
        Checkpoint(5),
        Extend(5, (9,) * ps),
        Finish(5, cache=False),
        Evict(64),
    ]


@pytest.mark.parametrize("factory", [ref_factory, gpu.factory], ids=["refimpl", "gpu"])
@pytest.mark.parametrize("ps", [1, 4])
def test_a_running_request_life_passes_and_gives_back_every_slot(factory: Any, ps: int) -> None:
    config = CacheConfig(capacity=64, page_size=ps)
    h = run_trace(factory(config), config, factory.capabilities, life(ps), close=False)
    try:
        assert not h.ledger.running and h.running_requests() == []
        snap = h.backend.snapshot()
        assert len(snap.free_slots) == snap.capacity and len(snap.nodes) == 1
    finally:
        h.close()


def test_what_a_request_owns_is_lent_and_counted() -> None:
    config = CacheConfig(capacity=64, page_size=4)
    h = Harness(RefCache(config), config, CAPS)
    try:
        h.step(Start(None, T(6)))  # two pages of its own, the second half used
        snap = h._snapshot(1, None)
        assert len(snap.lent_slots) == 8 and len(snap.free_slots) == 56
        h.step(Checkpoint(0))  # one whole page to the tree; the partial one stays the request's
        snap = h._snapshot(2, None)
        assert len(snap.lent_slots) == 4 and len(snap.free_slots) == 56
        h.step(Finish(0, cache=False))
        assert h._snapshot(3, None).lent_slots == ()
    finally:
        h.close()


class LendsTwice(RefCache):
    """An allocator that hands the second caller the first one's slots while they are still lent."""

    def alloc(self, n: int) -> tuple[int, ...]:
        got = super().alloc(n)
        if getattr(self, "_first", None) is None:
            self._first = got
            return got
        self.pool.give_back(got)
        return self._first[:n]  # type: ignore[no-any-return]


def test_a_slot_lent_to_two_running_requests_is_caught() -> None:
    config = CacheConfig(capacity=64, page_size=1)
    with pytest.raises(ConformanceFailure) as err:
        run_trace(LendsTwice(config), config, CAPS, [Start(None, T(4)), Start(None, T(4, 50))])
    assert {v.inv for v in err.value.violations} & {"INV-SLOT-1", "INV-ACCT-3"}


class ShortMatchAfterInsert(RefCache):
    """A match right after an insert reports one page less (a stale match index): a checkpointed request's row
    would point at slots the tree does not hold for it."""

    def insert(self, *args: Any, **kwargs: Any) -> Any:
        self._just_inserted = True
        return super().insert(*args, **kwargs)

    def match_prefix(self, namespace: Any, tokens: Any) -> MatchOut:
        got = super().match_prefix(namespace, tokens)
        if getattr(self, "_just_inserted", False) and got.length:
            self._just_inserted = False
            n = got.length - self.page_size
            return MatchOut(n, got.slots[:n], got.node, got.host_length, got.host_node)
        return got


def test_a_checkpoint_whose_prefix_is_not_cached_is_caught() -> None:
    config = CacheConfig(capacity=64, page_size=2)
    with pytest.raises(ConformanceFailure) as err:
        run_trace(ShortMatchAfterInsert(config), config, CAPS, [Start(None, T(6)), Checkpoint(0)])
    assert "INV-REQ-1" in {v.inv for v in err.value.violations}


class ScribblesOnLock(RefCache):
    """Locking a node writes stale KV into the slot after its last one (a DMA into what it takes for a free
    neighbour): there a running request keeps its own, not yet cached, KV."""

    def inc_lock_ref(self, node_id: int) -> None:
        super().inc_lock_ref(node_id)
        node = self.nodes.get(node_id)
        if node is not None and node.slots and node.slots[-1] + 1 in self.kv:
            self.kv[node.slots[-1] + 1] = bytes(len(self.kv[node.slots[-1] + 1]))


def test_a_running_request_whose_own_kv_is_overwritten_is_caught() -> None:
    config = CacheConfig(capacity=64, page_size=2)  # the checkpoint leaves token 6 in the request's partial page
    ops: list[Op] = [Insert(None, T(4)), Start(None, T(4) + T(3, 100)), Checkpoint(1)]
    with pytest.raises(ConformanceFailure) as err:
        run_trace(ScribblesOnLock(config), config, CAPS, ops)
    assert "INV-REQ-2" in {v.inv for v in err.value.violations}


def test_a_trace_that_steals_a_requests_lock_is_no_failure_of_the_backend() -> None:
    """Shrinking can delete a Lock and keep its Unlock; with a request holding that node the trace is one no
    caller could play, and the shrinker must not keep it as a smaller counterexample."""
    config = CacheConfig(capacity=32, page_size=1)
    ops: list[Op] = [Match(None, T(2)), Start(None, T(2)), Unlock(0), Finish(1)]
    assert replay_failure(ref_factory, CAPS, config, ops) is None
    ops_ok: list[Op] = [Match(None, T(2)), Start(None, T(2)), Lock(0), Unlock(0), Finish(1)]
    assert replay_failure(ref_factory, CAPS, config, ops_ok) is None


class Lenient(RefCache):
    """The reference model with SGLang's lenient insert: a key that ends mid-page caches its aligned head."""

    def insert(self, namespace: Any, tokens: Any, slots: Any, priority: int = 0) -> Any:
        cut = len(tokens) - len(tokens) % self.page_size
        return super().insert(namespace, tokens[:cut], slots[:cut], priority)


class LenientKeepsTail(Lenient):
    """...that also takes the tail's slots (frees them itself): the caller still owns them."""

    def insert(self, namespace: Any, tokens: Any, slots: Any, priority: int = 0) -> Any:
        out = super().insert(namespace, tokens, slots, priority)
        cut = len(tokens) - len(tokens) % self.page_size
        if cut < len(slots):
            self.pool.give_back(slots[cut:])
        return out


LENIENT = replace(CAPS, name="lenient refimpl", strict_input=False, aligns_keys=True)


def test_unaligned_inserts_cache_the_aligned_head_and_leave_the_tail_to_the_caller() -> None:
    config = CacheConfig(capacity=64, page_size=4)
    ops: list[Op] = [Insert(None, T(6)), Insert(None, T(11)), Match(None, T(11)), Insert(None, (7, 7, 7)), Evict(64)]
    run_trace(Lenient(config), config, LENIENT, ops)
    with pytest.raises(ConformanceFailure):
        run_trace(LenientKeepsTail(config), config, LENIENT, ops)


def test_a_strict_backend_still_rejects_an_unaligned_key() -> None:
    config = CacheConfig(capacity=64, page_size=4)
    h = run_trace(RefCache(config), config, CAPS, [Insert(None, T(6))], close=False)
    try:
        assert len(h.backend.snapshot().nodes) == 1
    finally:
        h.close()


class FoldsNamespace(RefCache):
    """Keys namespaces by `str(ns)`: the default namespace and the LoRA named "None" share a tree."""

    def insert(self, namespace: Any, tokens: Any, slots: Any, priority: int = 0) -> Any:
        return super().insert(str(namespace), tokens, slots, priority)

    def match_prefix(self, namespace: Any, tokens: Any) -> MatchOut:
        return super().match_prefix(str(namespace), tokens)


def test_the_default_namespace_and_one_named_none_are_kept_apart() -> None:
    config = CacheConfig(capacity=64, page_size=1)
    ops: list[Op] = [Insert(None, T(4)), Match("None", T(4))]
    run_trace(RefCache(config), config, CAPS, ops)
    with pytest.raises(ConformanceFailure):
        run_trace(FoldsNamespace(config), config, CAPS, ops)


def test_a_request_on_kv_still_loading_is_not_read_before_the_load_lands() -> None:
    """Found by certifying kvcert.gpu (its copies land only when completed): a request matched a node whose
    load was in flight and checkpointed; reading its row then read KV not yet there. The tree's part of a
    row is judged as the tree's (INV-KV-1, which waits for the load), the request's own part every step."""
    from pathlib import Path

    from kvcert.spec.ops import Trace

    trace = Trace.from_json((Path(__file__).parent / "running" / "request-matches-a-loading-node.json").read_text())
    for factory in (ref_factory, gpu.factory):
        run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))


@pytest.mark.parametrize("factory", [ref_factory, gpu.factory], ids=["refimpl", "gpu"])
def test_a_checkpoint_past_the_prompt_keeps_the_prompt_a_node_of_its_own(factory: Any) -> None:
    """SGLang's scheduler re-inserts a request's prompt one priority up once it has decoded past it (§4.8): the
    tree splits at the prompt's last whole page, and the prompt outranks what was decoded under `priority`."""
    config = CacheConfig(capacity=64, page_size=4, policy="priority")
    ops: list[Op] = [Start(None, T(6), 3), Extend(0, T(7, 100)), Checkpoint(0)]
    h = run_trace(factory(config), config, factory.capabilities, ops, quiesce=False, close=False)
    try:
        spec = h.oracle.snapshot()
        edges = sorted(len(n.key) for n in spec.nodes if n.id != spec.root)
        assert edges == [4, 8]  # 13 tokens: 12 cached, split after the prompt's one whole page
        (head,) = [n for n in h.oracle.nodes.values() if len(n.key) == 4]
        (tail,) = [n for n in h.oracle.nodes.values() if len(n.key) == 8]
        assert (head.priority, tail.priority) == (4, 3)
        mine = h.backend.snapshot()
        assert sorted(len(n.key) for n in mine.nodes if n.id != mine.root) == edges
    finally:
        h.close()


def test_an_insert_counts_no_hit_on_what_the_request_inserted_before() -> None:
    """`inserted_len` (SGLang's `cache_inserted_len`): the oracle of an engine's own checkpoint counts a hit only on
    nodes past what the request's earlier checkpoints inserted; a plain insert counts one on every node."""
    cache = RefCache(CacheConfig(capacity=32, page_size=1, policy="lfu"))
    first = cache.alloc(4)
    cache.insert(None, T(4), first)
    hits = lambda: sorted(n.hit_count for n in cache.nodes.values() if n is not cache.root)  # noqa: E731
    assert hits() == [1]
    more = cache.alloc(2)
    cache.insert(None, T(6), first + more, inserted_len=4)  # the same request, two tokens further
    assert hits() == [1, 1]  # the old node, split at nothing, keeps its one hit; the new one gets its first
    cache.insert(None, T(6), first + more, inserted_len=6)
    assert hits() == [1, 1]
    cache.insert(None, T(6), first + more)
    assert hits() == [2, 2]
