"""`kvcert selftest`: the suite's power, measured on the bug zoo, one report for the CLI and the tests.

Every mutant of `zoo.MUTANTS` is certified in a fresh interpreter (so its verdict is what a run
of it alone gives, whatever ran before), up to `jobs` at a time. A mutant counts as **killed**
only when a cell failed *and* its shrunk trace failed again on a fresh backend; a failure that
does not replay is reported as INV-DET-1 and is no kill. The directed mutants (`zoo.DIRECTED`:
bug classes generation reaches too rarely at this budget) are killed by a hand-written trace
each (`DIRECTED_TRACES`) and are also run through generation, whose verdict is reported beside
it, so the day generation reaches one shows. The unmodified model must pass every cell any
mutant ran. `tests/test_zoo.py` calls `run_selftest` with the CLI's defaults, so the two agree
on every verdict.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvcert.conformance import zoo
from kvcert.conformance.certification.certificate import Certificate
from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
from kvcert.spec.ops import (
    Complete,
    Evict,
    EvictHost,
    Insert,
    LoadBack,
    Match,
    Op,
    Poll,
    RegisterRef,
    ReleaseRef,
)
from kvcert.spec.types import CacheConfig

__all__ = ["DIRECTED_TRACES", "DirectedTrace", "SelftestReport", "Verdict", "directed_failure", "run_selftest"]

EXAMPLES, STEPS, SEED = 600, 50, 0
"""The zoo's budget: `kvcert selftest`'s defaults, and what tests/test_zoo.py runs."""


@dataclass(frozen=True)
class DirectedTrace:
    """A hand-written trace that kills one directed mutant: the model passes it, the mutant breaks `invariant`."""

    config: CacheConfig
    ops: tuple[Op, ...]
    invariant: str
    step: Optional[int] = None
    """The step the mutant must fail at, when the trace pins it down."""
    why: str = ""


_WT = CacheConfig(page_size=1, capacity=8, host_capacity=6, write_policy="write_through")
_WT_LARGE_HOST = CacheConfig(page_size=1, capacity=6, host_capacity=24, write_policy="write_through")

DIRECTED_TRACES: dict[str, DirectedTrace] = {
    "tier_ignores_ref_counts": DirectedTrace(
        CacheConfig(page_size=1, capacity=8),
        (
            Insert(None, (1,)),
            Insert(None, (2,)),
            RegisterRef("a", 0, 0),
            RegisterRef("b", 0, 0),
            RegisterRef("c", 1, 0),
            Evict(1),
        ),
        "INV-EVICT-4",
        5,
        "within a tier the node fewer sessions hold goes first (SPEC.md §11.3): LRU alone would take the older "
        "node two sessions share",
    ),
    "demotes_longest_session": DirectedTrace(
        _WT,
        (
            Insert(None, (1, 1)),  # write-through backs each insert up: copies 0 and 1
            Insert(None, (2, 2, 2)),
            Complete(0),
            Complete(1),
            Poll(),
            RegisterRef("short", 0, 1),
            RegisterRef("long", 1, 1),
            Evict(8),  # both demoted to the host: idle
            EvictHost(2),  # nothing UNUSED or LOW_REF: demote "short" and evict its 2 tokens
        ),
        "INV-TIER-5",
        8,
        "host pressure demotes the idle high-priority session with the fewest tokens (SPEC.md §11.4)",
    ),
    "demotion_never_restored": DirectedTrace(
        _WT,
        (
            Insert(None, (1, 1)),
            Complete(0),
            Poll(),
            RegisterRef("idle", 0, 1),
            Match(None, (9,)),  # a miss: its handle is the root
            RegisterRef("busy", 4, 1),  # high, holds nothing on the host: never idle
            Evict(8),  # "idle" is on the host only now
            EvictHost(2),  # nothing UNUSED or LOW_REF: "idle" is demoted and its copy evicted
            ReleaseRef("busy"),  # a high session ends: "idle" is high again
        ),
        "INV-TIER-5",
        8,
        "a high-priority session's end gives the latest demoted session its tier back (SPEC.md §11.4)",
    ),
    "write_acks_drained_on_one_path": DirectedTrace(
        _WT_LARGE_HOST,
        (Insert(None, (1,)), Complete(0), Poll(), Evict(1), Insert(None, (0,)), Match(None, (1,)), LoadBack(5)),
        "INV-COPY-1",
        None,
        "write acks are consumed whether or not a load is pending (SPEC.md §9.8): the shrunk seed-0 trace",
    ),
    "acks_out_of_order": DirectedTrace(
        _WT_LARGE_HOST,
        (
            Insert(None, (0,)),
            Complete(0),
            Poll(),
            Evict(1),
            EvictHost(1),
            Insert(None, (1,)),
            Insert("lora-a", (0,)),
            Insert(None, (0,)),
            Complete(3),
            Poll(),
        ),
        "INV-COPY-2",
        None,
        "acks are consumed in issue order (SPEC.md §9.8): the shrunk trace of a generated kill",
    ),
}


def directed_failure(name: str) -> ConformanceFailure:
    """Run mutant `name`'s directed trace: the unmodified model must pass it, the mutant must fail it."""
    trace = DIRECTED_TRACES[name]
    (mutant,) = [m for m in zoo.DIRECTED if m.name == name]
    ops = list(trace.ops)
    try:
        run_trace(zoo.refcache.RefCache(trace.config), trace.config, zoo.refcache.RefCache.capabilities, ops)
    except ConformanceFailure as failure:
        raise AssertionError(f"the unmodified model fails the directed trace of {name}: {failure}") from None
    factory = zoo.build(mutant)
    try:
        run_trace(factory(trace.config), trace.config, factory.capabilities, ops)  # type: ignore[attr-defined]
    except ConformanceFailure as failure:
        return failure
    raise AssertionError(f"directed mutant {name} passed its trace")


