"""A block table's choices as vLLM 0.32 makes them (SPEC.md §13.2): the `vllm-0.32` profile's model of a block pool.

The page-level core (`page_table`) says what any prefix cache must keep; this model pins what vLLM's `BlockPool`
chooses where the core leaves it open, so that a pool driven through its API can be compared with it call by call:
which block a request gets (the free queue's head), which cached block goes when one is needed (the head again:
least recently freed), where a freed block goes (a cached one to the tail, an uncached one to the head, in the
order the caller gives), which of several blocks holding one hash a lookup returns (the first cached), and that a
hit takes its block off the queue. Hashes are opaque here: the engine computes them. `preemption_victims` pins
which running requests its scheduler preempts for room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["BlockTableModel", "preemption_victims"]


@dataclass
class BlockTableModel:
    """`num_blocks` blocks; block 0 is the null block, outside the free queue and never handed out."""

    num_blocks: int
    ref: list[int] = field(default_factory=list)
    hash: list[Optional[bytes]] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    """The free queue, head (next to go) first."""
    table: dict[bytes, list[int]] = field(default_factory=dict)
    """Hash -> the blocks holding it, in the order they were cached."""

    def __post_init__(self) -> None:
        self.ref = [0] * self.num_blocks
        self.hash = [None] * self.num_blocks
        self.queue = list(range(1, self.num_blocks))

    def lookup(self, h: bytes) -> Optional[int]:
        """The block a hit on `h` returns: the first one cached under it."""
        blocks = self.table.get(h)
        return blocks[0] if blocks else None

    def take(self, n: int) -> tuple[list[int], list[bytes]]:
        """`get_new_blocks(n)`: the queue's first `n` blocks, each losing its hash; -> (blocks, hashes evicted)."""
        got, self.queue = self.queue[:n], self.queue[n:]
        evicted = []
        for b in got:
            h = self.hash[b]
            if h is not None:
                self._drop(b, h)
                evicted.append(h)
            self.ref[b] = 1
        return got, evicted

    def touch(self, blocks: Sequence[int]) -> None:
        """A hit: each block leaves the queue if it was on it, and gains a holder."""
        for b in blocks:
            if self.ref[b] == 0 and b != 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def cache(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """`cache_full_blocks`: each block takes its hash (a block already holding one keeps it)."""
        for b, h in zip(blocks, hashes):
            if b == 0 or self.hash[b] is not None:
                continue
            self.hash[b] = h
            self.table.setdefault(h, []).append(b)

    def free(self, ordered: Sequence[int]) -> None:
        """`free_blocks`: each loses a holder; those left with none go to the queue, uncached ones to its head and
        cached ones to its tail, each group in the order given."""
        first: list[int] = []
        last: list[int] = []
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0 and b != 0:
                (first if self.hash[b] is None else last).append(b)
        self.queue = first + self.queue + last

    def uncache(self, blocks: Sequence[int]) -> list[bytes]:
        """`evict_blocks`: the blocks lose their hashes and stay where they are; -> the hashes dropped."""
        out = []
        for b in blocks:
            h = self.hash[b]
            if h is not None:
                self._drop(b, h)
                out.append(h)
        return out

    def reset(self) -> bool:
        """`reset_prefix_cache`: only when no block is held; every hash goes."""
        if any(self.ref[1:]):
            return False
        self.table.clear()
        self.hash = [None] * self.num_blocks
        return True

    def _drop(self, b: int, h: bytes) -> None:
        self.hash[b] = None
        held = self.table[h]
        held.remove(b)
        if not held:
            del self.table[h]


def preemption_victims(policy: str, running: Sequence[tuple[str, int, float]], count: int) -> list[str]:
    """The requests vLLM's scheduler preempts, `count` of them, from `running` ((id, priority value, arrival time),
    in its running order) when the next request's blocks do not fit: under "fcfs" the last running, one after
    another; under "priority" the least important (the largest priority value, then the latest arrival) each time.

    post: len(__return__) == min(count, len(running))
    """
    if policy == "priority":
        ranked = sorted(running, key=lambda r: (r[1], r[2]), reverse=True)
        return [r[0] for r in ranked[:count]]
    return [r[0] for r in reversed(running)][:count]
