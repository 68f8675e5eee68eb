"""A certification's record: each cell's result, each logged finding's replay, and the certificate that holds them,
written as JSON and rewritten after every cell (`complete` says whether every planned cell ran)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from kvcert.spec.types import CacheConfig


@dataclass
class CellResult:
    page_size: int
    policy: str
    passed: bool
    examples: int
    steps: int
    seconds: float
    failure: Optional[str] = None
    trace_path: Optional[str] = None
    trace_len: Optional[int] = None
    reproduced: Optional[bool] = None
    write_policy: str = ""
    """"" for a device-only cell; else the host tier's write policy."""
    ops: dict[str, int] = field(default_factory=dict)
    """Steps per op kind (`RunStats.ops`): what the cell exercised, in the JSON certificate."""
    tier: str = ""
    """An API-level walk target's tier, as its cell names it (`WalkCell.tier`); "" for every other cell."""
    digest: str = ""
    """SHA-256 of every op the cell's examples executed, in order (`StepDigest`): equal digests, same run."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """The failure, structured: one `{invariant, step, op, message, trace}` per broken rule (`failure` is its text)."""
    corpus_replayed: int = 0
    """Traces of the shared failure corpus replayed before the walk: those recorded on this cell's config."""
    from_corpus: bool = False
    """The failure is a corpus trace's, failing again (the walk did not run)."""
    shrink_note: str = ""
    """Why the saved trace is not smaller, where shrinking did not reach a fixpoint (`Shrunk.note`)."""
    trace_json: Optional[str] = field(default=None, repr=False)
    """The saved trace's text, carried back from a worker that may run on another machine (not in the JSON)."""


@dataclass
class FindingReplay:
    """A logged finding's trace, replayed on the target before any cell walks (`conformance.findings`)."""

    id: str
    trace: str
    """The trace's path inside the package's findings folder."""
    reproduced: bool
    rules: list[str] = field(default_factory=list)
    """The rules it still breaks (empty when it no longer reproduces)."""
    summary: str = ""


@dataclass
class Certificate:
    target: str
    backend: str
    seed: int
    examples: int
    steps: int
    strict_input: bool
    profile: str = "core"
    """The profile the backend was held to (SPEC.md §6): the one it declares, or the one `--profile` named."""
    cells: list[CellResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Cells or rules asked for but not run."""
    not_checked: list[str] = field(default_factory=list)
    """What this certificate does not cover: capabilities the backend does not declare, or declares but
    no cell of this run exercised, and every deviation its adapter declares (`scope_gaps`). Printed next
    to the verdict."""
    planned: list[str] = field(default_factory=list)
    """Every cell the run set out to walk (`config_name`), in order: fewer finished means it was cut short."""
    findings: list[FindingReplay] = field(default_factory=list)
    """The target's logged findings, replayed before the walk: one that still reproduces means NOT CERTIFIED."""
    adapter_notes: list[str] = field(default_factory=list)
    """What the adapter says about how it drives the engine (`Capabilities.notes`), printed in every report."""
    kind: str = "api"
    """How the engine is driven (`Capabilities.kind`): "request-path" through its own scheduler code, "api" by
    the protocol's calls composed by the suite, "native" a cache written to the protocol."""
    interrupted: bool = False
    """Stopped by Ctrl-C: the cells that finished are kept, the one that was running is not (never complete)."""
    with_fixes: list[str] = field(default_factory=list)
    """Findings whose minimal fixes were applied to the engine before the walk (`--with-fixes`): the engine certified
    is the released one with those patches, each listed under NOT CHECKED."""

    @property
    def complete(self) -> bool:
        """Every planned cell ran (a run stopped early, by fail-fast or an interrupt, is not)."""
        return len(self.cells) == len(self.planned)

    @property
    def passed(self) -> bool:
        """CERTIFIED: every planned cell ran and passed, and no logged finding reproduced."""
        return (
            bool(self.cells)
            and self.complete
            and all(c.passed for c in self.cells)
            and not any(f.reproduced for f in self.findings)
        )

    @property
    def total_steps(self) -> int:
        return sum(c.steps for c in self.cells)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.cells)

    def to_json(self) -> str:
        body = asdict(self)
        for cell in body["cells"]:
            del cell["trace_json"]
        body.update(
            passed=self.passed,
            complete=self.complete,
            planned_cells=len(self.planned),
            finished_cells=len(self.cells),
            total_steps=self.total_steps,
            steps_per_second=round(self.total_steps / max(self.seconds, 1e-9), 1),
        )
        return json.dumps(body, indent=1)


def config_name(config: CacheConfig) -> str:
    """A cell's coordinates as reports name it: page size, policy, and its tiers' policies."""
    parts = [f"page_size={config.page_size}", f"policy={config.policy}"]
    if config.policy_config:
        parts.append("policy_config=" + ",".join(f"{k}:{v}" for k, v in config.policy_config))
    if config.host_capacity:
        parts.append(f"write_policy={config.write_policy}")
    if config.prefetch_policy:
        parts.append(f"prefetch_policy={config.prefetch_policy}")
    return " ".join(parts)
