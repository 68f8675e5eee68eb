"""kvcert.gpu's tensor-native API is the Backend protocol's internals without the tuples.

Two caches replay one seeded random workload, one through `alloc_tensor` / `match_prefix_fast` /
`insert_fast` / `free_tensor`, the other through `alloc` / `match_prefix` / `insert` / `free`:
every answer (slots, node ids, prefix lengths, host hits) and every snapshot must agree. Bad input
to the fast API raises the protocol's typed error and changes nothing.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcert.gpu import GpuCache, factory
from kvcert.spec import pages
from kvcert.spec.types import (
    POLICIES,
    CacheConfig,
    InvalidCount,
    InvalidToken,
    KVCertError,
    LengthMismatch,
    PoolExhausted,
    SlotNotOwned,
    UnalignedKey,
)

CONFIGS = [
    CacheConfig(page_size=1, capacity=48),
    CacheConfig(page_size=4, capacity=64, policy="lfu"),
    CacheConfig(page_size=2, capacity=32, host_capacity=64, load_back_threshold=2),
    CacheConfig(page_size=4, capacity=48, host_capacity=96, write_policy="write_back", policy="priority"),
]


def as_key(tokens: tuple[int, ...], form: int) -> Any:
    """The same token ids in each form the fast API takes."""
    if form == 0:
        return array("q", tokens)
    if form == 1:
        return array("q", tokens).tobytes()
    if form == 2:
        return torch.tensor(tokens, dtype=torch.int64)
    return list(tokens)


def slots_of(t: torch.Tensor) -> tuple[int, ...]:
    assert t.dtype == torch.int64 and t.dim() == 1
    return tuple(t.tolist())


def settle(cache: GpuCache) -> None:
    for copy in cache.in_flight():
        cache.complete(copy)
    cache.poll()


class Pair:
    """The same calls on two caches: `fast` through the tensor API, `proto` through the protocol."""

    def __init__(self, config: CacheConfig) -> None:
        self.fast, self.proto = factory(config), factory(config)
        self.ps = config.page_size
        self.held: list[tuple[torch.Tensor, tuple[int, ...]]] = []
        """Slots each cache lent and nobody gave back yet."""

    def same(self) -> None:
        assert self.fast.snapshot() == self.proto.snapshot()

    def both(self, fn: Callable[[GpuCache], Any]) -> Any:
        a, b = fn(self.fast), fn(self.proto)
        assert a == b
        return a

    def alloc(self, n: int) -> Any:
        try:
            t = self.fast.alloc_tensor(n)
        except PoolExhausted:
            with pytest.raises(PoolExhausted):
                self.proto.alloc(n)
            return None
        s = self.proto.alloc(n)
        assert slots_of(t) == s
        return t, s

    def match(self, ns: Any, tokens: tuple[int, ...], form: int) -> tuple[int, int]:
        a = self.fast.match_prefix_fast(ns, as_key(tokens, form))
        b = self.proto.match_prefix(ns, tokens)
        assert (slots_of(a.slots), a.node, a.host_length, a.host_node) == (b.slots, b.node, b.host_length, b.host_node)
        assert len(a.slots) == b.length
        return b.node, b.host_node

    def insert(self, ns: Any, tokens: tuple[int, ...], form: int, priority: int, shuffle: bool) -> int:
        got = self.alloc(len(tokens))
        if got is None:
            return 0
        t, s = got
        if shuffle:  # a valid run that is not whole pages in slot order: the per-slot path
            order = list(range(len(s)))
            random.Random(len(s)).shuffle(order)
            t, s = t[order], tuple(s[i] for i in order)
        a = self.fast.insert_fast(ns, as_key(tokens, form), t, priority)
        b = self.proto.insert(ns, tokens, s, priority)
        assert (a.prefix_len, a.node) == (b.prefix_len, b.node)
        dup_t, dup_s = t[: a.prefix_len], s[: b.prefix_len]
        if dup_s:
            if len(dup_s) > 1 and len(dup_s) % 2 == 0:  # give back in two halves: pages torn, then whole again
                half = len(dup_s) // 2
                self.fast.free_tensor(dup_t[:half])
                self.proto.free(dup_s[:half])
                self.fast.free_tensor(dup_t[half:])
                self.proto.free(dup_s[half:])
            else:
                self.fast.free_tensor(dup_t)
                self.proto.free(dup_s)
        return b.node


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"p{c.page_size}-{c.policy}-h{c.host_capacity}-{c.write_policy}"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_api_and_protocol_agree_on_a_random_workload(config: CacheConfig, seed: int) -> None:
    rng = random.Random(seed)
    pair = Pair(config)
    ps = config.page_size
    vocab = [tuple(rng.randrange(4) for _ in range(ps)) for _ in range(5)]
    keys: list[tuple[int, ...]] = []
    handles: list[int] = []
    locked: list[int] = []
    loaded = torn = 0
    for step in range(400):
        for cache in (pair.fast, pair.proto):
            cache.set_clock(step + 1)
        ns = rng.choice([None, None, "b"])
        if keys and rng.random() < 0.5:
            base = rng.choice(keys)
            tokens = base[: rng.randrange(len(base) + 1) // ps * ps] + sum(
                (rng.choice(vocab) for _ in range(rng.randrange(3))), ()
            )
        else:
            tokens = sum((rng.choice(vocab) for _ in range(rng.randrange(1, 6))), ())
        roll = rng.random()
        if roll < 0.35:
            handles.append(pair.insert(ns, tokens, rng.randrange(4), rng.randrange(3), rng.random() < 0.15))
            keys.append(tokens)
        elif roll < 0.6:
            tail = tuple(rng.randrange(4) for _ in range(rng.randrange(ps)))  # a match is cut to whole pages
            node, host_node = pair.match(ns, tokens + tail, rng.randrange(4))
            handles.append(node)
            if host_node != node and config.host_capacity and rng.random() < 0.5:
                loaded += pair.both(lambda c, h=host_node: c.load_back(h))
        elif roll < 0.7 and handles:
            node = rng.choice(handles)
            if pair.both(lambda c, h=node: c.nodes.get(h) is not None):
                pair.both(lambda c, h=node: c.inc_lock_ref(h))
                locked.append(node)
        elif roll < 0.8 and locked:
            node = locked.pop(rng.randrange(len(locked)))
            pair.both(lambda c, h=node: c.dec_lock_ref(h))
        elif roll < 0.9:
            n = rng.randrange(2 * config.capacity // 3)
            pair.both(lambda c, k=n: c.evict(k))
        elif config.host_capacity and roll < 0.95:
            n = rng.randrange(config.host_capacity // 2)
            pair.both(lambda c, k=n: c.evict_host(k))
        else:
            got = pair.alloc(ps * rng.randrange(1, 3))
            if got is not None:
                pair.fast.free_tensor(got[0])
                pair.proto.free(got[1])
        if rng.random() < 0.5:
            pair.both(settle)
        torn += bool(pair.fast.alloc_dev.mixed)
        pair.same()
    assert loaded or not config.host_capacity, "the workload must load host hits back"
    assert torn or config.page_size == 1, "and tear pages (the per-slot path)"


def bad_calls(cache: GpuCache, ps: int, lent: torch.Tensor) -> list[tuple[type[KVCertError], Callable[[], Any]]]:
    """(the protocol's error, a fast-API call that must raise it) for each kind of bad input."""
    good = tuple(range(5, 5 + 2 * ps))
    own = lent[: 2 * ps]
    free = torch.tensor([s for s in range(cache.capacity) if cache.alloc_dev.is_free(s)][: 2 * ps])
    return (
        [
            (InvalidToken, lambda: cache.insert_fast(None, array("q", (*good[:-1], -1)), own)),
            (InvalidToken, lambda: cache.insert_fast(None, torch.tensor(good, dtype=torch.float32), own)),
            (InvalidToken, lambda: cache.insert_fast(None, torch.tensor([good]), own)),
            (InvalidToken, lambda: cache.insert_fast(None, array("d", good), own)),
            (InvalidToken, lambda: cache.insert_fast(None, b"\x01" * 7, own)),
            (InvalidToken, lambda: cache.insert_fast(None, [1, True], own)),
            (InvalidToken, lambda: cache.insert_fast(None, "ab", own)),
            (InvalidToken, lambda: cache.match_prefix_fast(None, array("q", (3, -2)))),
            (InvalidToken, lambda: cache.match_prefix_fast(None, torch.tensor([1.0]))),
            (LengthMismatch, lambda: cache.insert_fast(None, array("q", good), lent[:ps])),
            (InvalidCount, lambda: cache.insert_fast(None, array("q", good), own, True)),  # type: ignore[arg-type]
            (InvalidCount, lambda: cache.insert_fast(None, array("q", good), own, "1")),  # type: ignore[arg-type]
            (SlotNotOwned, lambda: cache.insert_fast(None, array("q", good), free)),
            (SlotNotOwned, lambda: cache.insert_fast(None, array("q", good), torch.cat([own[:ps], own[:ps]]))),
            (SlotNotOwned, lambda: cache.insert_fast(None, array("q", good), own.to(torch.float64))),
            (SlotNotOwned, lambda: cache.insert_fast(None, array("q", good), own - cache.capacity)),
            (SlotNotOwned, lambda: cache.free_tensor(free)),
            (SlotNotOwned, lambda: cache.free_tensor(torch.cat([own[:1], own[:1]]))),
            (SlotNotOwned, lambda: cache.free_tensor(own + cache.capacity)),
            (SlotNotOwned, lambda: cache.free_tensor(own.view(2, ps))),
            (InvalidCount, lambda: cache.alloc_tensor(-ps)),
            (InvalidCount, lambda: cache.alloc_tensor(True)),  # type: ignore[arg-type]
            (PoolExhausted, lambda: cache.alloc_tensor(cache.capacity * 2)),
        ]
        + ([(UnalignedKey, lambda: cache.insert_fast(None, array("q", good[:-1]), own[:-1]))] if ps > 1 else [])
    )


@pytest.mark.parametrize("ps", [1, 4])
def test_bad_input_to_the_fast_api_raises_the_protocols_error_and_changes_nothing(ps: int) -> None:
    cache = factory(CacheConfig(page_size=ps, capacity=16 * ps, host_capacity=16 * ps))
    for tokens in ((1,) * ps, (1,) * ps + (2,) * ps, (3,) * 2 * ps):  # a small tree, and slots lent out
        slots = cache.alloc_tensor(len(tokens))
        out = cache.insert_fast(None, array("q", tokens), slots)
        cache.free_tensor(slots[: out.prefix_len])
    settle(cache)
    lent = cache.alloc_tensor(4 * ps)
    for error, call in bad_calls(cache, ps, lent):
        before = cache.snapshot()
        with pytest.raises(error):
            call()
        assert cache.snapshot() == before, error
    # the protocol rejects the same inputs with the same errors
    good = tuple(range(5, 5 + 2 * ps))
    own = tuple(lent[: 2 * ps].tolist())
    for error, call in [
        (InvalidToken, lambda: cache.insert(None, (*good[:-1], -1), own)),
        (LengthMismatch, lambda: cache.insert(None, good, own[:ps])),
        (InvalidCount, lambda: cache.insert(None, good, own, True)),
        (SlotNotOwned, lambda: cache.insert(None, good, own[:ps] * 2)),
        (SlotNotOwned, lambda: cache.free((own[0], own[0]))),
    ]:
        with pytest.raises(error):
            call()
    # and the lent slots still work, once
    out = cache.insert_fast(None, array("q", good), lent[: 2 * ps])
    assert out.prefix_len == 0 and cache.match_prefix_fast(None, array("q", good)).node == out.node
    cache.free_tensor(lent[2 * ps :])
    with pytest.raises(SlotNotOwned):
        cache.free_tensor(lent[2 * ps :])


def test_alloc_tensor_hands_out_whole_aligned_pages() -> None:
    cache = factory(CacheConfig(page_size=4, capacity=32))
    t = cache.alloc_tensor(12)
    assert t.dtype == torch.int64 and t.shape == (12,)
    pages_ = t.view(3, 4)
    assert bool((pages_[:, 0] % 4 == 0).all()) and bool((pages_ - pages_[:, :1] == torch.arange(4)).all())
    assert cache.free_count() == 20
    cache.free_tensor(t[4:])
    cache.free_tensor(t[:4])
    assert cache.free_count() == 32 and cache.snapshot().free_slots == tuple(range(32))


@pytest.mark.parametrize("policy", POLICIES)
def test_heap_entries_rank_as_the_spec_says(policy: str) -> None:
    cache = factory(CacheConfig(page_size=1, capacity=16, policy=policy))
    rng = random.Random(3)
    for i in range(6):
        cache.set_clock(i + 1)
        cache.insert_fast(None, array("q", (i, i + 1)), cache.alloc_tensor(2), rng.randrange(3))
        cache.match_prefix_fast(None, array("q", (rng.randrange(6), 1)))
    for n in cache.nodes.values():
        if n is not cache.root:
            shape = {"depth": n.end, "size": n.size, "history": n.history} if policy == "tlru" else {}
            params = cache.config.policy_params()
            rank = pages.policy_rank(policy, n.last_access, n.hit_count, n.creation, n.priority, **params, **shape)
            assert cache._entry(n) == (*rank, n.id)


def test_the_fast_hot_path_never_scans_the_tree() -> None:
    class Counting(dict):  # type: ignore[type-arg]
        scans = 0

        def values(self):  # type: ignore[no-untyped-def]
            Counting.scans += 1
            return super().values()

        def items(self):  # type: ignore[no-untyped-def]
            Counting.scans += 1
            return super().items()

        def __iter__(self):  # type: ignore[no-untyped-def]
            Counting.scans += 1
            return super().__iter__()

    cache = factory(CacheConfig(page_size=1, capacity=4096))
    cache.nodes = Counting(cache.nodes)
    for i in range(1500):
        key = array("q", (i % 7, i, i + 1))
        slots = cache.alloc_tensor(3)
        out = cache.insert_fast(None, key, slots)
        if out.prefix_len:
            cache.free_tensor(slots[: out.prefix_len])
    Counting.scans = 0
    cache.set_clock(10)
    hit = cache.match_prefix_fast(None, array("q", (3, 3, 4)))
    cache.inc_lock_ref(hit.node)
    slots = cache.alloc_tensor(4)
    out = cache.insert_fast(None, array("q", (3, 3, 4, 5)), slots)
    cache.free_tensor(slots[: out.prefix_len])
    cache.dec_lock_ref(hit.node)
    assert cache.evict(3) >= 3
    assert Counting.scans == 0
