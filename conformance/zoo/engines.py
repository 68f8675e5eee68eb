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
- **INV-LINK-7's reset clause**: the request path sends no flush, so the engine never resets its linker.
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
from kvcert.spec.ops import LinkerFault, Op, Step, Submit
from kvcert.spec.types import CacheConfig

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
    "engine_linker": "kvcert.conformance.engine_linker",
    "engine_decode": "kvcert.conformance.engine_decode",
}
"""Engine modules a mutant may edit -> their import name. Each defines `factory` (and `factory_gpu`)."""

EXAMPLES, STEPS, SEED = 40, 50, 0
"""The engine zoo's budget per cell: `kvcert engine-zoo`'s defaults, and what tests/test_engine_zoo.py runs."""


@dataclass(frozen=True)
class DirectedTrace:
    """Request-path ops (`kvcert.spec.ops.REQUEST_OPS`) that the unmodified engine passes and the mutant fails under
    one of its rules; the harness quiesces after the last op."""

    config: CacheConfig
    ops: tuple[Op, ...]
    why: str = ""


@dataclass(frozen=True)
class EngineMutant:
    name: str
    doc: str
    """The real bug class it reproduces."""
    edits: tuple[tuple[str, str], ...]
    """(find, replace) pairs; each `find` occurs exactly once in the module's source."""
    rules: frozenset[str]
    """The rules expected to catch it: a kill under any other rule is reported, not counted."""
    module: str = "engine_linker"
    trace: Optional[DirectedTrace] = None
    """For a bug class generation reaches at some seeds only, or not at all, at the zoo's budget: the trace that
    kills it (generation is still tried and reported)."""
    page_sizes: tuple[int, ...] = (1, 4)
    policies: tuple[str, ...] = ("lru",)
    budget: int = 1
    """Examples per cell, as a multiple of the zoo's (the control runs the largest)."""
    factory: str = "factory"
    """The module's factory it runs: `factory` (over the reference model) or `factory_gpu` (over kvcert.gpu)."""
    profile: Optional[str] = None
    """The profile it is held to instead of the engine's own (SPEC.md §6); the control is held to it too."""


# ------------------------------------------------------------------ directed traces

_CONFIG = CacheConfig(page_size=4, capacity=96, host_capacity=0)
_PROMPT = tuple([1] * 4 + [2] * 4 + [3] * 4 + [0] * 4 + [1] * 4)
_FLOODS = (tuple([2] * 44), tuple([3] * 44), tuple([0, 0, 0, 1] * 11))
"""Three long prompts that leave nothing of `_PROMPT` on the 96-slot device (tests/_linker.py's conversation)."""


def _run(request: str, prompt: tuple[int, ...], steps: int = 12) -> tuple[Op, ...]:
    return (Submit(request, None, prompt, 0, 2), *[Step()] * steps)


_EVICTED: tuple[Op, ...] = _run("r00", _PROMPT) + sum((_run(f"r0{i + 1}", f) for i, f in enumerate(_FLOODS)), ())
"""`_PROMPT` computed, offloaded and then evicted from the device: its pages are the store's only."""

_SMALL = CacheConfig(page_size=4, capacity=32, host_capacity=0)
_TWIN = tuple([5] * 8 + [6])
"""Two pages and a token: a prompt two requests send at once."""

# ------------------------------------------------------------------ the table

_ADMITTED_LOAD = (
    "        if n and self.store.load(r.id, tail[:n], r.row[r.computed : r.computed + n * self.ps]):\n"
    "            self.loading[r.id] = n * self.ps\n"
)

