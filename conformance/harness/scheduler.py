"""The scheduler's side: what a caller does around each protocol call, on either cache.

An `Op` is one step of a serving engine's life — a request finishes and caches its key, a running
request is retracted, a new one asks for room — and most are more than one protocol call: the
engine allocates, runs the model (writes KV), inserts, frees its duplicates. `run_op` plays that
part on one `Side` (`conformance.harness.side`: the backend, or the oracle beside it) through the table
`HANDLERS`, so the backend and the model see exactly the same calls. Only the backend side plays the model's KV and
records what the checks need afterwards (`StepNotes`); the oracle side is steered instead.

`settle` and `insert_request` are the same loops for callers outside a trace (tests, the bench).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

from kvcert.conformance.harness import running
from kvcert.conformance.harness.side import Side
from kvcert.spec import pages
from kvcert.spec.invariants import Violation
from kvcert.spec.ops import (
    AbortPrefetch,
    Admit,
    Checkpoint,
    CheckPrefetch,
    Complete,
    Discard,
    Evict,
    EvictHost,
    Extend,
    Fetch,
    Finish,
    InjectFault,
    Insert,
    LoadBack,
    Lock,
    Match,
    Op,
    Poll,
    Prefetch,
    RegisterRef,
    ReleaseRef,
    Restore,
    Retain,
    RetainWaiting,
    Retract,
    Start,
    Unlock,
    UpdateRef,
)
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    InsertOut,
    KVCertError,
    MatchOut,
    PoolExhausted,
    Running,
)

Outcome = Union[MatchOut, InsertOut, AdmissionPlan, int, None, KVCertError]


def running_of(running: Any) -> tuple[Running, ...]:
    """An Admit op's running requests as the protocol's values: (priority, tokens) pairs, ids by position."""
    return tuple(Running(i, r[0], r[1]) for i, r in enumerate(running))


def profile_of(profile: Any) -> Any:
    """An Admit op's profile as the protocol's value (a trace stores it as a 4-tuple)."""
    if isinstance(profile, (tuple, list)) and len(profile) == 4:
        return AdmissionProfile(*profile)
    return profile


def insert_request(
    cache: Any,
    namespace: Any,
    tokens: tuple[Any, ...],
    priority: Any = 0,
    value_len: Optional[int] = None,
    write: Optional[Callable[[tuple[int, ...]], None]] = None,
    page_size: int = 0,
    aligns: bool = True,
) -> InsertOut:
    """The caller's side of SGLang's insert: allocate, run the model (`write` its KV), insert, free the duplicates.

    With `page_size`, a key that ends mid-page is a lenient cache's input (SPEC.md §4.2): whole pages are
    allocated, the cache gets the whole key (`aligns`) or its page-aligned head, and the caller frees the
    duplicates and then the tail's slots, which stay its own.
    """
    cut = len(tokens) - len(tokens) % page_size if page_size and value_len is None else len(tokens)
    if cut == len(tokens):
        slots = cache.alloc(len(tokens) if value_len is None else value_len)
    else:
        slots = cache.alloc(pages.page_ceil(len(tokens), page_size))
    if write is not None:
        write(slots)
    key, given = tokens, slots
    if cut < len(tokens):
        key, given = (tokens, slots[: len(tokens)]) if aligns else (tokens[:cut], slots[:cut])
    try:
        out: InsertOut = cache.insert(namespace, key, given, priority)
    except KVCertError:
        cache.free(slots)
        raise
    cache.free(slots[: out.prefix_len])
    if cut < len(tokens):  # the tail's slots, and the last page's spare ones: the caller's
        cache.free(slots[cut:])
    return out


def settle(cache: Any, rounds: Optional[int] = None) -> None:
    """The copy engine goes idle: complete every pending copy and consume every ack, until none is left
    (a write ack may issue store copies). `rounds` bounds the loop (an armed failure retries a copy)."""
    done = 0
    while True:
        pending = cache.snapshot().pending
        if not pending:
            return
        if rounds is not None and done >= rounds:
            raise AssertionError(f"copies still pending after {rounds} complete/poll rounds")
        for c in pending:
            if not c.finished:
                cache.complete(c.id)
        cache.poll()
        done += 1


# ---------------------------------------------------------------------- the ops that are more than one call


def _insert(side: Side, op: Insert) -> InsertOut:
    return insert_request(
        side.cache,
        op.namespace,
        op.tokens,
        op.priority,
        op.value_len,
        (lambda slots: side.write_kv(slots, op.namespace, op.tokens)) if side.kv is not None else None,
        side.config.page_size if side.unaligned else 0,
        side.column == 0,
    )


def _retract(side: Side, op: Retract) -> Optional[int]:
    """The scheduler's side of a retraction: back up the request's KV, then free its own slots.

    Its KV is the device part of the handle's path (slots the tree holds) and `tail` fresh slots of
    its own (decoded tokens, `2` each), as SGLang backs up a request's whole `req_to_token` row.
    """
    cache = side.cache
    snap = cache.snapshot()
    nodes = snap.by_id()
    path: list[int] = []
    cur = nodes.get(side.node(op.handle))
    while cur is not None and cur.id != snap.root:
        path.append(cur.id)
        cur = nodes.get(cur.parent) if cur.parent is not None else None
    device = [nodes[nid] for nid in reversed(path) if nodes[nid].slots is not None]
    prefix = [x for n in device for x in n.slots or ()]
    own = cache.alloc(op.tail)
    try:
        if side.kv is not None and side.notes is not None and isinstance(op.tail, int):
            ns = device[0].namespace if device else None
            tokens = tuple(t for n in device for t in n.key) + (2,) * op.tail
            side.notes.made_kv = side.kv.entries(ns, tokens)
            cache.write_kv(own, side.notes.made_kv[len(prefix) :])  # the decoded tail; the prefix is the tree's
        got: Optional[int] = cache.retraction_backup(tuple(prefix) + tuple(own))
    finally:
        cache.free(own)
    return got


def _restore(side: Side, op: Restore) -> int:
    """The scheduler's side of a resume: fresh slots for the backup, restore, then the request runs and frees them."""
    cache = side.cache
    backup = side.ledger.retractions.id(op.retraction, side.column)
    views = {r.id: r for r in cache.snapshot().retractions}
    tokens = views[backup].tokens if backup in views else 0
    slots = cache.alloc(pages.page_ceil(tokens, side.config.page_size))
    try:
        node: int = cache.retraction_restore(backup, slots[:tokens])
        want = side.ledger.retraction_kv.get(op.retraction) if side.notes is not None else None
        if want is not None and side.notes is not None and list(cache.read_kv(slots[:tokens])) != list(want):
            side.notes.violations.append(
                Violation("INV-KV-3", f"restoring backup {op.retraction} put other KV in the request's slots")
            )
    finally:
        cache.free(slots)
    return node


