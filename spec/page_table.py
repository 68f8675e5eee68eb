"""The page-level core (SPEC.md §13): what a user of any prefix cache can observe, whatever holds its index.

A radix tree (SGLang, kvcert's caches) and a block-hash table (vLLM) are two representations of one thing: a set
of cached pages, each the KV of a page-aligned prefix under its keys, in a slot of the device pool, held by some
running requests or evictable. `PageTable` is that thing observed; `pages_of` reads it off a radix `Snapshot`,
and a block-hash engine's adapter builds it from the engine's own table. `check_pages` holds it to the rules
every correct prefix cache keeps; the rules about a tree's shape (one node per prefix, parents before children,
path-counted locks: INV-TREE-1/3, INV-NS-1, INV-LOCK-3) stay with the radix representation (`invariants`).

The core rules keep the IDs the radix checks gave them where the rule is the same (a pool that closes is
INV-ACCT-3 in either shape); INV-PAGE-* are the page-level forms of what a tree states through its edges.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcert.spec.invariants import Violation, _all_distinct, _all_within, _paged
from kvcert.spec.requests import RequestView
from kvcert.spec.types import Namespace, Snapshot, Tokens

__all__ = ["CachedPage", "PageTable", "check_pages", "holders_exact", "pages_of"]


@dataclass(frozen=True)
class CachedPage:
    """One cached page: the KV of the last `page_size` tokens of `tokens`, computed over all of them."""

    id: int
    """The engine's own name for it (a radix node's id and the page's index in it; a vLLM block id)."""
    namespace: Namespace
    """Its keys: requests under other keys must never read it (kvcert's namespace; an engine's extra keys)."""
    tokens: Tokens
    """Every token up to the end of the page: a page's KV depends on its whole prefix."""
    slots: tuple[int, ...]
    """Its device slots, one per token of the page."""
    holders: int
    """Running requests that hold it (a radix node's lock count; a block's reference count)."""


@dataclass(frozen=True)
class PageTable:
    """A prefix cache's device tier as pages. The fields the request harness reads off any snapshot (`sessions`,
    `pending`, `lent_slots`) have their radix meanings."""

    page_size: int
    capacity: int
    """Device slots the cache may use (an engine's reserved slots, such as vLLM's null block, are outside it)."""
    slot_limit: int
    """Slot ids lie in [0, slot_limit)."""
    pages: tuple[CachedPage, ...]
    free_slots: tuple[int, ...]
    """Slots neither cached nor held: free for any request."""
    lent_slots: tuple[int, ...]
    """Slots running requests hold outside any cached page (their uncached KV, a partial last page)."""
    evictable_size: int
    """Tokens the engine counts as cached and evictable (held by no request)."""
    protected_size: int
    """Tokens the engine counts as cached and held."""
    representation: str = "block-hash"
    """How the engine indexes its pages: "radix" or "block-hash"."""
    sessions: tuple[Any, ...] = ()
    pending: tuple[Any, ...] = ()
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def derived(self, name: str, build: Callable[[PageTable], Any]) -> Any:
        if name not in self._cache:
            self._cache[name] = build(self)
        return self._cache[name]