@dataclass
class Verdict:
    """What the suite did to one mutant."""

    name: str
    doc: str
    directed: bool = False
    killed: bool = False
    """Generation failed a cell and the shrunk trace failed again on a fresh backend."""
    unreplayed: bool = False
    """A cell failed but its trace passed on a fresh backend (INV-DET-1): no kill."""
    trace_len: Optional[int] = None
    broken: str = ""
    """The first broken rule of the failing cell, one line."""
    trace_path: Optional[str] = None
    steps: int = 0
    digests: tuple[str, ...] = ()
    """Per cell, `CellResult.digest`: the run, step for step."""
    by_trace: Optional[str] = None
    """Directed mutants: the rules its hand-written trace broke, or "" if the trace did not kill it."""
    trace_note: str = ""
    """Directed mutants whose trace did not kill them: why."""


@dataclass
class SelftestReport:
    generated: list[Verdict] = field(default_factory=list)
    directed: list[Verdict] = field(default_factory=list)
    control_passed: bool = False
    control_failure: str = ""

    @property
    def passed(self) -> bool:
        """Some mutants ran, generation killed every one, every directed trace killed its mutant, the model passed."""
        return (
            bool(self.generated)
            and all(v.killed for v in self.generated)
            and all(v.by_trace for v in self.directed)
            and self.control_passed
        )


def _verdict(mutant: zoo.Mutant, cert: Certificate, directed: bool) -> Verdict:
    v = Verdict(mutant.name, mutant.doc, directed=directed, steps=cert.total_steps)
    v.digests = tuple(c.digest for c in cert.cells)
    failing = [c for c in cert.cells if not c.passed]
    if failing:
        first = failing[0]
        v.killed = bool(first.reproduced)
        v.unreplayed = not first.reproduced
        v.trace_len, v.trace_path = first.trace_len, first.trace_path
        lines = (first.failure or "").splitlines()
        v.broken = (lines[1] if len(lines) > 1 else lines[0] if lines else "").strip()
    return v


def _run(name: str, examples: int, steps: int, seed: int, out_dir: Optional[Path]) -> Certificate:
    """One mutant (or "" for the control), in this interpreter."""
    if not name:
        return zoo.run_control(examples=examples, steps=steps, seed=seed, out_dir=out_dir)
    (mutant,) = [m for m in zoo.MUTANTS + zoo.DIRECTED if m.name == name]
    return zoo.run_mutant(mutant, examples=examples, steps=steps, seed=seed, out_dir=out_dir)


def run_selftest(
    names: Optional[list[str]] = None,
    *,
    examples: int = EXAMPLES,
    steps: int = STEPS,
    seed: int = SEED,
    out_dir: Optional[Path] = None,
    jobs: int = 2,
    directed: bool = True,
    on_verdict: Optional[Callable[[Verdict], None]] = None,
) -> SelftestReport:
    """Certify every mutant (or those named) and the control, each in a fresh interpreter, `jobs` at a time.

    `on_verdict(verdict)` is called as each mutant's verdict is known, in zoo order. Unknown names raise
    ValueError: a selftest of nothing proves nothing.
    """
    known = {m.name for m in zoo.MUTANTS + zoo.DIRECTED}
    unknown = sorted(set(names or ()) - known)
    if unknown:
        raise ValueError(f"no mutant named {', '.join(unknown)}; the zoo has {', '.join(sorted(known))}")
    generated = [m for m in zoo.MUTANTS if not names or m.name in names]
    chosen = [m for m in zoo.DIRECTED if directed and (not names or m.name in names)]
    if not generated and not chosen:
        raise ValueError("no mutant to run")
    report = SelftestReport()
    work = [m.name for m in generated + chosen] + [""]
    # spawn, one task per worker: every mutant starts in a fresh interpreter (Python 3.10 has no
    # ProcessPoolExecutor(max_tasks_per_child=...), so multiprocessing's Pool).
    with multiprocessing.get_context("spawn").Pool(max(1, jobs), maxtasksperchild=1) as pool:
        pending = [pool.apply_async(_run, (name, examples, steps, seed, out_dir)) for name in work]
        for mutant, result in zip(generated + chosen, pending):
            is_directed = mutant in chosen
            v = _verdict(mutant, result.get(), is_directed)
            if is_directed:
                try:
                    v.by_trace = " ".join(sorted({x.inv for x in directed_failure(mutant.name).violations}))
                except AssertionError as err:
                    v.by_trace, v.trace_note = "", str(err).splitlines()[0]
                report.directed.append(v)
            else:
                report.generated.append(v)
            if on_verdict is not None:
                on_verdict(v)
        control = pending[-1].get()
    report.control_passed = control.passed
    report.control_failure = next((c.failure or "" for c in control.cells if not c.passed), "")
    return report
