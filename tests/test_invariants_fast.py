"""The state invariants' one-pass checks (`spec/invariants.py`) against their plain definitions.

Each invariant decides the valid case in one pass and only writes its messages on the slow path.
Here the plain definitions (every slot counted, every page compared, every node walked to the
root) judge the same snapshots — states a certification reaches, and random corruptions of them —
and every message must be the same.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

import kvcert.conformance.harness.checks as checks
from kvcert.conformance.backend import capabilities_of
from kvcert.conformance.certification.certify import cells_for, load_factory, run_cell
from kvcert.spec import invariants as inv
from kvcert.spec.types import Snapshot


def _non_root(s: Snapshot) -> list:  # type: ignore[type-arg]
    return [n for n in s.nodes if n.id != s.root]


def plain_tree_links(s: Snapshot) -> list[str]:
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


def plain_paged(ps: int, owned: list[tuple[int, tuple[int, ...]]], free: tuple[int, ...]) -> list[str]:
    out = []
    for node_id, slots in owned:
        for i in range(0, len(slots) - ps + 1, ps):
            page = slots[i : i + ps]
            if page[0] % ps or list(page) != list(range(page[0], page[0] + ps)):
                out.append(f"node {node_id} page {i // ps} has slots {page}")
    per_page = Counter(x // ps for x in free)
    out += [f"free list holds {c}/{ps} slots of page {p}" for p, c in sorted(per_page.items()) if c != ps]
    return out


def plain_slots_unique(s: Snapshot) -> list[str]:
    owners: Counter[int] = Counter(s.free_slots)
    owners.update(s.lent_slots)
    for n in _non_root(s):
        owners.update(n.slots or ())
    return [f"slot {slot} owned {c} times" for slot, c in sorted(owners.items()) if c > 1]


def plain_slots_in_range(s: Snapshot) -> list[str]:
    bad = sorted({x for n in _non_root(s) for x in n.slots or ()} | set(s.free_slots) | set(s.lent_slots))
    return [f"slot {x} outside [0, {s.slot_limit})" for x in bad if not 0 <= x < s.slot_limit]


def plain_pool_closes(s: Snapshot) -> list[str]:
    held = sum(len(n.slots or ()) for n in _non_root(s))
    total = held + len(s.free_slots) + len(s.lent_slots)
    lent = f" + lent {len(s.lent_slots)}" if s.lent_slots else ""
    if total == s.capacity:
        return []
    return [f"free {len(s.free_slots)} + tree {held}{lent} = {total} != capacity {s.capacity}"]


def plain_slots_paged(s: Snapshot) -> list[str]:
    if s.page_size == 1:
        return []
    return plain_paged(s.page_size, [(n.id, n.slots) for n in _non_root(s) if n.slots is not None], s.free_slots)


def plain_host_slots_owned_once(s: Snapshot) -> list[str]:
    owners: Counter[int] = Counter(s.host_free_slots)
    for n in _non_root(s):
        owners.update(n.host_slots or ())
    for p in s.prefetches:
        owners.update(p.host_slots)
    for r in s.retractions:
        owners.update(r.host_slots)
    out = [f"host slot {x} owned {c} times" for x, c in sorted(owners.items()) if c > 1]
    out += [f"host slot {x} outside [0, {s.host_capacity})" for x in sorted(owners) if not 0 <= x < s.host_capacity]
    if s.page_size > 1:
        owned = [(n.id, n.host_slots) for n in _non_root(s) if n.host_slots is not None]
        owned += [(-1 - p.id, p.host_slots) for p in s.prefetches]
        owned += [(-1_000_000 - r.id, r.host_slots) for r in s.retractions]
        out += [f"host: {m}" for m in plain_paged(s.page_size, owned, s.host_free_slots)]
    return out


PLAIN = {
    "INV-TREE-1": plain_tree_links,
    "INV-ACCT-3": plain_pool_closes,
    "INV-SLOT-1": plain_slots_unique,
    "INV-SLOT-2": plain_slots_in_range,
    "INV-SLOT-4": plain_slots_paged,
    "INV-HOST-5": plain_host_slots_owned_once,
}


def _corrupt(s: Snapshot, rng: random.Random) -> Snapshot:
    """One random defect of the kinds these invariants judge: a slot moved, doubled, dropped or out of
    range, two slots of a page swapped, a parent pointer bent (cycles included), a node doubled, a running
    request's slot also free or out of range."""
    nodes = list(s.nodes)
    inner = [i for i, n in enumerate(nodes) if n.id != s.root]
    kind = rng.randrange(11)
    if kind == 9 and s.lent_slots:  # a running request's slot also free
        return dataclasses.replace(s, free_slots=tuple(sorted(s.free_slots + (rng.choice(s.lent_slots),))))
    if kind == 10 and s.lent_slots:
        lent = list(s.lent_slots)
        lent[rng.randrange(len(lent))] = rng.randrange(-3, s.slot_limit + 3)
        return dataclasses.replace(s, lent_slots=tuple(lent))
    if kind == 1 and s.free_slots:
        return dataclasses.replace(s, free_slots=s.free_slots + (rng.choice(s.free_slots),))
    if kind == 2 and s.free_slots:
        free = list(s.free_slots)
        free[rng.randrange(len(free))] = rng.randrange(-3, s.capacity + 8)
        return dataclasses.replace(s, free_slots=tuple(free))
    if kind == 5 and s.host_free_slots:
        return dataclasses.replace(s, host_free_slots=s.host_free_slots + (rng.choice(s.host_free_slots),))
    if kind == 7 and s.free_slots:
        free = list(s.free_slots)
        del free[rng.randrange(len(free))]
        return dataclasses.replace(s, free_slots=tuple(free))
    if not inner:
        return s
    i = rng.choice(inner)
    n = nodes[i]
    if kind == 0 and n.slots:
        slots = list(n.slots)
        slots[rng.randrange(len(slots))] = rng.choice([rng.randrange(-2, s.slot_limit + 3), *s.free_slots])
        nodes[i] = dataclasses.replace(n, slots=tuple(slots))
    elif kind == 3:
        nodes[i] = dataclasses.replace(n, parent=rng.choice([m.id for m in nodes] + [999]))
    elif kind == 4 and n.host_slots:
        slots = list(n.host_slots)
        slots[rng.randrange(len(slots))] = rng.randrange(-2, s.host_capacity + 3)
        nodes[i] = dataclasses.replace(n, host_slots=tuple(slots))
    elif kind == 6:
        nodes.append(dataclasses.replace(n))
    elif kind == 8 and n.slots and len(n.slots) > 1:
        slots = list(n.slots)
        a, b = rng.sample(range(len(slots)), 2)
        slots[a], slots[b] = slots[b], slots[a]
        nodes[i] = dataclasses.replace(n, slots=tuple(slots))
    return dataclasses.replace(s, nodes=tuple(nodes))


