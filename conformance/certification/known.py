"""Known findings: the defects kvcert has logged in real engines, as data, replayed before every certification.

The log (`findings/index.json`, rendered for people in docs/findings.md) holds one entry per defect: the engine
and version, its class — reached through the engine's own request path, reached only by direct API calls, or an
engine choice the spec leaves open — what a user of that engine sees, its minimal traces (`findings/<engine>/`),
the adapter modules that drive that engine, and what upstream knows of it.

`kvcert certify` replays, before any cell walks, every logged trace of the target's engine that lies in the
target's declared scope. One that still breaks a rule makes the certificate NOT CERTIFIED whatever the budget:
a defect the log already names is never luck of the draw. A trace outside the declared scope (an op kind the
target does not declare, a cell it does not run, bad input to a backend sent only valid traffic) is listed with
why, and judges nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcert.conformance.aliases import canonical_module
from kvcert.conformance.certification.replay import Replay, replay
from kvcert.spec.ops import (
    REQUEST_OPS,
    AbortPrefetch,
    Admit,
    CheckPrefetch,
    Discard,
    Evict,
    Fetch,
    InjectFault,
    Op,
    Prefetch,
    Publish,
    RegisterRef,
    ReleaseRef,
    Restore,
    Retain,
    RetainWaiting,
    Retract,
    StorageFault,
    Submit,
    Trace,
    UpdateRef,
)
from kvcert.spec.types import CLIENT_RULES, ONE_CLASS_THRESHOLD, Capabilities

if TYPE_CHECKING:
    from kvcert.conformance.backend import Factory

__all__ = ["CLASSES", "Finding", "findings", "findings_for", "in_scope", "trace_text"]

CLASSES: dict[str, str] = {
    "request-path": "reachable through the released engine's own request path",
    "condition": "reachable through the released engine's request path only given a fault or a configuration (the "
    "entry's `condition` says which)",
    "unreleased": "in code no released engine runs: an unmerged pull request, or a package no released engine loads",
    "api-only": "reachable only by direct API calls the engine's scheduler never makes",
    "choice": "an engine choice the spec leaves open (calibration, not a defect)",
}
"""A finding's class: how a user of the engine could meet it."""


@dataclass(frozen=True)
class Finding:
    """One logged defect (or calibrated choice) of a real engine."""

    id: str
    engine: str
    """The engine and version, as its users name it."""
    title: str
    cls: str
    """One of CLASSES."""
    user_sees: str
    """What a user of the engine sees when it happens: process exit, wrong KV served, memory that grows, priority
    inversion, or nothing."""
    traces: tuple[str, ...]
    """Minimal traces, paths inside the findings folder."""
    adapters: tuple[str, ...]
    """Adapter modules driving this engine: their targets replay the traces that lie in their declared scope."""
    upstream: str
    """What the engine's public tracker knows of it, with the thread cited; or how it was searched for."""
    condition: str = ""
    """Class "condition": the fault or configuration it needs."""
    fix: str = ""
    """Its minimal fix, a unified diff inside the findings folder (`conformance.certification.fixes`); "" if none."""
    fix_leaves: tuple[tuple[str, str], ...] = ()
    """(trace, why) for each of its traces the fix does not make pass (code the diff cannot reach); every other trace
    passes with the fix applied (tests/test_known_findings.py)."""
    fix_for: tuple[str, ...] = ()
    """The adapter modules whose engine the fix's diff is written against; () for all of `adapters`. A finding shared
    by two versions (SGLang 0.5.23 and the fork's 0.5.10 base) carries the diff of one; its traces on the other stay
    unfixed."""

    fix_by: tuple[tuple[str, str], ...] = ()
    """(adapter module, diff) for an engine version `fix` is not written against: a finding shared by SGLang 0.5.23
    and the fork's 0.5.10 base carries a diff for each."""

    fix_api: str = ""
    """Why the fix cannot be applied in-process, when it changes the engine's API (a request field, a message type):
    its diff is for upstream (docs/upstream/)."""

    fix_client: str = ""
    """An API fix's client half under the released API, as a client rule (CLIENT_RULES): what a client does that the
    new field would have said. `--with-fixes` applies only this half (the adapters' clients take the rule on) and
    refuses an API fix without one."""

    @property
    def fixes(self) -> tuple[str, ...]:
        """The adapter modules `--with-fixes` may apply the fix under."""
        if not self.fix or (self.fix_api and not self.fix_client):
            return ()
        return tuple(dict.fromkeys((self.fix_for or self.adapters) + tuple(m for m, _ in self.fix_by)))

    def diff_for(self, module: str) -> str:
        """The path of the fix's diff for the engine `module` drives."""
        return dict(self.fix_by).get(module, self.fix)

    @property
    def defect(self) -> bool:
        """A defect to replay before certifying (a calibrated choice is not one)."""
        return self.cls != "choice"


