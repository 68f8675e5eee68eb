"""Certification: run the state machine for every (page size, policy) cell a backend declares.

A cell fails at its first broken rule; the shrunk trace is saved as JSON and
replayed once more on a fresh backend, so a reported counterexample is known to
reproduce before anyone reads it.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, cast

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.errors import Flaky

from kvcert.conformance.aliases import canonical
from kvcert.conformance.backend import Factory, capabilities_of
from kvcert.conformance.certification import fixes
from kvcert.conformance.certification.certificate import CellResult, Certificate, FindingReplay, config_name
from kvcert.conformance.certification.cluster import map_ordered
from kvcert.conformance.certification.known import replay_findings
from kvcert.conformance.certification.replay import Replay, replay, replay_failure
from kvcert.conformance.certification.scope import scope_gaps
from kvcert.conformance.certification.walk import certify_walk
from kvcert.conformance.generation import interrupt
from kvcert.conformance.generation.determinism import fixed_generation
from kvcert.conformance.generation.fuzz import run_random
from kvcert.conformance.generation.machine import CacheMachine
from kvcert.conformance.generation.request_machine import RequestMachine, request_cells
from kvcert.conformance.generation.runner import run_machine
from kvcert.conformance.generation.shrink import shrink
from kvcert.conformance.harness.driver import ConformanceFailure, Harness
from kvcert.spec import profiles
from kvcert.spec.ops import Op, Trace, op_to_json
from kvcert.spec.types import (
    ONE_CLASS_THRESHOLD,
    POLICY_PARAMETERS,
    CacheConfig,
    Capabilities,
    InvalidPolicyConfig,
)

CAPACITY_PAGES = 16
"""Pool size per cell, in pages: small, so eviction and exhaustion happen often."""
HOST_PAGES = 24
"""Host pool size per host-tier cell, in pages: larger than the device, small enough to fill."""
HOST_CELL_DEVICE_PAGES = 6
"""Device pool of a host-tier cell, in pages: tight, so demotion, load-back and its refusal are common."""


STORAGE_PAGE_SIZES = (1, 4, 16)
"""Page sizes of the storage cells (write policy x prefetch stop policy x page size)."""
STORAGE_HOST_PAGES = 6
"""Host pool of a storage cell, in pages: small, so pages live in storage alone and prefetch finds them."""


def _tier(config: CacheConfig) -> str:
    if not config.host_capacity:
        return ""
    return f"{config.write_policy}+{config.prefetch_policy}" if config.prefetch_policy else config.write_policy


def load_factory(target: str) -> Factory:
    """Import `module:attribute` (an old module name through `conformance.aliases`) and check it declares
    capabilities."""
    module, _, attr = canonical(target).partition(":")
    if not attr:
        raise ValueError(f"target must look like module:factory, got {target!r}")
    obj = getattr(importlib.import_module(module), attr)
    capabilities_of(obj)
    return obj


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


DRIVERS = ("hypothesis", "random")


def _settings(examples: int, steps: int) -> settings:
    """Hypothesis's settings for one cell (the random driver takes none)."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
        report_multiple_bugs=False,
        phases=(
            Phase.explicit,
            Phase.reuse,
            Phase.generate,
        ),  # shrinking happens on the trace: conformance/generation/shrink.py
    )


