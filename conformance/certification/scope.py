"""What a certificate did not check (`NOT CHECKED`): the parts of the spec a backend does not declare, and the ones
it declares that its cells never exercised, counted from the ops that did them (SPEC.md §12.3 for request paths)."""

from __future__ import annotations

from typing import Optional

from kvcert.conformance.certification.certificate import CellResult
from kvcert.conformance.generation.request_machine import request_scope_gaps
from kvcert.conformance.harness.windows import WINDOWS
from kvcert.spec import profiles
from kvcert.spec.types import (
    FAULTS,
    POLICIES,
    PREFETCH_POLICIES,
    PRIORITY_PARTS,
    STORAGE_FAULTS,
    WRITE_POLICIES,
    Capabilities,
)


def _part_exercised(part: str, ops: dict[str, int], host_cells: bool) -> bool:
    """Whether a run did what a part of §11 is about (not only declared it)."""
    if part == "high":  # with a host tier, a demotion must have happened too
        return ops.get("event:high-session", 0) > 0 and (not host_cells or ops.get("event:demotion", 0) > 0)
    if part == "scope":
        return ops.get("event:scoped-evict", 0) > 0
    if part == "update":
        return ops.get("UpdateRef", 0) > 0
    if part == "move":
        return ops.get("event:move", 0) > 0
    if part == "retain":  # a retained node evicted last, a retention that ended while its session lived on, one held
        ends = ops.get("event:retained-evict", 0) > 0 and ops.get("event:retention-ends", 0) > 0
        return ends and ops.get("event:retention-waits", 0) > 0  # for a waiting turn
    return ops.get("Admit", 0) > 0


STORAGE_WINDOWS = ("split-under-store", "write-back-host-full")


WINDOW_TIERS = {
    name: (what, "device" if name == "split-locked" else "storage" if name in STORAGE_WINDOWS else "host")
    for name, what in WINDOWS.items()
}


