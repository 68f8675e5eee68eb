"""The scheduler's side: what a caller does around each protocol call, on either cache.

An `Op` is one step of a serving engine's life — a request finishes and caches its key, a running
request is retracted, a new one asks for room — and most are more than one protocol call: the
engine allocates, runs the model (writes KV), inserts, frees its duplicates. `run_op` plays that
part on one `Side` (the backend, or the oracle beside it) through the table `HANDLERS`, so the
backend and the model see exactly the same calls. Only the backend side plays the model's KV and
records what the checks need afterwards (`StepNotes`); the oracle side is steered instead.

`settle` and `insert_request` are the same loops for callers outside a trace (tests, the bench).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvcert.conformance.harness import running
from kvcert.conformance.harness.ledger import Ledger
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.decisions import Chooser
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
    Retract,
    Start,
    Unlock,
    UpdateRef,
)
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    InsertOut,
    KVCertError,
    MatchOut,
    PoolExhausted,
    Running,
    Snapshot,
)

Outcome = Union[MatchOut, InsertOut, AdmissionPlan, int, None, KVCertError]


class KVModel:
    """The model's KV content (SPEC.md §9.12), memoised: every step re-reads the whole tree."""

    def __init__(self, kv_layers: int) -> None:
        self.kv_layers = kv_layers
        self._memo: dict[tuple[Any, tuple[Any, ...]], Optional[tuple[bytes, ...]]] = {}

    def entries(self, namespace: Any, tokens: tuple[Any, ...]) -> tuple[bytes, ...]:
        """`token_entries` of a path."""
        got = self.content(namespace, tokens)
        return got if got is not None else l3.token_entries(namespace, tokens, self.kv_layers)

    def content(self, namespace: Any, tokens: tuple[Any, ...]) -> Optional[tuple[bytes, ...]]:
        """`token_entries` of a path the content function is defined on (`has_content`), else None."""
        key = (namespace, tokens)
        try:
            got = self._memo.get(key, self)
        except TypeError:  # unhashable: a namespace or token the content function is not defined on
            return None
        if got is self:
            if len(self._memo) > 4096:
                self._memo.clear()
            ok = has_content(namespace, tokens)
            got = self._memo[key] = l3.token_entries(namespace, tokens, self.kv_layers) if ok else None
        return got  # type: ignore[return-value]


def has_content(namespace: Any, tokens: Any) -> bool:
    """Whether the content function is defined on this path: valid token ids and a namespace."""
    return (namespace is None or isinstance(namespace, str)) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < l3.TOKEN_LIMIT for t in tokens
    )


def running_of(running: Any) -> tuple[Running, ...]:
    """An Admit op's running requests as the protocol's values: (priority, tokens) pairs, ids by position."""
    return tuple(Running(i, r[0], r[1]) for i, r in enumerate(running))


def profile_of(profile: Any) -> Any:
    """An Admit op's profile as the protocol's value (a trace stores it as a 4-tuple)."""
    if isinstance(profile, (tuple, list)) and len(profile) == 4:
        return AdmissionProfile(*profile)
    return profile


@dataclass
class StepNotes:
    """What the backend side of a step leaves for the checks."""

    made_kv: Optional[tuple[bytes, ...]] = None
    """The entries a retraction's backup was made from."""
    planned: Optional[Snapshot] = None
    """The backend's state when it made an admission plan (after the running requests' allocations)."""
    violations: list[Violation] = field(default_factory=list)
    """Broken rules the caller saw mid-op (restored KV read back, a running request's row)."""
    inserted: Optional[tuple[Any, tuple[Any, ...]]] = None
    """(namespace, key) a running request's checkpoint inserted: its insert's contract is checked on it."""


@dataclass
class Side:
    """One of the two caches a step runs on, and what the caller does differently on it."""

    cache: Any
    column: int
    """Which id of each ledger pair names this cache's objects: 0 the backend, 1 the oracle."""
    ledger: Ledger
    config: CacheConfig
    kv: Optional[KVModel] = None
    """The model's KV, written into the caller's fresh slots: the backend side of a kv_reads backend only."""
    notes: Optional[StepNotes] = None
    """Where the backend side records what the checks need; None on the oracle side."""
    admitted: Optional[list[bool]] = None
    """Per admission that fit, whether the backend could then allocate the planned slots (backend side)."""
    choose: Optional[Chooser] = None
    """The oracle's eviction tie-break, steered to the backend's choice (oracle side)."""
    native_checkpoint: bool = False
    """The backend runs a running request's checkpoint itself (`Capabilities.checkpoints`; backend side only)."""
    gated: bool = False
    """The oracle composes the checkpoint of a backend that runs its own, so it skips, as that engine does, the
    hits a request's earlier checkpoints counted (oracle side only; SPEC.md §4.8)."""
    unaligned: bool = False
    """The backend page-aligns insert keys itself (`Capabilities.aligns_keys`): the backend gets a key that
    ends mid-page whole, the oracle its page-aligned head; the caller keeps the tail's slots (SPEC.md §4.2)."""

    def node(self, k: Any) -> int:
        return self.ledger.handles.id(k, self.column)

    def content(self, namespace: Any, tokens: tuple[Any, ...]) -> Optional[tuple[bytes, ...]]:
        """The model's entries for a path, where this side plays the model and the path has content."""
        if self.kv is None or not has_content(namespace, tokens):
            return None
        return self.kv.entries(namespace, tuple(tokens))

    def write_kv(self, slots: tuple[int, ...], namespace: Any, tokens: tuple[Any, ...], start: int = 0) -> None:
        """Play the model: fill the caller's fresh slots with the content of `tokens[start:]` (valid ones only)."""
        entries = self.content(namespace, tokens) if slots else None
        if entries is None:
            return
        entries = entries[start : start + len(slots)]
        self.cache.write_kv(slots[: len(entries)], entries)


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
