"""The Backend protocol: what an engine's cache (or an adapter around it) implements.

The calls mirror a radix prefix cache's own API (SGLang's `RadixCache` is the
model), plus a slot allocator, a logical clock and `snapshot()`. Node handles
are plain ints that also appear as `NodeView.id` in snapshots.

A factory is any callable `factory(config: CacheConfig) -> Backend` with a
`capabilities: Capabilities` attribute; `kvcert certify MODULE:FACTORY` takes one.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from kvcert.spec.invariants import Violation
from kvcert.spec.requests import RequestView
from kvcert.spec.storage import StorageBackend
from kvcert.spec.types import (
    AdmissionPlan,
    AdmissionProfile,
    CacheConfig,
    Capabilities,
    InsertOut,
    MatchOut,
    Running,
    Snapshot,
)

__all__ = [
    "Backend",
    "Factory",
    "FaultInjectingBackend",
    "HostTierBackend",
    "Image",
    "InsertOut",
    "KINDS",
    "Keys",
    "KVBackend",
    "LinkerPathBackend",
    "MatchOut",
    "Model",
    "PriorityBackend",
    "Probe",
    "RequestPathBackend",
    "RetainingBackend",
    "RetractionBackend",
    "Served",
    "StorageTierBackend",
    "Walk",
    "WalkCell",
    "WalkFailure",
    "capabilities_of",
    "close_backend",
    "unexercised",
]


@runtime_checkable
class Backend(Protocol):
    """A device-tier radix KV cache under test (SPEC.md §4)."""

    def set_clock(self, now: int) -> None:
        """Logical time of the next operation; replaces any wall clock (SPEC.md §3)."""

    def alloc(self, n: int) -> tuple[int, ...]:
        """Take `n` free slots (whole pages); raise `PoolExhausted` if there are fewer."""

    def free(self, slots: Sequence[int]) -> None:
        """Return slots the caller owns to the pool."""

    def match_prefix(self, namespace: Optional[str], tokens: Sequence[int]) -> MatchOut: ...

    def insert(
        self, namespace: Optional[str], tokens: Sequence[int], slots: Sequence[int], priority: int = 0
    ) -> InsertOut: ...

    def inc_lock_ref(self, node: int) -> None: ...

    def dec_lock_ref(self, node: int) -> None: ...

    def evict(self, n: int) -> int:
        """Free at least min(n, evictable) tokens; return how many were freed."""

    def snapshot(self) -> Snapshot: ...


@runtime_checkable
class HostTierBackend(Backend, Protocol):
    """A cache with a host tier (SPEC.md §9); declared by `Capabilities.write_policies`."""

    def evict_host(self, n: int) -> int:
        """Free at least min(n, evictable host tokens) of host-only, unprotected KV; return how many."""

    def load_back(self, node: int) -> int:
        """Start loading the host-only part of the path ending at `node`; return its tokens (0: refused)."""

    def complete(self, copy: int) -> None:
        """The copy engine finished pending copy `copy` (an id from `Snapshot.pending`)."""

    def poll(self) -> int:
        """Consume finished acks in issue order; return how many."""


@runtime_checkable
class StorageTierBackend(HostTierBackend, Protocol):
    """A cache with an L3 storage tier (SPEC.md §10); declared by `Capabilities.prefetch_policies`.

    Storage-call discipline, so that faults armed by the harness land alike on every
    conforming backend: a store copy's `complete` is one `batch_set` of its pages, a
    `prefetch` one `batch_exists`, a `fetch` one `batch_get` of one page.
    """

    def attach_storage(self, storage: StorageBackend) -> None:
        """Use `storage` as L3 (the harness owns it and injects its faults)."""

    def prefetch(self, node: int, namespace: Optional[str], tokens: Sequence[int]) -> int:
        """Start fetching the stored pages of `tokens` that follow `node`'s path; return their tokens (0: none)."""

    def fetch(self, prefetch: int) -> None:
        """Storage delivers the next page of prefetch `prefetch` (an id from `Snapshot.prefetches`)."""

    def check_prefetch(self, prefetch: int) -> Optional[int]:
        """End the prefetch if its stop policy allows: the host tokens the tree gained, or None (still running)."""

    def abort_prefetch(self, prefetch: int) -> None:
        """End the prefetch, keeping nothing."""


@runtime_checkable
class FaultInjectingBackend(Backend, Protocol):
    """A cache that lets the harness arm its own faults; declared by `Capabilities.faults`."""

    def inject_fault(self, kind: str) -> None:
        """Arm one fault of `kind` (FAULTS): the cache's next host allocation (`host_alloc`) or
        copy completion (`copy`) fails."""