ENGINE_MUTANTS: tuple[EngineMutant, ...] = (
    EngineMutant(
        "load_past_lookup",
        "loads one page past the longest prefix the lookup reported (the page it hopes the store fetches meanwhile)",
        (
            (
                _ADMITTED_LOAD,
                "        if n and n < len(tail) and self.store.load(r.id, tail[: n + 1], "
                "r.row[r.computed : r.computed + (n + 1) * self.ps]):\n"
                "            self.loading[r.id] = n * self.ps\n",
            ),
        ),
        frozenset({"INV-LINK-1"}),
    ),
    EngineMutant(
        "load_into_tree_slots",
        "a load's destination ignores the device-cached prefix: it lands at the row's start, in the tree's slots",
        (
            (
                "r.row[r.computed : r.computed + n * self.ps]):",
                "r.row[: n * self.ps]):",
            ),
        ),
        frozenset({"INV-LINK-2"}),
        trace=DirectedTrace(
            _CONFIG,
            _EVICTED
            + _run("r04", _PROMPT[:8] + (5, 5))  # loads _PROMPT's first two pages back; they are cached again
            + (Submit("r99", None, _PROMPT + (2, 2, 2, 2), 0, 2),),  # a device prefix, then the store's pages
            "a store hit behind a device prefix: generation leaves just a prompt's head on the device at some seeds only",
        ),
        factory="factory_gpu",  # the reference model refuses a write into slots it did not lend (INV-RP-1)
    ),
    EngineMutant(
        "second_load",
        "the admission hook runs twice for a request (a retry after a lookup): a second load queued beside the first",
        (
            (
                "        hits = self.store.lookup(r.id, tail)\n        n = max(hits, default=0)\n" + _ADMITTED_LOAD,
                "        for _ in range(2):\n"
                "            hits = self.store.lookup(r.id, tail)\n"
                "            n = max(hits, default=0)\n"
                "            if n and self.store.load(r.id, tail[:n], r.row[r.computed : r.computed + n * self.ps]):\n"
                "                self.loading[r.id] = n * self.ps\n",
            ),
        ),
        frozenset({"INV-LINK-2"}),
    ),
    EngineMutant(
        "batch_never_finished",
        "only the error path finishes (releases) a batch: one that landed is read off its counter and never finished",
        (
            (
                "        landed = self.store.finish(batch)\n",
                "        landed = self.store.batches.get(batch, True) or self.store.finish(batch)\n",
            ),
        ),
        frozenset({"INV-LINK-3", "INV-LINK-7"}),
    ),
    EngineMutant(
        "batch_finished_per_request",
        "a batch is finished once per request in it instead of once",
        (
            (
                "        landed = self.store.finish(batch)\n",
                "        landed = all([self.store.finish(batch) for _ in self.loading])\n",
            ),
        ),
        frozenset({"INV-LINK-3"}),
        trace=DirectedTrace(
            _CONFIG,
            _EVICTED
            + (Submit("r98", None, _PROMPT + (2, 2, 2, 2), 0, 2), Submit("r99", None, _PROMPT + (3, 3, 3, 3), 0, 2))
            + (Step(),),
            "two loads in one batch (two requests admitted in one step, both hitting the store): not generated at this "
            "budget",
        ),
    ),
    EngineMutant(
        "serve_failed_load",
        "a failed batch is taken as landed (the counter's presence is checked, not its value): the request computes "
        "past the torn bytes",
        (("        landed = self.store.finish(batch)\n", "        landed = self.store.finish(batch) is not None\n"),),
        frozenset({"INV-LINK-4"}),
        trace=DirectedTrace(
            _CONFIG,
            _EVICTED + (LinkerFault("load_fail"), Submit("r99", None, _PROMPT + (2, 2, 2, 2), 0, 2)),
            "a store hit right after a `load_fail`: generation reaches it at some seeds only",
        ),
        profile="sglang-0.5.23",  # aborts_failed_loads: INV-LINK-4 judges the request itself (core sees INV-KV-1)
    ),
    EngineMutant(
        "offload_unpinned",
        "the offload's node is unlocked once the copy is queued, not once its result is taken",
        (
            (
                "        self.offloads.append((got.node, picked))\n",
                "        self.cache.dec_lock_ref(got.node)\n        self.offloads.append((got.node, picked))\n",
            ),
            ("            self.cache.dec_lock_ref(node)\n", ""),
        ),
        frozenset({"INV-LINK-5", "INV-HOST-6"}),  # HOST-6 sees the unlocked pending copy before a byte changes
    ),
    EngineMutant(
        "offload_from_row",
        "an offload copies from the request's row, whose pages the tree already held were freed as duplicates at "
        "insert: the copy reads slots reused meanwhile",
        (
            (
                "        slots = [s for i in new for s in got.slots[i * self.ps : (i + 1) * self.ps]]\n",
                "        slots = [s for i in new for s in r.row[i * self.ps : (i + 1) * self.ps]]\n",
            ),
        ),
        frozenset({"INV-LINK-5"}),
        trace=DirectedTrace(
            _SMALL,
            (
                LinkerFault("offload_refuse"),  # the first twin's offload is refused: its pages stay unstored
                LinkerFault("offload_hold"),  # the second twin's (from freed slots) stays in flight 3 steps
                Submit("a", None, _TWIN, 0, 1),
                Submit("b", None, _TWIN, 0, 1),
                Step(),
                Submit("c", None, tuple([7] * 16), 0, 1),  # reuses the freed slots while the copy is in flight
                *[Step()] * 4,
            ),
            "twins finishing together, the first one's offload refused, the second's held: not generated at this "
            "budget",
        ),
    ),
    EngineMutant(
        "stored_on_failure",
        "a node is marked stored whatever its offload's result",
        (
            (
                "            if self.store.pop():\n                self.stored",
                "            self.store.pop()\n            self.stored",
            ),
        ),
        frozenset({"INV-LINK-6"}),
        page_sizes=(4,),
    ),
    EngineMutant(
        "results_out_of_order",
        "the engine's offload bookkeeping is a stack: the oldest result is credited to the newest offload",
        (("            node, keys = self.offloads.pop(0)\n", "            node, keys = self.offloads.pop()\n"),),
        frozenset({"INV-LINK-6"}),
        trace=DirectedTrace(
            _SMALL,
            (
                LinkerFault("offload_fail"),
                Submit("a", None, _TWIN, 0, 1),
                Submit("b", None, tuple([6] * 8 + [5]), 0, 1),
                *[Step()] * 3,
            ),
            "two offloads taken in one step, the older one failed: generation reaches it at some seeds only",
        ),
    ),
    EngineMutant(
        "takes_unpublished_results",
        "a result is taken for every offload in flight, not only for those published",
        (("        for _ in range(self.store.completed()):\n", "        for _ in range(len(self.offloads)):\n"),),
        frozenset({"INV-LINK-6"}),
    ),
    EngineMutant(
        "load_left_queued",
        "a one-page hit is recomputed instead, dropped from the engine's books without cancelling the queued load, "
        "and a batch is started only when the engine waits for loads of its own",
        (
            (_ADMITTED_LOAD, _ADMITTED_LOAD.replace("):\n", ") and n > 1:\n")),
            ("        if not self.loading:\n            self.store.start()\n", "        if not self.loading:\n"),
        ),
        frozenset({"INV-LINK-7", "INV-LINK-3"}),
    ),
    EngineMutant(
        "newest_result_left",
        "an off-by-one in the take loop: the newest published result waits for the next one, its node locked, and "
        "the last offload's is never taken",
        (
            (
                "        for _ in range(self.store.completed()):\n",
                "        for _ in range(self.store.completed() - 1):\n",
            ),
        ),
        frozenset({"INV-LINK-7", "INV-LIVE-1"}),
    ),
    EngineMutant(
        "dest_one_page_early",
        "the destination starts a page early, on the promised prefix's last page: the prefill overwrites KV the tree "
        "holds",
        (
            (
                "            dest = own[: len(r.tokens) - got.length]\n",
                "            dest = (list(got.slots[-self.ps :]) + own)[: len(r.tokens) - got.length]\n",
            ),
        ),
        frozenset({"INV-DEC-1"}),
        module="engine_decode",
    ),
    EngineMutant(
        "prefix_lock_on_root",
        "the promised prefix's lock is taken on the wrong node (the root): eviction may take tokens the prefill skips",
        (
            (
                "            self.cache.inc_lock_ref(got.node)\n            need = final - got.length\n",
                "            held = self.cache.snapshot().root\n            self.cache.inc_lock_ref(held)\n"
                "            need = final - got.length\n",
            ),
            (
                "                self.cache.dec_lock_ref(got.node)\n                return\n            own",
                "                self.cache.dec_lock_ref(held)\n                return\n            own",
            ),
            (
                "r.row, r.protected, r.node = list(got.slots) + own, got.length, got.node",
                "r.row, r.protected, r.node = list(got.slots) + own, got.length, held",
            ),
        ),
        frozenset({"INV-DEC-2", "INV-DEC-3"}),
        module="engine_decode",
    ),
    EngineMutant(
        "lock_gap_in_transfer",
        "the prefix lock is dropped once the promise is sent and taken again at the commit (a lock handoff with a gap)",
        (
            (
                "            self.transfers.append(_Transfer(r, got.length, dest, self.steps))\n",
                "            self.transfers.append(_Transfer(r, got.length, dest, self.steps))\n"
                "            self.cache.dec_lock_ref(got.node)\n",
            ),
            (
                "            _, cached, locked = self._facts()\n            self.ledger.commit(",
                "            self.cache.inc_lock_ref(r.node)\n            _, cached, locked = self._facts()\n"
                "            self.ledger.commit(",
            ),
        ),
        frozenset({"INV-DEC-3"}),
        module="engine_decode",
    ),
    EngineMutant(
        "dest_out_of_row_order",
        "the destination pages are sent sorted otherwise than the row reads them (an allocator that sorts what it "
        "hands out): the prefill's bytes land out of order",
        (
            (
                "            dest = own[: len(r.tokens) - got.length]\n",
                "            dest = sorted(own[: len(r.tokens) - got.length], reverse=True)\n",
            ),
        ),
        frozenset({"INV-DEC-4"}),
        module="engine_decode",
    ),
    EngineMutant(
        "failed_transfer_cached",
        "a transfer the peer failed is finished as if it landed: its torn destination is inserted into the tree",
        (
            (
                '                self._end(r, "aborted")\n                self.ledger.fail(',
                '                r.computed = len(r.tokens)\n                self._end(r, "finished")\n'
                "                self.ledger.fail(",
            ),
        ),
        frozenset({"INV-DEC-5"}),
        module="engine_decode",
    ),
    EngineMutant(
        "never_fit_waits",
        "no check at arrival: a request that can never fit waits at the head of the queue, and starves every request "
        "behind it",
        (
            (
                "            if pages.page_ceil(len(tokens) + output, self.ps) > self.config.capacity:\n",
                "            if False:\n",
            ),
        ),
        frozenset({"INV-DEC-6"}),
        module="engine_decode",
    ),
)


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
