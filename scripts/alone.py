"""Which core rules alone kill a mutant (SPEC.md §6.4): the ablation behind tests/test_profiles.py's ALONE.

For each mutant, its counterexample (the recorded one in tests/corpus/zoo or tests/profiles, or one found
now by generation at the zoo's budget) is replayed under the core; each rule the failure names is then
dropped in turn (`Harness.ignore`), and a rule is *alone* when the trace, quiesce included, passes without
it. Candidates not yet in the zoo come from a Python file that defines `MUTANTS` (zoo.Mutant objects).

    .venv/bin/python scripts/alone.py NAME...                   # zoo mutants, recorded traces where there are
    .venv/bin/python scripts/alone.py --all                     # every zoo mutant with a recorded trace
    .venv/bin/python scripts/alone.py --candidates FILE [--seed S] [--examples N] [--out DIR]
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Optional

import typer

from kvcert.conformance import zoo
from kvcert.conformance.certification.certify import core_verdict
from kvcert.conformance.zoo.selftest import EXAMPLES, STEPS
from kvcert.spec.ops import Trace

ROOT = Path(__file__).resolve().parent.parent
RECORDED = (ROOT / "tests" / "corpus" / "zoo", ROOT / "tests" / "profiles")


def recorded(name: str) -> Optional[Trace]:
    paths = [p for d in RECORDED for p in sorted(d.glob(f"*zoo_{name}-*.json"))]
    return Trace.from_json(paths[0].read_text()) if paths else None


def found(mutant: zoo.Mutant, seed: int, examples: int, out: Path) -> Optional[Trace]:
    cert = zoo.run_mutant(mutant, examples=examples, steps=STEPS, seed=seed, out_dir=out)
    failed = next((c for c in cert.cells if not c.passed and c.trace_path), None)
    return Trace.from_json(Path(failed.trace_path).read_text()) if failed and failed.trace_path else None


def main(
    names: list[str] = typer.Argument(None),
    all_: bool = typer.Option(False, "--all", help="every zoo mutant with a recorded trace"),
    candidates: Optional[Path] = typer.Option(None, help="a .py file defining MUTANTS, added to the zoo here"),
    seed: int = 0,
    examples: int = EXAMPLES,
    out: Path = Path("kvcert-failures/alone"),
    fresh: bool = typer.Option(False, help="find a counterexample by generation even where one is recorded"),
) -> None:
    extra: tuple[zoo.Mutant, ...] = ()
    if candidates is not None:
        extra = tuple(runpy.run_path(str(candidates))["MUTANTS"])
        zoo.MUTANTS = zoo.MUTANTS + extra  # type: ignore[misc]  (this process only: the trace's target loads)
    by_name = {m.name: m for m in zoo.MUTANTS + zoo.DIRECTED}
    chosen = [m.name for m in extra] + list(names or [])
    if all_:
        chosen += [m.name for m in zoo.MUTANTS if recorded(m.name) is not None]
    for name in chosen:
        if name not in by_name:
            raise typer.BadParameter(f"no mutant named {name}")
        mutant = by_name[name]
        zoo.build(mutant)  # every edit applies once, or this raises
        trace = None if fresh or mutant in extra else recorded(name)
        source = "recorded"
        if trace is None:
            trace, source = found(mutant, seed, examples, out), "generated"
        if trace is None:
            print(f"{name:44s} SURVIVED generation (seed {seed}, {examples * mutant.budget} examples)")
            continue
        rules, step = core_verdict(trace)
        if not rules:
            print(f"{name:44s} passes under the core ({source}, {len(trace.ops)} ops): killed by the profile only")
            continue
        alone = sorted(r for r in rules if not core_verdict(trace, frozenset({r}))[0])
        print(
            f"{name:44s} {source}, {len(trace.ops)} ops, step {step}: breaks {' '.join(sorted(rules))}; "
            f"alone: {' '.join(alone) or '-'}"
        )


if __name__ == "__main__":
    typer.run(main)