@runtime_checkable
class KVBackend(Backend, Protocol):
    """A cache whose KV bytes the harness writes and reads (`Capabilities.kv_reads`; SPEC.md §9.12).

    An entry is one token's KV: `kvcert.spec.storage.token_entries` (K of every layer, then V).
    The harness plays the model: it writes a request's KV into the slots it allocated before
    inserting them, and after every step reads back every settled slot of both tiers.
    """

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        """The forward pass: `entries[i]` into device slot `slots[i]` (slots the caller holds)."""

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        """The entries device slots hold now."""

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        """The entries host slots hold now."""


@runtime_checkable
class RetractionBackend(HostTierBackend, Protocol):
    """A host tier that keeps retracted requests' KV (SPEC.md §9.11); declared by `Capabilities.retraction`."""

    def retraction_backup(self, slots: Sequence[int]) -> Optional[int]:
        """Copy the KV in `slots` (the tree's or the caller's) to fresh host slots; the backup id, or None without room."""

    def retraction_restore(self, backup: int, slots: Sequence[int]) -> int:
        """Copy backup `backup` into the caller's `slots` and free it; return the resumed request's
        last node (the root), locked once on the caller's behalf."""

    def retraction_discard(self, backup: int) -> None:
        """Free backup `backup`."""


@runtime_checkable
class PriorityBackend(Backend, Protocol):
    """Session refs, ref tiers and scoped eviction (SPEC.md §11); declared by `Capabilities.priority_refs`."""

    def register_ref(self, session: str, node: int, priority: int) -> None:
        """Session `session` holds the path ending at `node`, at `priority` (again: moved there)."""

    def update_ref(self, session: str, priority: int) -> None:
        """Session `session` changes priority; an adaptive demotion is cleared."""

    def release_ref(self, session: str) -> None:
        """Session `session` holds nothing any more."""

    def evict(self, n: int, allow_low: bool = True, allow_high: bool = True) -> int:  # type: ignore[override]
        """Free at least `n` device tokens, touching only the ref tiers the scope allows."""


@runtime_checkable
class RetainingBackend(PriorityBackend, Protocol):
    """Retention across a declared pause (SPEC.md §11.7); declared by priority part `retain`."""

    def retain(self, session: str, ttl: int) -> None:
        """Session `session` will come back: its path is retained for `ttl` time units."""

    def retain_waiting(self, session: str) -> None:
        """Session `session`'s next turn waits: a live retention lasts until that turn registers."""

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        """What admitting a request of `tokens` new tokens takes (SPEC.md §11.5); changes nothing."""


class Model(Protocol):
    """The model, played by the suite (SPEC.md §12): what a request-path target's forward pass asks of it."""

    def kv(self, namespace: Optional[str], tokens: Sequence[int], start: int, count: int) -> list[bytes]:
        """The KV entries of `tokens[start:start + count]` (each token's KV depends on its whole prefix)."""

    def next_token(self, namespace: Optional[str], tokens: Sequence[int]) -> int:
        """The token sampled after `tokens` (`kvcert.spec.requests.output_token`)."""


@runtime_checkable
class RequestPathBackend(Protocol):
    """An engine driven through its own scheduler code with real request objects (SPEC.md §12); declared by
    `Capabilities.kind == "request-path"`. The adapter translates each call into the engine's own entry point and
    never does the scheduler's part: the engine admits, chunks, allocates, evicts, caches, registers and frees.

    Each call returns once the engine has taken the message (a request queued, a close or a priority change
    received); its effect is the engine's business, at the engine's next `step` or at once, as the engine does it.
    """

    def set_clock(self, now: int) -> None:
        """Logical time of the next call; replaces any wall clock (SPEC.md §3)."""

    def attach_model(self, model: Model) -> None:
        """The model the engine's forward pass runs: it writes `model.kv(...)` into the slots the engine computed
        and samples `model.next_token(...)`."""

    def submit(
        self,
        request: str,
        session: Optional[str],
        namespace: Optional[str],
        tokens: Sequence[int],
        priority: int,
        output: int,
    ) -> None:
        """A request arrives: a turn of `session` (None: one-shot) whose prompt is `tokens`, decoding `output`
        tokens (the model never stops it earlier)."""

    def step(self) -> None:
        """One iteration of the engine's scheduler loop: take messages, schedule, run the model, process results."""

    def close_session(self, session: str) -> None:
        """The client ends `session` (the engine's release call: SGLang's close_session, the fork's /release_ref)."""

    def reprioritize(self, session: str, priority: int) -> None:
        """The client changes `session`'s priority (the fork's /update_ref)."""

    def abort(self, request: str) -> None:
        """The client aborts `request`."""

    def requests(self) -> tuple[RequestView, ...]:
        """Every request submitted and not yet reported finished or aborted before the last step, read off the
        engine's own request objects."""

    def snapshot(self) -> Snapshot:
        """The cache as for any backend, with the sessions the engine has registered (`Snapshot.sessions`) and
        the slots its requests hold (`Snapshot.lent_slots`)."""

    def bookkeeping(self) -> dict[str, tuple[Any, ...]]:
        """The engine's per-request and per-session indexes (registries, heaps, maps, counters), by name: how many
        entries each holds, the ids of the tree nodes its entries name, and, for one the engine caps itself, its cap
        (INV-LIVE-2: a capped index may stay above its baseline, never above its cap)."""

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        """The entries device slots hold now."""

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        """The entries host slots hold now."""


