"""The Backend protocol: what an engine's cache (or an adapter around it) implements.

The calls mirror a radix prefix cache's own API (SGLang's `RadixCache` is the
model), plus a slot allocator, a logical clock and `snapshot()`. Node handles
are plain ints that also appear as `NodeView.id` in snapshots.

A factory is any callable `factory(config: CacheConfig) -> Backend` with a
`capabilities: Capabilities` attribute; `kvcert certify MODULE:FACTORY` takes one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, Protocol, runtime_checkable

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
    "InsertOut",
    "KVBackend",
    "MatchOut",
    "PriorityBackend",
    "RetractionBackend",
    "StorageTierBackend",
    "capabilities_of",
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

    def plan_admission(
        self, tokens: int, priority: int, running: Sequence[Running], profile: Optional[AdmissionProfile]
    ) -> AdmissionPlan:
        """What admitting a request of `tokens` new tokens takes (SPEC.md §11.5); changes nothing."""


Factory = Callable[[CacheConfig], Backend]


def capabilities_of(factory: object) -> Capabilities:
    caps = getattr(factory, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{factory!r} has no `capabilities: Capabilities` attribute")
    return caps
