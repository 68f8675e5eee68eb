"""State invariants: predicates over one `Snapshot`.

Each checker returns messages; `check_snapshot` tags them with the stable IDs of
SPEC.md §5. They read nothing but the snapshot, so they apply to any backend,
SGLang's included. Relations that need a second snapshot or the oracle live in
`kvcert.spec.contracts`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvcert.spec.types import Snapshot


@dataclass(frozen=True)
class Violation:
    """One broken rule: its stable ID and what was seen."""

    inv: str
    message: str

    def __str__(self) -> str:
        return f"{self.inv}: {self.message}"


def _non_root(s: Snapshot):
    return [n for n in s.nodes if n.id != s.root]


def tree_links(s: Snapshot) -> list[str]:
    """INV-TREE-1: one root, unique ids, every parent exists, every node reaches the root."""
    out: list[str] = []
    ids = Counter(n.id for n in s.nodes)
    out += [f"node id {i} appears {c} times" for i, c in ids.items() if c > 1]
    nodes = s.by_id()
    root = nodes.get(s.root)
    if root is None:
        return out + [f"root {s.root} is not among the nodes"]
    if root.parent is not None or root.key:
        out.append("root has a parent or a non-empty key")
    for n in _non_root(s):
        if n.parent is None or n.parent not in nodes:
            out.append(f"node {n.id} has missing parent {n.parent}")
            continue
        cur, hops = n.id, 0
        while cur != s.root and hops <= len(nodes):
            parent = nodes[cur].parent
            if parent is None or parent not in nodes:
                break
            cur, hops = parent, hops + 1
        if cur != s.root:
            out.append(f"node {n.id} does not reach the root")
    return out


def tree_keys(s: Snapshot) -> list[str]:
    """INV-TREE-2: every non-root edge is non-empty, whole pages, one slot per token."""
    out = []
    for n in _non_root(s):
        if not n.key or len(n.key) % s.page_size:
            out.append(f"node {n.id} key length {len(n.key)} is not a positive multiple of {s.page_size}")
        if len(n.slots) != len(n.key):
            out.append(f"node {n.id} has {len(n.slots)} slots for {len(n.key)} tokens")
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
    """INV-ACCT-1: evictable_size == tokens in unlocked nodes."""
    want = sum(len(n.key) for n in _non_root(s) if n.lock_ref == 0)
    return [] if s.evictable_size == want else [f"evictable_size {s.evictable_size}, tree says {want}"]


def protected_exact(s: Snapshot) -> list[str]:
    """INV-ACCT-2: protected_size == tokens in locked nodes."""
    want = sum(len(n.key) for n in _non_root(s) if n.lock_ref > 0)
    return [] if s.protected_size == want else [f"protected_size {s.protected_size}, tree says {want}"]


def pool_closes(s: Snapshot) -> list[str]:
    """INV-ACCT-3: free slots + slots held by the tree == capacity (between operations)."""
    held = sum(len(n.slots) for n in _non_root(s))
    total = held + len(s.free_slots)
    return [] if total == s.capacity else [f"free {len(s.free_slots)} + tree {held} = {total} != capacity {s.capacity}"]


def slots_unique(s: Snapshot) -> list[str]:
    """INV-SLOT-1: no slot is owned twice (by two nodes, twice by one, or by a node and the free list)."""
    owners: Counter[int] = Counter(s.free_slots)
    for n in _non_root(s):
        owners.update(n.slots)
    return [f"slot {slot} owned {c} times" for slot, c in sorted(owners.items()) if c > 1]


def slots_in_range(s: Snapshot) -> list[str]:
    """INV-SLOT-2: every slot id lies in [0, slot_limit)."""
    bad = sorted({x for n in _non_root(s) for x in n.slots} | set(s.free_slots))
    return [f"slot {x} outside [0, {s.slot_limit})" for x in bad if not 0 <= x < s.slot_limit]


def slots_paged(s: Snapshot) -> list[str]:
    """INV-SLOT-4: with page_size > 1 a page's slots are one aligned, contiguous device page."""
    ps = s.page_size
    if ps == 1:
        return []
    out = []
    for n in _non_root(s):
        for i in range(0, len(n.slots) - ps + 1, ps):
            page = n.slots[i : i + ps]
            if page[0] % ps or list(page) != list(range(page[0], page[0] + ps)):
                out.append(f"node {n.id} page {i // ps} has slots {page}")
    per_page = Counter(x // ps for x in s.free_slots)
    out += [f"free list holds {c}/{ps} slots of page {p}" for p, c in sorted(per_page.items()) if c != ps]
    return out


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
}


def check_snapshot(s: Snapshot) -> list[Violation]:
    """Every state invariant over one snapshot; structure first, since later checks assume it."""
    out: list[Violation] = []
    for inv, check in SNAPSHOT_INVARIANTS.items():
        out += [Violation(inv, m) for m in check(s)]
        if inv == "INV-TREE-1" and out:
            return out
    return out