def _admit(side: Side, op: Admit) -> AdmissionPlan:
    """The scheduler's side of admission (SPEC.md §11.5): the running requests hold their slots, the cache
    plans, and the plan is applied: a scoped evict, the retractions (a backup for a kept one, then its
    slots freed), the request's allocation. The request then finishes at once."""
    cache = side.cache
    running = running_of(op.running)
    held: list[tuple[int, ...]] = []
    try:
        for r in running:
            held.append(cache.alloc(r.tokens))
        if side.notes is not None:
            side.notes.planned = cache.snapshot()
        plan: AdmissionPlan = cache.plan_admission(op.length, op.priority, running, profile_of(op.profile))
        if not plan.fits:
            return plan
        extra = {"choose": side.choose} if side.choose is not None else {}  # the oracle: the backend's ties
        cache.evict(plan.evict, allow_low=True, allow_high=plan.allow_high, **extra)
        for i, keep in zip(plan.retract, plan.keep):
            if keep:
                cache.retraction_backup(held[i])
            cache.free(held[i])
            held[i] = ()
        try:
            cache.free(cache.alloc(plan.slots))
            admitted = True
        except PoolExhausted:
            admitted = False  # the plan counted KV eviction could not free (pinned, §9.3)
        if side.admitted is not None:
            side.admitted.append(admitted)
        return plan
    finally:
        for slots in held:
            if slots:
                cache.free(slots)


