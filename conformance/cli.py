# Over 600 lines: every command's options in one typer app; the work of each command lives in its own module.
"""`kvcert`: certify a backend, replay a counterexample, or prove the suite's power on the bug zoo."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcert.conformance.aliases import canonical, canonical_module
from kvcert.conformance.backend import Factory
from kvcert.conformance.certification import explain, fixes, known, reports
from kvcert.conformance.certification.certificate import CellResult, Certificate
from kvcert.conformance.certification.certify import CorpusError, _tier, certify, load_factory
from kvcert.conformance.certification.cluster import RayUnavailable
from kvcert.conformance.certification.diff import NODE_FIELDS, snapshot_rows
from kvcert.conformance.certification.fixes import FixError
from kvcert.conformance.certification.replay import judged_as
from kvcert.conformance.certification.walk import WALK_FORMAT, replay_walk_trace
from kvcert.conformance.generation.interrupt import sigint_deferred
from kvcert.conformance.generation.request_machine import run_requests
from kvcert.conformance.harness.driver import ConformanceFailure, Harness, Outcome, run_trace
from kvcert.conformance.harness.running import lent
from kvcert.conformance.harness.windows import SHORT, WINDOWS
from kvcert.sim.cli import policy_cmd
from kvcert.spec.ops import (
    Evict,
    Match,
    Op,
    RegisterRef,
    ReleaseRef,
    Retain,
    RetainWaiting,
    Trace,
    UpdateRef,
    op_to_json,
)
from kvcert.spec.types import CacheConfig, InvalidPolicyConfig, MatchOut

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
"""Wide when piped (CI logs), so the certificate table is not squeezed to 80 columns."""


def _cell_line(cell: CellResult) -> str:
    verdict = "[green]PASS[/]" if cell.passed else "[red]FAIL[/]"
    rate = cell.steps / max(cell.seconds, 1e-9)
    tier = f" host={cell.write_policy:<37}" if cell.write_policy else " device-only" + " " * 31
    if cell.tier:  # an API-level walk's own tier
        tier = f" {cell.tier:<42}"
    line = f"  page_size={cell.page_size:<3} policy={cell.policy:<8}{tier} {verdict}  {cell.examples} examples, {cell.steps} steps, {rate:,.0f} steps/s"
    if not cell.passed:
        line += f"\n    {cell.failure}"
        if cell.trace_path:
            saved = json.loads(Path(cell.trace_path).read_text())
            if saved.get("format") == WALK_FORMAT:  # an API-level walk's own operations
                listed = list(saved["ops"])
            else:
                listed = [op_to_json(op) for op in Trace.from_json(json.dumps(saved)).ops]
            ops = "".join(f"\n      {i:>3} {json.dumps(op)}" for i, op in enumerate(listed))
            line += f"\n    minimal trace ({cell.trace_len} ops, replay reproduces: {cell.reproduced}):{ops}"
            line += f"\n    saved: {cell.trace_path}  (kvcert replay {cell.trace_path})"
        if cell.shrink_note:
            line += f"\n    {cell.shrink_note}"
    return line


def print_windows(cert: Certificate) -> None:
    """Per cell, the steps that entered each race window (`conformance.harness.windows`): where the races were tried."""
    seen = [w for w in WINDOWS if any(c.ops.get(f"window:{w}") for c in cert.cells)]
    if not seen:
        return
    table = Table(title="race windows entered (steps per cell)")
    for col in ("page size", "policy", "tiers"):
        table.add_column(col, no_wrap=col == "tiers")
    for w in seen:
        table.add_column(SHORT[w], justify="right")
    for c in cert.cells:
        counts = [str(c.ops.get(f"window:{w}", 0)) for w in seen]
        table.add_row(str(c.page_size), c.policy, c.write_policy or "device", *counts)
    console.print(table)
    console.print("  " + "; ".join(f"{SHORT[w]}: {WINDOWS[w]}" for w in seen))


def print_findings(cert: Certificate) -> None:
    """The target's logged findings, replayed before the walk: which still reproduce, and which lie outside scope."""
    for f in cert.findings:
        mark = "[red]REPRODUCES[/]" if f.reproduced else "[dim]judged nothing[/]" if "scope" in f.summary else "ok"
        console.print(f"  known finding {f.id} ({f.trace}): {mark}  {escape(f.summary)}")


def print_certificate(cert: Certificate) -> None:
    table = Table(
        title=f"kvcert certificate: {cert.backend} ({cert.target}), profile {cert.profile}, {cert.kind} target"
    )
    for col in ("page size", "policy", "tiers", "verdict", "examples", "steps", "steps/s", "counterexample"):
        table.add_column(col)
    for c in cert.cells:
        table.add_row(
            str(c.page_size),
            c.policy,
            reports.tiers(c),
            "[green]pass[/]" if c.passed else "[red]FAIL[/]",
            str(c.examples),
            str(c.steps),
            f"{c.steps / max(c.seconds, 1e-9):,.0f}",
            "" if c.passed else f"{c.trace_len} ops: {c.trace_path}",
        )
    console.print(table)
    print_windows(cert)
    print_findings(cert)
    for note in cert.adapter_notes:
        console.print(f"  adapter: {escape(note)}")
    for note in cert.skipped:
        console.print(f"  skipped: {note}")
    rate = cert.total_steps / max(cert.seconds, 1e-9)
    verdict = "[green]CERTIFIED[/]" if cert.passed else "[red]NOT CERTIFIED[/]"
    if cert.with_fixes:  # not the engine as released: say so beside the verdict, not only among the gaps
        verdict += f" (the engine with the fixes of {', '.join(cert.with_fixes)} applied)"
    why = reports.verdict_reasons(cert)
    scope = " for what it declares and this run exercised; NOT CHECKED:" if cert.not_checked else ""
    console.print(
        f"{verdict}  seed={cert.seed}  {cert.total_steps} steps in {cert.seconds:.1f}s ({rate:,.0f} steps/s)"
        + (f" — {'; '.join(why)}" if why else "")
        + scope
    )
    for gap in cert.not_checked:
        console.print(f"  not checked: {escape(gap)}")


