"""The engine zoo: textual mutants of kvcert's reference *engines*, one real bug class each (SPEC.md §14, §15).

`zoo.mutants` breaks the reference model; these break the scheduler around it, where the linker tier's cache-side
rules (INV-LINK-1..7) and decode-side admission's (INV-DEC-1..6) live. Each mutant edits one engine module
(`MODULES`: `engine_linker`, `engine_decode`) and each `find` must occur exactly once in that module's source, so a
refactor of the engine breaks the zoo loudly instead of silently mutating nothing. `build` compiles the edited
source as a module of its own; `kvcert.conformance.zoo.engines:<name>` loads as a target, so saved traces replay.

`run_engine_zoo` certifies every mutant at a small budget (generation) and runs each directed mutant's hand-written
request-path trace (its bug class generation reaches at some seeds only, or not at all, at that budget). A verdict
counts a kill only under one of the mutant's `rules`; a failure under other rules only is reported as such, and is
no kill. The control: the unmodified engine passes every cell and every directed trace.

Two rules are reached through another: an offload's node unlocked (`offload_unpinned`) is INV-HOST-6 at once, before
a byte changes, so INV-LINK-5's byte check itself is reached by `offload_from_row`, whose node stays locked; and the
harness judges INV-LINK-4 only under a profile that `aborts_failed_loads`, so `serve_failed_load` is held to SGLang's
(the unmodified engine aborts failed loads too and passes it; under core the torn KV shows as INV-KV-1).

What cannot be broken here, and why:

- **INV-LINK-3's cancel clause** ("a queued load whose request lets its slots go is cancelled first") has no window
  in `engine_linker`: its loads are queued during admission and started in the same `step`, after that step's
  messages (aborts included) were taken, so no request frees its slots between the two and `cancel` is never
  needed. Breaking it takes a different scheduler (loads started a step later), not an edit of this one. Its other
  clause (every batch started with loads is finished, once) is broken by `batch_never_finished` and
  `batch_finished_per_request`.
- **INV-LINK-7's reset clause** is reached by a client's `Flush` only once no request is in flight, so a reset meets
  offloads in flight, never loads; `flush_keeps_offload_locks` breaks it there.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from kvcert.conformance.backend import Factory, capabilities_of
from kvcert.conformance.certification.certify import certify
from kvcert.conformance.harness.driver import ConformanceFailure
from kvcert.conformance.harness.requests import RequestHarness
from kvcert.conformance.zoo.engine_mutants import ENGINE_MUTANTS, DirectedTrace, EngineMutant

__all__ = [
    "ENGINE_MUTANTS",
    "EXAMPLES",
    "MODULES",
    "DirectedTrace",
    "EngineMutant",
    "EngineVerdict",
    "EngineZooReport",
    "build",
    "run_directed",
    "run_engine_zoo",
]

MODULES: dict[str, str] = {
    "engine_linker": "kvcert.conformance.reference.engine_linker",
    "engine_decode": "kvcert.conformance.reference.engine_decode",
}
"""Engine modules a mutant may edit -> their import name. Each defines `factory` (and `factory_gpu`)."""

EXAMPLES, STEPS, SEED = 40, 50, 0
"""The engine zoo's budget per cell: `kvcert engine-zoo`'s defaults, and what tests/test_engine_zoo.py runs."""


# ------------------------------------------------------------------ building a mutant


def _source(module: str) -> str:
    spec = importlib.util.find_spec(MODULES[module])
    if spec is None or spec.origin is None:  # pragma: no cover - an installed kvcert has its sources
        raise AssertionError(f"no source for {MODULES[module]}")
    return Path(spec.origin).read_text()


def _mutant(name: str) -> EngineMutant:
    for m in ENGINE_MUTANTS:
        if m.name == name:
            return m
    raise KeyError(name)


def build(mutant: EngineMutant, attr: Optional[str] = None) -> Factory:
    """Compile the edited engine module as `kvcert.conformance._engine_mutant_<name>` and return its factory `attr`
    (`factory` or `factory_gpu`; by default the mutant's own), named `mutant:<name>`. It shares no class of its own
    with the real module."""
    if mutant.module not in MODULES:
        raise AssertionError(f"mutant {mutant.name}: module {mutant.module!r} is not one of {sorted(MODULES)}")
    source = _source(mutant.module)
    for find, repl in mutant.edits:
        count = source.count(find)
        if count != 1:
            raise AssertionError(f"mutant {mutant.name}: edit target occurs {count} times in {mutant.module}.py")
        source = source.replace(find, repl)
    module = types.ModuleType(f"kvcert.conformance._engine_mutant_{mutant.name}")
    module.__file__ = f"<engine mutant {mutant.name}: {mutant.module}.py>"
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    factory: Factory = getattr(module, attr or mutant.factory)
    factory.capabilities = replace(capabilities_of(factory), name=f"mutant:{mutant.name}")  # type: ignore[attr-defined]
    return factory


def __getattr__(name: str) -> Factory:
    """`kvcert.conformance.zoo.engines:<mutant>` is a loadable target, so saved traces replay."""
    try:
        mutant = _mutant(name)
    except KeyError:
        raise AttributeError(name) from None
    return build(mutant)


# ------------------------------------------------------------------ running the zoo


def run_directed(factory: Factory, trace: DirectedTrace, profile: Optional[str] = None) -> Optional[ConformanceFailure]:
    """`trace` on a fresh engine (held to `profile`, else its own), judged after every op and quiesced: the failure,
    or None."""
    caps = capabilities_of(factory)
    h = RequestHarness(factory(trace.config), trace.config, replace(caps, profile=profile or caps.profile))
    try:
        for op in trace.ops:
            h.step(op)
        h.quiesce()
    except ConformanceFailure as failure:
        return failure
    finally:
        h.close()
    return None


@dataclass
class EngineVerdict:
    """What the suite did to one engine mutant: generation and its directed trace, apart."""

    name: str
    doc: str
    rules: frozenset[str]
    directed: bool
    generated: tuple[str, ...] = ()
    """Rules the first failing cell broke (its trace replayed on a fresh engine); () when generation missed it."""
    unreplayed: bool = False
    """A cell failed, and its trace passed on a fresh engine: no kill."""
    trace_len: Optional[int] = None
    trace_path: Optional[str] = None
    by_trace: tuple[str, ...] = ()
    """Directed mutants: the rules the trace broke; () when it passed."""

    @property
    def other_rules(self) -> tuple[str, ...]:
        """Generation failed it under these rules only, none of its own: reported, no kill."""
        return () if self.killed_generated else self.generated

    @property
    def killed_generated(self) -> bool:
        return bool(set(self.generated) & self.rules)

    @property
    def killed_by_trace(self) -> bool:
        return bool(set(self.by_trace) & self.rules)

    @property
    def killed(self) -> bool:
        """A directed mutant must die by its trace; any other by generation; either under one of its rules."""
        return self.killed_by_trace if self.directed else self.killed_generated


@dataclass
class EngineZooReport:
    verdicts: list[EngineVerdict] = field(default_factory=list)
    control_failure: str = ""
    """The unmodified engine's first failure, on a cell or a directed trace; "" when it passed them all."""
    control_cells: int = 0
    control_traces: int = 0

    @property
    def passed(self) -> bool:
        return bool(self.verdicts) and all(v.killed for v in self.verdicts) and not self.control_failure

    def summary(self) -> str:
        """Generated kills over every mutant (generation tries them all), directed kills over the directed ones."""
        directed = [v for v in self.verdicts if v.directed]
        return (
            f"generated: {sum(v.killed_generated for v in self.verdicts)}/{len(self.verdicts)} killed; "
            f"directed: {sum(v.killed_by_trace for v in directed)}/{len(directed)} killed by their traces"
        )


def _rules(failure: ConformanceFailure) -> tuple[str, ...]:
    return tuple(sorted({v.inv for v in failure.violations}))


def run_engine_zoo(
    names: Optional[list[str]] = None,
    *,
    examples: int = EXAMPLES,
    steps: int = STEPS,
    seed: int = SEED,
    out_dir: Optional[Path] = None,
    on_verdict: Optional[Callable[[EngineVerdict], None]] = None,
) -> EngineZooReport:
    """Certify every mutant (or those named) in this process, run each directed trace, then the control.

    In-process: `certify` fixes Hypothesis's generation (`fixed_generation`), so a verdict does not depend on what ran
    before, and each engine mutant is a small module. Unknown names raise ValueError."""
    known = [m.name for m in ENGINE_MUTANTS]
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"no engine mutant named {', '.join(unknown)}; the zoo has {', '.join(known)}")
    chosen = [m for m in ENGINE_MUTANTS if not names or m.name in names]
    out = out_dir or Path("kvcert-failures/engine-zoo")
    report = EngineZooReport()
    for m in chosen:
        factory = build(m)
        cert = certify(
            f"kvcert.conformance.zoo.engines:{m.name}",
            factory=factory,
            examples=examples * m.budget,
            steps=steps,
            seed=seed,
            page_sizes=m.page_sizes,
            policies=m.policies,
            out_dir=out,
            fail_fast=True,
            profile=m.profile,
        )
        v = EngineVerdict(m.name, m.doc, m.rules, m.trace is not None)
        failing = next((c for c in cert.cells if not c.passed), None)
        if failing is not None:
            v.unreplayed = not failing.reproduced
            if failing.reproduced:
                v.generated = tuple(sorted({f["invariant"] for f in failing.failures}))
            v.trace_len, v.trace_path = failing.trace_len, failing.trace_path
        if m.trace is not None:
            failure = run_directed(factory, m.trace, m.profile)
            v.by_trace = _rules(failure) if failure is not None else ()
        report.verdicts.append(v)
        if on_verdict is not None:
            on_verdict(v)
    _control(report, chosen, examples, steps, seed, out)
    return report