def _evict(side: Side, op: Evict) -> int:
    extra = {"choose": side.choose} if side.choose is not None else {}
    if op.allow_low is True and op.allow_high is True:  # the full scope: any backend's plain evict
        return int(side.cache.evict(op.n, **extra))
    return int(side.cache.evict(op.n, allow_low=op.allow_low, allow_high=op.allow_high, **extra))


def _evict_host(side: Side, op: EvictHost) -> int:
    extra = {"choose": side.choose} if side.choose is not None else {}
    return int(side.cache.evict_host(op.n, **extra))


def _prefetch(side: Side, op: Prefetch, ops: list[Op]) -> Outcome:
    request = ops[op.handle] if isinstance(op.handle, int) and 0 <= op.handle < len(ops) else None
    node = side.ledger.anchors.id(op.handle, side.column)
    if not isinstance(request, Match):
        return side.cache.prefetch(node, None, ())  # an unknown handle: the cache rejects the node
    return int(side.cache.prefetch(node, request.namespace, request.tokens))


def _prefetch_id(side: Side, k: Any) -> int:
    return side.ledger.prefetches.id(k, side.column)


Handler = Callable[[Side, Any, list[Op]], Outcome]

HANDLERS: dict[type[Op], Handler] = {
    Insert: lambda s, op, _: _insert(s, op),
    Match: lambda s, op, _: s.cache.match_prefix(op.namespace, op.tokens),
    Lock: lambda s, op, _: s.cache.inc_lock_ref(s.node(op.handle)),
    Unlock: lambda s, op, _: s.cache.dec_lock_ref(s.node(op.handle)),
    Evict: lambda s, op, _: _evict(s, op),
    EvictHost: lambda s, op, _: _evict_host(s, op),
    LoadBack: lambda s, op, _: int(s.cache.load_back(s.ledger.host_handles.id(op.handle, s.column))),
    Complete: lambda s, op, _: s.cache.complete(s.ledger.copies.id(op.copy, s.column)),
    Poll: lambda s, op, _: int(s.cache.poll()),
    Prefetch: _prefetch,
    Fetch: lambda s, op, _: s.cache.fetch(_prefetch_id(s, op.prefetch)),
    CheckPrefetch: lambda s, op, _: s.cache.check_prefetch(_prefetch_id(s, op.prefetch)),
    AbortPrefetch: lambda s, op, _: s.cache.abort_prefetch(_prefetch_id(s, op.prefetch)),
    InjectFault: lambda s, op, _: s.cache.inject_fault(op.kind),
    Retract: lambda s, op, _: _retract(s, op),
    Restore: lambda s, op, _: _restore(s, op),
    Discard: lambda s, op, _: s.cache.retraction_discard(s.ledger.retractions.id(op.retraction, s.column)),
    Admit: lambda s, op, _: _admit(s, op),
    RegisterRef: lambda s, op, _: s.cache.register_ref(op.session, s.node(op.handle), op.priority),
    UpdateRef: lambda s, op, _: s.cache.update_ref(op.session, op.priority),
    ReleaseRef: lambda s, op, _: s.cache.release_ref(op.session),
    Retain: lambda s, op, _: s.cache.retain(op.session, op.ttl),
    RetainWaiting: lambda s, op, _: s.cache.retain_waiting(op.session),
    Start: running.start,
    Extend: running.extend,
    Checkpoint: running.checkpoint,
    Finish: running.finish,
}
"""Op type -> what the caller does on one side. Storage-side events (Publish, StorageFault) make no
cache call: the harness applies them to both stores (`conformance.harness.storage`)."""


def run_op(side: Side, op: Op, ops: list[Op]) -> Outcome:
    """One op as protocol calls on one side; a typed rejection is the outcome, not an exception."""
    handler = HANDLERS.get(type(op))
    if handler is None:
        raise TypeError(f"not an op: {op!r}")
    try:
        return handler(side, op, ops)
    except KVCertError as err:
        return err