def run_cell(
    factory: Factory,
    capabilities: Capabilities,
    config: CacheConfig,
    *,
    examples: int,
    steps: int,
    seed: int,
    target: str,
    out_dir: Path,
    bad_input: Optional[bool] = None,
    driver: str = "hypothesis",
    seconds: Optional[float] = None,
    corpus: tuple[str, ...] = (),
    on_example: Optional[Callable[[CacheConfig, int, int], None]] = None,
) -> CellResult:
    """One cell: first every `corpus` trace (JSON text) recorded on this config, replayed on a fresh backend (the
    first that fails is the cell's failure, as found); then examples of the machine under `driver`
    ("hypothesis", or "random": `conformance.generation.fuzz`'s seeded walk, for `seconds` when given, else `examples`). A
    failure of the walk is shrunk, replayed and saved either way."""
    if driver not in DRIVERS:
        raise ValueError(f"driver {driver!r}: one of {', '.join(DRIVERS)}")
    machine = (RequestMachine if capabilities.kind == "request-path" else CacheMachine).bind(
        factory, config, capabilities, bad_input
    )
    if on_example is not None:
        machine.stats.on_example = lambda stats: on_example(config, stats.examples, stats.steps)
    start = time.perf_counter()
    result = CellResult(config.page_size, config.policy, True, 0, 0, 0.0, write_policy=_tier(config))
    tier = f"-{_tier(config)}" if config.host_capacity else ""
    name = f"{_slug(target)}-ps{config.page_size}-{config.policy}{tier}"
    for text in corpus:
        known = Trace.from_json(text)
        if known.config != config:
            continue
        result.corpus_replayed += 1
        failure = replay_failure(factory, capabilities, config, list(known.ops))
        if failure is not None:
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            _failed(result, config, capabilities, target, out_dir / f"{name}-corpus-{digest}.json", known.ops, failure)
            result.from_corpus = True
            result.seconds = time.perf_counter() - start
            return result
    try:
        if driver == "random":
            run_random(machine, steps, seed, examples=None if seconds is not None else examples, seconds=seconds)
        elif examples < 1:
            pass  # Hypothesis runs at least one example: a budget of none runs nothing (and passes nothing)
        else:
            with fixed_generation():
                run_machine(machine, _settings(examples, steps), seed)
    except ConformanceFailure as original:
        shrunk = shrink(machine.last_trace(), guarded(factory, capabilities, config, bad_input), config.page_size)
        how = "-fuzz" if driver == "random" else ""
        replayed = replay_failure(factory, capabilities, config, shrunk.ops)
        path = out_dir / f"{name}{how}-seed{seed}.json"
        _failed(result, config, capabilities, target, path, shrunk.ops, replayed, original)
        result.shrink_note = shrunk.note
    except Flaky as flaky:
        # Hypothesis replayed the failing example and it passed: same ops, different outcome.
        seen = [e for e in getattr(flaky, "exceptions", ()) if isinstance(e, ConformanceFailure)]
        result.passed, result.reproduced = False, False
        result.failure = (
            "INV-DET-1: the backend is not deterministic under a fixed trace (the failing example passed when "
            f"Hypothesis replayed it); the run reported:\n{seen[0] if seen else str(flaky).splitlines()[0]}"
        )
        result.failures = [
            {"invariant": "INV-DET-1", "step": None, "op": None, "message": result.failure, "trace": None}
        ]
    result.seconds = time.perf_counter() - start
    result.examples, result.steps = machine.stats.examples, machine.stats.steps
    result.ops = dict(sorted(machine.stats.ops.items()))
    result.digest = machine.stats.digest.hexdigest()
    if result.passed and result.steps == 0:
        budget = f"{seconds:g} s" if seconds is not None else f"{examples} examples"
        result.passed = False
        result.failure = (
            f"{NO_STEPS}: the cell ran no step within its budget ({budget}); a cell that ran nothing certifies nothing"
        )
        result.failures = [{"invariant": NO_STEPS, "step": None, "op": None, "message": result.failure, "trace": None}]
    return result


NO_STEPS = "NO-STEPS"
"""A cell's verdict when its budget let no step run: not passed, whatever else it did."""


