"""State invariants: predicates over one `Snapshot`.

Each checker returns messages; `check_snapshot` tags them with the stable IDs of
SPEC.md §5. They read nothing but the snapshot, so they apply to any backend,
SGLang's included. Relations that need a second snapshot or the oracle live in
`kvcert.spec.contracts`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Optional

from kvcert.spec import pages
from kvcert.spec.types import NodeView, PendingCopy, Snapshot, tier_of


@dataclass(frozen=True)
class Violation:
    """One broken rule: its stable ID and what was seen."""

    inv: str
    message: str

    def __str__(self) -> str:
        return f"{self.inv}: {self.message}"


def _non_root(s: Snapshot) -> list[NodeView]:
    return s.derived("non_root", _build_non_root)


def _build_non_root(s: Snapshot) -> list[NodeView]:
    return [n for n in s.nodes if n.id != s.root]


def tree_links(s: Snapshot) -> list[str]:
    """INV-TREE-1: one root, unique ids, every parent exists, every node reaches the root."""
    out: list[str] = []
    nodes = s.by_id()
    if len(nodes) != len(s.nodes):
        ids = Counter(n.id for n in s.nodes)
        out += [f"node id {i} appears {c} times" for i, c in ids.items() if c > 1]
    root = nodes.get(s.root)
    if root is None:
        return out + [f"root {s.root} is not among the nodes"]
    if root.parent is not None or root.key:
        out.append("root has a parent or a non-empty key")
    reached = {s.root}
    for n in _non_root(s):
        if n.parent is None or n.parent not in nodes:
            out.append(f"node {n.id} has missing parent {n.parent}")
        elif not _reaches(nodes, n.id, reached):
            out.append(f"node {n.id} does not reach the root")
    return out


def _reaches(nodes: dict[int, NodeView], start: int, reached: set[int]) -> bool:
    """Whether `start`'s parent links end in `reached` (ids known to reach the root), which then takes every id
    walked: each path is walked once, not once per node below it, and a cycle stops within `len(nodes)` steps."""
    walked: list[int] = []
    cur: Optional[int] = start
    while cur is not None and cur in nodes and cur not in reached and len(walked) <= len(nodes):
        walked.append(cur)
        cur = nodes[cur].parent
    if cur in reached:
        reached.update(walked)
        return True
    return False


def rooted(s: Snapshot) -> Snapshot:
    """`s` cut to the tree its root reaches: nodes with unique ids whose parent links end at the root.

    What every other rule reads when INV-TREE-1 is set aside (SPEC.md §6.4): a node outside that tree
    is INV-TREE-1's alone, so dropping that checker must not also blind the rules that walk the tree.
    """
    ids = Counter(n.id for n in s.nodes)
    nodes = {n.id: n for n in s.nodes if ids[n.id] == 1}
    if s.root not in nodes or nodes[s.root].parent is not None:
        return s  # no tree to cut to: the other rules read what is there
    reached = {s.root}
    for n in s.nodes:
        _reaches(nodes, n.id, reached)
    if len(reached) == len(s.nodes):
        return s
    return replace(s, nodes=tuple(n for n in s.nodes if n.id in reached and ids[n.id] == 1))


def tree_keys(s: Snapshot) -> list[str]:
    """INV-TREE-2: every non-root edge is non-empty, whole pages, one slot per token in each tier it is on."""
    out = []
    for n in _non_root(s):
        if not n.key or len(n.key) % s.page_size:
            out.append(f"node {n.id} key length {len(n.key)} is not a positive multiple of {s.page_size}")
        for tier, slots in (("device", n.slots), ("host", n.host_slots)):
            if slots is not None and len(slots) != len(n.key):
                out.append(f"node {n.id} has {len(slots)} {tier} slots for {len(n.key)} tokens")
    return out


def tree_radix(s: Snapshot) -> list[str]:
    """INV-TREE-3: siblings start with different (namespace, first page)."""
    seen: dict[tuple, int] = {}
    out = []
    for n in _non_root(s):
        sel = (n.parent, n.namespace, tuple(n.key[: s.page_size]))
        if sel in seen:
            out.append(f"nodes {seen[sel]} and {n.id} share parent and first page {sel[2]}")
        seen[sel] = n.id
    return out


def namespace_inherited(s: Snapshot) -> list[str]:
    """INV-NS-1: a node's namespace is its parent's (only the root's children choose one)."""
    nodes = s.by_id()
    out = []
    for n in _non_root(s):
        parent = nodes.get(n.parent) if n.parent is not None else None
        if parent is not None and parent.id != s.root and parent.namespace != n.namespace:
            out.append(f"node {n.id} in {n.namespace!r} under node {parent.id} in {parent.namespace!r}")
    return out


def locks_nonnegative(s: Snapshot) -> list[str]:
    """INV-LOCK-1: no lock count is negative."""
    return [f"node {n.id} lock_ref {n.lock_ref}" for n in _non_root(s) if n.lock_ref < 0]


def locks_monotone(s: Snapshot) -> list[str]:
    """INV-LOCK-3: a lock protects the whole path: lock_ref(child) <= lock_ref(parent)."""
    nodes = s.by_id()
    out = []
    for n in _non_root(s):
        parent = nodes.get(n.parent) if n.parent is not None else None
        if parent is not None and parent.id != s.root and n.lock_ref > parent.lock_ref:
            out.append(f"node {n.id} lock_ref {n.lock_ref} above its parent's {parent.lock_ref}")
    return out


def evictable_exact(s: Snapshot) -> list[str]:
    """INV-ACCT-1: evictable_size == tokens in unlocked nodes on the device."""
    want = sum(len(n.key) for n in _non_root(s) if n.lock_ref == 0 and n.slots is not None)
    return [] if s.evictable_size == want else [f"evictable_size {s.evictable_size}, tree says {want}"]


def protected_exact(s: Snapshot) -> list[str]:
    """INV-ACCT-2: protected_size == tokens in locked nodes on the device."""
    want = sum(len(n.key) for n in _non_root(s) if n.lock_ref > 0 and n.slots is not None)
    return [] if s.protected_size == want else [f"protected_size {s.protected_size}, tree says {want}"]


def _device_held(s: Snapshot) -> list[int]:
    """Every device slot the tree's nodes hold, node by node (a slot held twice appears twice)."""
    return s.derived("device_held", _build_device_held)


def _build_device_held(s: Snapshot) -> list[int]:
    out: list[int] = []
    for n in _non_root(s):
        if n.slots is not None:
            out.extend(n.slots)
    return out


def _all_distinct(*groups: Sequence[int]) -> bool:
    seen: set[int] = set()
    seen.update(*groups)
    return len(seen) == sum(map(len, groups))


def _all_within(limit: int, *groups: Sequence[int]) -> bool:
    present = [g for g in groups if g]
    return not present or (min(map(min, present)) >= 0 and max(map(max, present)) < limit)


def pool_closes(s: Snapshot) -> list[str]:
    """INV-ACCT-3: free slots + slots held by the tree + slots lent to running requests == capacity
    (between operations)."""
    held = len(_device_held(s))
    total = held + len(s.free_slots) + len(s.lent_slots)
    if total == s.capacity:
        return []
    lent = f" + lent {len(s.lent_slots)}" if s.lent_slots else ""
    return [f"free {len(s.free_slots)} + tree {held}{lent} = {total} != capacity {s.capacity}"]


def slots_unique(s: Snapshot) -> list[str]:
    """INV-SLOT-1: no slot is owned twice (by two nodes, twice by one, by a node and the free list, or by a
    running request and any other owner)."""
    if _all_distinct(s.free_slots, _device_held(s), s.lent_slots):
        return []
    owners: Counter[int] = Counter(s.free_slots)
    owners.update(_device_held(s))
    owners.update(s.lent_slots)
    return [f"slot {slot} owned {c} times" for slot, c in sorted(owners.items()) if c > 1]


def slots_in_range(s: Snapshot) -> list[str]:
    """INV-SLOT-2: every slot id (in the tree, free, or lent to a running request) lies in [0, slot_limit)."""
    if _all_within(s.slot_limit, s.free_slots, _device_held(s), s.lent_slots):
        return []
    bad = sorted(set(_device_held(s)) | set(s.free_slots) | set(s.lent_slots))
    return [f"slot {x} outside [0, {s.slot_limit})" for x in bad if not 0 <= x < s.slot_limit]


def _whole_pages(ps: int, slots: Sequence[int]) -> bool:
    """Every full page of `slots` is one aligned, contiguous page (the common case, checked in one pass)."""
    full = len(slots) - len(slots) % ps
    starts = slots[0:full:ps]
    return all(x % ps == 0 for x in starts) and tuple(slots[:full]) == tuple(
        x for first in starts for x in range(first, first + ps)
    )


def _paged(ps: int, owned: list[tuple[int, tuple[int, ...]]], free: tuple[int, ...]) -> list[str]:
    out = []
    for node_id, slots in owned:
        if _whole_pages(ps, slots):
            continue
        for i in range(0, len(slots) - ps + 1, ps):
            page = slots[i : i + ps]
            if page[0] % ps or list(page) != list(range(page[0], page[0] + ps)):
                out.append(f"node {node_id} page {i // ps} has slots {page}")
    if len(set(free)) == len(free) == ps * len({x // ps for x in free}):
        return out  # distinct slots, at most ps to a page, ps per page on average: every page whole
    per_page = Counter(x // ps for x in free)
    out += [f"free list holds {c}/{ps} slots of page {p}" for p, c in sorted(per_page.items()) if c != ps]
    return out


def slots_paged(s: Snapshot) -> list[str]:
    """INV-SLOT-4: with page_size > 1 a page's slots are one aligned, contiguous device page."""
    if s.page_size == 1:
        return []
    return _paged(s.page_size, [(n.id, n.slots) for n in _non_root(s) if n.slots is not None], s.free_slots)


# --------------------------------------------------------------------------- host tier (SPEC.md §9)


def host_or_device(s: Snapshot) -> list[str]:
    """INV-HOST-1: every node holds its KV somewhere: on the device, on the host, or both."""
    return [f"node {n.id} is on neither tier" for n in _non_root(s) if n.slots is None and n.host_slots is None]


def device_prefix_closed(s: Snapshot) -> list[str]:
    """INV-HOST-2: a node on the device has its parent on the device, so a device match never skips a gap."""
    nodes = s.by_id()
    out = []
    for n in _non_root(s):
        parent = nodes.get(n.parent) if n.parent is not None else None
        if n.slots is not None and parent is not None and parent.id != s.root and parent.slots is None:
            out.append(f"node {n.id} is on the device under node {parent.id}, which is not")
    return out


def host_prefix_closed(s: Snapshot) -> list[str]:
    """INV-HOST-3: under write-through a backed-up node's parent is backed up: host copies are prefixes."""
    if not s.write_policy.startswith("write_through"):
        return []
    nodes = s.by_id()
    out = []
    for n in _non_root(s):
        parent = nodes.get(n.parent) if n.parent is not None else None
        if n.host_slots is not None and parent is not None and parent.id != s.root and parent.host_slots is None:
            out.append(f"node {n.id} is backed up under node {parent.id}, which is not")
    return out


def host_pool_closes(s: Snapshot) -> list[str]:
    """INV-HOST-4: free host slots + the tree's + prefetch reservations + retraction backups == host capacity."""
    held = sum(len(n.host_slots or ()) for n in _non_root(s))
    reserved = sum(len(p.host_slots) for p in s.prefetches)
    retracted = sum(len(r.host_slots) for r in s.retractions)
    total = held + reserved + retracted + len(s.host_free_slots)
    if total == s.host_capacity:
        return []
    return [
        f"host free {len(s.host_free_slots)} + tree {held} + prefetch {reserved} + retraction {retracted} "
        f"= {total} != host capacity {s.host_capacity}"
    ]


def host_slots_owned_once(s: Snapshot) -> list[str]:
    """INV-HOST-5: host slots are owned once, lie in [0, host_capacity), and come in whole pages."""
    groups: list[Sequence[int]] = [s.host_free_slots]
    groups += [n.host_slots for n in _non_root(s) if n.host_slots is not None]
    groups += [p.host_slots for p in s.prefetches]
    groups += [r.host_slots for r in s.retractions]
    out: list[str] = []
    if not (_all_distinct(*groups) and _all_within(s.host_capacity, *groups)):
        owners: Counter[int] = Counter()
        for g in groups:
            owners.update(g)
        out += [f"host slot {x} owned {c} times" for x, c in sorted(owners.items()) if c > 1]
        out += [f"host slot {x} outside [0, {s.host_capacity})" for x in sorted(owners) if not 0 <= x < s.host_capacity]
    if s.page_size > 1:
        owned = [(n.id, n.host_slots) for n in _non_root(s) if n.host_slots is not None]
        owned += [(-1 - p.id, p.host_slots) for p in s.prefetches]
        owned += [(-1_000_000 - r.id, r.host_slots) for r in s.retractions]
        out += [f"host: {m}" for m in _paged(s.page_size, owned, s.host_free_slots)]
    return out


def prefetches_sane(s: Snapshot) -> list[str]:
    """INV-PF-1: a running prefetch hangs from a live, host-protected anchor and reserves whole pages.

    Its anchor is the root or a backed-up node (under write-back, whose reclaim can strip a
    device node's backup, the anchor may have none); `fetched` never exceeds `requested`, and it
    reserves exactly `requested` host slots.
    """
    nodes = s.by_id()
    out = []
    for p in s.prefetches:
        anchor = nodes.get(p.anchor)
        if anchor is None:
            out.append(f"prefetch {p.id}: anchor {p.anchor} left the tree")
        elif anchor.id != s.root and anchor.host_lock_ref <= 0:
            out.append(f"prefetch {p.id}: anchor {p.anchor} is not host-protected")
        elif anchor.id != s.root and anchor.host_slots is None and s.write_policy != "write_back":
            out.append(f"prefetch {p.id}: anchor {p.anchor} has no backup (only write-back pins such an anchor)")
        if not 0 <= p.fetched <= p.requested or p.requested % s.page_size or p.fetched % s.page_size:
            out.append(f"prefetch {p.id}: fetched {p.fetched} of {p.requested} tokens")
        if len(p.host_slots) != p.requested:
            out.append(f"prefetch {p.id}: reserves {len(p.host_slots)} host slots for {p.requested} tokens")
    return out


def retractions_sane(s: Snapshot) -> list[str]:
    """INV-RETRACT-1: a retraction backup holds its tokens rounded up to whole pages of host slots, and ids are unique."""
    out = []
    for r in s.retractions:
        want = pages.page_ceil(max(r.tokens, 0), s.page_size)
        if r.tokens <= 0 or len(r.host_slots) != want:
            out.append(f"retraction {r.id}: {len(r.host_slots)} host slots for {r.tokens} tokens (want {want})")
    ids = [r.id for r in s.retractions]
    if len(set(ids)) != len(ids):
        out.append(f"retraction ids repeat: {ids}")
    return out


def _depth(nodes: dict[int, NodeView], nid: int) -> int:
    depth, cur = 0, nodes.get(nid)
    while cur is not None and cur.parent is not None and depth <= len(nodes):
        depth, cur = depth + 1, nodes.get(cur.parent)
    return depth


def load_anchor(nodes: dict[int, NodeView], copy: PendingCopy) -> Optional[int]:
    """The node a load copy was issued for: the deepest one it moves that is still in the tree (SPEC.md §9.7)."""
    present = [nid for nid in copy.nodes if nid in nodes]
    return max(present, key=lambda nid: _depth(nodes, nid)) if present else None


def copies_pinned(s: Snapshot, load_host_lock: bool = True) -> list[str]:
    """INV-HOST-6: an unacknowledged copy pins both ends: its nodes are locked and hold both tiers' slots.

    With `load_host_lock` (a profile that pins LOAD_LOCK, SPEC.md §6.1) a pending load also host-locks the
    host copy of the node it was issued for (the deepest one it moves); the nodes above it are
    host-protected by having children (SPEC.md §9.7).
    """
    nodes = s.by_id()
    out = []
    for copy in s.pending:
        for nid in copy.nodes:
            n = nodes.get(nid)
            if n is None:
                out.append(f"{copy.kind} copy {copy.id} moves node {nid}, which left the tree")
            elif copy.kind == "offload":  # device to a linker's store (SPEC.md §14): the source stays locked
                if n.slots is None or n.lock_ref <= 0:
                    out.append(f"offload {copy.id}: node {nid} lock_ref {n.lock_ref}, on device {n.slots is not None}")
            elif copy.kind == "store":
                if n.host_slots is None or n.host_lock_ref <= 0:
                    out.append(
                        f"store copy {copy.id}: node {nid} backed up {n.host_slots is not None}, host_lock_ref {n.host_lock_ref}"
                    )
            elif n.lock_ref <= 0 or n.slots is None or n.host_slots is None:
                out.append(
                    f"{copy.kind} copy {copy.id}: node {nid} lock_ref {n.lock_ref}, on device {n.slots is not None}, backed up {n.host_slots is not None}"
                )
        deepest = load_anchor(nodes, copy) if copy.kind == "load" and load_host_lock else None
        if deepest is not None:
            if nodes[deepest].host_lock_ref <= 0:
                out.append(f"load copy {copy.id}: node {deepest}'s host copy is not protected")
    return out


def host_locks_sane(s: Snapshot) -> list[str]:
    """INV-HOST-7: host lock counts are non-negative.

    Unlike `lock_ref` they are not path counts: a load protects one node's host copy (SPEC.md §9.1).
    """
    return [f"node {n.id} host_lock_ref {n.host_lock_ref}" for n in _non_root(s) if n.host_lock_ref < 0]


def derived_refs(s: Snapshot) -> dict[int, tuple[int, int]]:
    """Node id -> (high_ref, low_ref) as the sessions define them: the high / low sessions whose path holds it."""
    nodes = s.by_id()
    out = {nid: (0, 0) for nid in nodes}
    for session in s.sessions:
        cur = nodes.get(session.node)
        while cur is not None and cur.id != s.root:
            high, low = out[cur.id]
            out[cur.id] = (high + 1, low) if session.high else (high, low + 1)
            cur = nodes.get(cur.parent) if cur.parent is not None else None
    return out


def refs_exact(s: Snapshot) -> list[str]:
    """INV-TIER-1: sessions end in the tree, `high` follows priority and demotion, refs equal the sessions'."""
    nodes = s.by_id()
    out = []
    for session in s.sessions:
        if session.node not in nodes:
            out.append(f"session {session.id!r} holds node {session.node}, which is not in the tree")
        if session.high != (session.priority >= s.high_priority_threshold and not session.demoted):
            out.append(
                f"session {session.id!r} (priority {session.priority}, demoted {session.demoted}) "
                f"counts as {'high' if session.high else 'low'}"
            )
    if out:
        return out
    for nid, (high, low) in derived_refs(s).items():
        n = nodes[nid]
        if nid != s.root and (n.high_ref, n.low_ref) != (high, low):
            out.append(f"node {nid} has refs high {n.high_ref} low {n.low_ref}; its sessions make {high}, {low}")
    return out[:3]


def tier_sizes_exact(s: Snapshot) -> list[str]:
    """INV-TIER-2: `tier_evictable` = device tokens of unlocked nodes per tier (by the node's own refs)."""
    if s.tier_evictable is None:
        return []
    want = [0, 0, 0]
    for n in _non_root(s):
        if n.lock_ref == 0 and n.slots is not None:
            want[tier_of(n.high_ref, n.low_ref)] += len(n.key)
    got = list(s.tier_evictable)
    return [] if got == want else [f"tier_evictable {tuple(got)}, the tree says {tuple(want)}"]


SNAPSHOT_INVARIANTS: dict[str, Callable[[Snapshot], list[str]]] = {
    "INV-TREE-1": tree_links,
    "INV-TREE-2": tree_keys,
    "INV-TREE-3": tree_radix,
    "INV-NS-1": namespace_inherited,
    "INV-LOCK-1": locks_nonnegative,
    "INV-LOCK-3": locks_monotone,
    "INV-ACCT-1": evictable_exact,
    "INV-ACCT-2": protected_exact,
    "INV-ACCT-3": pool_closes,
    "INV-SLOT-1": slots_unique,
    "INV-SLOT-2": slots_in_range,
    "INV-SLOT-4": slots_paged,
    "INV-HOST-1": host_or_device,
    "INV-HOST-2": device_prefix_closed,
    "INV-HOST-3": host_prefix_closed,
    "INV-HOST-4": host_pool_closes,
    "INV-HOST-5": host_slots_owned_once,
    "INV-RETRACT-1": retractions_sane,
    "INV-HOST-6": copies_pinned,
    "INV-HOST-7": host_locks_sane,
    "INV-PF-1": prefetches_sane,
    "INV-TIER-1": refs_exact,
    "INV-TIER-2": tier_sizes_exact,
}


def check_snapshot(s: Snapshot, load_host_lock: bool = True) -> list[Violation]:
    """Every state invariant over one snapshot; structure first, since later checks assume it. `load_host_lock`:
    whether a pending load must host-lock its node (the profile choice LOAD_LOCK)."""
    out: list[Violation] = []
    for inv, check in SNAPSHOT_INVARIANTS.items():
        found = copies_pinned(s, load_host_lock) if inv == "INV-HOST-6" else check(s)
        if found:
            out += [Violation(inv, m) for m in found]
        if inv == "INV-TREE-1" and out:
            return out
    return out