def scope_gaps(capabilities: Capabilities, cells: list[CellResult], bad_input: Optional[bool] = None) -> list[str]:
    """What a certificate over `cells` does not cover, one line each: every part of the spec the backend
    does not declare, and every part it declares that no step of these cells exercised."""
    if capabilities.kind == "request-path":
        return request_scope_gaps(capabilities, cells)
    ops: dict[str, int] = {}
    for c in cells:
        for k, v in c.ops.items():
            ops[k] = ops.get(k, 0) + v
    host_cells = [c for c in cells if c.write_policy]
    storage_cells = [c for c in cells if "+" in c.write_policy]
    faults_fired = {k.split(":", 1)[1] for k in ops if k.startswith("InjectFault:")}
    rejected = sum(v for k, v in ops.items() if k.endswith(":bad"))
    parts: list[tuple[str, bool, bool]] = [
        # (what, declared, exercised: counted from steps that did it)
        (
            "KV bytes (SPEC.md §9.12, INV-KV-1..3: every slot read back)",
            capabilities.kv_reads,
            ops.get("kv:entries", 0) > 0,
        ),
        (
            "host tier (SPEC.md §9: backups, demotion, host eviction, load-back, copy acks)",
            bool(capabilities.write_policies),
            bool(host_cells) and ops.get("Complete", 0) > 0,
        ),
        (
            "storage tier (SPEC.md §10: store copies, prefetch, storage faults)",
            bool(capabilities.prefetch_policies),
            bool(storage_cells) and ops.get("Fetch", 0) > 0,
        ),
        ("retraction (SPEC.md §9.11, INV-RETRACT-1/2)", capabilities.retraction, ops.get("Retract", 0) > 0),
        (
            "priority tiers (SPEC.md §11.1-§11.2: sessions, refs, tiers, INV-TIER-1/2/5)",
            capabilities.priority_refs,
            ops.get("RegisterRef", 0) > 0,
        ),
        *(
            (
                f"priority tiers, {part}: {what}",
                part in capabilities.priority_parts,
                _part_exercised(part, ops, bool(host_cells)),
            )
            for part, what in PRIORITY_PARTS.items()
            if capabilities.priority_refs  # a backend without §11 gets the one line above
        ),
        (
            "bad input (INV-ERR-1/2: typed errors, state unchanged)",
            capabilities.strict_input or bool(bad_input),
            bad_input is not False and rejected > 0,
        ),
        ("namespaces (INV-NS-*)", capabilities.namespaces, ops.get("namespace:named", 0) > 0),
    ]
    if capabilities.write_policies:
        parts.append(
            (
                "locks on host-only nodes (SPEC.md §9.1: the device counters move only for device nodes)",
                capabilities.locks_host_only,
                ops.get("window:lock-host-only", 0) > 0,
            )
        )
    out = []
    for what, declared, exercised in parts:
        if not declared:
            out.append(f"{what}: not declared by the backend")
        elif not exercised:
            out.append(f"{what}: declared, but no step of this run exercised it")
    for kind in FAULTS:
        what = f"injected {kind} faults (SPEC.md §10.5)"
        if kind not in capabilities.faults:
            out.append(f"{what}: not declared by the backend")
        elif kind not in faults_fired:
            out.append(f"{what}: declared, but none was injected in this run")
    for window, (what, tier) in WINDOW_TIERS.items():
        in_tier = {"device": bool(cells), "host": bool(host_cells), "storage": bool(storage_cells)}[tier]
        if window == "lock-host-only":
            continue  # its own line above (a part a backend may leave out)
        if in_tier and not ops.get(f"window:{window}"):
            out.append(f"race window {window} ({what}): no step of this run entered it")
    missing = [p for p in POLICIES if p not in capabilities.policies]
    if missing:
        out.append(f"eviction policies {', '.join(missing)}: not declared by the backend")
    if capabilities.write_policies:
        missing = [w for w in WRITE_POLICIES if w not in capabilities.write_policies]
        if missing:
            out.append(f"write policies {', '.join(missing)}: not declared by the backend")
    if capabilities.prefetch_policies:
        missing = [w for w in PREFETCH_POLICIES if w not in capabilities.prefetch_policies]
        if missing:
            out.append(f"prefetch stop policies {', '.join(missing)}: not declared by the backend")
    if capabilities.prefetch_policies:
        missing = [k for k in STORAGE_FAULTS if k not in capabilities.storage_faults]
        if missing:
            out.append(f"storage faults {', '.join(missing)}: the backend's store cannot take them")
    held = profiles.profile(capabilities.profile)
    has = {
        "": True,
        "write_back": "write_back" in capabilities.write_policies,
        "copy": "copy" in capabilities.faults,
        "host": bool(capabilities.write_policies),
        "priority_host": capabilities.priority_refs and bool(capabilities.write_policies),
        "retraction": capabilities.retraction,
        "storage": bool(capabilities.prefetch_policies),
        "host_room": bool(capabilities.prefetch_policies)
        or (capabilities.retraction and bool(capabilities.write_policies)),
    }
    for choice in profiles.CHOICES:
        if has[choice.needs] and not held.pinned(choice):
            out.append(f"choice {choice.id} ({choice.pinned}): left to the backend under profile {held.name}")
    if held.pinned(profiles.RANK) and not capabilities.reports_metadata:
        out.append("policy metadata (INV-META-1): not exposed by the backend, judged only through eviction order")
    for part, pin in profiles.STILL_PINNED:
        if has[part]:
            out.append(f"pinned under every profile (a correct cache that chooses otherwise fails): {pin}")
    out += [
        f"adapter deviation (the engine as certified differs from the engine as shipped): {d}"
        for d in capabilities.deviations
    ]
    if capabilities.still_between_calls:
        out.append(
            "state between steps: not re-read (the backend declares still_between_calls, so each step's "
            "before is the last step's after)"
        )
    return out