def pages_of(s: Snapshot) -> PageTable:
    """A radix snapshot's device tier as pages: each device node of `k` pages is `k` cached pages whose holders are
    the node's lock count. Page ids are `node id * 2**20 + page index` (stable while the node keeps its key)."""
    from kvcert.spec.contracts import node_paths

    ps = s.page_size
    paths = node_paths(s)
    out = []
    for n in s.nodes:
        if n.id == s.root or n.slots is None or n.id not in paths:
            continue
        ns, path = paths[n.id]
        start = len(path) - len(n.key)
        for i in range(0, len(n.key) - len(n.key) % ps, ps):
            out.append(CachedPage(n.id * 2**20 + i // ps, ns, path[: start + i + ps], n.slots[i : i + ps], n.lock_ref))
    return PageTable(
        page_size=ps,
        capacity=s.capacity,
        slot_limit=s.slot_limit,
        pages=tuple(out),
        free_slots=s.free_slots,
        lent_slots=s.lent_slots,
        evictable_size=s.evictable_size,
        protected_size=s.protected_size,
        representation="radix",
        sessions=s.sessions,
        pending=s.pending,
    )


# --------------------------------------------------------------------------- the core rules over pages


def pages_whole(t: PageTable) -> list[str]:
    """INV-PAGE-1: a cached page covers a page-aligned prefix and has one slot per token of its page."""
    out = []
    for p in t.pages:
        if not p.tokens or len(p.tokens) % t.page_size:
            out.append(f"page {p.id} ends at {len(p.tokens)} tokens, not a positive multiple of {t.page_size}")
        if len(p.slots) != t.page_size:
            out.append(f"page {p.id} has {len(p.slots)} slots for a {t.page_size}-token page")
    return out


def holders_nonnegative(t: PageTable) -> list[str]:
    """INV-LOCK-1: no holder count is negative."""
    return [f"page {p.id} has {p.holders} holders" for p in t.pages if p.holders < 0]


def evictable_exact(t: PageTable) -> list[str]:
    """INV-ACCT-1: the evictable size is the tokens of cached pages no request holds."""
    want = sum(t.page_size for p in t.pages if p.holders == 0)
    return [] if t.evictable_size == want else [f"evictable size {t.evictable_size}, the pages say {want}"]


def protected_exact(t: PageTable) -> list[str]:
    """INV-ACCT-2: the protected size is the tokens of cached pages some request holds."""
    want = sum(t.page_size for p in t.pages if p.holders > 0)
    return [] if t.protected_size == want else [f"protected size {t.protected_size}, the pages say {want}"]


def _cached_slots(t: PageTable) -> list[int]:
    return t.derived("cached_slots", lambda t: [x for p in t.pages for x in p.slots])


def pool_closes(t: PageTable) -> list[str]:
    """INV-ACCT-3: free slots + cached pages' slots + slots lent to running requests = capacity (nothing leaked)."""
    total = len(t.free_slots) + len(_cached_slots(t)) + len(t.lent_slots)
    if total == t.capacity:
        return []
    return [
        f"free {len(t.free_slots)} + cached {len(_cached_slots(t))} + lent {len(t.lent_slots)} = {total} "
        f"!= capacity {t.capacity}"
    ]


def slots_unique(t: PageTable) -> list[str]:
    """INV-SLOT-1: no slot is owned twice (two pages, a page and the free list, a page and a request's own)."""
    if _all_distinct(t.free_slots, _cached_slots(t), t.lent_slots):
        return []  # the common case, in one pass
    owners: Counter[int] = Counter(t.free_slots)
    owners.update(_cached_slots(t))
    owners.update(t.lent_slots)
    return [f"slot {slot} owned {c} times" for slot, c in sorted(owners.items()) if c > 1]


def slots_in_range(t: PageTable) -> list[str]:
    """INV-SLOT-2: every slot lies in [0, slot_limit)."""
    if _all_within(t.slot_limit, t.free_slots, _cached_slots(t), t.lent_slots):
        return []
    every = set(t.free_slots) | set(_cached_slots(t)) | set(t.lent_slots)
    return [f"slot {x} outside [0, {t.slot_limit})" for x in sorted(every) if not 0 <= x < t.slot_limit]


def slots_paged(t: PageTable) -> list[str]:
    """INV-SLOT-4: with pages of more than one token, a page's slots are one aligned contiguous device page."""
    if t.page_size == 1:
        return []
    return _paged(t.page_size, [(p.id, p.slots) for p in t.pages], t.free_slots)


PAGE_INVARIANTS: dict[str, Callable[[PageTable], list[str]]] = {
    "INV-PAGE-1": pages_whole,
    "INV-LOCK-1": holders_nonnegative,
    "INV-ACCT-1": evictable_exact,
    "INV-ACCT-2": protected_exact,
    "INV-ACCT-3": pool_closes,
    "INV-SLOT-1": slots_unique,
    "INV-SLOT-2": slots_in_range,
    "INV-SLOT-4": slots_paged,
}
"""The core's state rules over pages, in the order they are checked."""


def check_pages(t: PageTable) -> list[Violation]:
    """Every core state rule over one page table."""
    return [Violation(inv, m) for inv, check in PAGE_INVARIANTS.items() for m in check(t)]


def holders_exact(t: PageTable, requests: Sequence[RequestView]) -> list[Violation]:
    """INV-PAGE-2: a cached page's holders are exactly the running requests whose row maps it — a count above that is
    a reference nobody will drop (the page can never be evicted), one below it a page that can be evicted, and its
    slots reused, under a request that still reads it."""
    rows: Counter[int] = Counter()
    for v in requests:
        if v.state == "running":
            rows.update({x for x in v.row[: v.computed]} | set(v.held))
    out = []
    for p in t.pages:
        readers = rows[p.slots[0]] if p.slots else 0
        if readers != p.holders:
            out.append(Violation("INV-PAGE-2", f"page {p.id} (ending at {len(p.tokens)} tokens) has {p.holders} "
                                 f"holders; {readers} running requests map it"))  # fmt: skip
    return out[:5]