@cache
def findings() -> tuple[Finding, ...]:
    """Every logged finding, in the log's order."""
    raw: list[dict[str, Any]] = json.loads(files("kvcert.conformance").joinpath("findings/index.json").read_text())
    out = []
    for entry in raw:
        cls = entry["class"]
        if cls not in CLASSES:
            raise ValueError(f"finding {entry['id']}: unknown class {cls!r}")
        if (cls == "condition") != bool(entry.get("condition")):
            raise ValueError(f"finding {entry['id']}: a `condition` is given exactly for class condition")
        if entry.get("fix_client", "") not in ("", *CLIENT_RULES):
            raise ValueError(f"finding {entry['id']}: fix_client {entry['fix_client']!r} is no client rule")
        out.append(
            Finding(
                id=entry["id"],
                engine=entry["engine"],
                title=entry["title"],
                cls=cls,
                user_sees=entry["user_sees"],
                traces=tuple(entry["traces"]),
                adapters=tuple(entry["adapters"]),
                upstream=entry["upstream"],
                condition=entry.get("condition", ""),
                fix=entry.get("fix", ""),
                fix_leaves=tuple(sorted(entry.get("fix_leaves", {}).items())),
                fix_for=tuple(entry.get("fix_for", ())),
                fix_by=tuple(sorted(entry.get("fix_by", {}).items())),
                fix_api=entry.get("fix_api", ""),
                fix_client=entry.get("fix_client", ""),
            )
        )
    return tuple(out)


def trace_text(path: str) -> str:
    """A logged trace's JSON text: `path` inside the findings folder, or an absolute path (a user's own log)."""
    if Path(path).is_absolute():
        return Path(path).read_text()
    return files("kvcert.conformance").joinpath("findings", path).read_text()


def findings_for(target: str) -> list[Finding]:
    """The defects logged for the engine `target` (`module:factory`) drives."""
    module = canonical_module(target.partition(":")[0])
    return [f for f in findings() if f.defect and module in f.adapters]


def in_scope(trace: Trace, capabilities: Capabilities) -> str:
    """ "" when a backend declaring `capabilities` could be sent `trace` by a certification run; else why not.

    The trace's config must be a cell the backend declares, and each op one its capabilities ask the suite to
    send. Whether its ops are valid traffic (for a backend that does not declare `strict_input`) the replay
    itself decides: the oracle beside the backend rejects bad input."""
    c, caps = trace.config, capabilities
    if c.page_size not in caps.page_sizes or c.policy not in caps.policies:
        return f"page size {c.page_size} / policy {c.policy}: not a declared cell"
    if c.host_capacity and c.write_policy not in caps.write_policies:
        return f"write policy {c.write_policy}: not declared"
    if c.prefetch_policy and c.prefetch_policy not in caps.prefetch_policies:
        return f"prefetch policy {c.prefetch_policy}: not declared"
    parts = caps.priority_parts if caps.priority_refs else ()
    if caps.priority_refs and "high" not in parts and c.high_priority_threshold != ONE_CLASS_THRESHOLD:
        if any(
            isinstance(op, (RegisterRef, UpdateRef)) and _high(op.priority, c.high_priority_threshold)
            for op in trace.ops
        ):
            return "a high-priority session: the backend declares one ref class"
    registered: set[Any] = set()
    for op in trace.ops:
        need = _needs(op, caps)
        if need:
            return f"{type(op).__name__}: {need}"
        if isinstance(op, RegisterRef):
            if _hashable(op.session) in registered and "move" not in parts:
                return "a registered session registered again: the backend does not declare moves"
            registered.add(_hashable(op.session))
        elif isinstance(op, ReleaseRef):
            registered.discard(_hashable(op.session))
    return ""