@pytest.fixture(scope="module")
def reached(tmp_path_factory: pytest.TempPathFactory) -> list[Snapshot]:
    """Snapshots a certification of kvcert.gpu checks: device-only, host and storage cells, P = 1 and 4."""
    seen: list[Snapshot] = []
    real = checks.check_snapshot

    def spy(s: Snapshot, load_host_lock: bool = True) -> list[inv.Violation]:
        seen.append(s)
        return real(s, load_host_lock)

    factory = load_factory("kvcert.gpu:factory")
    caps = capabilities_of(factory)
    checks.check_snapshot = spy  # type: ignore[assignment]
    try:
        for ps in (1, 4):
            cells, _ = cells_for(caps, [ps], ["lru"])
            for cell in (cells[0], cells[3], cells[-1]):  # device-only, write-back, write-back + timeout
                run_cell(factory, caps, cell, examples=6, steps=40, seed=1, target="x", out_dir=tmp_path_factory.mktemp("f"))
    finally:
        checks.check_snapshot = real  # type: ignore[assignment]
    return seen


def test_one_pass_checks_write_the_plain_definitions_messages(reached: list[Snapshot]) -> None:
    rng = random.Random(0)
    broken = 0
    assert len(reached) > 500
    assert any(s.lent_slots for s in reached), "running requests' slots are among what the checks judge"
    for s in reached:
        for t in [s] + [_corrupt(_corrupt(s, rng) if rng.random() < 0.3 else s, rng) for _ in range(4)]:
            fresh = dataclasses.replace(t)  # no derived tables carried over
            for name, plain in PLAIN.items():
                want = plain(t)
                assert inv.SNAPSHOT_INVARIANTS[name](fresh) == want, (name, t)
                broken += bool(want)
    assert broken > 1000, "the corruptions break these rules often"