class _CellProgress:
    """A progress bar inside the running cell: examples started and steps so far. Shown on a terminal, for a run in
    this process (cells in workers report when they end); elsewhere the per-cell lines are the progress."""

    def __init__(self, examples: Optional[int], shown: bool) -> None:
        self.examples = examples
        self.bar: Optional[Progress] = None
        if shown and console.is_terminal:
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
        self.task: Optional[TaskID] = None

    def __enter__(self) -> _CellProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def example(self, config: CacheConfig, examples: int, steps: int) -> None:
        if self.bar is None:
            return
        tier = f" {_tier(config)}" if config.host_capacity else ""
        what = f"  page_size={config.page_size} {config.policy}{tier}: {steps:,} steps"
        if self.task is None:
            self.task = self.bar.add_task(what, total=self.examples)
        self.bar.update(self.task, completed=examples - 1, description=what)

    def cell(self, cell: CellResult) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.remove_task(self.task)
            self.task = None
        console.print(_cell_line(cell))


RAY_HELP = "run cells as tasks on this Ray cluster ('local' starts one here for the run)"
CORPUS_HELP = "shared failure corpus: every cell replays its traces first; new failures are added"
# The cell selection certify and fuzz share (one declaration each, so the two commands pick the same cells).
PREFETCH_POLICY = typer.Option(None, "--prefetch-policy", help="storage cells: these prefetch stop policies")
NO_STORAGE = typer.Option(False, "--no-storage", help="skip the storage cells")
STORAGE_ONLY = typer.Option(False, "--storage-only", help="run only the storage cells")
POLICY_CONFIG = typer.Option(
    None,
    "--policy-config",
    metavar="JSON",
    help="the eviction policy's parameters, as SGLang's --radix-eviction-policy-config (e.g. "
    '\'{"threshold": 64, "next_prompt_estimate": 16}\'), for the cells whose policy takes them',
)
BAD_INPUT = typer.Option(
    None,
    "--bad-input/--no-bad-input",
    help="force the bad-input rules on or off (default: as the backend declares strict_input)",
)


def _cells(
    device_only: bool,
    no_storage: bool,
    storage_only: bool,
    write_policy: Optional[list[str]],
    prefetch_policy: Optional[list[str]],
    policy_config: Optional[str] = None,
) -> dict[str, Any]:
    """`certify`'s cell selection from the shared options: an empty list drops a kind of cell, None keeps all."""
    config: Optional[dict[str, Any]] = None
    if policy_config is not None:
        try:
            config = json.loads(policy_config)
        except ValueError as e:
            raise InvalidPolicyConfig(f"--policy-config is not JSON: {e}") from e
        if not isinstance(config, dict):
            raise InvalidPolicyConfig(f"--policy-config must be a JSON object, got {policy_config!r}")
    return dict(
        write_policies=[] if device_only else write_policy,
        prefetch_policies=[] if device_only or no_storage else prefetch_policy,
        device_cells=not storage_only,
        host_cells=not storage_only,
        policy_config=config,
    )


@app.command("certify")
def certify_cmd(
    target: str = typer.Argument(..., help="MODULE:FACTORY, e.g. kvcert.refimpl:factory"),
    examples: int = typer.Option(200, help="Hypothesis examples per (page size, policy) cell"),
    steps: int = typer.Option(50, help="maximum operations per example"),
    seed: int = typer.Option(0, help="same seed, same run"),
    page_size: Optional[list[int]] = typer.Option(None, "--page-size", help="restrict to these page sizes"),
    policy: Optional[list[str]] = typer.Option(None, "--policy", help="restrict to these policies"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the certificate as JSON"),
    junit_path: Optional[Path] = typer.Option(None, "--junit", help="write the certificate as JUnit XML"),
    markdown_path: Optional[Path] = typer.Option(None, "--markdown", help="write the certificate as Markdown"),
    out: Path = typer.Option(Path("kvcert-failures"), help="where minimal traces are saved"),
    write_policy: Optional[list[str]] = typer.Option(
        None, "--write-policy", help="host-tier cells: these write policies"
    ),
    device_only: bool = typer.Option(False, "--device-only", help="skip the host-tier and storage cells"),
    prefetch_policy: Optional[list[str]] = PREFETCH_POLICY,
    no_storage: bool = NO_STORAGE,
    storage_only: bool = STORAGE_ONLY,
    bad_input: Optional[bool] = BAD_INPUT,
    policy_config: Optional[str] = POLICY_CONFIG,
    profile: Optional[str] = typer.Option(
        None, "--profile", help="hold the backend to this profile (core, sglang-0.5.23) instead of the one it declares"
    ),
    jobs: int = typer.Option(1, "--jobs", help="run cells in this many processes (the same certificate)"),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help=RAY_HELP),
    corpus: Optional[Path] = typer.Option(None, "--corpus", metavar="DIR", help=CORPUS_HELP),
    with_fixes: Optional[str] = typer.Option(
        None,
        "--with-fixes",
        metavar="IDS",
        help="comma-separated findings of the target's engine whose minimal fixes are applied first, so the walk "
        "goes past them (each listed under NOT CHECKED); `all` for every one logged with a fix",
    ),
) -> None:
    """Run the conformance suite against a backend and print its certificate."""
    _certify_and_report(
        target,
        (json_path, junit_path, markdown_path),
        examples=examples,
        steps=steps,
        seed=seed,
        page_sizes=page_size,
        policies=policy,
        out_dir=out,
        bad_input=bad_input,
        **_checked_cells(device_only, no_storage, storage_only, write_policy, prefetch_policy, policy_config),
        profile=profile,
        jobs=jobs,
        ray=ray,
        corpus=corpus,
        with_fixes=_fix_ids(target, with_fixes),
    )


def _fix_ids(target: str, given: Optional[str]) -> tuple[str, ...]:
    """`--with-fixes`: the findings named, or with `all` every finding of the target's engine that carries a fix."""
    if not given:
        return ()
    if given.strip() == "all":
        return tuple(f.id for f in known.findings_for(target) if canonical_module(target.partition(":")[0]) in f.fixes)
    return tuple(i.strip() for i in given.split(",") if i.strip())