def _failed(
    result: CellResult,
    config: CacheConfig,
    capabilities: Capabilities,
    target: str,
    path: Path,
    ops: Sequence[Op],
    failure: Optional[ConformanceFailure],
    original: Optional[ConformanceFailure] = None,
) -> None:
    """Record a failing cell: `ops` saved as a trace at `path`, and `failure`, their replay on a fresh backend (None
    when that replay passed although the run that found them, `original`, failed: not deterministic)."""
    if failure is None:
        report = (
            f"INV-DET-1: the failure did not replay on a fresh backend from the same {len(ops)} ops; "
            f"the run reported:\n{original}"
        )
    else:
        report = str(failure)
    note = report.splitlines()[-1].strip()
    trace = Trace(
        config=config, ops=tuple(ops), target=target, note=note, profile=capabilities.profile, fixes=fixes.active()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    result.trace_json = trace.to_json()
    path.write_text(result.trace_json)
    result.passed, result.failure, result.trace_path, result.trace_len = False, report, str(path), len(ops)
    result.reproduced = failure is not None
    result.failures = (
        [
            {
                "invariant": v.inv,
                "step": failure.step,
                "op": None if failure.op is None else op_to_json(failure.op),
                "message": v.message,
                "trace": str(path),
            }
            for v in failure.violations
        ]
        if failure is not None
        else [{"invariant": "INV-DET-1", "step": None, "op": None, "message": report, "trace": str(path)}]
    )


def core_verdict(trace: Trace, ignore: frozenset[str] = frozenset()) -> tuple[set[str], Optional[int]]:
    """The rules `trace` breaks on its target under the core, and the step, with the `ignore`d checkers dropped:
    the ablation that shows a rule alone kills a mutant (SPEC.md §6.4). The initial state is judged too."""
    make = load_factory(trace.target)
    caps = replace(capabilities_of(make), profile="core")
    h: Optional[Harness] = None
    try:
        h = Harness(make(trace.config), trace.config, caps, ignore=ignore)
        for op in trace.ops:
            h.step(op)
        h.quiesce()
    except ConformanceFailure as failure:
        return {v.inv for v in failure.violations}, failure.step
    finally:
        if h is not None:
            h.close()
    return set(), None


def _tiered(page_size: int, policy: str, write_policy: str, prefetch_policy: str = "") -> CacheConfig:
    """A host-tier cell, or with `prefetch_policy` a storage cell (whose host pool is smaller)."""
    host_pages = STORAGE_HOST_PAGES if prefetch_policy else HOST_PAGES
    return CacheConfig(
        page_size=page_size,
        policy=policy,
        capacity=HOST_CELL_DEVICE_PAGES * page_size,
        host_capacity=host_pages * page_size,
        write_policy=write_policy,
        load_back_threshold=page_size,
        prefetch_policy=prefetch_policy,
    )


def guarded(
    factory: Factory,
    capabilities: Capabilities,
    config: CacheConfig,
    bad_input: Optional[bool] = None,
    replayer: Callable[[Factory, Capabilities, CacheConfig, Sequence[Op]], Replay] = replay,
) -> Callable[[list[Op]], Optional[list[str]]]:
    """The shrinker's verdict: the rules a candidate breaks on a fresh backend, or None. For a backend the suite
    sends only valid traffic (not `strict_input`, bad input not forced), a candidate that fails only after an op
    the oracle rejected as bad input does not count: shrinking must not turn a failure on valid traffic into one
    on a caller bug (an unlock with no lock). The oracle judges in the replay itself, steered to this backend
    (its copies cut as the backend cut them), so the backend's own numbering of copies is valid traffic."""
    valid_only = not capabilities.strict_input and not bad_input

    def judge(ops: list[Op]) -> Optional[list[str]]:
        got = replayer(factory, capabilities, config, ops)
        if got.failure is None or (valid_only and not got.valid_failure()):
            return None
        return [v.inv for v in got.failure.violations]

    return judge


def cells_for(
    capabilities: Capabilities,
    page_sizes: Optional[Iterable[int]],
    policies: Optional[Iterable[str]],
    bad_input: Optional[bool] = None,
    write_policies: Optional[Iterable[str]] = None,
    device_cells: bool = True,
    prefetch_policies: Optional[Iterable[str]] = None,
    host_cells: bool = True,
    policy_config: Optional[dict[str, int]] = None,
) -> tuple[list[CacheConfig], list[str]]:
    """The cells to run, and what was asked for but not declared.

    Device-only cells: every page size x policy. Host-tier cells (backends that declare
    write policies): every page size x write policy, under LRU unless policies are named.
    Storage cells (backends that declare prefetch policies): write policy x prefetch policy x
    page size in STORAGE_PAGE_SIZES, faults on. `policy_config` (SGLang's `--radix-eviction-policy-config`) goes
    to the cells whose policy takes its keys; `InvalidPolicyConfig` if none does, or its values are refused.
    """
    want_ps = [p for p in (page_sizes or capabilities.page_sizes)]
    want_pol = list(policies) if policies else list(capabilities.policies)
    want_wp = list(capabilities.write_policies if write_policies is None else write_policies)
    skipped = [f"page_size={p}: not declared" for p in want_ps if p not in capabilities.page_sizes]
    skipped += [f"policy={p}: not declared" for p in want_pol if p not in capabilities.policies]
    skipped += [f"write_policy={w}: not declared" for w in want_wp if w not in capabilities.write_policies]
    sizes = [p for p in want_ps if p in capabilities.page_sizes]
    pols = [p for p in want_pol if p in capabilities.policies]
    host_pols = pols if policies else [p for p in pols if p == "lru"] or pols[:1]
    configs = [
        CacheConfig(page_size=ps, policy=pol, capacity=CAPACITY_PAGES * ps)
        for ps in sizes
        for pol in pols
        if device_cells
    ]
    configs += [
        _tiered(ps, pol, wp)
        for ps in sizes
        for wp in want_wp
        if wp in capabilities.write_policies and host_cells
        for pol in host_pols
    ]
    want_pf = list(capabilities.prefetch_policies if prefetch_policies is None else prefetch_policies)
    skipped += [f"prefetch_policy={p}: not declared" for p in want_pf if p not in capabilities.prefetch_policies]
    configs += [
        _tiered(ps, pol, wp, pf)
        for ps in sizes
        if ps in STORAGE_PAGE_SIZES or page_sizes
        for wp in want_wp
        if wp in capabilities.write_policies
        for pf in want_pf
        if pf in capabilities.prefetch_policies
        for pol in host_pols
    ]
    if policy_config:
        takes = [c for c in configs if set(policy_config) <= set(POLICY_PARAMETERS.get(c.policy, ()))]
        if not takes:
            raise InvalidPolicyConfig(f"no cell's policy takes {sorted(policy_config)} (POLICY_PARAMETERS)")
        configs = [replace(c, policy_config=tuple(policy_config.items())) if c in takes else c for c in configs]
    if capabilities.priority_refs and "high" not in capabilities.priority_parts:  # one ref class: every session low
        configs = [replace(c, high_priority_threshold=ONE_CLASS_THRESHOLD) for c in configs]
    if capabilities.kind == "request-path":
        storage = [config_name(c) for c in configs if c.prefetch_policy]
        skipped += [f"{name}: no storage tier on a request path yet" for name in storage]
        configs = request_cells(configs, capabilities)
    if bad_input is False and capabilities.strict_input:
        skipped.append("bad-input rules: switched off (--no-bad-input)")
    elif bad_input and not capabilities.strict_input:
        skipped.append("bad-input rules forced on a backend that does not declare strict_input: failures are advisory")
    return configs, skipped


"""Windows only a storage cell can enter: store copies, and a host small and pinned enough to fill."""
"""Race window -> (what it is, the cells that can enter it): a run of those cells that never did says so."""


def certify(
    target: str,
    *,
    factory: Optional[Factory] = None,
    examples: int = 200,
    steps: int = 50,
    seed: int = 0,
    page_sizes: Optional[Iterable[int]] = None,
    policies: Optional[Iterable[str]] = None,
    out_dir: Path = Path("kvcert-failures"),
    on_cell: Optional[Callable[[CellResult], None]] = None,
    bad_input: Optional[bool] = None,
    fail_fast: bool = False,
    write_policies: Optional[Iterable[str]] = None,
    device_cells: bool = True,
    prefetch_policies: Optional[Iterable[str]] = None,
    host_cells: bool = True,
    profile: Optional[str] = None,
    driver: str = "hypothesis",
    seconds: Optional[float] = None,
    jobs: int = 1,
    on_progress: Optional[Callable[[Certificate], None]] = None,
    ray: Optional[str] = None,
    corpus: Optional[Path] = None,
    on_example: Optional[Callable[[CacheConfig, int, int], None]] = None,
    policy_config: Optional[dict[str, int]] = None,
    with_fixes: Sequence[str] = (),
) -> Certificate:
    """Run every cell; the certificate passes only if every cell does. `fail_fast` stops at the first failing cell.
    `profile` holds the backend to that profile instead of the one it declares (SPEC.md §6). `driver` "random"
    walks each cell with `conformance.generation.fuzz` instead of Hypothesis; `seconds` (random only) is split evenly
    across the cells and replaces `examples` as the budget. `jobs` > 1 runs cells in that many spawned interpreters,
    `ray` (an address, or "local") as tasks on a Ray cluster (`conformance.certification.cluster`); either needs a target loaded
    by name (each worker imports it), and a cell's result does not depend on where it ran, so the certificate is
    the same. `corpus` is a shared failure corpus, a directory of traces: every cell replays those recorded on its
    config before its walk, and each new failure's trace is added to it. `on_progress(cert)` sees the certificate
    after each cell (an interrupted run keeps what it did); `on_example(config, examples, steps)` sees each example
    start inside a cell, in a run in this process (workers report per cell only). Under `interrupt.sigint_deferred()`
    (the CLI) Ctrl-C returns the certificate so far, `interrupted`; elsewhere KeyboardInterrupt propagates.
    `with_fixes` names logged findings of the target's engine whose minimal fixes are applied to the engine first
    (`fixes`, in every worker too): the walk goes past those defects, and the certificate lists each under NOT
    CHECKED; their traces are still replayed, and one that still breaks a rule means the fix did not hold."""
    given_factory = factory is not None
    factory = factory or load_factory(target)
    caps = capabilities_of(factory)
    # The fixes are put back on return: the engine in this process is the released one again.
    with fixes.applied(with_fixes, target) as patched:
        if patched:
            caps = replace(caps, deviations=caps.deviations + tuple(f.describe() for f in patched))
        if profile is not None:
            caps = replace(caps, profile=profiles.profile(profile).name)
        if hasattr(factory, "walk"):  # an API-level target with its own operations (a block pool, an offload tier)
            return certify_walk(
                target, factory, caps, examples=examples, steps=steps, seed=seed, out_dir=out_dir, on_cell=on_cell
            )
        configs, skipped = cells_for(
            caps,
            page_sizes,
            policies,
            bad_input,
            write_policies,
            device_cells,
            prefetch_policies,
            host_cells,
            policy_config,
        )
        cert = Certificate(
            target,
            caps.name,
            seed,
            examples,
            steps,
            caps.strict_input,
            caps.profile,
            skipped=skipped,
            planned=[config_name(c) for c in configs],
            adapter_notes=list(caps.notes),
            kind=caps.kind,
            with_fixes=[f.finding for f in patched],
        )
        cert.findings = [
            FindingReplay(j.finding.id, j.trace, j.reproduced, list(j.rules), j.summary)
            for j in replay_findings(target, factory, caps)
        ]
        cert.not_checked = scope_gaps(caps, cert.cells, bad_input)
        if on_progress is not None:  # the findings' verdict is known before any cell runs
            on_progress(cert)
        if seconds is not None and driver != "random":
            raise ValueError("a time budget (seconds) is the random driver's; Hypothesis runs a number of examples")
        elsewhere = ray is not None or (jobs > 1 and len(configs) > 1)
        if elsewhere and given_factory:
            raise ValueError(
                "jobs > 1 or ray needs a target loaded by name (each worker imports it), not a factory object"
            )
        # a time budget is wall time: `jobs` workers spend it on `jobs` cells at once (a Ray run's budget is per cell)
        workers = len(configs) if ray is not None else min(max(1, jobs), len(configs))
        per_cell = seconds * workers / max(1, len(configs)) if seconds is not None else None
        run = dict(
            examples=examples,
            steps=steps,
            seed=seed,
            target=target,
            out_dir=out_dir.resolve() if elsewhere else out_dir,  # a worker's working directory is not the caller's
            bad_input=bad_input,
            driver=driver,
            seconds=per_cell,
            corpus=load_corpus(corpus) if corpus is not None else (),
        )
        cells: Iterator[CellResult]
        if elsewhere:
            fixed = tuple(with_fixes)
            cells = map_ordered(
                _cell_by_name, [((caps.profile, config, fixed), run) for config in configs], jobs=jobs, ray=ray
            )
        else:
            cells = (run_cell(factory, caps, config, on_example=on_example, **run) for config in configs)  # type: ignore[arg-type,call-arg]

        def progress(cert: Certificate) -> None:  # what the cells so far leave unchecked, in every rewrite
            cert.not_checked = scope_gaps(caps, cert.cells, bad_input)
            if on_progress is not None:
                on_progress(cert)

        try:
            with closing(cast(Generator[CellResult, None, None], cells)):  # a stop ends the workers still running
                _collect(cert, cells, on_cell, progress, fail_fast, corpus, remote=ray is not None)
        except KeyboardInterrupt:
            if not interrupt.interrupted():  # not under the CLI's `sigint_deferred`: a caller's own Ctrl-C goes on up
                raise
            cert.interrupted = True  # the running cell is dropped: the certificate is not complete, so not CERTIFIED
        cert.not_checked = scope_gaps(caps, cert.cells, bad_input)
        return cert


class CorpusError(ValueError):
    """A file of the failure corpus is not a kvcert trace."""


def load_corpus(directory: Path) -> tuple[str, ...]:
    """Every trace of a failure corpus (`*.json` in `directory`, in name order) as JSON text, each parsed once here
    so a bad file stops the run before any cell starts. A directory that does not exist yet is an empty corpus."""
    if not directory.exists():
        return ()
    if not directory.is_dir():
        raise CorpusError(f"{directory}: the failure corpus is a directory of traces")
    texts = []
    for path in sorted(directory.glob("*.json")):
        text = path.read_text()
        try:
            Trace.from_json(text)
        except (ValueError, KeyError, TypeError) as e:
            raise CorpusError(f"{path}: not a kvcert trace ({type(e).__name__}: {e})") from e
        texts.append(text)
    return tuple(texts)


def _collect(
    cert: Certificate,
    cells: Iterable[CellResult],
    on_cell: Optional[Callable[[CellResult], None]],
    on_progress: Optional[Callable[[Certificate], None]],
    fail_fast: bool,
    corpus: Optional[Path] = None,
    remote: bool = False,
) -> None:
    """Cells into the certificate in cell order, reporting each; stop at the first failure with `fail_fast`. A
    failing cell's trace is added to the `corpus`, and with `remote` (Ray: its worker may have saved it on
    another machine) written here too."""
    for cell in cells:
        cert.cells.append(cell)
        if cell.trace_path and cell.trace_json is not None:
            path = Path(cell.trace_path)
            if remote:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(cell.trace_json)
            if corpus is not None and not cell.from_corpus:
                corpus.mkdir(parents=True, exist_ok=True)
                (corpus / path.name).write_text(cell.trace_json)
        if on_cell is not None:
            on_cell(cell)
        if on_progress is not None:
            on_progress(cert)
        if fail_fast and not cell.passed:
            break
        interrupt.check()  # a Ctrl-C while workers ran cells elsewhere: stop before the next


def _cell_by_name(profile: str, config: CacheConfig, with_fixes: tuple[str, ...], **run: Any) -> CellResult:
    """One cell in a worker: the target imported by name, held to `profile` and with the fixes the parent applied."""
    factory = load_factory(run["target"])
    fixes.apply(with_fixes, run["target"])
    caps = replace(capabilities_of(factory), profile=profile)
    return run_cell(factory, caps, config, **run)
