"""The reference model: a deliberately plain radix tree over a device pool and an optional host pool.

Readability first: dicts, lists and full scans, no heaps or indexes. Every rule
is the one SPEC.md states, in the order it states it; where SPEC.md says
"engines may choose" (which tied leaf to evict), `evict` takes a `choose`
callback so the harness can steer this model to a backend's legal choice.

With `host_capacity > 0` it models the host tier (SPEC.md §9): backups to host
slots under a write policy, demotion on eviction, host eviction, load-back, and
asynchronous copies that stay pending until `complete` and `poll` say otherwise.

It also holds KV bytes (SPEC.md §9.12): two plain dicts, device slot -> entry and host slot ->
entry, filled by the caller's `write_kv` and moved by every copy exactly where a real cache's
bytes move (`_move_kv`). As the oracle it is never written to, so its dicts stay near empty.

The model is one class in rooms, one per tier, each a mixin over `tree.Tree` (which holds the state):
`device` (match, insert, locks, eviction), `host` (backups, load-back, copies, retraction), `sessions` (refs,
tiers, demotion, admission), `storage` (store copies, prefetch); `records` holds the records they share. This
module composes them and adds the KV bytes and the snapshot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvcert.refimpl.device import DeviceTier
from kvcert.refimpl.host import HostTier
from kvcert.refimpl.records import (
    _check_ids,
)
from kvcert.refimpl.sessions import SessionTier
from kvcert.refimpl.storage import StorageTier
from kvcert.spec import storage as l3
from kvcert.spec.decisions import (
    Batch,
    Decisions,
    Demote,
    Fetch,
    LoadLock,
    LoadRoom,
    Reclaim,
    Retry,
    Room,
    Throttle,
)
from kvcert.spec.types import (
    FAULTS,
    POLICIES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    CacheConfig,
    Capabilities,
    LengthMismatch,
    NodeView,
    PendingCopy,
    PendingPrefetch,
    RetractionView,
    SessionView,
    Snapshot,
)


class RefCache(DeviceTier, HostTier, SessionTier, StorageTier):
    """The oracle, and a Backend in its own right (strict input checking)."""

    capabilities = Capabilities(
        name="kvcert.refimpl",
        page_sizes=(1, 2, 4, 8, 16),
        policies=POLICIES,
        namespaces=True,
        strict_input=True,
        write_policies=WRITE_POLICIES,
        prefetch_policies=PREFETCH_POLICIES,
        faults=FAULTS,
        retraction=True,
        kv_reads=True,
        priority_refs=True,
        priority_parts=("high", "scope", "update", "admission", "move", "retain"),
        still_between_calls=True,
        profile="sglang-0.5.23",
        reports_choices=True,
        kind="native",
    )

    # ------------------------------------------------------------------ KV bytes (SPEC.md §9.12)

    def write_kv(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        """The forward pass: `entries[i]` into device slot `slots[i]`, slots lent to the caller only.

        Bad input writes nothing: every check runs before the first byte lands.
        """
        if not isinstance(slots, Sequence) or not isinstance(entries, Sequence) or len(slots) != len(entries):
            raise LengthMismatch(f"write_kv takes one entry per slot, got {slots!r:.60} and {entries!r:.60}")
        self.pool.require_lent(slots, "write KV into")
        width = len(l3.KV_PARTS) * self.kv_layers * l3.KV_WIDTH
        if any(not isinstance(e, bytes) or len(e) != width for e in entries):
            raise LengthMismatch(f"an entry is {width} bytes: K and V of {self.kv_layers} layers")
        self.kv.update(zip(slots, entries))

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        """The entries device slots hold now (b"" for a slot never written)."""
        _check_ids(slots, self.pool.capacity)
        return [self.kv.get(s, b"") for s in slots]

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        """The entries host slots hold now (b"" for a slot never written)."""
        _check_ids(host_slots, self.host.capacity if self.host else 0)
        return [self.host_kv.get(s, b"") for s in host_slots]

    # ------------------------------------------------------------------ observation

    def snapshot(self) -> Snapshot:
        views = tuple(
            NodeView(
                id=n.id,
                parent=n.parent.id if n.parent is not None else None,
                namespace=n.namespace,
                key=n.key,
                slots=n.slots,
                lock_ref=n.lock_ref,
                host_slots=n.host_slots,
                host_lock_ref=n.host_lock_ref,
                high_ref=n.high_ref,
                low_ref=n.low_ref,
            )
            for n in self.nodes.values()
        )
        return Snapshot(
            page_size=self.page_size,
            capacity=self.pool.capacity,
            slot_limit=self.pool.capacity,
            root=self.root.id,
            nodes=views,
            free_slots=self.pool.free_slots(),
            evictable_size=self.evictable_size,
            protected_size=self.protected_size,
            host_capacity=self.host.capacity if self.host else 0,
            host_free_slots=self.host.free_slots() if self.host else (),
            write_policy=self.write_policy,
            pending=tuple(PendingCopy(c.id, c.kind, tuple(n.id for n in c.nodes), c.finished) for c in self.copies),
            prefetches=tuple(
                PendingPrefetch(
                    p.id,
                    p.anchor.id,
                    len(p.keys) * self.page_size,
                    p.published * self.page_size,
                    p.failed,
                    p.host_slots,
                )
                for p in self.prefetches
            ),
            retractions=tuple(RetractionView(r.id, r.tokens, r.host_slots) for r in self.retractions),
            sessions=tuple(
                SessionView(
                    s.id,
                    s.node.id,
                    s.priority,
                    self._is_high(s),
                    s.demoted,
                    s.until if self.retained(s) else None,
                    s.waiting and self.retained(s),
                )
                for s in self.sessions.values()
            ),
            tier_evictable=(self.tier_evictable[0], self.tier_evictable[1], self.tier_evictable[2]),
            high_priority_threshold=self.threshold,
            choices=tuple(self.chosen),
        )


def factory(config: CacheConfig) -> RefCache:
    """`kvcert certify kvcert.refimpl:factory` entry point."""
    return RefCache(config)


factory.capabilities = RefCache.capabilities  # type: ignore[attr-defined]


ALTERNATIVE = Decisions(
    reclaim=Reclaim(first=False),
    retry=Retry("invalidate"),
    room=Room(prefetch="shortfall", backup="whole"),
    batch=Batch("per_node"),
    demote=Demote(restore="earliest", restore_on_move=True),
    load_lock=LoadLock(host_lock=False),
    load_room=LoadRoom(scope=(True, False), ask="whole"),
    fetch=Fetch(batch=1),
    throttle=Throttle(fraction=None),
)
"""Another correct choice at each of SPEC.md §6's open places but RANK (`alternative`)."""


def alternative(config: CacheConfig) -> RefCache:
    """`kvcert.refimpl:alternative`: the reference model built another correct way (SPEC.md §6). Write-back host
    eviction takes duplicate backups and host-only leaves in one rank order, a failed write copy is
    invalidated rather than retried, a prefetch or retraction backup that does not fit host-evicts only its
    shortfall, each written node is its own write copy, issued deepest first, a released (or moved) high
    session restores the earliest demoted session rather than the latest, a pending load's host copy is
    protected by the load's own pins rather than a host lock, a backup short of host room host-evicts its
    whole size, load-back evicts its whole size, in a low requester's scope, a prefetch publishes every page as it
    arrives, and admission never declines a prefetch. It passes the core and fails the sglang-0.5.23 profile."""
    return RefCache(config, decisions=ALTERNATIVE)


alternative.capabilities = replace(  # type: ignore[attr-defined]
    RefCache.capabilities, name="kvcert.refimpl:alternative", profile="core"
)