@runtime_checkable
class LinkerPathBackend(RequestPathBackend, Protocol):
    """A request-path engine whose cache is linked straight to the harness's external store (SPEC.md §14;
    `Capabilities.linker_faults`). The store is `kvcert.conformance.reference.linker.LinkerStore`: it moves the bytes and
    judges every call the engine makes to it; the adapter reports those judgements through `observed`."""

    def linker_fault(self, kind: str) -> None:
        """The store fails as `kind` (`kvcert.spec.linker.FAULTS`) says, now or at the call it applies to."""

    def failed_loads(self) -> set[str]:
        """Requests whose load the store failed: the engine may fail them (INV-LINK-4)."""


Factory = Callable[[CacheConfig], Backend]


def capabilities_of(factory: object) -> Capabilities:
    caps = getattr(factory, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{factory!r} has no `capabilities: Capabilities` attribute")
    return caps


def close_backend(backend: object) -> None:
    """Release a backend: its `close()` (pools, threads), if it has one. Backends need not define it."""
    close = getattr(backend, "close", None)
    if callable(close):
        close()


# --------------------------------------------------------------------------- walk targets


@dataclass(frozen=True)
class WalkCell:
    """One cell of a walk target: a policy, a page size and the target's own parameters."""

    policy: str
    page_size: int = 1
    params: tuple[tuple[str, Any], ...] = ()
    tier: str = ""
    """What the certificate's tiers column says for it (e.g. "host (CPU offload)")."""

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    @property
    def name(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in self.params)
        return f"ps{self.page_size}-{self.policy}{extra}"


class WalkFailure(Exception):
    """The first broken rule of a replay: at which operation, and what broke."""

    def __init__(self, step: int, op: dict[str, Any], violations: list[Violation]) -> None:
        super().__init__(f"step {step} {op}: " + "; ".join(map(str, violations)))
        self.step, self.op, self.violations = step, op, violations


class Walk(Protocol):
    """An API-level target's own operations (`conformance.certification.walk`): its cells, a seeded generator of
    JSON-able operations, a replay that checks every rule after every operation, and what it does not check."""

    def cells(self, capabilities: Capabilities) -> list[WalkCell]: ...

    def generate(self, rng: random.Random, cell: WalkCell, steps: int) -> list[dict[str, Any]]: ...

    def replay(
        self, factory: Callable[[WalkCell], Any], cell: WalkCell, ops: Sequence[dict[str, Any]]
    ) -> tuple[Optional[WalkFailure], Counter[str]]: ...

    def gaps(self, capabilities: Capabilities, exercised: Counter[str]) -> list[str]: ...


def unexercised(exercised: Counter[str], parts: Sequence[tuple[str, str]]) -> list[str]:
    """A walk's NOT CHECKED lines for what it declares and this run never reached: one per (what, count key) whose
    count in `exercised` is zero."""
    return [f"{what}: no step of this run exercised it" for what, key in parts if not exercised.get(key)]


# Key partitioning (`kvcert partition`, `conformance.harness.partition`): what a probe is served and reports.


@dataclass(frozen=True)
class Image:
    """A multimodal item: its content's identifier and the prompt tokens its placeholder covers."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class Keys:
    """What a request's KV is keyed by besides its tokens."""

    lora: Optional[tuple[str, str]] = None
    """(name, path) of the adapter, None for the base model."""
    salt: Optional[str] = None
    images: tuple[Image, ...] = ()
    """Sorted by offset, placeholders not overlapping."""


@dataclass(frozen=True)
class Served:
    """What serving one request reported: the prompt tokens it found cached, and its pages in order."""

    hit_tokens: int
    pages: tuple[int, ...]


KINDS = frozenset({"lora", "salt", "images"})
"""The key kinds a case may use. A probe that takes fewer says so in `kinds`; its cases that use the others are
not run, and the report names them NOT CHECKED."""


class Probe(Protocol):
    page: int

    def fresh(self) -> None:
        """Start again from an empty cache."""

    def serve(self, tokens: Sequence[int], keys: Keys) -> Served:
        """Serve one request to the end of its prefill and free it, as the engine's scheduler does."""
