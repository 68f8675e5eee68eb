"""INV-EVENT-1 for SGLang 0.5.23's caches: their KV events, replayed as a router replays them, give what they hold.

A KV-aware router (Dynamo, SGLang's own) rebuilds a worker's cache from `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` and sends a prompt where its blocks are. `Replay` keeps a router's view of one cache, each
medium's blocks (GPU: the device tier, CPU_PINNED: the host tier), from the events alone; `agree` compares it
with the blocks the cache's snapshot holds, named as SGLang names them (`block_hashes`: SGLang's default event
format, no LoRA adapter named). A block whose copy is in flight may be announced at its issue or at its ack
(SGLang announces a write-through backup at the ack, kvcert's backend at the issue): such blocks may be on
either side; every other block must be on both or neither.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

from kvcert.conformance.adapters.sglang import env as _env
from kvcert.spec import contracts
from kvcert.spec.invariants import Violation
from kvcert.spec.types import Snapshot

with _env.quiet_imports():
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, StorageMedium
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

__all__ = ["GPU", "HOST", "Replay", "block_hashes", "held_blocks"]

GPU, HOST = StorageMedium.GPU.value, StorageMedium.CPU.value
Blocks = dict[str, Counter[int]]
NamespaceParts = Callable[[Optional[str]], tuple[Optional[str], Optional[str]]]
"""A snapshot's namespace -> SGLang's (extra_key, cache_salt)."""


def _medium(medium: Any) -> str:
    """An event's medium as its wire value ("GPU", "CPU_PINNED"), from SGLang's enum or a string."""
    return str(getattr(medium, "value", medium))


def block_hashes(cache_salt: Optional[str], path: Sequence[int], page_size: int) -> list[int]:
    """SGLang 0.5.23's published hash of each whole page of `path` (tokens from the root), in its default event
    format with no LoRA adapter named: a chain of page hashes from the root, seeded by the cache salt
    (`compute_node_event_hash_values`); the extra key does not enter it."""
    salt = cache_salt or None
    prior = None if salt is None else hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode("utf-8")).hexdigest()
    return [hash_str_to_int64(h) for h in get_hash_str(list(path), prior, page_size=page_size)]


def held_blocks(snap: Snapshot, parts: NamespaceParts) -> tuple[Blocks, Blocks]:
    """Each medium's blocks in the snapshot's tree: all of them, and those settled there (without the blocks of
    nodes a pending copy moves onto that medium: a load onto the device, a write onto the host)."""
    moving: dict[str, set[int]] = {GPU: set(), HOST: set()}
    for c in snap.pending:
        if c.kind in ("load", "write"):
            moving[GPU if c.kind == "load" else HOST].update(c.nodes)
    held: Blocks = {GPU: Counter(), HOST: Counter()}
    settled: Blocks = {GPU: Counter(), HOST: Counter()}
    nodes = snap.by_id()
    for nid, (_, path) in contracts.node_paths(snap).items():
        n = nodes[nid]
        pages = block_hashes(parts(n.namespace)[1], path, snap.page_size)[(len(path) - len(n.key)) // snap.page_size :]
        for medium, present in ((GPU, n.slots), (HOST, n.host_slots)):
            if present is not None:
                held[medium].update(pages)
                if nid not in moving[medium]:
                    settled[medium].update(pages)
    return held, settled


class Replay:
    """A router's view of one cache: each medium's blocks, from its KV events alone."""

    def __init__(self) -> None:
        self.known: Blocks = {GPU: Counter(), HOST: Counter()}

    def apply(self, events: Iterable[Any]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.known = {GPU: Counter(), HOST: Counter()}
            elif isinstance(ev, (BlockStored, BlockRemoved)):
                have = self.known.setdefault(_medium(ev.medium), Counter())
                (have.update if isinstance(ev, BlockStored) else have.subtract)(ev.block_hashes)

    def agree(self, snap: Snapshot, parts: NamespaceParts) -> list[Violation]:
        """INV-EVENT-1: every block the events announce is held, and every block held (its copy landed) is announced."""
        held, settled = held_blocks(snap, parts)
        out = []
        for medium in sorted(set(self.known) | set(held)):
            told = +self.known.get(medium, Counter())
            stale, missing = told - held.get(medium, Counter()), settled.get(medium, Counter()) - told
            if stale or missing:
                out.append(Violation("INV-EVENT-1", f"after its KV events a router sees {sum(told.values())} blocks "
                                     f"on {medium}: {sum(stale.values())} of them not held there, and "
                                     f"{sum(missing.values())} blocks held there never announced"))  # fmt: skip
        return out
