"""Core relations and engine profiles (SPEC.md §6).

The core is what every correct cache must satisfy; a profile pins, on top of it, the choices one
engine makes where the core allows several. A backend declares the profile it claims
(`Capabilities.profile`); `kvcert certify --profile core` holds any backend to the core alone. Each
`Choice` names one place where the core is looser than SGLang: under a profile that pins it the
oracle makes SGLang's choice and the backend must match; under one that does not, the harness
checks the core relation and then seats the oracle on whatever legal choice the backend reported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvcert.spec.decisions import SGLANG_0523, Batch, Decisions, Demote, LoadLock, LoadRoom, Room


@dataclass(frozen=True)
class Choice:
    """One choice the core leaves open and a profile may pin."""

    id: str
    pinned: str
    """What a profile that pins it requires (SGLang 0.5.23's behaviour)."""
    core: str
    """What the core allows instead, and the relation it still checks."""
    needs: str = ""
    """The part of the spec a backend must declare for the choice to arise: "" (any backend), "write_back"
    (a write policy), "copy" (a fault kind), "host_room" (prefetch, or retraction with a host tier), "host" (a host tier), "priority_host" (sessions and a host tier)."""


RANK = Choice(
    "RANK",
    "victims go in the policy's rank order (SPEC.md §4.5 table) over SGLang's metadata updates (§4.7)",
    "any greedy removal: each victim an unlocked leaf when it goes, within INV-EVICT-1/2/3/5 and the scope's "
    "tiers; last_access, hit_count and priority are the backend's own",
)
RECLAIM = Choice(
    "RECLAIM",
    "write-back host eviction drops duplicate backups of device-resident nodes before any host-only leaf (§9.4)",
    "host victims are duplicate backups and host-only leaves in any order, within INV-HOST-7/8",
    "write_back",
)
RETRY = Choice(
    "RETRY",
    "a failed write-through copy stays pending, both ends pinned, until a later completion succeeds (§10.5)",
    "or it is invalidated: the copy ends, its nodes and every host copy below them lose their backups (host-only "
    "ones leave the tree), unless one of those is moving or host-locked; no wrong KV either way",
    "copy",
)

ROOM = Choice(
    "ROOM",
    "a prefetch or a retraction backup that does not fit host-evicts its whole size, not the shortfall (§10.4 D9, "
    "§9.11 D17); a node's backup (write-through, write-back) its shortfall (§9.2)",
    "host eviction for one asks for at most its size (from nothing to all of it), its victims legal as any host "
    "eviction's; a prefetch then reserves the longest whole-page part that fits, a backup all or nothing",
    "host",
)

BATCH = Choice(
    "BATCH",
    "copies are grouped and ordered as SGLang issues them: one write copy per insert's written nodes, one store "
    "copy per node (a write ack's shallowest first, write-back's eviction backups in victim order) (§9.2, §10.3 D7/D8)",
    "an operation's new write and store copies move exactly the spec's nodes, each node in one copy of its kind, "
    "grouped and ordered as the backend likes; the oracle re-cuts its copies to the backend's (INV-COPY-1)",
    "host",
)

DEMOTE = Choice(
    "DEMOTE",
    "host pressure demotes the idle high session with the fewest tokens on its path, ties to the earliest registered; "
    "a released high session restores the most recently demoted one (§11.4)",
    "host pressure demotes high sessions, one at a time and only while the host eviction's unused and low-tier "
    "candidates fall short, whichever the backend picks; a released high session restores one demoted session when "
    "one exists, whichever, and a moved high session may restore one or none; refs and tiers stay exact "
    "(INV-TIER-1/5) and no high host copy goes while a "
    "demotion was possible (INV-TIER-4)",
    "priority_host",
)

LOAD_LOCK = Choice(
    "LOAD_LOCK",
    "a pending load keeps the host copy of the node it was issued for host-locked until its ack (§9.7)",
    "or the load's own pins alone protect it: its nodes are on both tiers and device-locked until the ack, and no "
    "host eviction or write-back reclaim may take a node a pending copy moves (INV-HOST-6's both-tiers clause)",
    "host",
)

LOAD_ROOM = Choice(
    "LOAD_ROOM",
    "load-back makes its device room by evicting its shortfall, in the full scope: any unlocked leaf may go (§9.7, "
    "§11.3)",
    "eviction for it asks for anything from the shortfall to the load's whole size, in the full scope or a "
    "low-priority requester's (no HIGH_REF node goes for it), and the load is refused when that is short; its "
    "victims legal as any eviction's in that scope (INV-TIER-3)",
    "host",
)

FETCH = Choice(
    "FETCH",
    "a prefetch's progress reaches the engine per batch of 128 fetched pages (SGLang's STORAGE_BATCH_SIZE), at a "
    "batch's first miss, or at its last page; an ended prefetch keeps the pages published by then (§10.4)",
    "after any fetch the published progress stays or becomes every page fetched so far, and a miss or the last page "
    "publishes; an ended prefetch keeps exactly its published pages (INV-PF-3 compares them step by step)",
    "storage",
)

THROTTLE = Choice(
    "THROTTLE",
    "a prefetch is declined, asking storage nothing, while the running prefetches' requested spans (every page "
    "after their anchors, stored or not) reach half the host pool (SGLang's prefetch_capacity_limit, §10.4)",
    "a prefetch made while others run may be declined so, whenever the backend likes; one made while none runs is not",
    "storage",
)

CHOICES: tuple[Choice, ...] = (RANK, RECLAIM, RETRY, ROOM, BATCH, DEMOTE, LOAD_LOCK, LOAD_ROOM, FETCH, THROTTLE)

STILL_PINNED: tuple[tuple[str, str], ...] = (
    ("host", "a load-back is one copy, issued by the load_back call that asks for it (INV-COPY-1)"),
)
"""SGLang's choices the core does not yet relax, with the part of the spec they belong to: a correct cache that
differs here fails even the core."""


@dataclass(frozen=True)
class Profile:
    name: str
    pins: frozenset[str]
    """The ids of the choices this profile pins; the rest are checked by their core relation."""
    decisions: Decisions = SGLANG_0523
    """The engine's choice at every open place (`kvcert.spec.decisions`): what the reference model follows under
    this profile where it pins a choice, so the model makes the engine's choice and the engine must match. SGLang
    0.5.23's wherever the profile says nothing else."""

    aborts_failed_loads: bool = False
    """A direct linker's failed load (SPEC.md §14, INV-LINK-4): the core lets the engine abort the request or
    recompute it; True pins the abort (SGLang 0.5.23: FINISH_ABORT, 503), so one that finishes normally was served
    over the slots the store did not fill."""

    def pinned(self, choice: Choice) -> bool:
        return choice.id in self.pins

    @property
    def load_host_lock(self) -> bool:
        """Whether a pending load must host-lock its anchor's host copy (INV-HOST-6's LOAD_LOCK clause): only where
        the profile pins LOAD_LOCK to SGLang's choice; open, or pinned to the fork's, the load's own pins do."""
        return self.pinned(LOAD_LOCK) and self.decisions.load_lock.host_lock


CORE = Profile("core", frozenset())
SGLANG = Profile("sglang-0.5.23", frozenset(c.id for c in CHOICES), aborts_failed_loads=True)
REFAWARE = Profile(
    "refaware-0.5.10",
    frozenset({RANK.id, BATCH.id, DEMOTE.id, LOAD_LOCK.id, LOAD_ROOM.id, ROOM.id}),
    decisions=Decisions(
        batch=Batch("per_node_parents_first"),
        demote=Demote(order="queued", restore="earliest", restore_on_move=True),
        load_lock=LoadLock(host_lock=False),
        load_room=LoadRoom(scope=(True, False), ask="whole"),
        room=Room(backup="whole"),
    ),
)
"""The priority-aware fork of SGLang 0.5.10 (the seed's implementation), held to its own design
(docs/calibration/refaware.md): it ranks victims as §4.5/§11.3 do on both tiers; cuts one write copy per node, parents
first (H11); host pressure demotes the high session queued with the fewest tokens when it was queued, ties to the
smaller id, idle or not (H4, H8: its idle-high heap, which it fills at a registration or a restore as high, and
the design fills at a raise to high too: H5 is the fork missing that); a released or moved high session restores
the earliest demoted one (H6, H9); a pending load's host copy is kept by the load's own pins (H1); a request-less
load makes room for its whole size in a low requester's scope (H7, H13); a backup short of host room host-evicts
its whole size (H12). RECLAIM and RETRY stay the core's: the fork never reclaims a write-back duplicate (H2, a
defect), and it injects no faults."""
KVCERT_QUEUED = Profile(
    "kvcert-queued",
    frozenset(c.id for c in CHOICES),
    decisions=replace(SGLANG_0523, demote=Demote(order="queued")),
    aborts_failed_loads=True,
)
"""kvcert.gpu with the RefAware fork's demotion order (`kvcert.gpu:factory_queued`): SGLang 0.5.23's choice at every
open place but DEMOTE, where host pressure demotes the first still-high session of a queue every high session joins
when registered, raised or restored (fewest tokens then, ties to the smaller id), idle or not. The order that closes
kvcert.gpu's gap to the fork (docs/bench_policy.md, "What the gap is made of")."""
VLLM = Profile("vllm-0.32", frozenset())
"""vLLM 0.32's v1 prefix cache, a block-hash table judged by the page-level core (SPEC.md §13). It pins none of the
radix choices above (they are a tree's); its own choices (block-granular eviction from the free queue's head, a
request's blocks freed tail first, the last prompt token always recomputed, one hash held by several blocks,
a block outliving its parent's) are named in §13.3."""
PROFILES: dict[str, Profile] = {p.name: p for p in (CORE, SGLANG, REFAWARE, KVCERT_QUEUED, VLLM)}


def profile(name: str) -> Profile:
    """The profile called `name`; ValueError naming the known ones otherwise."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
