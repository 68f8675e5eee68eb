"""The operation vocabulary as data.

One `Op` type serves the Hypothesis rules, saved counterexamples and replay.
Handles are positions: `Lock(handle=k)` means "the node returned by operation
k of this trace" (an `Insert`, a `Match` or a `Restore` that succeeded; anything else is an
unknown handle), so a trace names nodes without knowing any backend's ids, and
deleting an operation while shrinking only renumbers later references.

Fields are deliberately loose (`tokens` may hold a string, `n` a float): bad
input must be expressible, and the backend, not the trace type, rejects it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Union, get_args

from kvcert.spec.types import CacheConfig

TRACE_FORMAT = "kvcert-trace/1"


@dataclass(frozen=True)
class Insert:
    """A request finished computing `tokens`: allocate slots, insert, free the duplicates."""

    namespace: Optional[str]
    tokens: tuple[Any, ...]
    priority: int = 0
    value_len: Optional[int] = None
    """Slots to allocate; None means len(tokens). A different value is bad input."""


@dataclass(frozen=True)
class Match:
    """Look up the longest cached prefix of `tokens` (page-aligned)."""

    namespace: Optional[str]
    tokens: tuple[Any, ...]


@dataclass(frozen=True)
class Lock:
    """inc_lock_ref on the node behind handle `handle`."""

    handle: int


@dataclass(frozen=True)
class Unlock:
    """dec_lock_ref on the node behind handle `handle`."""

    handle: int


@dataclass(frozen=True)
class Evict:
    """Ask the cache to free at least `n` tokens of unlocked KV, in a scope of ref tiers (SPEC.md §11.3)."""

    n: Any
    allow_low: Any = True
    allow_high: Any = True


@dataclass(frozen=True)
class EvictHost:
    """Ask the cache to free at least `n` host tokens of host-only, unprotected KV."""

    n: Any


@dataclass(frozen=True)
class LoadBack:
    """Load back the host hit of the Match at op `handle` (its `host_node`)."""

    handle: int


@dataclass(frozen=True)
class Complete:
    """The copy engine finishes copy `copy`: the copy-th one issued in this trace (from 0)."""

    copy: int


@dataclass(frozen=True)
class Poll:
    """One scheduler tick of ack handling (SGLang's writing_check + loading_check)."""


@dataclass(frozen=True)
class Prefetch:
    """Prefetch from storage the rest of the Match at op `handle`, below its `host_node`."""

    handle: int


@dataclass(frozen=True)
class Fetch:
    """Storage delivers the next page of prefetch `prefetch` (the prefetch-th issued, from 0)."""

    prefetch: int


@dataclass(frozen=True)
class CheckPrefetch:
    """check_prefetch_progress on prefetch `prefetch`: end it if its stop policy says so."""

    prefetch: int


@dataclass(frozen=True)
class AbortPrefetch:
    """The request behind prefetch `prefetch` is aborted: end it, keeping nothing."""

    prefetch: int


@dataclass(frozen=True)
class InjectFault:
    """Arm one fault in the cache (and the oracle): its next allocation of that kind fails."""

    kind: str


@dataclass(frozen=True)
class Publish:
    """Another engine sharing the L3 store stored `tokens`' pages (canonical records, both sides alike)."""

    namespace: Optional[str]
    tokens: tuple[Any, ...]


@dataclass(frozen=True)
class StorageFault:
    """Damage storage on both sides alike: arm a call fault, or corrupt / drop the `at`-th stored page.

    `kind` is "error", "partial_write" or "torn_write" (the next storage call that can
    fail does), or "corrupt" / "drop" (page `at` of the oracle's stored keys, sorted).
    """

    kind: str
    at: int = 0


@dataclass(frozen=True)
class Retract:
    """A running request is retracted: its KV is backed up to host, then its own slots are freed.

    Its KV is the device part of the path to the node behind `handle` (the prefix it
    reads) followed by `tail` tokens of its own (decode output, not in the tree).
    """

    handle: int
    tail: int = 0


@dataclass(frozen=True)
class Restore:
    """The `retraction`-th retracted request resumes: fresh device slots take its backup."""

    retraction: int


@dataclass(frozen=True)
class Discard:
    """The `retraction`-th retracted request is dropped for good: its backup is freed."""

    retraction: int


@dataclass(frozen=True)
class RegisterRef:
    """Session `session` holds the path of the node behind `handle`, at `priority` (SPEC.md §11.1)."""

    session: Any
    handle: int
    priority: Any = 0


@dataclass(frozen=True)
class UpdateRef:
    """Session `session` changes priority."""

    session: Any
    priority: Any = 0


@dataclass(frozen=True)
class Retain:
    """Session `session` will come back: its path is retained for `ttl` time units (SPEC.md §11.7)."""

    session: Any
    ttl: Any = 1


@dataclass(frozen=True)
class RetainWaiting:
    """Session `session`'s next turn has arrived and waits in the engine's queue: a live retention lasts until that
    turn registers (SPEC.md §11.7, the engine's half)."""

    session: Any


@dataclass(frozen=True)
class ReleaseRef:
    """Session `session` ends: it holds nothing any more."""

    session: Any


@dataclass(frozen=True)
class Admit:
    """A request of `length` new tokens at `priority` asks for room while `running` requests decode (SPEC.md §11.5).

    `running` holds (priority, tokens) per running request: each holds `tokens` fresh slots of its
    own, and its id is its position. `profile` is (load, store, step, target) or None (§11.6). The
    harness asks both sides for a plan, compares them, and applies the plan.
    """

    length: Any
    priority: Any = 0
    running: tuple[Any, ...] = ()
    profile: Any = None


@dataclass(frozen=True)
class Start:
    """A request is admitted and runs (SPEC.md §4.8): it matches `tokens`, locks the match and computes
    the rest into slots of its own, which it keeps across operations. Its position is its handle."""

    namespace: Optional[str]
    tokens: tuple[Any, ...]
    priority: int = 0


@dataclass(frozen=True)
class Extend:
    """The running request `handle` decodes `tokens` more (fresh slots when its last page fills)."""

    handle: int
    tokens: tuple[Any, ...]


@dataclass(frozen=True)
class Checkpoint:
    """The running request `handle` caches what it has computed so far and keeps running
    (SGLang's `checkpoint`, once `cache_unfinished_req`): §4.8."""

    handle: int


@dataclass(frozen=True)
class Finish:
    """The running request `handle` ends: with `cache`, its KV is checkpointed first; then it frees what
    it still owns and drops its lock (SGLang's `release_kv_cache`)."""

    handle: int
    cache: bool = True


@dataclass(frozen=True)
class Submit:
    """A client sends request `request` to an engine (SPEC.md §12): a turn of `session` (None: one-shot) whose prompt
    is `tokens`, decoding `output` tokens. The engine's scheduler admits, chunks and finishes it as it decides."""

    request: Any
    namespace: Optional[str]
    tokens: tuple[Any, ...]
    priority: Any = 0
    output: Any = 1
    session: Any = None
    lora: Any = None
    """The LoRA adapter it runs under, (name, path), or None for the base model: the adapter's weights change every
    token's KV (`kvcert.spec.requests.kv_namespace`). Left out of a trace's JSON when None."""
    retain: Any = None
    """The client's retention hint (SPEC.md §11.7, §12.3): seconds until its session's next turn, sent with the turn;
    the session's path is retained that long once the turn finishes. None: no hint (left out of a trace's JSON)."""


OMITTED_WHEN_NONE = frozenset({"lora", "retain"})
"""Op fields a trace's JSON (and a run's digest) leaves out when None: fields added after traces were recorded."""


@dataclass(frozen=True)
class Step:
    """One iteration of the engine's scheduler loop: it takes its messages, schedules, runs the model, processes results."""


@dataclass(frozen=True)
class CloseSession:
    """A client ends session `session` (SGLang's close_session, the RefAware fork's /release_ref)."""

    session: Any


@dataclass(frozen=True)
class Reprioritize:
    """A client changes session `session`'s priority (the RefAware fork's /update_ref)."""

    session: Any
    priority: Any = 0


@dataclass(frozen=True)
class AbortRequest:
    """A client aborts request `request`, wherever it stands."""

    request: Any


@dataclass(frozen=True)
class LinkerFault:
    """The external store behind a direct linker fails as `kind` says (`kvcert.spec.linker.FAULTS`, SPEC.md §14): an
    event of the world the engine runs in, not a client's request; a request-path target with a linker takes it."""

    kind: Any


@dataclass(frozen=True)
class PeerFault:
    """The prefill peer of a decode server fails as `kind` says (`kvcert.spec.decode.FAULTS`, SPEC.md §15): an event
    of the world the engine runs in, not a client's request; a decode target takes it."""

    kind: Any


@dataclass(frozen=True)
class Flush:
    """A client asks the engine to flush its cache (SGLang's `/flush_cache`): an engine honours it only when no request
    is in flight, or refuses it; either way nothing is lost, and a linked store is reset with whatever it still has in
    flight (SPEC.md §14, INV-LINK-7)."""


Op = Union[
    Insert,
    Match,
    Lock,
    Unlock,
    Evict,
    EvictHost,
    LoadBack,
    Complete,
    Poll,
    Prefetch,
    Fetch,
    CheckPrefetch,
    AbortPrefetch,
    InjectFault,
    Publish,
    StorageFault,
    Retract,
    Restore,
    Discard,
    RegisterRef,
    UpdateRef,
    Retain,
    RetainWaiting,
    ReleaseRef,
    Admit,
    Start,
    Extend,
    Checkpoint,
    Finish,
    Submit,
    Step,
    CloseSession,
    Reprioritize,
    AbortRequest,
    LinkerFault,
    PeerFault,
    Flush,
]
OP_TYPES: dict[str, type] = {t.__name__: t for t in get_args(Op)}
"""Op name -> class, for JSON traces: derived from `Op`, so a new op cannot be left out."""
REQUEST_OPS = (Submit, Step, CloseSession, Reprioritize, AbortRequest, LinkerFault, PeerFault, Flush)
"""What clients send an engine (SPEC.md §12): the ops of a request-path target's traces, and only of those."""
HANDLE_PRODUCERS = (Insert, Match, Restore, Start)
"""Ops whose result names a node a later op may use: a restore returns the resumed request's last node, a
start its match's (the node the running request locks; `Extend`, `Checkpoint` and `Finish` name the
request by the same position)."""


def op_to_json(op: Op) -> dict[str, Any]:
    body = {k: v for k, v in asdict(op).items() if not (k in OMITTED_WHEN_NONE and v is None)}
    if "tokens" in body:
        body["tokens"] = list(body["tokens"])
    return {"op": type(op).__name__, **body}


def op_from_json(obj: dict[str, Any]) -> Op:
    kind = obj.get("op")
    if kind not in OP_TYPES:
        raise ValueError(f"unknown op {kind!r}")
    cls = OP_TYPES[kind]
    names = {f.name for f in fields(cls)}
    args = {k: v for k, v in obj.items() if k in names}
    if "tokens" in args:
        args["tokens"] = tuple(args["tokens"])
    if isinstance(args.get("lora"), list):
        args["lora"] = tuple(args["lora"])
    op: Op = cls(**args)
    return op


def config_to_json(config: CacheConfig) -> dict[str, Any]:
    """A config as a trace records it: every field, but `policy_config` only when it is not the default (as a JSON
    object, SGLang's `--radix-eviction-policy-config`), so a trace of a config without one reads as before."""
    body = asdict(config)
    if config.policy_config:
        body["policy_config"] = dict(config.policy_config)
    else:
        del body["policy_config"]
    return body


@dataclass(frozen=True)
class Trace:
    """A replayable run: which backend, under which config, doing what."""

    config: CacheConfig
    ops: tuple[Op, ...]
    target: str = "kvcert.refimpl:RefCache"
    note: str = ""
    profile: str = ""
    """The profile it was judged under (SPEC.md §6); "" for the one the target declares."""
    fixes: tuple[str, ...] = ()
    """The findings whose minimal fixes were applied to the engine when it was found (`kvcert certify --with-fixes`):
    its replay applies them again."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": TRACE_FORMAT,
                "target": self.target,
                "config": config_to_json(self.config),
                "note": self.note,
                **({"profile": self.profile} if self.profile else {}),
                **({"fixes": list(self.fixes)} if self.fixes else {}),
                "ops": [op_to_json(op) for op in self.ops],
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: str) -> Trace:
        obj = json.loads(text)
        if obj.get("format") != TRACE_FORMAT:
            raise ValueError(f"not a {TRACE_FORMAT} file")
        return Trace(
            config=CacheConfig(**obj["config"]),
            ops=tuple(op_from_json(o) for o in obj["ops"]),
            target=obj.get("target", "kvcert.refimpl:RefCache"),
            note=obj.get("note", ""),
            profile=obj.get("profile", ""),
            fixes=tuple(obj.get("fixes", ())),
        )
