"""The harness's KV content checks (SPEC.md §9.12): silent on right bytes, loud on wrong ones.

`ContentCache` is the reference model plus KV reads that answer from the content function
(`token_entries` of each slot's path), with a switch that corrupts one kind of read: the
checks must pass it untouched and name the right invariant for each corruption.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import pytest

from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
from kvcert.refimpl import RefCache
from kvcert.spec import storage as l3
from kvcert.spec.ops import Complete, Evict, Insert, Match, Op, Poll, Restore, Retract
from kvcert.spec.types import CacheConfig

CONFIG = CacheConfig(capacity=16, host_capacity=16, prefetch_policy="best_effort", kv_layers=2)
CAPS = replace(RefCache.capabilities, kv_reads=True)


class ContentCache(RefCache):
    """Reads answer with each slot's content; `corrupt` flips the reads of one kind."""

    corrupt: Optional[str] = None

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.written: list[tuple[tuple[int, ...], tuple[bytes, ...]]] = []
        self.restored: dict[int, tuple[bytes, ...]] = {}
        self.backups: dict[int, tuple[bytes, ...]] = {}
        self.lent_kv: dict[int, bytes] = {}

    def _content(self, slot: int, host: bool) -> bytes:
        for node in self.nodes.values():
            held = node.host_slots if host else node.slots
            if node is not self.root and held is not None and slot in held:
                path = self._full_path(node)
                entries = l3.token_entries(node.namespace, path, self.kv_layers)
                return entries[len(path) - len(node.key) + held.index(slot)]
        for backup in self.retractions:
            if host and slot in backup.host_slots:
                return self.backups[backup.id][backup.host_slots.index(slot)]
        return self.lent_kv.get(slot, b"")

    def _flip(self, entry: bytes, kind: str) -> bytes:
        return bytes([entry[0] ^ 1]) + entry[1:] if self.corrupt == kind and entry else entry

    def write_kv(self, slots, entries) -> None:  # type: ignore[no-untyped-def]
        self.written.append((tuple(slots), tuple(entries)))
        self.lent_kv.update(zip(slots, entries))

    def read_kv(self, slots) -> list[bytes]:  # type: ignore[no-untyped-def]
        return [self._flip(self.lent_kv[s] if s in self.pool.lent else self._content(s, False), "device") for s in slots]

    def read_host_kv(self, host_slots) -> list[bytes]:  # type: ignore[no-untyped-def]
        return [self._flip(self._content(s, True), "host") for s in host_slots]

    def retraction_backup(self, slots):  # type: ignore[no-untyped-def]
        entries = tuple(self.lent_kv.get(s, b"") if s in self.pool.lent else self._content(s, False) for s in slots)
        got = super().retraction_backup(slots)
        if got is not None:
            pad = len(self.retractions[-1].host_slots) - len(entries)
            self.backups[got] = entries + (b"",) * pad
            if self.corrupt == "backup":
                self.backups[got] = (b"x" + entries[0][1:],) + self.backups[got][1:]
        return got

    def retraction_restore(self, backup_id, slots):  # type: ignore[no-untyped-def]
        entries = self.backups.get(backup_id, ())
        node = super().retraction_restore(backup_id, slots)
        self.lent_kv.update(zip(slots, entries))
        return node


OPS: list[Op] = [
    Insert(None, (1, 2, 3)),
    Complete(0),
    Poll(),  # the write lands: the host copy must hold the path's content
    Complete(1),
    Poll(),  # the store copy
    Insert(None, (1, 2, 3, 4)),
    Match(None, (1, 2, 3, 4)),
    Retract(6, tail=2),
    Evict(16),
    Restore(0),
]


def run(corrupt: Optional[str]) -> ContentCache:
    cache = ContentCache(CONFIG)
    cache.corrupt = corrupt
    run_trace(cache, CONFIG, CAPS, OPS)
    return cache


def test_right_bytes_pass_and_the_harness_plays_the_model() -> None:
    cache = run(None)
    slots, entries = cache.written[0]
    assert entries == l3.token_entries(None, (1, 2, 3), CONFIG.kv_layers) and len(slots) == 3
    tail_slots, tail = cache.written[-1]
    assert tail == l3.token_entries(None, (1, 2, 3, 4, 2, 2), CONFIG.kv_layers)[4:], "the decoded tail continues the path"


@pytest.mark.parametrize(("corrupt", "inv"), [("device", "INV-KV-1"), ("host", "INV-KV-2"), ("backup", "INV-KV-3")])
def test_wrong_bytes_are_named(corrupt: str, inv: str) -> None:
    with pytest.raises(ConformanceFailure) as failure:
        run(corrupt)
    assert inv in {v.inv for v in failure.value.violations}


def test_backends_without_kv_reads_are_not_read() -> None:
    cache = ContentCache(CONFIG)
    cache.corrupt = "device"
    no_kv = replace(RefCache.capabilities, kv_reads=False)
    run_trace(cache, CONFIG, no_kv, OPS)  # kv_reads off: nothing is read, nothing fails
    assert cache.written == []


class ShortReads(ContentCache):
    """A device read of a node's slots answers one entry short (a node kept short of its slots reads so)."""

    def read_kv(self, slots) -> list[bytes]:  # type: ignore[no-untyped-def]
        got = super().read_kv(slots)
        return got[:-1] if len(slots) > 1 and not any(s in self.pool.lent for s in slots) else got


def test_a_short_node_is_named_not_a_harness_crash() -> None:
    """A node whose slots read back fewer entries than its tokens is INV-KV-1 with both counts (the check once
    indexed the missing slot and crashed the harness)."""
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(ShortReads(CONFIG), CONFIG, CAPS, OPS)
    assert any(v.inv == "INV-KV-1" and "slots for its" in v.message for v in failure.value.violations)
