# Over 600 lines: one contract per operation over the same snapshot helpers (paths, pins, tiers, retention); split by tier, each part would import the others.
"""Operation contracts: relations over (snapshot before, arguments, result, snapshot after).

Where backends may legitimately differ (SPEC.md §6: tie-breaks, slot choice,
leaf overshoot) these functions accept every allowed outcome and, for
eviction, return a witness so the harness can steer the oracle to the same one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from kvcert.spec.pages import min_rank_ids, overshoot_ok, page_ceil
from kvcert.spec.types import (
    HIGH_REF,
    LOW_REF,
    UNUSED,
    AdmissionPlan,
    AdmissionProfile,
    Namespace,
    Running,
    Snapshot,
    Tokens,
    tier_of,
)

Path = tuple[Namespace, Tokens]
"""A node named by where it ends: (namespace, every token from the root)."""


def node_paths(s: Snapshot) -> dict[int, Path]:
    """Every non-root node's end path, computed once top-down."""
    return s.derived("node_paths", _node_paths)


def _node_paths(s: Snapshot) -> dict[int, Path]:
    kids = s.children()
    nodes = s.by_id()
    out: dict[int, Path] = {}
    stack: list[tuple[int, Path]] = [(c, (nodes[c].namespace, nodes[c].key)) for c in kids.get(s.root, [])]
    while stack:
        nid, path = stack.pop()
        out[nid] = path
        for c in kids.get(nid, []):
            stack.append((c, (path[0], path[1] + nodes[c].key)))
    return out


@dataclass(frozen=True)
class NodeShape:
    """What the spec fixes about one node, whoever implements it."""

    size: int
    lock_ref: int
    on_device: bool
    backed_up: bool
    host_lock_ref: int


def shape(s: Snapshot) -> dict[Path, NodeShape]:
    """The backend-independent tree: end path -> edge length, locks and residency."""
    return s.derived("shape", _shape)


def _shape(s: Snapshot) -> dict[Path, NodeShape]:
    nodes = s.by_id()
    return {
        p: NodeShape(len(n.key), n.lock_ref, n.slots is not None, n.host_slots is not None, n.host_lock_ref)
        for i, p in node_paths(s).items()
        for n in (nodes[i],)
    }


def shape_difference(mine: NodeShape, spec: NodeShape) -> Optional[str]:
    """The invariant a node breaks when its shape differs from the spec's (same size assumed)."""
    if mine.lock_ref != spec.lock_ref:
        return "INV-LOCK-2"
    if (mine.on_device, mine.backed_up) != (spec.on_device, spec.backed_up):
        return "INV-HOST-10"
    if mine.host_lock_ref != spec.host_lock_ref:
        return "INV-HOST-11"
    return None


def page_slots(s: Snapshot) -> dict[Path, tuple[int, ...]]:
    """Every cached page, named by the path up to its last token, to the slots holding its KV.

    Pages, not tokens, are the unit: with page_size > 1 two cached pages may
    share leading tokens yet hold different slots.
    """
    return s.derived("page_slots", _page_slots)


def _page_slots(s: Snapshot) -> dict[Path, tuple[int, ...]]:
    nodes = s.by_id()
    ps = s.page_size
    out: dict[Path, tuple[int, ...]] = {}
    for nid, (ns, path) in node_paths(s).items():
        node = nodes[nid]
        if node.slots is None:  # on the host only: not cached on the device
            continue
        start = len(path) - len(node.key)
        for i in range(0, len(node.key), ps):
            out[(ns, path[: start + i + ps])] = tuple(node.slots[i : i + ps])
    return out


def cached_prefix_len(s: Snapshot, namespace: Namespace, tokens: Sequence[int]) -> int:
    """The exact answer to match_prefix: the longest cached page-aligned prefix in `namespace`."""
    cached = page_slots(s)
    toks = tuple(tokens)
    n, ps = 0, s.page_size
    while n + ps <= len(toks) and (namespace, toks[: n + ps]) in cached:
        n += ps
    return n


def host_hit_len(s: Snapshot, namespace: Namespace, tokens: Sequence[int], device_len: int) -> int:
    """Tokens past the device match that sit on the host only, page by page (INV-MATCH-3)."""
    ps = s.page_size
    nodes = s.by_id()
    host_pages: set[Path] = set()
    for nid, (ns, path) in node_paths(s).items():
        node = nodes[nid]
        if node.slots is None and node.host_slots is not None:
            start = len(path) - len(node.key)
            host_pages.update((ns, path[: start + i + ps]) for i in range(0, len(node.key), ps))
    toks = tuple(tokens)
    n = device_len
    while n + ps <= len(toks) and (namespace, toks[: n + ps]) in host_pages:
        n += ps
    return n - device_len


