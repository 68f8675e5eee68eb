"""A long seeded workload on `kvcert.gpu:factory_threaded`: copies move on the worker thread while the tree changes.

Thousands of operations (insert, match, lock/unlock, eviction with demotion to host, load-back,
host eviction, completes and polls, injected copy failures, retraction backup/restore/discard)
under write-through and write-back, with many copies in flight at once. Every few operations
the engine is drained (`ThreadedCopyEngine.drain`: every submitted copy has moved its bytes —
nothing is acknowledged) and then the snapshot must pass every spec invariant
(`kvcert.spec.invariants.check_snapshot`, as the conformance driver checks it), every slot of
every node on both tiers — pending copies included, since their bytes have moved — and every
retraction backup must hold the KV written for its tokens, and no slot may leak. At the end
copies are settled by bounded complete/poll loops and the cache is emptied completely.

Outcomes do not depend on the worker's timing: the same seed on the deferred engine (bytes
move only in `finish`) must produce the same outcome log, and does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Optional

import pytest

from kvcert.gpu import GpuCache, factory, factory_threaded
from kvcert.gpu.copy_engine import DeferredCopyEngine, ThreadedCopyEngine
from kvcert.spec import contracts, pages
from kvcert.spec import storage as l3
from kvcert.spec.invariants import check_snapshot
from kvcert.spec.types import CacheConfig, KVCertError, Snapshot

PS = 2
OPS = 6000
CHECK_EVERY = 40
SETTLE_ROUNDS = 64
"""Bound on complete/poll rounds when settling: each round completes every open copy, so one
round suffices unless armed failures hit; more rounds than armed failures is a hang."""

CONFIGS = {
    wp: CacheConfig(
        page_size=PS,
        capacity=96,
        host_capacity=192,
        write_policy=wp,
        kv_layers=2,
        load_back_threshold=PS,
    )
    for wp in ("write_through", "write_back")
}
FAMILIES = [tuple(1000 * f + i for i in range(12)) for f in range(6)]
"""Shared prefixes: requests that share them split and re-match nodes."""


class Soak:
    """One seeded workload on one cache; `log` records every outcome the cache returned."""

    def __init__(self, cache: GpuCache, config: CacheConfig, seed: int, moved: bool) -> None:
        self.cache, self.config = cache, config
        self.rng = random.Random(seed)
        self.moved = moved
        """True when a drained engine has moved the bytes of every pending copy (threaded)."""
        self.layers = config.kv_layers
        self.log: list[tuple[Any, ...]] = []
        self.handles: list[int] = []
        self.host_hits: list[int] = []
        self.locked: list[int] = []
        self.backups: dict[int, tuple[bytes, ...]] = {}
        self.checks = 0
        self.in_flight_max = 0

    # ------------------------------------------------------------------ workload

    def tokens(self) -> tuple[Optional[str], tuple[int, ...]]:
        rng = self.rng
        ns = rng.choice([None, None, "a"])
        shared = rng.randrange(0, 5) * PS
        tail = tuple(rng.randrange(40) for _ in range(rng.randrange(1, 4) * PS))
        return ns, FAMILIES[rng.randrange(len(FAMILIES))][:shared] + tail

    def entries(self, ns: Optional[str], tokens: tuple[int, ...]) -> tuple[bytes, ...]:
        return l3.token_entries(ns, tokens, self.layers)

    def alloc(self, n: int) -> Optional[tuple[int, ...]]:
        cache = self.cache
        if cache.free_count() < n:
            self.log.append(("make-room", cache.evict(n - cache.free_count())))
        if cache.free_count() < n:
            return None
        return tuple(cache.alloc(n))

    def op_insert(self) -> None:
        ns, tokens = self.tokens()
        slots = self.alloc(len(tokens))
        if slots is None:
            self.log.append(("insert", "full"))
            return
        self.cache.write_kv(slots, self.entries(ns, tokens))
        out = self.cache.insert(ns, tokens, slots, self.rng.randrange(3))
        self.cache.free(slots[: out.prefix_len])
        self.handles.append(out.node)
        self.log.append(("insert", out.prefix_len, out.node))

    def op_match(self) -> None:
        ns, tokens = self.tokens()
        m = self.cache.match_prefix(ns, tokens)
        self.handles.append(m.node)
        if m.host_length:
            self.host_hits.append(m.host_node)
        self.log.append(("match", m.length, m.host_length, m.node, m.host_node))

    def op_lock(self) -> None:
        if self.handles:
            node = self.rng.choice(self.handles[-20:])
            self.log.append(("lock", node, self.call(lambda: self.cache.inc_lock_ref(node))))
            if self.log[-1][-1] is None:
                self.locked.append(node)

    def op_unlock(self) -> None:
        if self.locked:
            node = self.locked.pop(self.rng.randrange(len(self.locked)))
            self.log.append(("unlock", node, self.call(lambda: self.cache.dec_lock_ref(node))))

    def op_evict(self) -> None:
        self.log.append(("evict", self.cache.evict(self.rng.randrange(1, 9) * PS)))

    def op_evict_host(self) -> None:
        self.log.append(("evict_host", self.cache.evict_host(self.rng.randrange(1, 9) * PS)))

    def op_load_back(self) -> None:
        """Mostly a fresh host hit (match, then load what it found on the host); sometimes an older handle."""
        if self.rng.random() < 0.75:
            ns, tokens = self.tokens()
            m = self.cache.match_prefix(ns, tokens)
            self.log.append(("match", m.length, m.host_length, m.node, m.host_node))
            if not m.host_length:
                return
            node = m.host_node
        elif self.host_hits:
            node = self.rng.choice(self.host_hits[-10:])
        else:
            return
        self.log.append(("load_back", node, self.call(lambda: self.cache.load_back(node))))

    def op_complete(self) -> None:
        open_ = [c.id for c in self.cache.snapshot().pending if not c.finished]
        self.in_flight_max = max(self.in_flight_max, len(open_))
        if open_:
            copy = self.rng.choice(open_)
            self.cache.complete(copy)
            self.log.append(("complete", copy))

    def op_poll(self) -> None:
        self.log.append(("poll", self.cache.poll()))

    def op_fault(self) -> None:
        self.cache.inject_fault("copy")
        self.log.append(("fault",))

    def op_retract(self) -> None:
        ns, tokens = self.tokens()
        slots = self.alloc(pages.page_ceil(len(tokens), PS))
        if slots is None:
            return
        entries = self.entries(ns, tokens)
        own = slots[: len(tokens)]
        self.cache.write_kv(own, entries)
        backup = self.cache.retraction_backup(own)
        self.cache.free(slots)
        if backup is not None:
            self.backups[backup] = entries
        self.log.append(("retract", backup))

    def op_restore(self) -> None:
        if not self.backups:
            return
        backup = self.rng.choice(sorted(self.backups))
        entries = self.backups[backup]
        if self.rng.random() < 0.3:
            self.cache.retraction_discard(backup)
            del self.backups[backup]
            self.log.append(("discard", backup))
            return
        slots = self.alloc(pages.page_ceil(len(entries), PS))
        if slots is None:
            return
        node = self.cache.retraction_restore(backup, slots[: len(entries)])
        del self.backups[backup]
        assert self.cache.read_kv(slots[: len(entries)]) == list(entries), "restore put other KV in the slots"
        self.cache.dec_lock_ref(node)  # the resumed request finishes at once
        self.cache.free(slots)
        self.log.append(("restore", backup, node))

    def call(self, fn: Callable[[], object]) -> object:
        """`fn()`'s result, or the name of the protocol error it raised (a stale handle: a legal, logged outcome)."""
        try:
            return fn()
        except KVCertError as err:
            return type(err).__name__

    OPS: list[tuple[str, int]] = [
        ("op_insert", 26),
        ("op_match", 16),
        ("op_lock", 6),
        ("op_unlock", 6),
        ("op_evict", 8),
        ("op_evict_host", 4),
        ("op_load_back", 14),
        ("op_complete", 8),
        ("op_poll", 5),
        ("op_fault", 1),
        ("op_retract", 3),
        ("op_restore", 3),
    ]

    def run(self, ops: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for i in range(ops):
            self.cache.set_clock(i + 1)
            getattr(self, self.rng.choices(names, weights)[0])()
            if (i + 1) % CHECK_EVERY == 0:
                self.check()
        self.settle()
        self.check()
        self.empty()

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Drain the engine, then every invariant, every node's KV on both tiers, every backup's, and no leak."""
        self.cache.engine.drain()
        snap = self.cache.snapshot()
        self.in_flight_max = max(self.in_flight_max, sum(not c.finished for c in snap.pending))
        violations = check_snapshot(snap)
        assert not violations, "\n".join(map(str, violations))
        loading = {n for c in snap.pending if c.kind == "load" for n in c.nodes}
        writing = {n for c in snap.pending if c.kind == "write" for n in c.nodes}
        paths = contracts.node_paths(snap)
        for node in snap.nodes:
            if node.id == snap.root:
                continue
            ns, path = paths[node.id]
            want = list(self.entries(ns, path)[len(path) - len(node.key) :])
            if node.slots is not None and (self.moved or node.id not in loading):
                assert self.cache.read_kv(node.slots) == want, f"device KV of node {node.id} ({len(path)} tokens)"
            if node.host_slots is not None and (self.moved or node.id not in writing):
                assert self.cache.read_host_kv(node.host_slots) == want, f"host KV of node {node.id}"
        for r in snap.retractions:
            assert self.cache.read_host_kv(r.host_slots[: r.tokens]) == list(self.backups[r.id]), f"backup {r.id}"
        self.check_no_leak(snap)
        self.checks += 1

    def check_no_leak(self, snap: Snapshot) -> None:
        held = sum(len(n.slots) for n in snap.nodes if n.slots is not None)
        assert len(snap.free_slots) + held == snap.capacity, "device slots leaked"
        assert len(snap.free_slots) == self.cache.free_count()
        host_held = sum(len(n.host_slots) for n in snap.nodes if n.host_slots is not None)
        host_held += sum(len(r.host_slots) for r in snap.retractions)
        host_held += sum(len(p.host_slots) for p in snap.prefetches)
        assert len(snap.host_free_slots) + host_held == snap.host_capacity, "host slots leaked"

    def settle(self) -> None:
        """Complete every open copy and consume every ack, in bounded rounds (an armed failure retries a copy)."""
        for _ in range(SETTLE_ROUNDS):
            pending = self.cache.snapshot().pending
            if not pending:
                return
            for c in pending:
                if not c.finished:
                    self.cache.complete(c.id)
            self.log.append(("settle-poll", self.cache.poll()))
        raise AssertionError(f"copies still pending after {SETTLE_ROUNDS} complete/poll rounds")

    def empty(self) -> None:
        """Release everything the workload holds; both tiers must then empty completely."""
        for node in self.locked:
            self.cache.dec_lock_ref(node)
        self.locked = []
        for backup in sorted(self.backups):
            self.cache.retraction_discard(backup)
        self.backups = {}
        self.log.append(("final-evict", self.cache.evict(self.config.capacity)))
        self.settle()
        self.log.append(("final-evict-host", self.cache.evict_host(self.config.host_capacity)))
        snap = self.cache.snapshot()
        assert [n.id for n in snap.nodes] == [snap.root], "nodes left after emptying the cache"
        assert len(snap.free_slots) == snap.capacity and len(snap.host_free_slots) == snap.host_capacity
        assert not snap.pending and not snap.retractions
        self.check_no_leak(snap)


def soak(build: Callable[[CacheConfig], GpuCache], config: CacheConfig, seed: int, ops: int) -> Soak:
    cache = build(config)
    try:
        assert isinstance(cache.engine, (ThreadedCopyEngine, DeferredCopyEngine))
        s = Soak(cache, config, seed, moved=isinstance(cache.engine, ThreadedCopyEngine))
        s.run(ops)
        return s
    finally:
        cache.close()


@pytest.mark.parametrize("write_policy", sorted(CONFIGS))
def test_threaded_engine_soak_keeps_every_invariant_and_every_byte(write_policy: str) -> None:
    config = CONFIGS[write_policy]
    threaded = soak(factory_threaded, config, seed=7, ops=OPS)
    assert threaded.checks >= OPS // CHECK_EVERY
    kinds = {entry[0] for entry in threaded.log}
    assert {"insert", "match", "evict", "evict_host", "load_back", "complete", "poll", "retract", "restore"} <= kinds
    assert any(e[0] == "load_back" and isinstance(e[-1], int) and e[-1] > 0 for e in threaded.log), "no load-back ran"
    assert threaded.in_flight_max >= 4, "the workload never had several copies in flight"
    deferred = soak(factory, config, seed=7, ops=OPS)
    assert threaded.log == deferred.log, "the worker's timing changed an outcome"
