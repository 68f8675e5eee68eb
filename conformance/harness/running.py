"""Running requests: the caller's side of a request that holds KV across operations (SPEC.md §4.8).

A serving engine does not insert a request once, at its end. It matches the prompt and locks the
match, computes the rest into slots of its own, decodes into more, and publishes what it has so far
while it keeps running (SGLang's `checkpoint`, which was `cache_unfinished_req`): an insert of the
page-aligned prefix over a path it still locks, a free of the duplicates that insert exposed, the
row repointed at the tree's slots, and the lock moved to the node the insert ended on. At its end
it checkpoints once more (or not), frees what it still owns and drops its lock. Bugs live in those
seams: a duplicate range off by a page, a lock moved in the wrong order, a partial page freed that
the request still reads.

The request's state is the caller's, so it lives here, one `Request` per side in the ledger
(`Ledger.running`), keyed by the `Start` op's position. The backend's side reads the request's
state back after each checkpoint (INV-REQ-1) and its own KV after every step (INV-REQ-2); the slots a request owns are the snapshot's
`lent_slots`, so nothing it holds counts as leaked and nothing it holds may be free or in the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from kvcert.conformance.harness.side import Side
from kvcert.spec import pages
from kvcert.spec.invariants import Violation
from kvcert.spec.ops import Checkpoint, Extend, Finish, Start
from kvcert.spec.types import InsertOut, KVCertError, LockUnderflow, MatchOut

PRIORITY_MAX = 2**63 - 1
"""The prompt's priority bump saturates here, as SGLang's does at int64's top."""


class TraceInvalid(Exception):
    """A trace no caller could play: a running request's lock was dropped by an `Unlock` it did not take.

    Only shrinking makes such a trace (deleting a `Lock` keeps the `Unlock` after it); the oracle, which
    never rejects a valid call, tells it apart, and a shrink candidate that raises this is not kept."""


def _unlock(side: Side, r: Request, k: int) -> None:
    try:
        side.cache.dec_lock_ref(r.node)
    except LockUnderflow:
        if side.notes is None:  # the oracle's side: the request's lock is gone, so the trace took it
            raise TraceInvalid(f"request {k}'s lock was dropped by an Unlock the trace did not take") from None
        raise


@dataclass(frozen=True)
class Request:
    """One running request as one side's caller sees it: immutable, replaced at each step."""

    namespace: Any
    tokens: tuple[Any, ...]
    priority: int
    row: tuple[int, ...]
    """A slot per token: `row[:protected]` the tree's (locked through `node`), the rest its own."""
    own: tuple[int, ...]
    """Slots it allocated and still holds, in row order: `row[protected:]`, then its last page's spare slots."""
    protected: int
    node: int
    """The node it locks (the end of its cached prefix)."""
    prompt: int = 0
    """How many of its tokens are its prompt (the `Start`'s): the rest it decoded (`Extend`)."""
    inserted: int = 0
    """How much of its key its checkpoints have inserted so far (SGLang's `cache_inserted_len`)."""


def _get(side: Side, k: Any) -> Optional[Request]:
    pair = side.ledger.running.get(k) if isinstance(k, int) and not isinstance(k, bool) else None
    return pair[side.column] if pair is not None else None


def _put(side: Side, k: int, request: Optional[Request]) -> None:
    pair = list(side.ledger.running.get(k, (None, None)))
    pair[side.column] = request
    if pair == [None, None]:
        side.ledger.running.pop(k, None)
    else:
        side.ledger.running[k] = (pair[0], pair[1])


def start(side: Side, op: Start, ops: list[Any]) -> MatchOut:
    """Match the prompt, lock the match, allocate whole pages for the rest and compute it."""
    cache = side.cache
    got: MatchOut = cache.match_prefix(op.namespace, op.tokens)
    cache.inc_lock_ref(got.node)
    try:
        own = tuple(cache.alloc(pages.page_ceil(len(op.tokens), side.config.page_size) - got.length))
    except KVCertError:
        cache.dec_lock_ref(got.node)
        raise
    fresh = own[: len(op.tokens) - got.length]
    side.write_kv(fresh, op.namespace, op.tokens, got.length)
    row = tuple(got.slots) + fresh
    request = Request(op.namespace, tuple(op.tokens), op.priority, row, own, got.length, got.node, prompt=len(op.tokens))
    _put(side, len(ops) - 1, request)
    return got


