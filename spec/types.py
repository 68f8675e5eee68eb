# Over 600 lines: the one vocabulary every layer shares (errors, snapshot, capabilities, config), read as one reference.
"""Observable state, errors and capabilities shared by every layer.

Everything a checker needs is a plain value here: a backend is judged only by
the `Snapshot` it exposes and the results it returns, never by its internals.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

_T = TypeVar("_T")

Namespace = Optional[str]
"""A cache namespace (LoRA id, cache salt). `None` is the default namespace."""

Tokens = tuple[int, ...]

POLICIES: tuple[str, ...] = ("lru", "lfu", "fifo", "mru", "priority", "slru", "tlru")
"""Eviction policies the spec defines (SPEC.md §4.5)."""

POLICY_PARAMETERS: dict[str, tuple[str, ...]] = {"slru": ("protected_threshold",), "tlru": ("threshold", "next_prompt_estimate")}
"""The parameters each policy takes (`CacheConfig.policy_config`, SGLang's `--radix-eviction-policy-config` keys); a
policy not listed takes none."""

WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
"""Host-tier write policies (SPEC.md §9.2)."""

PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")
"""When `check_prefetch` ends a storage prefetch (SPEC.md §10.4; SGLang's prefetch stop policies)."""

FAULTS: tuple[str, ...] = ("host_alloc", "copy")
"""Faults a backend can have injected (SPEC.md §10.5): `host_alloc` makes its next host-slot
allocation fail; `copy` makes the next copy the engine finishes (`complete`) fail instead."""

STORAGE_FAULTS: tuple[str, ...] = ("error", "partial_write", "torn_write", "corrupt", "drop")
"""Faults the harness applies to a backend's store (`StorageFault` kinds, SPEC.md §10.5): the next call fails, a write
is partial or torn, a stored page is corrupted or dropped."""

PRIORITY_PARTS: dict[str, str] = {
    "high": "two ref classes: HIGH_REF nodes that host eviction spares, adaptive demotion (SPEC.md §11.1-§11.4); "
    "without it every session is low",
    "scope": "scoped eviction evict(n, allow_low, allow_high) (SPEC.md §11.3, INV-TIER-3)",
    "update": "update_ref: a session's new priority on the same path (SPEC.md §11.1)",
    "admission": "plan_admission and partial residency (SPEC.md §11.5-§11.6, INV-ADMIT-*); needs scope",
    "move": "register_ref of a registered session anywhere moves it (SPEC.md §11.1); without it a session is "
    "registered again only at or below the node it holds (the conversation's next turn), else released first",
    "retain": "retain(session, ttl): a session's path retained across a declared pause, ranked after its tier's "
    "unretained nodes and spared by demotion until its deadline; retain_waiting(session): held past it while the "
    "session's next turn, arrived within it, waits (SPEC.md §11.7, INV-RET-*)",
}
"""The parts of §11 a priority-aware backend may offer (`Capabilities.priority_parts`)."""
ONE_CLASS_THRESHOLD = 3
"""The cells' high-priority threshold for a backend without two ref classes: above every priority the suite
draws (0-2), so every session is low."""

CLIENT_RULES: dict[str, str] = {
    "sessions-only": "every request is a turn of a session: no one-shot requests",
    "idle-changes": "a session's priority changes and its close arrive between its turns only, and a turn keeps its "
    "session's priority: a class changes through a priority change, never with a turn",
    "no-aborts": "no request is aborted",
    "distinct-ids": "no request id starts with another's: ids the engine makes (SGLang's uuid4 rids), not the client",
    "releases-one-shot": "a client releases the id of each request it sent without a session once its answer or "
    "abort arrives (an engine that registers every finished request, as the RefAware fork does, holds it until then)",
}
"""Rules a request-path target's clients keep (`Capabilities.client`), as its engine's own clients do: the traffic the
suite sends keeps them, and the certificate prints each under NOT CHECKED."""

KINDS: dict[str, str] = {
    "request-path": "driven through its engine's own scheduler code, with real request objects",
    "api": "driven through its cache API, by calls the suite composes in its scheduler's place",
    "native": "a cache written to kvcert's protocol",
    "block-pool": "a block table driven through its own API by a walk of the calls its engine's managers make "
    "(SPEC.md §13)",
    "offload": "an offload tier driven through its own API by a walk of the calls its engine's connector makes",
    "linker": "a direct external linker driven through its own API by a walk of the calls its engine's scheduler and "
    "cache make, over a stand-in store (SPEC.md §14.1)",
}
"""How a target drives its cache (`Capabilities.kind`); a certificate names it."""

WRITE_THROUGH_THRESHOLD = {"write_through": 1, "write_through_selective": 2}
"""Hits after which a node is backed up, per write-through policy (SGLang's defaults)."""


# --------------------------------------------------------------------------- errors


class KVCertError(Exception):
    """Root of every error a conforming backend raises on purpose."""


class BadInput(KVCertError, ValueError):
    """The call was malformed; a conforming backend changes nothing (INV-ERR-1)."""


class UnalignedKey(BadInput):
    """An inserted key's length is not a multiple of the page size."""


class LengthMismatch(BadInput):
    """An insert supplied a different number of slots than tokens."""


class InvalidToken(BadInput):
    """A token id is negative or not an integer."""


class InvalidCount(BadInput):
    """An eviction or allocation count is negative or not an integer."""


class StaleHandle(BadInput):
    """A node handle was never issued, or its node has left the tree."""


class UnknownCopy(BadInput):
    """complete() named a copy that was never issued or is already finished."""


class LockUnderflow(BadInput):
    """dec_lock_ref on a handle that holds no lock of its own."""


class SlotNotOwned(BadInput):
    """A slot passed to free/insert is not the caller's (free already, or the tree's)."""


class UnknownPrefetch(BadInput):
    """fetch/check_prefetch/abort_prefetch named a prefetch that is not running (or has no page left)."""


class UnknownFault(BadInput):
    """inject_fault named a fault kind the backend does not declare."""


class UnknownRetraction(BadInput):
    """retraction_restore/discard named a backup that does not exist (never made, or already used)."""


def check_count(n: object) -> int:
    """A count (evict, alloc): a non-negative int, never a bool; `InvalidCount` otherwise."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidCount(f"count must be a non-negative int, got {n!r}")
    return n


TOKEN_ID_LIMIT = 2**63
"""Token ids lie in [0, 2**63): engines hold them as int64 (SGLang's `array("q")`, torch.int64)."""


def check_tokens(tokens: Sequence[object]) -> Tokens:
    """Token ids: ints in [0, TOKEN_ID_LIMIT), never bools; `InvalidToken` otherwise."""
    out: list[int] = []
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < TOKEN_ID_LIMIT:
            raise InvalidToken(f"token ids must be ints in [0, 2**63), got {t!r}")
        out.append(t)
    return tuple(out)


class InvalidSession(BadInput):
    """A session id that is not a `str` (SPEC.md §11.1)."""


class UnknownSession(BadInput):
    """update_ref/release_ref of a session that is not registered (SPEC.md §11.1)."""


class InvalidScope(BadInput):
    """Eviction scope flags that are not bools, or `allow_high` without `allow_low` (SPEC.md §11.3)."""


class InvalidPlan(BadInput):
    """plan_admission with a malformed token count, running request or profile (SPEC.md §11.5)."""


def check_priority(priority: object) -> int:
    """A priority: an int, never a bool; `InvalidCount` otherwise (SPEC.md §7)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidCount(f"priority must be an int, got {priority!r}")
    return priority


def check_ttl(ttl: object) -> int:
    """A retention's TTL (SPEC.md §11.7): an int ≥ 1, never a bool; `InvalidCount` otherwise."""
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1:
        raise InvalidCount(f"ttl must be an int >= 1, got {ttl!r}")
    return ttl


def check_session(session: object) -> str:
    """A session id: a `str`; `InvalidSession` otherwise."""
    if not isinstance(session, str):
        raise InvalidSession(f"session ids are strings, got {session!r}")
    return session


def check_scope(allow_low: object, allow_high: object) -> tuple[bool, bool]:
    """An eviction scope (SPEC.md §11.3): two bools, and the high tier only with the low one."""
    if not isinstance(allow_low, bool) or not isinstance(allow_high, bool):
        raise InvalidScope(f"scope flags must be bools, got {allow_low!r}, {allow_high!r}")
    if allow_high and not allow_low:
        raise InvalidScope("a scope that allows HIGH_REF must allow LOW_REF (UNUSED -> LOW_REF -> HIGH_REF)")
    return allow_low, allow_high


class PoolExhausted(KVCertError):
    """The slot pool has fewer free slots than asked for; nothing was allocated."""


class InvalidPolicyConfig(KVCertError, ValueError):
    """A `CacheConfig.policy_config` its policy does not take (SPEC.md §4.5): a key the policy has no parameter
    for, a value that is not a non-negative int, or T-LRU's threshold not above its next-prompt estimate. Raised
    when the config is made, so no cache is ever built from it."""


def policy_params(policy: str, page_size: int, config: Sequence[tuple[str, int]] = ()) -> dict[str, int]:
    """The parameters `policy` ranks with (SPEC.md §4.5): its defaults, overridden by `config`'s (key, value) pairs.

    Defaults: slru's `protected_threshold` 2 (SGLang's); tlru's `threshold` 3 pages and `next_prompt_estimate`
    1 page, in tokens (kvcert's: a tail of 2 pages is TEL-safe, which the suite's keys of 1-5 pages reach; SGLang's
    own 0 and 0 are refused by SGLang). `InvalidPolicyConfig` for a key the policy does not take, a value that is not
    a non-negative int (never a bool), or a T-LRU threshold not above its estimate (SGLang's startup check)."""
    keys = POLICY_PARAMETERS.get(policy, ())
    out = {"slru": {"protected_threshold": 2}, "tlru": {"threshold": 3 * page_size, "next_prompt_estimate": page_size}}.get(
        policy, {}
    )
    for key, value in config:
        if key not in keys:
            takes = ", ".join(keys) if keys else "no parameters"
            raise InvalidPolicyConfig(f"policy {policy!r} takes {takes}, not {key!r}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidPolicyConfig(f"{policy} {key} must be a non-negative int, got {value!r}")
        out[key] = value
    if policy == "tlru" and out["threshold"] <= out["next_prompt_estimate"]:
        raise InvalidPolicyConfig(
            f"tlru threshold must be above next_prompt_estimate, got {out['threshold']} <= "
            f"{out['next_prompt_estimate']} (no token would ever be TEL-safe: T-LRU would be LRU)"
        )
    return out


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class NodeView:
    """One radix-tree node as a backend exposes it.

    `key` holds only this node's own tokens (the edge from its parent);
    `slots[i]` is the device KV slot of `key[i]`.
    """

    id: int
    parent: Optional[int]
    namespace: Namespace
    key: Tokens
    slots: Optional[tuple[int, ...]]
    """Device slots, one per token; None when the node lives on the host only (evicted)."""
    lock_ref: int
    host_slots: Optional[tuple[int, ...]] = None
    """Host slots of the node's backup; None when it has none."""
    host_lock_ref: int = 0
    """Host-copy protections (in-flight load-back, prefetch) at or below this node."""
    high_ref: int = 0
    """High-priority sessions whose path holds this node (SPEC.md §11.1)."""
    low_ref: int = 0
    """Low-priority sessions whose path holds this node."""
    meta: Optional[tuple[int, int, int, int]] = None
    """(last_access, hit_count, creation, priority): the policy metadata (SPEC.md §4.7), from a backend that exposes
    it; under a profile that pins RANK the order it ranks the nodes in must refine the spec's, and with
    `Capabilities.metadata_exact` each node's rank must equal the spec's (INV-META-1)."""
    history: Optional[int] = None
    """Under tlru, with `meta`: the node's history, its branch's high-water depth in tokens (SPEC.md §4.7, SGLang's
    `_tlru_history_len`), which T-LRU's rank reads and the tree does not show; None otherwise."""


@dataclass(frozen=True)
class Snapshot:
    """Everything observable about a device-tier cache between two operations."""

    page_size: int
    capacity: int
    """Number of usable device slots (tokens)."""
    slot_limit: int
    """Exclusive upper bound on slot ids (an engine may reserve slot 0)."""
    root: int
    nodes: tuple[NodeView, ...]
    """All nodes, root included (root: parent None, empty key)."""
    free_slots: tuple[int, ...]
    """Free device slots, sorted."""
    evictable_size: int
    """The backend's own counter: tokens in unlocked nodes."""
    protected_size: int
    """The backend's own counter: tokens in locked nodes."""
    host_capacity: int = 0
    """Usable host slots; 0 for a device-only cache."""
    host_free_slots: tuple[int, ...] = ()
    write_policy: str = ""
    """The write policy in force ("" for a device-only cache)."""
    pending: tuple[PendingCopy, ...] = ()
    """Copies issued and not yet acknowledged, in issue order."""
    prefetches: tuple[PendingPrefetch, ...] = ()
    """Storage prefetches issued and not yet ended, in issue order (SPEC.md §10)."""
    retractions: tuple[RetractionView, ...] = ()
    """Retraction backups held on the host, in creation order (SPEC.md §9.11)."""
    sessions: tuple[SessionView, ...] = ()
    """Registered sessions, in registration order (SPEC.md §11.1)."""
    tier_evictable: Optional[tuple[int, int, int]] = None
    """The backend's counters: device tokens of unlocked nodes per tier (UNUSED, LOW_REF, HIGH_REF);
    None for a backend without priority refs (SPEC.md §11.2)."""
    high_priority_threshold: int = 1
    """Priorities at or above this are high (SPEC.md §11.1)."""
    lent_slots: tuple[int, ...] = ()
    """Device slots the caller holds between operations (running requests' own KV, SPEC.md §4.8), sorted:
    only the caller knows them, so the harness fills this in; a backend leaves it empty."""
    choices: tuple[tuple[str, int], ...] = ()
    """What the last operation chose where the core leaves a choice (SPEC.md §6.1), in order, from a backend
    that declares `reports_choices`: ("evict", node) a device victim, ("skip", node) a write-back victim
    tried and kept, ("reclaim", node) a duplicate backup dropped, ("host_evict", node) a host-only node
    removed. Node ids as before the operation (or after it, for a node the operation made)."""

    def derived(self, name: str, build: Callable[[Snapshot], _T]) -> _T:
        """`build(self)`, computed once per snapshot and kept with it.

        A snapshot never changes, and a conformance step asks for the same derived structures (node
        paths, shapes, page slots) many times; each is built on first use. What it returns is shared:
        callers must not mutate it.
        """
        memo: Optional[dict[str, Any]] = self.__dict__.get("_derived")
        if memo is None:
            memo = self.__dict__["_derived"] = {}
        got: Any = memo.get(name, memo)  # the memo itself: not built yet (no derived structure is the memo)
        if got is memo:
            got = build(self)
            memo[name] = got
        built: _T = got
        return built

    def by_id(self) -> dict[int, NodeView]:
        """Node id -> node (shared: do not mutate). Asked for most of all, so kept in its own slot."""
        got: Optional[dict[int, NodeView]] = self.__dict__.get("_by_id")
        if got is None:
            got = self.__dict__["_by_id"] = _by_id(self)
        return got

    def children(self) -> dict[int, list[int]]:
        """Node id -> its children's ids, in node order (shared: do not mutate)."""
        return self.derived("children", _children)

    def path_of(self, node_id: int) -> tuple[Namespace, Tokens]:
        """(namespace, all tokens from the root to the end of `node_id`)."""
        nodes = self.by_id()
        parts: list[Tokens] = []
        ns: Namespace = None
        cur: Optional[int] = node_id
        seen = 0
        while cur is not None and cur != self.root:
            node = nodes[cur]
            parts.append(node.key)
            ns = node.namespace
            cur = node.parent
            seen += 1
            if seen > len(nodes):
                raise ValueError("cycle in parent links")
        return ns, tuple(t for part in reversed(parts) for t in part)


def _by_id(s: Snapshot) -> dict[int, NodeView]:
    return {n.id: n for n in s.nodes}


def _children(s: Snapshot) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {n.id: [] for n in s.nodes}
    for n in s.nodes:
        if n.parent is not None and n.parent in out:
            out[n.parent].append(n.id)
    return out


@dataclass(frozen=True)
class PendingCopy:
    """An asynchronous copy between tiers that the cache has not yet acknowledged."""

    id: int
    kind: str
    """"write" (device to host), "load" (host to device), "store" (host to storage) or "offload" (device to a
    direct linker's store, SPEC.md §14)."""
    nodes: tuple[int, ...]
    finished: bool = False
    """The copy engine has finished; the cache has not yet consumed the ack."""


@dataclass(frozen=True)
class PendingPrefetch:
    """A storage prefetch in flight: pages reserved on the host, fetched one by one (SPEC.md §10.4)."""

    id: int
    anchor: int
    """The node the fetched pages will hang below (host-protected meanwhile)."""
    requested: int
    """Tokens asked of storage (whole pages)."""
    fetched: int
    """Tokens fetched, verified and published so far, from the start: the progress the engine sees (§10.4)."""
    failed: bool
    """A page came back missing or corrupt: nothing after it will be used."""
    host_slots: tuple[int, ...]
    """Host slots reserved for the requested pages."""


@dataclass(frozen=True)
class RetractionView:
    """A retracted request's KV, backed up to host slots outside the tree (SPEC.md §9.11)."""

    id: int
    tokens: int
    """Device slots the backup was made from (the length a restore must supply)."""
    host_slots: tuple[int, ...]
    """Host slots it holds: `tokens` rounded up to whole pages."""


@dataclass(frozen=True)
class SessionView:
    """A registered session (SPEC.md §11.1): the path it holds ends at `node`."""

    id: str
    node: int
    priority: int
    high: bool
    """Counts as high priority now: priority at or above the threshold and not demoted."""
    demoted: bool = False
    """Adaptive demotion (SPEC.md §11.4) made it count as low."""
    retained_until: Optional[int] = None
    """The live deadline of its retention (SPEC.md §11.7): its path is retained while `now` is below it, or while
    `waiting` (then it is the time its next turn arrived)."""
    waiting: bool = False
    """Its next turn arrived within its retention and waits in the engine's queue (`retain_waiting`, §11.7)."""


UNUSED, LOW_REF, HIGH_REF = 0, 1, 2
"""Eviction tiers (SPEC.md §11.2)."""


def tier_of(high_ref: int, low_ref: int) -> int:
    """A node's tier from its refs: HIGH_REF if any high session holds it, else LOW_REF if any low one."""
    return HIGH_REF if high_ref > 0 else LOW_REF if low_ref > 0 else UNUSED


# --------------------------------------------------------------------------- admission (SPEC.md §11.5)


@dataclass(frozen=True)
class Running:
    """A running request a high-priority admission may retract."""

    id: int
    priority: int
    tokens: int
    """Device tokens retracting it frees (its own slots)."""


@dataclass(frozen=True)
class AdmissionProfile:
    """Offline-profiled costs for partial residency (SPEC.md §11.6), in one time unit of the profiler's choosing."""

    load: int
    """Loading one token's KV of one layer."""
    store: int
    """Storing one token's KV of one layer."""
    step: int
    """A decode step without streaming."""
    target: int
    """The time per output token the operator promises."""


@dataclass(frozen=True)
class AdmissionPlan:
    """What admitting a request takes (SPEC.md §11.5); `fits=False` means nothing is applied."""

    fits: bool
    evict: int = 0
    """Device tokens to evict, in the request's scope."""
    allow_high: bool = False
    """The scope: a high-priority request may evict HIGH_REF."""
    retract: tuple[int, ...] = ()
    """Running request ids to retract, in pick order."""
    keep: tuple[bool, ...] = ()
    """Per retracted request: backed up to host (True) or discarded."""
    layers: int = 0
    """Resident layers (kv_layers: fully resident)."""
    slots: int = 0
    """Device slots to allocate for the resident part."""


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class MatchOut:
    """match_prefix's answer: matched length, its slots, the node where it ends."""

    length: int
    slots: tuple[int, ...]
    node: int
    host_length: int = 0
    """Tokens after `length` that are on the host only (a load-back could restore them)."""
    host_node: Optional[int] = None
    """The node where the host hit ends (the deepest backed-up node); None without one."""


@dataclass(frozen=True)
class InsertOut:
    """insert's answer: how much of the key was already cached, and the node where it ends.

    The tree owns `slots[prefix_len:]` afterwards; `slots[:prefix_len]` are
    duplicates and stay the caller's to free (SGLang's `RadixCache` contract).
    """

    prefix_len: int
    node: int


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CacheConfig:
    """What the suite asks a factory to build."""

    page_size: int = 1
    policy: str = "lru"
    capacity: int = 64
    """Usable device slots; a multiple of page_size."""
    host_capacity: int = 0
    """Usable host slots (a multiple of page_size); 0 builds a device-only cache."""
    write_policy: str = "write_through"
    """write_through, write_through_selective or write_back (with a host tier)."""
    load_back_threshold: int = 1
    """load_back refuses fewer host tokens than this (SGLang: 10)."""
    prefetch_policy: str = ""
    """A storage tier's stop policy (PREFETCH_POLICIES); "" builds a cache without storage."""
    prefetch_timeout_base: int = 4
    """timeout policy: a prefetch may be ended after base + per_page * pages ticks of the logical clock."""
    prefetch_timeout_per_page: int = 1
    model_id: str = "kvcert-synthetic"
    """Part of the storage compatibility digest: caches of different models never share pages."""
    kv_layers: int = 2
    """Layers of synthetic KV per token in stored pages (`kvcert.spec.storage.page_payload`)."""
    high_priority_threshold: int = 1
    """Session priorities at or above this are high (SPEC.md §11.1)."""
    policy_config: tuple[tuple[str, int], ...] = ()
    """The policy's parameters as (key, value) pairs, sorted by key (SGLang's `--radix-eviction-policy-config`; a
    mapping is taken and sorted); () for every default (`policy_params`). Checked when the config is made
    (`InvalidPolicyConfig`); a trace records it only when it is not ()."""

    def __post_init__(self) -> None:
        raw: Any = self.policy_config
        if raw == ():
            return
        try:
            pairs = raw.items() if isinstance(raw, Mapping) else raw
            items = tuple(sorted((key, value) for key, value in pairs))
        except (TypeError, ValueError) as e:
            raise InvalidPolicyConfig(f"policy_config must be (key, value) pairs, got {raw!r}") from e
        if len({key for key, _ in items}) != len(items):
            raise InvalidPolicyConfig(f"policy_config names a key twice: {raw!r}")
        policy_params(self.policy, max(self.page_size, 1) if isinstance(self.page_size, int) else 1, items)
        object.__setattr__(self, "policy_config", items)

    def policy_params(self) -> dict[str, int]:
        """This config's policy parameters, defaults filled in (`policy_params`)."""
        return policy_params(self.policy, self.page_size, self.policy_config)


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it supports; the suite runs only what applies."""

    name: str
    page_sizes: tuple[int, ...] = (1,)
    policies: tuple[str, ...] = ("lru",)
    namespaces: bool = True
    strict_input: bool = False
    """True: bad input raises a `BadInput` subclass and changes nothing."""
    write_policies: tuple[str, ...] = ()
    """Host-tier write policies supported; () for a device-only cache."""
    prefetch_policies: tuple[str, ...] = ()
    """Storage-tier stop policies supported; () for a cache without storage."""
    faults: tuple[str, ...] = ()
    """Fault kinds `inject_fault` accepts (FAULTS)."""
    storage_faults: tuple[str, ...] = STORAGE_FAULTS
    """The storage faults (`StorageFault` kinds, SPEC.md §10.5) the harness can apply to the backend's store: a
    backend whose engine does its own storage I/O (SGLang's `file` backend) takes only the page faults."""
    retraction: bool = False
    """True: the host tier backs up, restores and discards retracted requests' KV (SPEC.md §9.11)."""
    kv_reads: bool = False
    """True: the harness writes each request's KV and reads every slot back (`KVBackend`, SPEC.md §9.12)."""
    priority_refs: bool = False
    """True: sessions, tiered and scoped eviction, adaptive demotion, admission plans (SPEC.md §11)."""
    priority_parts: tuple[str, ...] = ("high", "scope", "update", "admission", "move")
    """With `priority_refs`, the parts of §11 the backend offers (PRIORITY_PARTS); an engine that lacks one is
    not sent its ops, and the certificate lists it as not checked."""
    locks_host_only: bool = True
    """False: the engine's callers never lock a node that is on the host only (SPEC.md §9.1 allows it; the
    RefAware fork's scheduler locks only device nodes), so the suite sends no such lock and the certificate
    lists it as not checked."""
    aligns_keys: bool = False
    """True: an insert key that ends mid-page caches its page-aligned head and leaves the tail's slots to
    the caller (SGLang's `RadixCache.insert`), instead of raising `UnalignedKey` (SPEC.md §4.2)."""
    checkpoints: bool = False
    """True: the backend runs a running request's checkpoint itself, as its engine does
    (`checkpoint(ns, tokens, row, protected, node, priority, *, prompt, request) -> (InsertOut, row head,
    node)`: insert the page-aligned prefix and re-insert the prompt's, free the duplicates past `protected`,
    repoint the row, move the lock; `request` names the request across its checkpoints); else the harness
    composes it from inserts, free, match and the two lock calls (SPEC.md §4.8)."""
    profile: str = "core"
    """The engine profile the backend claims (`kvcert.spec.profiles`): "core" holds it to what every correct
    cache must do; "sglang-0.5.23" also pins SGLang's choices (eviction rank, reclaim order, retry) for
    differential depth (SPEC.md §6)."""
    reports_choices: bool = False
    """True: every snapshot lists the last operation's eviction choices in order (`Snapshot.choices`), and
    under a profile that leaves them open the oracle follows them instead of searching for an order."""
    reports_metadata: bool = False
    """True: every node's `NodeView.meta` holds its policy metadata (under tlru `NodeView.history` too), and under a
    profile that pins RANK each node's rank from it is compared with the spec's every step (INV-META-1, SPEC.md
    §4.7)."""
    metadata_exact: bool = False
    """True (with `reports_metadata`): `NodeView.meta` is in the spec's units (the harness's clock from `set_clock`,
    one hit per counted access), so INV-META-1 holds each node's rank equal to the spec's, not only in its order."""
    still_between_calls: bool = False
    """True: the state changes only inside the backend's operations (never in `set_clock`, a read, or a
    background thread), so the harness reads its snapshot once per step and takes the one after a step as
    the next step's before. A backend that declares it and changes between calls is checked against a
    stale before; its afters are still read fresh."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """How the adapter drives the engine, one line each; printed in every report."""
    deviations: tuple[str, ...] = field(default_factory=tuple)
    """What the adapter changes in the engine it drives (a patched attribute, a replaced component, a shipped
    default overridden), each with what it changes; every report lists them under NOT CHECKED."""
    client: tuple[str, ...] = ()
    """A request-path target's client rules (CLIENT_RULES): traffic outside them is not sent."""
    loras: bool = False
    """True (a request-path target): requests may run under a LoRA adapter (`Submit.lora`), sent to `submit(...,
    lora=(name, path))`; else none is sent."""
    linker_faults: tuple[str, ...] = ()
    """A request-path target whose cache is linked to the harness's external store (SPEC.md §14): the faults of
    that store (`kvcert.spec.linker.FAULTS`) the trace may cue (`LinkerFault`, sent to `linker_fault(kind)`)."""
    peer_faults: tuple[str, ...] = ()
    """A PD decode target (SPEC.md §15): the faults of its prefill peer (`kvcert.spec.decode.FAULTS`) the trace may
    cue (`PeerFault`, sent to `peer_fault(kind)`)."""
    flushes: bool = False
    """True (a request-path target with a linker): the client may ask the engine to flush its cache (`Flush`, sent to
    `flush()`), which resets its linker with whatever is still in flight."""
    never_fit: bool = False
    """True (a decode target): the client may send a request whose prompt and output can never fit the device
    (INV-DEC-6); the engine may abort it unasked."""
    kind: str = "api"
    """How the cache is driven (KINDS): "request-path" through its engine's own scheduler code with real
    request objects, "api" through the cache's API by calls the suite composes, "native" a cache written to
    this protocol (kvcert's own)."""
