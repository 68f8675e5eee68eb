"""`kvcert.gpu.watch`: the tree tells its watch of every tier arrival and departure, so published KV events
replay to what the cache holds.

A watched cache checks, at every snapshot the harness takes (after every op of a certification run), that the
pages its watch was told are on each tier are exactly the pages its nodes hold there; certifying it over every
tier (device, host under each write policy, storage prefetches) walks every place a node's residency changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest

from kvcert.conformance.certification.certify import certify
from kvcert.gpu import CAPABILITIES, GpuCache
from kvcert.gpu.node import Node
from kvcert.gpu.tree import RadixTree
from kvcert.gpu.watch import DEVICE, HOST
from kvcert.spec import contracts
from kvcert.spec.types import CacheConfig, Namespace, Snapshot

Page = tuple[Namespace, tuple[int, ...]]
"""A page's identity as a router knows it: its namespace and the tokens from the root to the page's end."""


def _pages(ns: Namespace, path: tuple[int, ...], start: int, page_size: int) -> list[Page]:
    return [(ns, path[: end]) for end in range(start + page_size, len(path) + 1, page_size)]


class Ledger:
    """A router's view: each tier's pages, from the watch's calls alone."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.held: dict[str, Counter[Page]] = {DEVICE: Counter(), HOST: Counter()}

    def _of(self, node: Node) -> list[Page]:
        parts: list[tuple[int, ...]] = []
        cur: Optional[Node] = node
        while cur is not None and cur.parent is not None:
            parts.append(cur.key.to_tuple())
            cur = cur.parent
        path = tuple(t for part in reversed(parts) for t in part)
        return _pages(node.ns, path, len(path) - node.size, self.page_size)

    def stored(self, node: Node, tier: str) -> None:
        self.held[tier].update(self._of(node))

    def removed(self, node: Node, tier: str) -> None:
        self.held[tier].subtract(self._of(node))


def residency(snap: Snapshot) -> dict[str, Counter[Page]]:
    """Each tier's pages as the snapshot shows them."""
    out: dict[str, Counter[Page]] = {DEVICE: Counter(), HOST: Counter()}
    nodes = snap.by_id()
    for nid, (ns, path) in contracts.node_paths(snap).items():
        v = nodes[nid]
        pages = _pages(ns, path, len(path) - len(v.key), snap.page_size)
        if v.slots is not None:
            out[DEVICE].update(pages)
        if v.host_slots is not None:
            out[HOST].update(pages)
    return out


class WatchedCache(GpuCache):
    """kvcert.gpu with a ledger for a watch; every snapshot first checks the ledger against the tree."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.ledger = Ledger(config.page_size)
        self.watch = self.ledger

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        have = residency(snap)
        for tier in (DEVICE, HOST):
            told, held = +self.ledger.held[tier], have[tier]
            if told != held:
                raise AssertionError(
                    f"watch out of step on the {tier} tier: told of {sorted(told - held)[:3]} not held, "
                    f"not told of {sorted(held - told)[:3]}"
                )
        return snap


def watched(config: CacheConfig) -> WatchedCache:
    return WatchedCache(config)


watched.capabilities = CAPABILITIES  # type: ignore[attr-defined]


def _run(tmp_path: Path) -> Any:
    return certify(
        "watched", factory=watched, examples=6, steps=30, seed=0, page_sizes=[1, 2], policies=["lru"],
        out_dir=tmp_path,
    )  # fmt: skip


def test_the_watch_is_told_of_every_tier_change(tmp_path: Path) -> None:
    cert = _run(tmp_path)
    failures = [f"P={c.page_size} {c.write_policy or 'device'}: {c.failure}" for c in cert.cells if not c.passed]
    assert not failures, "\n".join(failures)
    assert any("+" in c.write_policy for c in cert.cells), "storage cells ran"  # prefetches hang host pages


def _silent(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: RadixTree, *args: Any) -> Any:
        watch, self.watch = self.watch, None
        try:
            return method(self, *args)
        finally:
            self.watch = watch

    return call


@pytest.mark.parametrize("method", ["forget", "set_device"])
def test_a_change_the_watch_is_not_told_of_is_caught(method: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(RadixTree, method, _silent(getattr(RadixTree, method)))
    assert not _run(tmp_path).passed