def extend(side: Side, op: Extend, _ops: list[Any]) -> None:
    """Decode `op.tokens` more: fresh whole pages once the last one is full; a request not running is a no-op."""
    r = _get(side, op.handle)
    if r is None:
        return None
    tokens = r.tokens + tuple(op.tokens)
    need = pages.page_ceil(len(tokens), side.config.page_size) - r.protected - len(r.own)
    own = r.own + (tuple(side.cache.alloc(need)) if need > 0 else ())
    fresh = own[len(r.tokens) - r.protected : len(tokens) - r.protected]
    side.write_kv(fresh, r.namespace, tokens, len(r.tokens))
    _put(side, op.handle, replace(r, tokens=tokens, row=r.row + fresh, own=own))
    return None


def _checkpoint(side: Side, r: Request, k: int) -> tuple[Optional[InsertOut], Request]:
    """Insert the page-aligned prefix computed so far, free the duplicates, repoint the row, move the lock:
    the engine's own checkpoint where the backend runs one, else composed here."""
    aligned = pages.page_floor(len(r.tokens), side.config.page_size)
    if aligned == 0:
        return None, r
    if side.notes is not None:
        side.notes.inserted = (r.namespace, r.tokens[:aligned])
    if side.native_checkpoint:
        out, head, node = side.cache.checkpoint(
            r.namespace, r.tokens, r.row, r.protected, r.node, r.priority, prompt=r.prompt, request=k
        )
    else:
        out, head, node = _composed_checkpoint(side, r, aligned, k)
    moved = replace(
        r,
        row=tuple(head) + r.row[len(head) :],
        own=r.own[aligned - r.protected :],
        protected=aligned,
        node=node,
        inserted=max(r.inserted, aligned),
    )
    if side.notes is not None and len(head) != aligned:  # INV-REQ-1; the row's KV is judged with the state
        side.notes.violations.append(
            Violation("INV-REQ-1", f"request {k}: {len(head)} of its {aligned} checkpointed tokens are cached")
        )
    return out, moved


def _composed_checkpoint(side: Side, r: Request, aligned: int, k: int) -> tuple[InsertOut, tuple[int, ...], int]:
    """The checkpoint from protocol calls: (the insert's outcome, the tree's slots for the prefix, the node).

    Where the prompt ends inside the prefix, its page-aligned part is inserted once more, one priority up, so
    that it is a node of its own that eviction can keep while it drops the decoded tail (SGLang's scheduler
    does this at every checkpoint). The oracle that stands for an engine's own checkpoint (`gated`) also skips
    the hits the request's earlier checkpoints counted (`inserted_len`), as that engine does."""
    cache, key = side.cache, r.tokens[:aligned]
    gate: dict[str, int] = {"inserted_len": r.inserted} if side.gated else {}
    out: InsertOut = cache.insert(r.namespace, key, r.row[:aligned], r.priority, **gate)
    prompt = pages.page_floor(r.prompt, side.config.page_size)
    if 0 < prompt < aligned:
        gate = {"inserted_len": prompt} if side.gated else {}
        cache.insert(r.namespace, key[:prompt], r.row[:prompt], min(r.priority + 1, PRIORITY_MAX), **gate)
    cache.free(r.row[r.protected : out.prefix_len])  # the tree held these already: the request's copies go
    got: MatchOut = cache.match_prefix(r.namespace, key)
    _unlock(side, r, k)  # the lock moves: SGLang unlocks the old node, then locks the new one
    cache.inc_lock_ref(got.node)
    return out, tuple(got.slots), got.node


def checkpoint(side: Side, op: Checkpoint, _ops: list[Any]) -> Optional[InsertOut]:
    r = _get(side, op.handle)
    if r is None:
        return None
    out, moved = _checkpoint(side, r, op.handle)
    _put(side, op.handle, moved)
    return out


def finish(side: Side, op: Finish, _ops: list[Any]) -> Optional[InsertOut]:
    """Checkpoint (with `cache`), then free what the request still owns and drop its lock."""
    r = _get(side, op.handle)
    if r is None:
        return None
    out = None
    if op.cache:
        out, r = _checkpoint(side, r, op.handle)
    _put(side, op.handle, None)
    side.cache.free(r.own)
    _unlock(side, r, op.handle)
    return out


def lent(requests: dict[int, tuple[Optional[Request], Optional[Request]]], column: int) -> tuple[int, ...]:
    """Every slot one side's running requests own, sorted (the snapshot's `lent_slots`)."""
    return tuple(sorted(x for pair in requests.values() if (r := pair[column]) is not None for x in r.own))