def _control(
    report: EngineZooReport, chosen: list[EngineMutant], examples: int, steps: int, seed: int, out: Path
) -> None:
    """The unmodified engines on every cell a mutant ran, at the largest budget, under each profile a mutant is held
    to, and on every directed trace; the first failure goes into `report.control_failure`."""
    for module, attr, held in sorted({(m.module, m.factory, m.profile or "") for m in chosen}):
        ms = [m for m in chosen if (m.module, m.factory, m.profile or "") == (module, attr, held)]
        target = f"{MODULES[module]}:{attr}"
        cert = certify(
            target,
            examples=examples * max(m.budget for m in ms),
            steps=steps,
            seed=seed,
            page_sizes=sorted({p for m in ms for p in m.page_sizes}),
            policies=sorted({p for m in ms for p in m.policies}),
            out_dir=out / "control",
            profile=held or None,
        )
        report.control_cells += len(cert.cells)
        bad = next((c for c in cert.cells if not c.passed), None)
        if bad is not None:
            report.control_failure = f"{target} fails a cell (page size {bad.page_size}): {bad.failure}"
            return
        factory: Factory = getattr(importlib.import_module(MODULES[module]), attr)
        for m in ms:
            if m.trace is not None:
                report.control_traces += 1
                failure = run_directed(factory, m.trace, m.profile)
                if failure is not None:
                    report.control_failure = f"{target} fails the directed trace of {m.name}: {failure}"
                    return