def _high(priority: Any, threshold: int) -> bool:
    return isinstance(priority, int) and not isinstance(priority, bool) and priority >= threshold


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _needs(op: Op, caps: Capabilities) -> str:
    """What `op` needs declared that `caps` does not declare, or ""."""
    if isinstance(op, REQUEST_OPS) != (caps.kind == "request-path"):
        return (
            "a client's request, for a target driven through its request path (SPEC.md §12)"
            if isinstance(op, REQUEST_OPS)
            else "a call on the cache's API, and the target is driven through its engine's request path"
        )
    parts = caps.priority_parts if caps.priority_refs else ()
    if isinstance(op, Submit) and op.lora is not None and not caps.loras:
        return "LoRA adapters not declared"
    if (
        isinstance(op, (Prefetch, Fetch, CheckPrefetch, AbortPrefetch, Publish, StorageFault))
        and not caps.prefetch_policies
    ):
        return "no storage tier declared"
    if isinstance(op, StorageFault) and op.kind not in caps.storage_faults:
        return f"{op.kind} storage faults not declared"
    if isinstance(op, InjectFault) and op.kind not in caps.faults:
        return f"{op.kind} faults not declared"
    if isinstance(op, (Retract, Restore, Discard)) and not caps.retraction:
        return "retraction not declared"
    if isinstance(op, (RegisterRef, ReleaseRef, UpdateRef, Admit)) and not caps.priority_refs:
        return "priority refs not declared"
    if isinstance(op, UpdateRef) and "update" not in parts:
        return "update_ref not declared"
    if isinstance(op, (Retain, RetainWaiting)) and "retain" not in parts:
        return "retention not declared"
    if isinstance(op, Admit) and "admission" not in parts:
        return "admission plans not declared"
    if isinstance(op, Evict) and (op.allow_low, op.allow_high) != (True, True) and "scope" not in parts:
        return "scoped eviction not declared"
    return ""


@dataclass(frozen=True)
class Judged:
    """One logged trace, as a certification run judged it on its target."""

    finding: Finding
    trace: str
    reproduced: bool
    rules: tuple[str, ...]
    summary: str


def replay_findings(
    target: str, factory: Factory, capabilities: Capabilities, extra: Sequence[Finding] = ()
) -> list[Judged]:
    """Replay every logged trace of `target`'s engine in its declared scope on a fresh backend of `factory`."""
    out = []
    for finding in [*findings_for(target), *extra]:
        for path in finding.traces:
            trace = Trace.from_json(trace_text(path))
            why = in_scope(trace, capabilities)
            if why:
                out.append(Judged(finding, path, False, (), f"out of this target's declared scope: {why}"))
                continue
            got = replay(factory, capabilities, trace.config, trace.ops, windows=True)
            out.append(_judged(finding, path, got, capabilities))
    return out


def _judged(finding: Finding, path: str, got: Replay, caps: Capabilities) -> Judged:
    """A replay's verdict on a logged trace: it reproduces, it no longer does, or it left the declared scope on the
    way (bad input to a backend sent only valid traffic; a lock on a host-only node its callers never take)."""
    if got.failure is None and got.invalid:
        return Judged(finding, path, False, (), f"out of this target's declared scope: {got.invalid}")
    if got.failure is None:
        return Judged(
            finding,
            path,
            False,
            (),
            "does not reproduce on this target (fixed, or avoided by how its adapter drives the engine)",
        )
    step = got.failure.step
    if not caps.strict_input and not got.valid_failure():
        return Judged(finding, path, False, (), "out of scope: bad input, and the backend is sent only valid traffic")
    if not caps.locks_host_only and any(w == "lock-host-only" and i <= step for i, w in got.windows):
        why = "out of scope: it locks a host-only node, which the backend declares its callers never do"
        return Judged(finding, path, False, (), why)
    rules = tuple(dict.fromkeys(v.inv for v in got.failure.violations))
    return Judged(finding, path, True, rules, f"still reproduces at step {step}: {', '.join(rules)}")