def _checked_cells(*args: Any) -> dict[str, Any]:
    """`_cells`, or exit 2 with the reason on a `--policy-config` that is no JSON object."""
    try:
        return _cells(*args)
    except InvalidPolicyConfig as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


def _certify_and_report(
    target: str, reports_to: tuple[Optional[Path], Optional[Path], Optional[Path]], **kwargs: Any
) -> NoReturn:
    """`certify` with a line per cell (and a bar inside it), the certificate printed and written as JSON (after
    every cell), JUnit and Markdown where `reports_to` names a path; exit 0 if it passed, 1 if not, 2 on an error
    a user can fix before anything runs (no Ray, a bad corpus file), 130 if Ctrl-C stopped it (the partial
    certificate is printed and written, `complete: false`)."""
    json_path, junit_path, markdown_path = reports_to
    budget = kwargs["examples"] if kwargs.get("seconds") is None else None
    shown = kwargs.get("jobs", 1) <= 1 and kwargs.get("ray") is None
    with _CellProgress(budget, shown=shown) as progress, sigint_deferred():  # Ctrl-C: the certificate so far
        try:
            cert = certify(
                target,
                on_cell=progress.cell,
                on_example=progress.example,
                on_progress=_progress_json(json_path),
                **kwargs,
            )
        except (RayUnavailable, CorpusError, InvalidPolicyConfig, FixError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e
    print_certificate(cert)
    _write_reports(cert, json_path, junit_path, markdown_path)
    raise typer.Exit(130 if cert.interrupted else 0 if cert.passed else 1)  # 130: stopped by Ctrl-C, as shells say


def _progress_json(json_path: Optional[Path]) -> Optional[Callable[[Certificate], None]]:
    """Rewrite the JSON certificate after every cell, so an interrupted run keeps the cells it finished."""
    if json_path is None:
        return None

    def write(cert: Certificate) -> None:
        _write(json_path, cert.to_json())

    return write


def _write_reports(
    cert: Certificate, json_path: Optional[Path], junit_path: Optional[Path], markdown_path: Optional[Path]
) -> None:
    """The certificate in each format asked for (JSON, JUnit XML, Markdown)."""
    if json_path is not None:
        _write(json_path, cert.to_json())
    if junit_path is not None:
        _write(junit_path, reports.junit_xml(cert))
    if markdown_path is not None:
        _write(markdown_path, reports.markdown(cert))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@app.command("fuzz")
def fuzz_cmd(
    target: str = typer.Argument(..., help="MODULE:FACTORY, e.g. kvcert.gpu:factory"),
    seconds: Optional[float] = typer.Option(None, help="time budget for the whole run, split evenly across the cells"),
    examples: Optional[int] = typer.Option(None, help="examples per cell instead of a time budget (an exact run)"),
    steps: int = typer.Option(50, help="maximum operations per example"),
    seed: int = typer.Option(0, help="same seed, same walk: example k of a cell draws from (seed, k)"),
    page_size: Optional[list[int]] = typer.Option(None, "--page-size", help="restrict to these page sizes"),
    policy: Optional[list[str]] = typer.Option(None, "--policy", help="restrict to these policies"),
    write_policy: Optional[list[str]] = typer.Option(None, "--write-policy", help="host cells: these write policies"),
    device_only: bool = typer.Option(False, "--device-only", help="skip the host-tier and storage cells"),
    prefetch_policy: Optional[list[str]] = PREFETCH_POLICY,
    no_storage: bool = NO_STORAGE,
    storage_only: bool = STORAGE_ONLY,
    bad_input: Optional[bool] = BAD_INPUT,
    policy_config: Optional[str] = POLICY_CONFIG,
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the certificate as JSON"),
    junit_path: Optional[Path] = typer.Option(None, "--junit", help="write the certificate as JUnit XML"),
    markdown_path: Optional[Path] = typer.Option(None, "--markdown", help="write the certificate as Markdown"),
    out: Path = typer.Option(Path("kvcert-failures"), help="where minimal traces are saved"),
    profile: Optional[str] = typer.Option(
        None, "--profile", help="hold the backend to this profile (core, sglang-0.5.23)"
    ),
    jobs: int = typer.Option(1, "--jobs", help="walk cells in this many processes (--seconds is wall time)"),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS", help=RAY_HELP + " (--seconds per cell)"),
    corpus: Optional[Path] = typer.Option(None, "--corpus", metavar="DIR", help=CORPUS_HELP),
) -> None:
    """Walk every cell with a seeded random driver instead of Hypothesis: same ops, checks and failure path
    (shrunk, replayed, saved), for long runs. Exit 1 if a cell fails."""
    if (seconds is None) == (examples is None):
        console.print("[red]error:[/] give exactly one budget: --seconds or --examples")
        raise typer.Exit(2)
    _certify_and_report(
        target,
        (json_path, junit_path, markdown_path),
        examples=examples or 0,
        steps=steps,
        seed=seed,
        page_sizes=page_size,
        policies=policy,
        out_dir=out,
        bad_input=bad_input,
        **_checked_cells(device_only, no_storage, storage_only, write_policy, prefetch_policy, policy_config),
        profile=profile,
        driver="random",
        seconds=seconds,
        jobs=jobs,
        ray=ray,
        corpus=corpus,
    )


@app.command("explain")
def explain_cmd(
    inv_id: Optional[str] = typer.Argument(None, metavar="INV-ID", help="an invariant ID, e.g. INV-ACCT-3 (any case)"),
    list_ids: bool = typer.Option(False, "--list", help="print every ID with its one-line rule"),
) -> None:
    """Print what an invariant ID means: its SPEC.md text and section, and its checker's docstring."""
    if list_ids:
        for inv in explain.invariant_ids():
            console.print(f"{inv:<14} {explain.summary(inv)}", markup=False, emoji=False)
        return
    if inv_id is None:
        typer.echo("error: give an invariant ID (e.g. INV-ACCT-3), or --list", err=True)
        raise typer.Exit(2)
    try:
        console.print(explain.explain(inv_id), markup=False, emoji=False, end="")
    except KeyError:
        close = explain.suggestions(inv_id)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        typer.echo(f"error: unknown invariant ID {explain.normalize(inv_id)}{hint} (kvcert explain --list)", err=True)
        raise typer.Exit(2) from None


def _describe(outcome: Outcome) -> str:
    if isinstance(outcome, Exception):
        return f"raised {type(outcome).__name__}"
    return repr(outcome)


def _replay_walk(path: Path, target: str) -> None:
    """Replay a saved walk trace (a block pool's, an offload tier's) on a fresh target."""
    failure = replay_walk_trace(path, load_factory(target))
    console.print(f"replaying {path} on {target}")
    if failure is None:
        console.print("PASS: the trace satisfies the target's rules")
        return
    console.print(f"FAIL step {failure.step}: {failure.op}")
    for v in failure.violations:
        console.print(f"  {escape(str(v))}")
    raise typer.Exit(1)


def _replay_served(path: Path, target: Optional[str]) -> None:
    """A served failure, replayed on fresh servers (the same requests, flags and rules; `--target` names another
    served target to give the same conversation to)."""
    from kvcert.conformance.served import run as served

    saved = json.loads(path.read_text())
    name = target or saved["target"]
    if name not in served.TARGETS:
        typer.echo(f"error: unknown served target {name!r} (kvcert serve-certify --list)", err=True)
        raise typer.Exit(2)
    console.print(f"replaying {path} on fresh {name} servers (it broke {', '.join(saved.get('rules', []))})")
    verdict = served.replay_file(path, say=lambda line: console.print(escape(line)), target_name=name)
    if verdict.passed:
        console.print("PASS: the conversation satisfies every end-to-end rule")
        return
    console.print(f"FAIL: {', '.join(verdict.rules_broken())}")
    raise typer.Exit(1)


@app.command("replay")
def replay_cmd(
    trace_file: Path = typer.Argument(..., exists=True, readable=True),
    target: Optional[str] = typer.Option(
        None, help="override the trace's target MODULE:FACTORY (a served file: a served target)"
    ),
    versus_plain: bool = typer.Option(
        False,
        "--versus-plain",
        help="also replay it ref-blind (no sessions, full-scope evictions) and compare the matches",
    ),
    diff_at: Optional[int] = typer.Option(
        None,
        "--diff-at",
        metavar="N",
        help="after step N (as numbered below), print the backend's snapshot beside the oracle's; "
        "at the failing step instead if the trace fails first",
    ),
) -> None:
    """Re-run a saved trace step by step; exit 1 if it still breaks the spec."""
    saved = json.loads(trace_file.read_text())
    if isinstance(saved, dict) and saved.get("format") == WALK_FORMAT:  # a walk target's own operations
        _replay_walk(trace_file, target or saved["target"])
        return
    if isinstance(saved, dict) and str(saved.get("format", "")).startswith("kvcert-served"):
        _replay_served(trace_file, target)
        return
    trace = Trace.from_json(trace_file.read_text())
    name = target or trace.target
    if diff_at is not None and (diff_at < 0 or versus_plain):
        why = "--diff-at and --versus-plain cannot be combined" if versus_plain else "--diff-at must be >= 0"
        typer.echo(f"error: {why}", err=True)
        raise typer.Exit(2)
    factory = load_factory(name)
    if trace.note:
        console.print(trace.note)
    if trace.fixes:  # found with known defects patched out: replay over the same engine
        try:
            for fix in fixes.apply(trace.fixes, name):
                console.print(fix.describe())
        except FixError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e
    if diff_at is not None:
        _replay_diff(factory, trace, name, diff_at)
        return
    runs = [("proactive" if versus_plain else "", list(trace.ops))]
    if versus_plain:
        runs.append(("plain LRU", plain_ops(trace.ops)))
    hits: dict[str, dict[int, int]] = {}
    for label, ops in runs:
        console.print(f"replaying {len(ops)} ops on {name} ({trace.config}){f' — {label}' if label else ''}")
        matched: dict[int, int] = {}

        def hook(i: int, op: Op, outcome: Outcome, matched: dict[int, int] = matched) -> None:
            console.print(f"  {i:>3} {op_to_json(op)} -> {_describe(outcome)}")
            if isinstance(outcome, MatchOut):
                matched[i] = outcome.length

        try:
            caps = judged_as(factory.capabilities, trace)  # type: ignore[attr-defined]
            replayer = run_requests if caps.kind == "request-path" else run_trace
            replayer(factory(trace.config), trace.config, caps, ops, hook=hook)
        except ConformanceFailure as failure:
            console.print(f"[red]FAIL[/] {failure}")
            raise typer.Exit(1) from None
        console.print("[green]PASS[/]: the trace satisfies the spec")
        hits[label] = matched
    if versus_plain:
        table = Table(title="lookups: tokens hit")
        table.add_column("op")
        table.add_column("tokens asked")
        for label, _ in runs:
            table.add_column(label)
        for i, op in enumerate(trace.ops):
            if isinstance(op, Match) and op.tokens:
                table.add_row(str(i), str(len(op.tokens)), *(str(hits[label].get(i, "-")) for label, _ in runs))
        console.print(table)


def _replay_diff(factory: Factory, trace: Trace, name: str, at: int) -> None:
    """`replay --diff-at`: the harness's own loop (`run_trace`'s), with the harness at hand so the diff shows
    the oracle exactly as the checks saw it, steered to the backend's choices."""
    console.print(f"replaying {len(trace.ops)} ops on {name} ({trace.config}), diff at step {at}")
    h: Optional[Harness] = None
    shown = False

    def show(i: int, op: Optional[Op], why: str = "") -> None:
        nonlocal shown
        shown = True
        assert h is not None
        print_diff(h, i, op, why)

    def hook(i: int, op: Op, outcome: Outcome) -> None:
        console.print(f"  {i:>3} {op_to_json(op)} -> {_describe(outcome)}")
        if i == at:  # after the op and the oracle's steered step, before the checks: a failing step shows too
            show(i, op)

    caps = judged_as(factory.capabilities, trace)  # type: ignore[attr-defined]
    try:
        h = Harness(factory(trace.config), trace.config, caps, trace_hook=hook)
        for op in trace.ops:
            h.step(op)
            if not shown and len(h.ops) - 1 == at:  # a storage-side op (no hook call) at step N
                show(at, op)
        h.quiesce()
    except ConformanceFailure as failure:
        if h is None:
            console.print("the trace fails in the initial state, before any step: no diff")
        elif not shown:
            before = f", before step {at}" if failure.step < at else ""
            show(failure.step, failure.op, f"the trace failed at step {failure.step}{before}")
        console.print(f"[red]FAIL[/] {failure}")
        raise typer.Exit(1) from None
    finally:
        if h is not None:
            h.close()
    if not shown:
        typer.echo(f"error: step {at} is past the end: the replay ran steps 0..{len(h.ops) - 1}", err=True)
        raise typer.Exit(2)
    console.print("[green]PASS[/]: the trace satisfies the spec")


def print_diff(h: Harness, i: int, op: Optional[Op], why: str = "") -> None:
    """The backend's snapshot beside the oracle's at step `i` (`conformance.certification.diff`): nodes by path, then the
    scalar fields; what differs in red. Cells that differ read `backend / oracle`."""
    try:
        # The harness's view of the backend: the snapshot with the caller's lent slots filled in.
        mine = h._snapshot(i, op)
    except ConformanceFailure as err:
        console.print(f"  no diff at step {i}: {err.violations[0]}")
        return
    spec = h.spec_snapshot()
    if h.ledger.running:  # the oracle's half of the running requests, as the backend's half is filled in
        spec = replace(spec, lent_slots=lent(h.ledger.running, 1))
    rows = snapshot_rows(mine, spec)
    differing = [r for r in rows if r.differs]
    title = f"step {i}: backend ({h.capabilities.name}) / oracle (kvcert.refimpl)"
    if why:
        console.print(f"[yellow]{why}[/]: the diff at step {i}")
    nodes = Table(title=f"{title}: nodes by path", caption="cells that differ read backend / oracle")
    for col in ("", "path", *NODE_FIELDS):
        nodes.add_column(col, no_wrap=col != "path")
    for r in (r for r in rows if r.section == "node"):
        cells = [b if b == o else f"[red]{b} / {o}[/]" for _, b, o in r.cells]
        nodes.add_row("[red]≠[/]" if r.differs else "", escape(r.key), *cells)
    console.print(nodes)
    state = Table(title=f"{title}: state")
    for col in ("", "field", "backend", "oracle"):
        state.add_column(col)
    for r in (r for r in rows if r.section == "state"):
        ((_, b, o),) = r.cells
        style = "red" if r.differs else ""
        state.add_row("[red]≠[/]" if r.differs else "", r.key, escape(b), escape(o), style=style)
    console.print(state)
    console.print(
        f"{len(differing)} rows differ: {', '.join(escape(r.key) for r in differing)}"
        if differing
        else "backend and oracle agree on every row"
    )


def plain_ops(ops: Sequence[Op]) -> list[Op]:
    """The same trace for a ref-blind cache: session calls become empty lookups (so handle positions
    stay put) and every eviction takes the full scope, as a scheduler without tiers would."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, (RegisterRef, UpdateRef, ReleaseRef, Retain, RetainWaiting)):
            out.append(Match(None, ()))
        elif isinstance(op, Evict):
            out.append(Evict(op.n))
        else:
            out.append(op)
    return out


@app.command("selftest")
def selftest_cmd(
    examples: int = typer.Option(600, help="examples per cell for each mutant"),
    steps: int = typer.Option(50),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("kvcert-failures/zoo")),
    mutant_names: Optional[list[str]] = typer.Option(None, "--mutant", help="only these mutants"),
    jobs: int = typer.Option(2, help="mutants certified at once, each in its own fresh interpreter"),
    directed: bool = typer.Option(True, "--directed/--no-directed", help="also run the directed mutants"),
) -> None:
    """Run the suite against every mutant in the bug zoo; each must be killed, the refimpl must pass."""
    from kvcert.conformance.zoo.selftest import Verdict, run_selftest

    def show(v: Verdict) -> None:
        if v.directed:
            trace = (
                f"[green]trace kills it[/] ({v.by_trace})" if v.by_trace else f"[red]TRACE MISSES IT[/] {v.trace_note}"
            )
            gen = f"generation kills it too, {v.trace_len} ops" if v.killed else "generation does not reach it"
            console.print(f"directed {v.name:<34} {trace}; {gen}")
        elif v.killed:
            console.print(f"[green]killed[/]   {v.name:<34} {v.trace_len:>3} ops  {v.broken}")
        elif v.unreplayed:
            console.print(f"[red]NOT REPLAYED[/] {v.name:<30} a cell failed, its trace passed afresh: {v.broken}")
        else:
            console.print(f"[red]SURVIVED[/] {v.name:<34} ({v.doc})")

    try:
        report = run_selftest(
            mutant_names,
            examples=examples,
            steps=steps,
            seed=seed,
            out_dir=out,
            jobs=jobs,
            directed=directed,
            on_verdict=show,
        )
    except ValueError as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(2) from None
    control = (
        "[green]passes[/]" if report.control_passed else f"[red]FAILS[/] {report.control_failure.splitlines()[:2]}"
    )
    console.print(f"control  kvcert.refimpl unmodified: {control}")
    lengths = [v.trace_len or 0 for v in report.generated if v.killed]
    if lengths:
        console.print(f"median counterexample: {statistics.median(lengths)} ops (max {max(lengths)})")
    killed = sum(v.killed for v in report.generated)
    line = f"killed {killed}/{len(report.generated)} by generation"
    if report.directed:
        by_trace = sum(bool(v.by_trace) for v in report.directed)
        also = sum(v.killed for v in report.directed)
        line += f"; directed: {by_trace}/{len(report.directed)} killed by their traces, {also} also by generation"
    console.print(line)
    raise typer.Exit(0 if report.passed else 1)


@app.command("engine-zoo")
def engine_zoo_cmd(
    examples: int = typer.Option(40, help="examples per cell for each mutant"),
    steps: int = typer.Option(50),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("kvcert-failures/engine-zoo")),
    mutant_names: Optional[list[str]] = typer.Option(None, "--mutant", help="only these mutants"),
) -> None:
    """The engine zoo (`conformance/zoo/engines.py`): mutants of the reference engine's direct linker (SPEC.md §14),
    each certified (generated) and, where generation reaches its bug class rarely, run through its directed trace.
    A kill counts under one of the mutant's own rules only. Exits 1 if a mutant survives (a directed one: its trace
    passed; any other: generation missed it) or the unmodified engine fails a cell or a directed trace."""
    from kvcert.conformance.zoo.engines import EngineVerdict, run_engine_zoo

    def show(v: EngineVerdict) -> None:
        if v.killed_generated:
            gen = f"[green]killed[/] under {' '.join(v.generated)} ({v.trace_len} ops)"
        elif v.other_rules:
            gen = f"[yellow]failed under {' '.join(v.other_rules)} only[/] (not {'/'.join(sorted(v.rules))}: no kill)"
        elif v.unreplayed:
            gen = "[red]NOT REPLAYED[/] (a cell failed, its trace passed afresh)"
        else:
            gen = "not reached" if v.directed else f"[red]SURVIVED[/] ({v.doc})"
        line = f"{v.name:<28} generated: {gen}"
        if v.directed:
            by = " ".join(v.by_trace)
            line += "; directed: " + (
                f"[green]killed by its trace[/] ({by})"
                if v.killed_by_trace
                else f"[red]TRACE MISSES IT[/] ({by or 'it passes'})"
            )
        console.print(line)

    try:
        report = run_engine_zoo(mutant_names, examples=examples, steps=steps, seed=seed, out_dir=out, on_verdict=show)
    except ValueError as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(2) from None
    control = (
        f"[red]FAILS[/] {escape(report.control_failure.splitlines()[0])}"
        if report.control_failure
        else f"[green]passes[/] {report.control_cells} cells and {report.control_traces} directed traces"
    )
    console.print(f"control  the unmodified engine: {control}")
    console.print(report.summary())
    raise typer.Exit(0 if report.passed else 1)


@app.command("partition")
def partition_cmd(
    target: str = typer.Argument(
        ..., help="MODULE:FACTORY returning a probe, e.g. kvcert.conformance.adapters.vllm.kv:probe"
    ),
    cases: int = typer.Option(200, help="generated cases, after the directed ones"),
    seed: int = typer.Option(0, help="same seed, same cases"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the report as JSON"),
) -> None:
    """Key partitioning: requests that differ in a cache key (LoRA, cache salt, an image) never reuse each other's KV
    from where the key applies; requests that agree do. Exits 1 on any failure, or if no case reused or none
    differed."""
    from dataclasses import asdict

    from kvcert.conformance.harness import partition

    try:
        probe = partition.load(target)
    except (ImportError, ValueError, AttributeError) as e:
        console.print(f"[red]{escape(str(e))}[/]")
        console.print(
            "(a vLLM probe runs in .venv-vllm: scripts/install_vllm.sh, then .venv-vllm/bin/kvcert partition)"
        )
        raise typer.Exit(2) from e
    report = partition.run(target, probe, partition.cases(cases, seed, probe.page, probe))
    verdict = "[green]PASSED[/]" if report.passed else "[red]FAILED[/]"
    console.print(
        f"{verdict} {target}: {report.cases} cases ({report.reused} reused KV, {report.isolated} with keys that "
        f"differ where KV could be reused), {len(report.failures)} failures"
    )
    for f in report.failures[:5]:
        console.print(f"  {f.case}: {'; '.join(f.why)}  (keys {f.keys_a} then {f.keys_b})")
    for kind, n in sorted(report.not_checked.items()):
        console.print(f"  NOT CHECKED: {kind} (the probe does not take them; {n} cases not run)")
    if json_path is not None:
        json_path.write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=1))
    raise typer.Exit(0 if report.passed else 1)


@app.command("same")
def same_cmd(
    first: Path = typer.Argument(..., exists=True, readable=True, help="a certificate written by certify --json"),
    second: Path = typer.Argument(..., exists=True, readable=True),
    common: bool = typer.Option(False, "--common", help="compare only the cells both certificates ran"),
) -> None:
    """Whether two certificates are the same run: cell by cell, the digest of every op executed (exit 1 if not).

    Two machines, installs or processes that certified the same target at the same seed and budget
    must print "same run" for every cell (SPEC.md §3). A target under its old module name (`conformance.aliases`) is
    the same target as under its new one."""
    cells, runs = [], []
    for path in (first, second):
        body = json.loads(path.read_text())
        cells.append({(c["page_size"], c["policy"], c["write_policy"]): c for c in body["cells"]})
        runs.append({k: body.get(k) for k in ("target", "seed", "examples", "steps")})
        if isinstance(runs[-1]["target"], str):  # an old module name and its new one are one target
            runs[-1]["target"] = canonical(runs[-1]["target"])
    differ = 0
    for k in runs[0]:
        if runs[0][k] != runs[1][k]:  # another target, seed or budget is another run, whatever the digests
            console.print(f"  [red]DIFFERENT {k}[/]  {runs[0][k]} vs {runs[1][k]}")
            differ += 1
    keys = set(cells[0]) & set(cells[1]) if common else set(cells[0]) | set(cells[1])
    if not keys:
        console.print("[red]no cell in common[/]: nothing was compared")
        raise typer.Exit(1)
    for key in sorted(keys):
        a, b = cells[0].get(key), cells[1].get(key)
        where = f"page_size={key[0]} policy={key[1]} {key[2] or 'device-only'}"
        if a is None or b is None:
            console.print(f"  [red]only in {'the second' if a is None else 'the first'}[/]  {where}")
            differ += 1
        elif a.get("digest") and a.get("digest") == b.get("digest") and a["passed"] == b["passed"]:
            console.print(f"  same run   {where}  {a['steps']} steps, {a['digest'][:16]}")
        else:
            console.print(f"  [red]DIFFERENT[/]  {where}  {a['steps']} vs {b['steps']} steps")
            differ += 1
    console.print("same run" if not differ else f"[red]{differ} cells differ[/]")
    raise typer.Exit(1 if differ else 0)


@app.command("serve-certify")
def serve_certify_cmd(
    target: Optional[str] = typer.Argument(None, help="a served target (kvcert serve-certify --list)"),
    list_targets: bool = typer.Option(False, "--list", help="print every served target and exit"),
    examples: int = typer.Option(20, help="conversations to play"),
    seed: int = typer.Option(0, help="same seed, same traffic"),
    url: Optional[str] = typer.Option(
        None, "--url", help="attach to a server already running here instead of starting one"
    ),
    events: Optional[str] = typer.Option(
        None,
        "--events",
        metavar="ADDR[,REPLAY]",
        help="with --url: the ZMQ address its KV-event publisher connects to (kvcert binds it), and its replay socket; "
        "without a replay socket kvcert flushes the cache first and judges events from the flush on",
    ),
    twin_url: Optional[str] = typer.Option(
        None,
        "--twin-url",
        help="with --url: a twin of that server with prefix caching off (same output is judged against it)",
    ),
    python: Optional[str] = typer.Option(
        None, "--python", help="the engine environment's interpreter (default: the target's)"
    ),
    flag: Optional[list[str]] = typer.Option(
        None, "--flag", help="an extra server flag for the server under test (repeat)"
    ),
    shrink_seconds: float = typer.Option(600.0, "--shrink-seconds", help="time budget for shrinking a failure"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the certificate as JSON"),
    junit_path: Optional[Path] = typer.Option(None, "--junit", help="write the certificate as JUnit XML"),
    markdown_path: Optional[Path] = typer.Option(None, "--markdown", help="write the certificate as Markdown"),
    out: Path = typer.Option(Path("kvcert-failures"), help="where replay files and server logs are saved"),
) -> None:
    """Certify an engine as users deploy it: its real server processes on a model kvcert makes, driven over HTTP by
    seeded multi-turn traffic and judged end to end (SPEC.md §16): same output as a caching-off twin, KV events
    that agree, bounded memory, a server that stays up. Exit 1 if a rule breaks; the failure is shrunk and saved."""
    from kvcert.conformance.served import run as served

    if list_targets or target is None:
        for t in served.TARGETS.values():
            state = f"  [red]unavailable[/]: {escape(t.unavailable)}" if t.unavailable else ""
            console.print(f"{t.name:<16} {escape(t.summary)}  ({t.engine}; {t.install}){state}")
        raise typer.Exit(0 if list_targets else 2)
    if target not in served.TARGETS:
        typer.echo(f"error: unknown served target {target!r} (kvcert serve-certify --list)", err=True)
        raise typer.Exit(2)
    if (events or twin_url) and not url:
        typer.echo("error: --events and --twin-url go with --url", err=True)
        raise typer.Exit(2)
    try:
        cert, _ = served.serve_certify(
            target,
            examples=examples,
            seed=seed,
            out_dir=out,
            url=url,
            events=events,
            twin_url=twin_url,
            python=python,
            extra_flags=tuple(flag or ()),
            shrink_seconds=shrink_seconds,
            say=lambda line: console.print(escape(line)),
        )
    except (served.EnvironmentMissing, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    print_certificate(cert)
    for cell in cert.cells:
        if not cell.passed:
            console.print(f"  [red]FAIL[/] {escape(cell.failure or 'the run did not finish')}")
            if cell.trace_path:
                console.print(
                    f"  minimal conversation: {cell.trace_len} requests, replay reproduces: {cell.reproduced}"
                    f"\n  saved: {cell.trace_path}  (kvcert replay {cell.trace_path})"
                )
    console.print("  exercised: " + ", ".join(f"{k} {v}" for k, v in sorted(cert.cells[0].ops.items())))
    _write_reports(cert, json_path, junit_path, markdown_path)
    raise typer.Exit(0 if cert.passed else 1)


bench_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Performance benchmarks (measured, never asserted)."
)
app.add_typer(bench_app, name="bench")


bench_app.command("policy")(policy_cmd)  # kvcert bench policy: the serving simulator (kvcert.sim)


@bench_app.command("served")
def bench_served_cmd(
    target: Optional[list[str]] = typer.Option(
        None, "--target", help="a served target (default: sglang, sglang-hicache, sglang-kvcert)"
    ),
    repeat: int = typer.Option(5, help="workload seeds, from --seed on: one run of every target at each"),
    seed: int = typer.Option(0, help="the first workload seed"),
    hp: int = typer.Option(6, help="high-priority clients (half as many low-priority ones)"),
    think_max: float = typer.Option(3.0, help="think time between turns, seconds (max; min 1)"),
    python: Optional[str] = typer.Option(None, "--python", help="the engine environment's interpreter"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write every run's figures as JSON"),
    logs: Path = typer.Option(Path("kvcert-failures/bench-served"), help="where the servers' logs go"),
) -> None:
    """kvcert's plugin against SGLang's default cache and HiCache, served on the same multi-turn traffic with
    priorities: HP hit from the engine's reported cached tokens, TTFT from the stream, the simulator's prediction
    for the same pools and traffic beside each figure. Measured, never asserted."""
    from kvcert.conformance.served import bench as served_bench

    names = list(target or served_bench.BENCH_TARGETS)
    unknown = [n for n in names if n not in served_bench.PREDICTED_BY]
    if unknown or repeat < 1:
        typer.echo(f"error: targets are {', '.join(served_bench.BENCH_TARGETS)}; --repeat >= 1", err=True)
        raise typer.Exit(2)
    spec = served_bench.BenchSpec(hp_clients=hp, think_max=think_max)
    try:
        result = served_bench.bench(
            names, spec, range(seed, seed + repeat), logs, python, say=lambda line: console.print(escape(line))
        )
    except (served_bench.EnvironmentMissing, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    for table in served_bench.tables(result):
        console.print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1))
        console.print(f"figures: {json_out}")


@bench_app.command("harness", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_harness_cmd(
    ctx: typer.Context,
    question: str = typer.Argument(..., help="drivers | checks | profile | versus"),
    target: str = typer.Option("kvcert.gpu:factory", "--target", help="MODULE:FACTORY"),
    examples: int = typer.Option(60, help="examples per cell"),
    repeats: int = typer.Option(3, help="rounds, the sides' order alternating; ratios print as median [spread]"),
    rows: int = typer.Option(30, help="profile: functions to list"),
    rev: str = typer.Option("", "--versus", help="versus: the baseline commit"),
) -> None:
    """Where a checked step's time goes: certify beside fuzz (drivers), the checks' share (checks), a profile of
    the walk (profile), or this checkout beside another commit (versus; extra options go to both certify runs)."""
    from kvcert.conformance.bench import harness

    try:
        harness.run(question, target, examples=examples, repeats=repeats, rows=rows, rev=rev, args=ctx.args,
                    root=Path(__file__).resolve().parent.parent)  # fmt: skip
    except ValueError as err:
        console.print(f"[red]{escape(str(err))}[/]")
        raise typer.Exit(2) from None


@bench_app.command("meta")
def bench_meta_cmd(
    page_size: list[int] = typer.Option([1, 64], "--page-size", help="one run per page size"),
    pages: int = typer.Option(20_000, help="device pool, in pages"),
    requests: int = typer.Option(20_000, help="requests in the trace"),
    seed: int = typer.Option(0),
    budget: float = typer.Option(120.0, help="seconds per implementation before it stops early"),
    impl: Optional[list[str]] = typer.Option(None, "--impl", help="only these implementations"),
    host: bool = typer.Option(False, "--host", help="also replay with a host tier (2x the pool, write-through)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the figures as JSON"),
    repeats: int = typer.Option(
        3, help="rounds, the implementations' order alternating; ratios print as median [spread]"
    ),
) -> None:
    """Replay one multi-turn trace against every implementation; print calls/s per operation and ratios.

    Every implementation runs on a logical clock (the request number) and must answer every request
    with the same hit lengths; where one does not, the run says so and exits 1. Each implementation
    runs `repeats` times, in an order that alternates round by round; a rate is the median of its
    rounds, and a ratio to the baseline is the median of the rounds' ratios with the lowest and highest."""
    from kvcert.conformance.bench import meta as bench
    from kvcert.conformance.bench import rounds, spread

    if repeats < 1:
        console.print("[red]--repeats must be at least 1[/]")
        raise typer.Exit(2)
    report = []
    differ = False
    modes: list[tuple[str, Any, Any, tuple[str, ...], str]] = [
        ("device", bench.drivers, bench.replay, bench.IMPLEMENTATIONS, bench.BASELINE)
    ]
    if host:
        modes.append(("host", bench.host_drivers, bench.replay_host, bench.HOST_IMPLEMENTATIONS, bench.HOST_BASELINE))
    for ps in page_size:
        spec = bench.TraceSpec(page_size=ps, pages=pages, requests=requests, seed=seed)
        trace = bench.make_trace(spec)
        tokens = sum(len(r.tokens) for r in trace)
        for mode, make_drivers, run, everyone, baseline in modes:
            tier = f", host pool {bench.HOST_RATIO * pages:,} pages" if mode == "host" else ""
            console.print(f"page size {ps}: {len(trace)} requests, {tokens:,} key tokens, pool {pages:,} pages{tier}")
            makers = make_drivers(ps, pages * ps, impl or everyone)
            runs_of: dict[str, list[Any]] = {label: [] for label, _ in makers}
            for r, order in enumerate(rounds(repeats, makers)):
                for label, make in order:
                    res = run(make(), trace, budget)
                    runs_of[label].append(res)
                    note = f" (stopped after {res.requests} requests: budget)" if res.requests < len(trace) else ""
                    console.print(
                        f"  round {r + 1}: {res.name:<34} {res.seconds:7.1f}s{note}{'  ' + res.error if res.error else ''}"
                    )
            if not makers:
                continue
            for line in bench.disagreements([res for runs in runs_of.values() for res in runs]):
                console.print(f"  [red]DIFFERENT ANSWERS[/]: {line}")
                differ = True
            ops = runs_of[makers[0][0]][0].ops
            base = runs_of.get(baseline)
            title = (
                f"calls/s, page size {ps}{' with a host tier' if mode == 'host' else ''}, median of {repeats} "
                f"(ratio to {baseline}: median [spread])"
            )
            table = Table(title=escape(title))
            table.add_column("implementation")
            for op in (*ops, "all"):
                table.add_column(op, justify="right")

            def rate_of(res: Any, op: str) -> Optional[float]:
                return res.total_rate if op == "all" else res.rate(op)

            for label, _ in makers:
                runs = runs_of[label]
                cells = []
                medians: dict[str, Optional[float]] = {}
                for op in (*ops, "all"):
                    rates = [rate_of(res, op) for res in runs]
                    if any(x is None for x in rates):
                        medians[op] = None
                        cells.append("-")
                        continue
                    medians[op] = statistics.median(rates)  # type: ignore[type-var]
                    ratios = (
                        [x / y for x, y in zip(rates, (rate_of(b, op) for b in base))]  # type: ignore[operator]
                        if base and all(rate_of(b, op) for b in base)
                        else []
                    )
                    cells.append(f"{medians[op]:,.0f}" + (f" ({spread(ratios)})" if ratios else ""))
                table.add_row(runs[0].name, *cells)
                first = runs[0]
                report.append(
                    {
                        "page_size": ps,
                        "mode": mode,
                        "implementation": label,
                        "name": first.name,
                        "requests": first.requests,
                        "seconds": round(statistics.median(res.seconds for res in runs), 2),
                        "refused": first.refused,
                        "loaded": first.loaded,
                        "error": first.error,
                        "calls": dict(first.calls),
                        "calls_per_s": {op: medians[op] for op in ops},
                        "all_per_s": medians["all"],
                        "tokens_hit": sum(d + h for d, h in first.hits),
                        "rounds": [
                            {"calls_per_s": {op: res.rate(op) for op in ops}, "all_per_s": res.total_rate}
                            for res in runs
                        ],
                    }
                )
            console.print(table, width=max(console.width, 180))  # one row per implementation, unwrapped
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=1))
    if differ:  # the figures compare different work: say so in the exit status too
        raise typer.Exit(1)


def main() -> None:
    sys.exit(app())


if __name__ == "__main__":
    main()
