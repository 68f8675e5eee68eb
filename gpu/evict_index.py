"""The eviction index: exact candidate sets, per-tier min-heaps with lazy deletion, write-back's duplicates.

Three memberships per node, re-derived in O(1) by `refresh(node)` wherever the tree changes a
node's residency, children, locks, host locks, copies or refs:

- **device candidates** (`dev_leaves`): on device, `lock_ref == 0`, no child on device;
- **host candidates** (`host_leaves`): host only, childless, unlocked, no host lock;
- **settled duplicates** (`dups`, write-back only): on both tiers, in no pending copy, no host lock.

The first two are ordered by heaps of flat int tuples, the node id last. A node's one live entry
is `dev_pushed` / `host_pushed`; any other entry of it is stale and skipped when popped (an
identity test), so re-ranking a node never searches a heap. The UNUSED tier's heaps hold
`(*policy_rank, id)` — exactly what a workload without sessions pushed before tiers existed —
LOW_REF ones `(retained, -deadline, low_ref, *policy_rank, id)`, HIGH_REF ones `(retained, -deadline,
high_ref, low_ref, *policy_rank, id)`: the rank `(tier, retained, -deadline, high_ref, low_ref, *policy_rank)`
with the tier made the heap (SPEC.md §11.3, §11.7; an UNUSED node is on no session's path, so never retained).
Entries of different tiers differ in length, so an entry equal to a node's live one is in the right
heap. Host eviction never takes a HIGH_REF copy, so a HIGH_REF host leaf is pushed nowhere until a
demotion drops it to LOW_REF. `compact` rebuilds the heaps from the sets once stale entries
outnumber live ones 4:1 (amortised O(1) per push). The duplicates' heap is of ids, oldest first.

The index holds no node table: `pop_*` and `compact` take the tree's `nodes` (id -> node), so the
tree stays the one owner of its nodes.

Ranks are `kvcert.spec.pages.policy_rank`'s, with the policy's parameters (`params`, from the config): slru
reads a node's hit count like lfu, so the walk's refreshes re-rank it; tlru also reads the node's depth (`end`,
fixed for life), its length and its branch's history, so the tree refreshes a node whose history rises
(`made`) or whose edge a split shortens (`RadixTree.split`). Every other policy's entry is
what it was before them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Optional

from kvcert.gpu.node import Node
from kvcert.spec import pages
from kvcert.spec.types import HIGH_REF, UNUSED, policy_params

Entry = tuple[int, ...]
"""A heap entry: a rank, then the node id (flat ints: cheap to compare)."""


def _lru_entry(n: Node) -> Entry:
    return (n.last_access, n.id)


class EvictionIndex:
    """Candidate sets and heaps of one tree (SPEC.md §4.5, §9.4, §11.3, §11.4)."""

    def __init__(
        self, root: Node, policy: str, write_back: bool, host: bool, params: Optional[dict[str, int]] = None
    ) -> None:
        self.root = root
        self.policy = policy
        self.write_back = write_back
        """Track settled duplicates (write-back's reclaim)."""
        self.host = host
        """A host tier exists: its heaps count for compaction."""
        self.dev_leaves: set[int] = set()
        self.host_leaves: set[int] = set()
        self.dev_heap: list[Entry] = []
        self.host_heap: list[Entry] = []
        """The UNUSED tier (no session holds the node)."""
        self.dev_heap_low: list[Entry] = []
        self.dev_heap_high: list[Entry] = []
        self.host_heap_low: list[Entry] = []
        """The ref tiers' heaps (no host HIGH_REF heap: §11.4)."""
        self.dups: dict[int, Node] = {}
        """Write-back's settled duplicates."""
        self.dup_heap: list[int] = []
        """Their ids, oldest node first (lazy deletion)."""
        self.entry: Callable[[Node], Entry] = {"lru": _lru_entry, "slru": self._slru_entry, "tlru": self._tlru_entry}.get(
            policy, self._ranked_entry
        )
        """`n`'s heap entry: its eviction rank (`kvcert.spec.pages.policy_rank`), then its id (LRU's inlined)."""
        self.tlru = policy == "tlru"
        """The tree keeps every node's history (`made`): only T-LRU reads it."""
        self.params: dict[str, int] = dict(params) if params is not None else policy_params(policy, 1)
        """The policy's parameters (SPEC.md §4.5; `CacheConfig.policy_params()`), the defaults of 1-token pages if none."""
        self._protected = self.params.get("protected_threshold", 0)
        self._threshold = self.params.get("threshold", 0)
        self._estimate = self.params.get("next_prompt_estimate", 0)

    def made(self, n: Node) -> None:
        """T-LRU's bookkeeping for a node new in the tree (SGLang's `_set_tlru_lens_and_raise_history`): its history
        is its depth, and every ancestor whose history is below that is raised to it (SPEC.md §4.7) and re-ranked,
        for one may be a candidate (a device leaf above a prefetch's new host-only node). The parent is the caller's
        to refresh once it links `n` in (before, it may still look like a leaf)."""
        end = n.history = n.end
        parent = cur = n.parent
        while cur is not None and cur.history < end:
            cur.history = end
            if cur is not parent:
                self.refresh(cur)
            cur = cur.parent

    def _ranked_entry(self, n: Node) -> Entry:
        return (*pages.policy_rank(self.policy, n.last_access, n.hit_count, n.creation, n.priority), n.id)

    def _slru_entry(self, n: Node) -> Entry:
        rank = pages.policy_rank(
            "slru", n.last_access, n.hit_count, n.creation, n.priority, protected_threshold=self._protected
        )
        return (*rank, n.id)

    def _tlru_entry(self, n: Node) -> Entry:
        """T-LRU reads the node's place: its depth (`end`, fixed for life), its length and its branch's history. A
        change to any of them re-ranks it: the tree refreshes a node whose history rises or whose edge is split."""
        rank = pages.policy_rank(
            "tlru",
            n.last_access,
            n.hit_count,
            n.creation,
            n.priority,
            depth=n.end,
            size=n.size,
            history=n.history,
            threshold=self._threshold,
            next_prompt_estimate=self._estimate,
        )
        return (*rank, n.id)

    def tier_entry(self, n: Node) -> Entry:
        """A held node's entry in its ref tier's heap: `(retained, -deadline, low_ref, *rank, id)` or `(retained,
        -deadline, high_ref, low_ref, *rank, id)`; `retained` 0 or 1 and `deadline` the earliest of the retentions
        holding it (0 when none): SPEC.md §11.7, a retained node after its tier's others, the latest back first."""
        held = n.retained
        ret = (1, -min(held)) if held else (0, 0)
        if n.high_ref:
            return (*ret, n.high_ref, n.low_ref, *self.entry(n))
        return (*ret, n.low_ref, *self.entry(n))

    def refresh(self, n: Node) -> None:
        """Re-derive `n`'s memberships (O(1)); push a heap entry when it joins or re-ranks."""
        if n is self.root:
            return
        nid = n.id
        if n.lock_ref:
            self.dev_leaves.discard(nid)
            self.host_leaves.discard(nid)
        elif n.slots is not None:
            self.host_leaves.discard(nid)
            if n.dev_children == 0:
                self.dev_leaves.add(nid)
                if n.tier:
                    self._push_tiered(n, True)
                else:
                    entry = self.entry(n)
                    if n.dev_pushed != entry:
                        heapq.heappush(self.dev_heap, entry)
                        n.dev_pushed = entry
            else:
                self.dev_leaves.discard(nid)
        else:
            self.dev_leaves.discard(nid)
            if not n.children and n.host_lock_ref == 0:
                self.host_leaves.add(nid)
                if n.tier:
                    self._push_tiered(n, False)
                else:
                    entry = self.entry(n)
                    if n.host_pushed != entry:
                        heapq.heappush(self.host_heap, entry)
                        n.host_pushed = entry
            else:
                self.host_leaves.discard(nid)
        if (
            self.write_back
            and n.slots is not None
            and n.host_slots is not None
            and n.host_lock_ref == 0
            and not n.copies
        ):
            if n.id not in self.dups:
                self.dups[n.id] = n
                heapq.heappush(self.dup_heap, n.id)
        else:
            self.dups.pop(n.id, None)

    def _push_tiered(self, n: Node, device: bool) -> None:
        """Push a held candidate's entry into its tier's heap (a host HIGH_REF leaf goes in none: §11.4)."""
        entry = self.tier_entry(n)
        if device:
            if n.dev_pushed != entry:
                heapq.heappush(self.dev_heap_high if n.high_ref else self.dev_heap_low, entry)
                n.dev_pushed = entry
        elif n.high_ref:
            n.host_pushed = None  # any entry it had is stale: host eviction may not take it now
        elif n.host_pushed != entry:
            heapq.heappush(self.host_heap_low, entry)
            n.host_pushed = entry

    def forget(self, node_id: int) -> None:
        """A node left the tree: it is in no set (its heap entries go stale by themselves)."""
        self.dev_leaves.discard(node_id)
        if self.host_leaves:
            self.host_leaves.discard(node_id)
        if self.dups:
            self.dups.pop(node_id, None)

    # ------------------------------------------------------------------ popping

    def _pop(self, heap: list[Entry], members: set[int], device: bool, nodes: Mapping[int, Node]) -> Optional[Node]:
        """The minimal-rank member of `members`, popped from `heap` (stale entries dropped)."""
        while heap:
            entry = heapq.heappop(heap)
            node_id = entry[-1]
            n = nodes.get(node_id)
            if n is None:
                continue
            if device:
                if n.dev_pushed is not entry:
                    continue
                n.dev_pushed = None
            else:
                if n.host_pushed is not entry:
                    continue
                n.host_pushed = None
            if node_id in members:
                return n
        return None

    def pop_device(self, nodes: Mapping[int, Node], allow_low: bool = True, allow_high: bool = True) -> Optional[Node]:
        """The minimal-rank device candidate in scope: UNUSED, then LOW_REF, then HIGH_REF (SPEC.md §11.3)."""
        n = self._pop(self.dev_heap, self.dev_leaves, True, nodes)
        if n is None and allow_low and (self.dev_heap_low or self.dev_heap_high):
            n = self._pop(self.dev_heap_low, self.dev_leaves, True, nodes) if self.dev_heap_low else None
            if n is None and allow_high and self.dev_heap_high:
                n = self._pop(self.dev_heap_high, self.dev_leaves, True, nodes)
        return n

    def pop_host(self, nodes: Mapping[int, Node]) -> Optional[Node]:
        """The minimal-rank host candidate: UNUSED, then LOW_REF; never HIGH_REF (SPEC.md §11.4)."""
        n = self._pop(self.host_heap, self.host_leaves, False, nodes)
        if n is None and self.host_heap_low:
            n = self._pop(self.host_heap_low, self.host_leaves, False, nodes)
        return n

    def pop_dup(self) -> Optional[Node]:
        """The oldest settled duplicate (lowest id), or None for a stale id: call while `dups` is non-empty."""
        return self.dups.pop(heapq.heappop(self.dup_heap), None)

    # ------------------------------------------------------------------ compaction

    def compact(self, nodes: Mapping[int, Node]) -> None:
        """Rebuild heaps whose stale entries outnumber the live ones (amortised O(1) per push)."""
        if len(self.dev_heap) + len(self.dev_heap_low) + len(self.dev_heap_high) > 4 * len(self.dev_leaves) + 64 or (
            self.host
            and (
                len(self.host_heap) + len(self.host_heap_low) > 4 * len(self.host_leaves) + 64
                or len(self.dup_heap) > 4 * len(self.dups) + 64
            )
        ):
            self._rebuild(nodes)

    def _rebuild(self, nodes: Mapping[int, Node]) -> None:
        for heaps, members, device in (
            ((self.dev_heap, self.dev_heap_low, self.dev_heap_high), self.dev_leaves, True),
            ((self.host_heap, self.host_heap_low), self.host_leaves, False),
        ):
            if sum(map(len, heaps)) > 4 * len(members) + 64:
                for heap in heaps:
                    for old in heap:  # entries about to vanish: their nodes must push again
                        gone = nodes.get(old[-1])
                        if gone is not None:
                            if device:
                                gone.dev_pushed = None
                            else:
                                gone.host_pushed = None
                live: tuple[list[Entry], ...] = ([], [], [])
                for node_id in members:
                    n = nodes[node_id]
                    tier = n.tier
                    if tier == HIGH_REF and not device:
                        continue  # a host HIGH_REF leaf waits for a demotion (`_push_tiered`)
                    entry = self.entry(n) if tier == UNUSED else self.tier_entry(n)
                    live[tier].append(entry)
                    if device:
                        n.dev_pushed = entry
                    else:
                        n.host_pushed = entry
                for heap, entries in zip(heaps, live):
                    heapq.heapify(entries)
                    heap[:] = entries
        if len(self.dup_heap) > 4 * len(self.dups) + 64:
            self.dup_heap = sorted(self.dups)