def prefix_slots(s: Snapshot, namespace: Namespace, tokens: Sequence[int], length: int) -> tuple[int, ...]:
    """The slots a match of `length` tokens must return, read off the tree."""
    cached = page_slots(s)
    toks = tuple(tokens)
    return tuple(x for end in range(s.page_size, length + 1, s.page_size) for x in cached[(namespace, toks[:end])])


def order_breach(ranks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> Optional[tuple[int, int]]:
    """INV-META-1's relation: the backend's order refines the spec's, or the first pair where it does not.

    `ranks[i]` is node i's (spec rank, backend rank). A node the spec ranks strictly before another, the backend
    must rank strictly before it too; where the spec ties, the backend may order either way. Only order is
    compared, never values: a backend's clock and counters are its own. Returns (i, j): the spec ranks i before
    j, the backend does not.

    post: __return__ is None or (ranks[__return__[0]][0] < ranks[__return__[1]][0] and ranks[__return__[0]][1] >= ranks[__return__[1]][1])
    """
    order = sorted(range(len(ranks)), key=lambda i: ranks[i][0])
    latest: Optional[int] = None  # the node of the greatest backend rank among the spec's earlier ranks
    k = 0
    while k < len(order):
        end = k
        while end < len(order) and ranks[order[end]][0] == ranks[order[k]][0]:
            end += 1
        group = order[k:end]
        first = min(group, key=lambda i: ranks[i][1])
        if latest is not None and ranks[first][1] <= ranks[latest][1]:
            return latest, first
        last = max(group, key=lambda i: ranks[i][1])
        if latest is None or ranks[last][1] > ranks[latest][1]:
            latest = last
        k = end
    return None


def slot_changes(before: Snapshot, after: Snapshot) -> list[str]:
    """INV-SLOT-3: a page cached before and after an operation keeps its slots."""
    a = page_slots(after)
    return [
        f"page ending {path[1][-4:]}@{len(path[1])} moved from slots {slots} to {a[path]}"
        for path, slots in page_slots(before).items()
        if path in a and a[path] != slots
    ]


# --------------------------------------------------------------------------- eviction


@dataclass(frozen=True)
class EvictNode:
    """What eviction may look at: structure, size, lock, and the policy rank."""

    id: int
    parent: Optional[int]
    size: int
    locked: bool
    rank: tuple[int, ...]


def eviction_witness(
    nodes: Mapping[int, EvictNode], root: int, asked: int, removed: frozenset[int]
) -> Optional[list[int]]:
    """An eviction order that removes exactly `removed`, or None if none is legal.

    Legal (SPEC.md §4.5): repeatedly remove an unlocked leaf of minimal rank
    (ties free) while fewer than `asked` tokens are freed; whole nodes only.
    Searches over tie choices only, so it is fast when ties are rare.
    """
    kids: dict[int, set[int]] = {i: set() for i in nodes}
    for n in nodes.values():
        if n.parent is not None and n.parent in kids:
            kids[n.parent].add(n.id)
    dead: set[frozenset[int]] = set()

    def search(gone: frozenset[int], freed: int) -> Optional[list[int]]:
        if gone in dead:
            return None
        leaves = [
            (n.rank, n.id)
            for n in nodes.values()
            if n.id != root and n.id not in gone and not n.locked and not (kids[n.id] - gone)
        ]
        if freed >= asked or not leaves:
            return [] if gone == removed else None
        for pick in min_rank_ids(leaves):
            if pick in removed:
                rest = search(gone | {pick}, freed + nodes[pick].size)
                if rest is not None:
                    return [pick, *rest]
        dead.add(gone)
        return None

    if not removed <= set(nodes) - {root}:
        return None
    return search(frozenset(), 0)


def newly_demoted(before: Snapshot, after: Snapshot) -> list[str]:
    """Sessions adaptive demotion demoted during a step (SPEC.md §11.4), in the snapshot's session order."""
    was = {x.id for x in before.sessions if x.demoted}
    return [x.id for x in after.sessions if x.demoted and x.id not in was]


def host_duplicates(s: Snapshot) -> set[int]:
    """Write-back's first host victims: settled backups of nodes also on the device (SPEC.md §9.4)."""
    if s.write_policy != "write_back":
        return set()
    moving = {nid for c in s.pending for nid in c.nodes}
    return {
        n.id
        for n in s.nodes
        if n.id != s.root
        and n.slots is not None
        and n.host_slots is not None
        and n.host_lock_ref == 0
        and n.id not in moving
    }


def host_reclaimed(before: Snapshot, after: Snapshot) -> set[int]:
    """Nodes of `before` that stay in the tree but lost their host copy."""
    paths_after, nodes_after = node_paths(after), after.by_id()
    backed_after = {p for i, p in paths_after.items() if nodes_after[i].host_slots is not None}
    kept = set(paths_after.values())
    nodes = before.by_id()
    return {
        i
        for i, p in node_paths(before).items()
        if nodes[i].host_slots is not None and p in kept and p not in backed_after
    }


def host_eviction_bounds(
    before: Snapshot, after: Snapshot, asked: int, reported: int, reclaim_first: bool = True
) -> list[tuple[str, str]]:
    """INV-HOST-8: what host eviction may free, in which phase, and that it counts it exactly.

    Host eviction drops settled duplicate backups (write-back) and removes unlocked, unprotected
    host-only nodes, leaves first, stopping within one node past `asked`. With `reclaim_first` (the
    sglang-0.5.23 profile, SPEC.md §6) every duplicate goes before any leaf.
    """
    out: list[tuple[str, str]] = []
    paths_b, paths_a = node_paths(before), node_paths(after)
    kept = set(paths_a.values())
    nodes = before.by_id()
    gone = {i for i, p in paths_b.items() if p not in kept}
    for i in sorted(gone):
        n = nodes[i]
        if n.slots is not None or n.host_lock_ref > 0 or n.lock_ref > 0:
            out.append(
                (
                    "INV-HOST-8",
                    f"node {i} (on device {n.slots is not None}, lock_ref {n.lock_ref}, "
                    f"host_lock_ref {n.host_lock_ref}) was host-evicted",
                )
            )
    kids = before.children()
    for i in gone:
        alive = [c for c in kids.get(i, []) if c not in gone]
        if alive:
            out.append(("INV-HOST-8", f"node {i} host-evicted while its child {alive[0]} stays"))
    duplicates = host_duplicates(before)
    reclaimed = host_reclaimed(before, after)
    for i in sorted(reclaimed - duplicates):
        out.append(("INV-HOST-8", f"node {i} lost its host copy but is not a settled write-back duplicate"))
    sizes = [len(nodes[i].key) for i in reclaimed]
    every = sizes + [len(nodes[i].key) for i in gone]
    if reclaim_first and sizes and sum(sizes) - max(sizes) >= asked:
        out.append(("INV-HOST-8", f"reclaimed {sum(sizes)} duplicate tokens, past the {asked} asked by a whole node"))
    if not reclaim_first and every and sum(every) - max(every) >= asked:
        out.append(("INV-HOST-8", f"freed {sum(every)} host tokens, past the {asked} asked by a whole node"))
    if reclaim_first and gone and duplicates - reclaimed:
        out.append(("INV-HOST-8", f"host-evicted leaves while duplicate {min(duplicates - reclaimed)} kept its backup"))
    freed = sum(len(nodes[i].key) for i in gone) + sum(sizes)
    grew = len(after.host_free_slots) - len(before.host_free_slots)
    if not reported == freed == grew:
        out.append(("INV-HOST-8", f"reported {reported}, host lost {freed}, host free list grew {grew}"))
    return out


def device_paths(s: Snapshot) -> dict[int, Path]:
    """Node id -> path, for the nodes whose KV is on the device."""
    return s.derived("device_paths", _device_paths)


def _device_paths(s: Snapshot) -> dict[int, Path]:
    nodes = s.by_id()
    return {i: p for i, p in node_paths(s).items() if nodes[i].slots is not None}


def pinned_nodes(s: Snapshot) -> set[int]:
    """Device nodes eviction may skip: a node without a backup that is itself host-protected,
    or whose host-only subtree holds a locked or host-protected node (it would be dropped with
    it), and its ancestors, which keep a device child (SPEC.md §9.3)."""
    return s.derived("pinned_nodes", _pinned_nodes)


def _pinned_nodes(s: Snapshot) -> set[int]:
    nodes, kids = s.by_id(), s.children()

    def protected_below(i: int) -> bool:
        return any(
            nodes[c].slots is None and (nodes[c].lock_ref > 0 or nodes[c].host_lock_ref > 0 or protected_below(c))
            for c in kids.get(i, [])
        )

    stuck: set[int] = set()
    for n in s.nodes:
        if (
            n.id != s.root
            and n.slots is not None
            and n.host_slots is None
            and (n.host_lock_ref > 0 or protected_below(n.id))
        ):
            cur: Optional[int] = n.id
            while cur is not None and cur != s.root and cur not in stuck:
                stuck.add(cur)
                cur = nodes[cur].parent
    return stuck


def eviction_bounds(
    before: Snapshot, after: Snapshot, asked: int, reported: int, tiers: Optional[frozenset[int]] = None
) -> list[tuple[str, str]]:
    """INV-EVICT-1/2/3/5 from two snapshots alone; returns (inv, message) pairs.

    A node is evicted when its KV leaves the device, whether it leaves the tree or
    stays on the host (demotion). With `tiers` (a scoped eviction, SPEC.md §11.3) only the
    evictable tokens of those ref tiers count for INV-EVICT-1.
    """
    out: list[tuple[str, str]] = []
    paths_b, paths_a = device_paths(before), device_paths(after)
    kept = set(paths_a.values())
    nodes = before.by_id()
    gone = {i for i, p in paths_b.items() if p not in kept}
    appeared = kept - set(paths_b.values())
    if appeared:
        out.append(("INV-EVICT-3", f"eviction put new nodes on the device: {sorted(p[1] for p in appeared)[:3]}"))
    freed_tokens = sum(len(nodes[i].key) for i in gone)
    for i in gone:
        if nodes[i].lock_ref > 0:
            out.append(("INV-EVICT-3", f"locked node {i} (lock_ref {nodes[i].lock_ref}) was evicted"))
    kids = before.children()
    for i in gone:
        alive = [c for c in kids.get(i, []) if c in paths_b and c not in gone]
        if alive:
            out.append(("INV-EVICT-3", f"node {i} evicted while its child {alive[0]} stays on the device"))
    free_delta = len(after.free_slots) - len(before.free_slots)
    if not reported == freed_tokens == free_delta:
        out.append(("INV-EVICT-5", f"reported {reported}, device lost {freed_tokens}, free list grew {free_delta}"))
    # Write-back tries a node that would drop a protected host copy, and skips it only when its backup
    # fails; its victims' own store copies can protect a host copy mid-eviction. So what eviction may skip
    # is read off the state it left: the nodes pinned afterwards (SPEC.md §9.3).
    stuck = pinned_nodes(after if before.write_policy == "write_back" else before)
    evictable = before.evictable_size - sum(
        len(nodes[i].key) for i in stuck if i in nodes and nodes[i].slots is not None and nodes[i].lock_ref == 0
    )
    if tiers is not None:
        evictable = sum(
            len(n.key)
            for n in before.nodes
            if n.id != before.root
            and n.slots is not None
            and n.lock_ref == 0
            and n.id not in stuck
            and tier_of(n.high_ref, n.low_ref) in tiers
        )
    if freed_tokens < min(asked, evictable):
        out.append(("INV-EVICT-1", f"asked {asked}, evictable {evictable}, freed only {freed_tokens}"))
    tops = [i for i in gone if nodes[i].parent not in gone]
    if gone and not any(overshoot_ok(freed_tokens, asked, len(nodes[i].key)) for i in tops):
        out.append(("INV-EVICT-2", f"asked {asked}, freed {freed_tokens}: went on past the node that sufficed"))
    return out


# --------------------------------------------------------------------------- priority tiers (SPEC.md §11)


def _tier(s: Snapshot, node_id: int) -> int:
    n = s.by_id()[node_id]
    return tier_of(n.high_ref, n.low_ref)


def session_paths(s: Snapshot) -> list[tuple[str, Path, int, bool, bool]]:
    """The sessions as the spec fixes them: (id, the path they hold, priority, high, demoted), in order."""
    return s.derived("session_paths", _session_paths)


def _session_paths(s: Snapshot) -> list[tuple[str, Path, int, bool, bool]]:
    paths = node_paths(s)
    return [(x.id, paths.get(x.node, (None, ())), x.priority, x.high, x.demoted) for x in s.sessions]


def retained_nodes(s: Snapshot, live: Optional[set[str]] = None) -> set[int]:
    """The nodes a live retention holds (SPEC.md §11.7): those on the path of a session with a deadline; with
    `live`, only the sessions it names."""
    nodes = s.by_id()
    out: set[int] = set()
    for x in s.sessions:
        if x.retained_until is None or (live is not None and x.id not in live):
            continue
        cur: Optional[int] = x.node
        while cur is not None and cur != s.root and cur in nodes and cur not in out:
            out.add(cur)
            cur = nodes[cur].parent
    return out


def scope_tiers(allow_low: bool, allow_high: bool) -> frozenset[int]:
    """The ref tiers a scope lets an eviction touch (SPEC.md §11.3)."""
    return frozenset({UNUSED} | ({LOW_REF} if allow_low else set()) | ({HIGH_REF} if allow_high else set()))


def tier_eviction_violations(
    before: Snapshot, after: Snapshot, allow_low: bool, allow_high: bool
) -> list[tuple[str, str]]:
    """INV-TIER-3/4 and INV-RET-1 for one device eviction: nothing outside the scope, no lower tier left behind,
    and no unretained candidate left in a tier that lost a retained node.

    Tiers and retention are read off `before` (an eviction may demote sessions on the way, §11.4; the oracle
    comparison checks that part), retentions only of sessions still retained after it (one whose deadline came
    with this op's clock is not). Nodes it could skip (§9.3, `pinned_nodes` after it) are no candidates.
    """
    allowed = scope_tiers(allow_low, allow_high)
    paths_after = set(device_paths(after).values())
    gone = [i for i, p in device_paths(before).items() if p not in paths_after]
    out: list[tuple[str, str]] = []
    outside = sorted(i for i in gone if _tier(before, i) not in allowed)
    if outside:
        out.append(
            (
                "INV-TIER-3",
                f"evicted nodes {outside} of tiers {[_tier(before, i) for i in outside]} "
                f"outside the scope (allow_low={allow_low}, allow_high={allow_high})",
            )
        )
    top = max((_tier(before, i) for i in gone), default=-1)
    kept = retained_nodes(before, {x.id for x in after.sessions if x.retained_until is not None})
    spared = {_tier(before, i) for i in gone if i in kept}  # tiers that lost a retained node
    nodes, kids, skip, known = after.by_id(), after.children(), pinned_nodes(after), before.by_id()
    for n in after.nodes:
        if (
            n.id == after.root
            or n.id not in known
            or n.slots is None
            or n.lock_ref > 0
            or n.id in skip
            or any(nodes[c].slots is not None for c in kids.get(n.id, []))
        ):
            continue
        tier = _tier(before, n.id)
        if tier in allowed and tier < top:
            out.append(("INV-TIER-4", f"a tier-{top} node was evicted while tier-{tier} node {n.id} stays a candidate"))
            break
        if tier in spared and n.id not in kept:
            lost = sorted(i for i in gone if i in kept and _tier(before, i) == tier)
            out.append(("INV-RET-1", f"retained tier-{tier} nodes {lost} were evicted while unretained tier-{tier} "
                                      f"node {n.id} stays a candidate"))  # fmt: skip
            break
    return out


def host_tier_violations(before: Snapshot, after: Snapshot) -> list[tuple[str, str]]:
    """INV-TIER-4 for host eviction: no host copy goes while a high session holds it, counting the
    demotions the eviction made (the sessions' `high` after it, on the paths they held before)."""
    high_after = {x.id: x.high for x in after.sessions}
    nodes, after_ids = before.by_id(), {n.id for n in after.nodes}
    held: set[int] = set()
    for x in before.sessions:
        if not high_after.get(x.id, False):
            continue
        cur: Optional[int] = x.node
        while cur is not None and cur != before.root and cur in nodes:
            held.add(cur)
            cur = nodes[cur].parent
    gone = sorted(i for i in held if i not in after_ids)
    return [("INV-TIER-4", f"host eviction removed nodes {gone} that a high-priority session holds")] if gone else []


def plan_violations(
    s: Snapshot,
    tokens: int,
    priority: int,
    running: Sequence[Running],
    profile: Optional[AdmissionProfile],
    layers_total: int,
    plan: AdmissionPlan,
    backups: bool = True,
) -> list[tuple[str, str]]:
    """INV-ADMIT-1..4: check an admission plan against the state it was made in (SPEC.md §11.5, §11.6).
    `backups`: whether the backend keeps retracted requests' KV on the host at all (it declares retraction).

    Sizes come from the tree, not the backend's counters, so a drifting tier counter that skews a
    plan shows here as well as in INV-TIER-2.
    """
    threshold, ps = s.high_priority_threshold, s.page_size
    high = priority >= threshold
    free = len(s.free_slots)
    tiers = scope_tiers(True, high)
    scope_size = sum(
        len(n.key)
        for n in s.nodes
        if n.id != s.root and n.slots is not None and n.lock_ref == 0 and tier_of(n.high_ref, n.low_ref) in tiers
    )
    low = [r for r in running if r.priority < threshold]
    reserve = sum(r.tokens for r in low) if high else 0

    def need(layers: int) -> int:
        return page_ceil(-(-tokens * layers // layers_total), ps)

    def affordable(layers: int) -> bool:
        if layers == layers_total:
            return True
        return profile is not None and (
            profile.step + (layers_total - layers) * tokens * (profile.load + profile.store) <= profile.target
        )

    def coverable(layers: int) -> bool:
        return need(layers) <= free + scope_size + reserve

    if not plan.fits:
        fits = [k for k in range(1, layers_total + 1) if affordable(k) and coverable(k)]
        return [("INV-ADMIT-4", f"'does not fit', yet {max(fits)} resident layers would")] if fits else []
    out: list[tuple[str, str]] = []
    if plan.allow_high != high:
        out.append(("INV-ADMIT-1", f"scope allow_high={plan.allow_high} for a request of priority {priority}"))
    if not 1 <= plan.layers <= layers_total or plan.slots != need(plan.layers):
        out.append(("INV-ADMIT-1", f"{plan.slots} slots for {plan.layers} of {layers_total} layers of {tokens} tokens"))
        return out
    by_id = {r.id: r for r in running}
    taken = [by_id[i] for i in plan.retract if i in by_id]
    if len(taken) != len(plan.retract) or len(set(plan.retract)) != len(plan.retract):
        out.append(("INV-ADMIT-1", f"retracts {plan.retract}: not each a distinct running request"))
        return out
    if any(r.priority >= threshold for r in taken) or (taken and not high):
        out.append(("INV-ADMIT-1", f"retracts {[(r.id, r.priority) for r in taken]} for a priority-{priority} request"))
    short = plan.slots - free - scope_size
    want_evict = scope_size if taken else max(0, plan.slots - free)
    if plan.evict != want_evict or plan.evict > scope_size:
        out.append(("INV-ADMIT-1", f"evicts {plan.evict}; the scope holds {scope_size}, the plan needs {want_evict}"))
    if free + plan.evict + sum(r.tokens for r in taken) < plan.slots:
        out.append(("INV-ADMIT-1", f"frees {free + plan.evict + sum(r.tokens for r in taken)} for {plan.slots} slots"))
    if taken:
        if short <= 0:
            out.append(("INV-ADMIT-2", "retracts running requests although eviction frees enough"))
        else:
            largest = sorted(low, key=lambda r: (-r.tokens, r.id))
            fewest = next((k for k in range(1, len(largest) + 1) if sum(r.tokens for r in largest[:k]) >= short), 0)
            first = largest[: fewest - 1] if fewest else []
            base = sum(r.tokens for r in first)
            closing = [r for r in low if r not in first and base + r.tokens >= short]
            rule = [r.id for r in first] + [min(closing, key=lambda r: (r.tokens, r.id)).id] if fewest else []
            if not fewest:
                out.append(
                    ("INV-ADMIT-2", f"retracts {plan.retract}, yet no set of low-priority requests covers {short}")
                )
            elif [r.id for r in taken] != rule:
                out.append(("INV-ADMIT-2", f"retracts {plan.retract}; the fewest, by the stated rule: {tuple(rule)}"))
        room, keep = len(s.host_free_slots) if backups else 0, []
        for r in taken:
            size = page_ceil(r.tokens, ps)
            keep.append(0 < size <= room)
            room -= size if keep[-1] else 0
        if list(plan.keep) != keep:
            out.append(("INV-ADMIT-2", f"backs up {plan.keep}; the host's free slots allow {tuple(keep)}"))
    elif len(plan.keep):
        out.append(("INV-ADMIT-2", "keeps backups of no retraction"))
    if plan.layers < layers_total:
        if not affordable(plan.layers):
            out.append(("INV-ADMIT-3", f"{plan.layers} resident layers stream past the profile's target"))
        if affordable(plan.layers + 1) and coverable(plan.layers + 1):
            out.append(("INV-ADMIT-3", f"{plan.layers} resident layers, yet {plan.layers + 1} would fit"))
    return out
