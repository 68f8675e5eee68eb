"""`kvcert bench harness`: where a checked step's time goes, measured side by side and repeated.

One command for four questions, each over the same cells and seed:

- `drivers`: the Hypothesis-driven walk (`kvcert certify`) beside the seeded random walk (`kvcert fuzz`);
- `checks`: the random walk with every check on, with the state checks off, and with the state and contract
  checks off. What is left with both off is the walk itself (the backend's and the oracle's operations, their
  snapshots, steering, bookkeeping): the ceiling a faster harness alone could reach. Nothing in kvcert can switch
  a check off, so this module replaces `Checks.state` / `Checks.contract` with no-ops while it measures;
- `profile`: cProfile over the walk with every check on: the functions with the most time of their own, as shares
  of the walk (cProfile slows every call alike, so the shares, not the times, are what to read);
- `versus REV`: this checkout beside another commit built as a wheel into a bare site-packages, `kvcert certify`
  from each in turn, with whether both generated the very same traces (`kvcert same` on their digests).

Each comparison runs `repeats` rounds, alternating the order of the sides (a b, then b a) so that a machine that
slows down or speeds up weighs on both alike, and prints each ratio as its median and its spread (lowest and
highest round). Measured, never asserted.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcert.conformance.bench import rounds, spread
from kvcert.conformance.certification.certificate import Certificate
from kvcert.conformance.certification.certify import certify, load_factory
from kvcert.conformance.harness import checks, driver

__all__ = ["QUESTIONS", "run"]

QUESTIONS = ("drivers", "checks", "profile", "versus")
WALK_CELLS: dict[str, Any] = dict(
    page_sizes=[1, 4, 16], policies=["lru"], write_policies=["write_through"], prefetch_policies=["best_effort"]
)
"""The `checks` and `profile` cells: page sizes 1, 4, 16 under LRU, each on the device alone, with a write-through
host tier, and with write-through + best-effort storage."""
CHECK_MODES = ("every check on", "state checks off", "state and contract checks off")


def _rate(cert: Certificate) -> float:
    return cert.total_steps / cert.seconds


def _cell(c: Any) -> str:
    return f"ps{c.page_size} {c.policy} {c.write_policy or 'device'}"


def drivers(target: str, examples: int, repeats: int, say: Callable[[str], None]) -> None:
    runs: dict[str, list[Certificate]] = {"hypothesis": [], "random": []}
    for order in rounds(repeats, ("hypothesis", "random")):
        for d in order:
            runs[d].append(certify(target, examples=examples, seed=0, out_dir=Path(tempfile.mkdtemp()), driver=d))
    say(f"{target}, {examples} examples per cell, seed 0, {repeats} rounds: fuzz steps/s over certify steps/s")
    say(f"{'cell':<50} {'certify steps/s':>16} {'fuzz steps/s':>13}  ratio, median [spread]")
    for i, cell in enumerate(runs["hypothesis"][0].cells):
        h = [c.cells[i].steps / c.cells[i].seconds for c in runs["hypothesis"]]
        r = [c.cells[i].steps / c.cells[i].seconds for c in runs["random"]]
        ratios = [b / a for a, b in zip(h, r)]
        say(f"{_cell(cell):<50} {statistics.median(h):>16,.0f} {statistics.median(r):>13,.0f}  {spread(ratios)}")
    h = [_rate(c) for c in runs["hypothesis"]]
    r = [_rate(c) for c in runs["random"]]
    say(f"{'all cells':<50} {statistics.median(h):>16,.0f} {statistics.median(r):>13,.0f}  "
        f"{spread([b / a for a, b in zip(h, r)])}")  # fmt: skip
    say(f"verdicts: certify {[c.passed for c in runs['hypothesis']]}, fuzz {[c.passed for c in runs['random']]}")


def _walk(target: str, examples: int, mode: int) -> Certificate:
    state, contract = checks.Checks.state, checks.Checks.contract
    try:
        if mode >= 1:
            checks.Checks.state = lambda self, *a, **k: []  # type: ignore[method-assign]
        if mode >= 2:
            checks.Checks.contract = lambda self, *a, **k: None  # type: ignore[method-assign]
        return certify(target, examples=examples, seed=0, out_dir=Path(tempfile.mkdtemp()), driver="random",
                       **WALK_CELLS)  # fmt: skip
    finally:
        checks.Checks.state, checks.Checks.contract = state, contract  # type: ignore[method-assign]


def check_costs(target: str, examples: int, repeats: int, say: Callable[[str], None]) -> None:
    modes = list(range(len(CHECK_MODES)))
    runs: dict[int, list[Certificate]] = {m: [] for m in modes}
    for order in rounds(repeats, CHECK_MODES):
        for name in order:
            mode = CHECK_MODES.index(name)
            runs[mode].append(_walk(target, examples, mode))
    steps = {c.total_steps for m in modes for c in runs[m]}
    if len(steps) != 1:
        raise AssertionError(f"the walk differs between modes: {sorted(steps)} steps")
    say(f"{target}, {examples} examples per cell, seed 0, the fuzz walk, {repeats} rounds; {steps.pop():,} steps a run")
    for m in modes:
        rates = [_rate(c) for c in runs[m]]
        us = [1e6 / r for r in rates]
        say(f"{CHECK_MODES[m]:<32} {statistics.median(rates):>10,.0f} steps/s  "
            f"{spread(us, '{:.0f} µs')} a step")  # fmt: skip
    shares = [1 - none.seconds / full.seconds for full, none in zip(runs[0], runs[modes[-1]])]
    say(f"the checks' share of a checked step: {spread([100 * s for s in shares], '{:.0f}%')}")


def profile(target: str, examples: int, rows: int, say: Callable[[str], None]) -> None:
    sizes: list[tuple[int, int]] = []
    check = driver.Harness.check

    def counted(self: driver.Harness, index: int, op: object, snap: Any, found: list) -> None:  # type: ignore[type-arg]
        sizes.append((len(snap.nodes), snap.capacity))
        check(self, index, op, snap, found)  # type: ignore[arg-type]

    load_factory(target)  # imported before the profile starts: its import is not a step's time
    driver.Harness.check = counted  # type: ignore[method-assign]
    prof = cProfile.Profile()
    try:
        prof.enable()
        cert = _walk(target, examples, 0)
        prof.disable()
    finally:
        driver.Harness.check = check  # type: ignore[method-assign]
    steps = cert.total_steps
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    own = sorted(((tt, calls, where) for where, (_, calls, tt, _, _) in stats.items()), reverse=True)
    total = sum(tt for tt, _, _ in own)
    nodes = sum(n for n, _ in sizes) / len(sizes)
    slots = sum(c for _, c in sizes) / len(sizes)
    say(f"{target}, {examples} examples per cell, seed 0, the fuzz walk, every check on, one profiled run")
    say(f"{steps:,} checked steps; a checked state has {nodes:.1f} nodes (the root included) and {slots:.0f} device "
        "slots on average")  # fmt: skip
    say(f"{'own time':>9} {'calls/step':>11}  function")
    for tt, calls, (path, line, name) in own[:rows]:
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}" if line else path
        say(f"{tt / total:>9.1%} {calls / steps:>11.1f}  {name} ({where})")


def _wheel(root: Path, rev: str, where: Path) -> Path:
    """Commit `rev` of the checkout at `root`, built as a wheel and installed into a bare site-packages."""
    src, dist, site = where / "src", where / "dist", where / "site-packages"
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "--prefix=src/"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], check=True)
    (wheel,) = dist.glob("kvcert-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    return site


def _certify_from(site: Path | None, target: str, out: Path, args: Sequence[str], cwd: Path) -> dict[str, Any]:
    """`kvcert certify` in a fresh interpreter: from `site` (a baseline wheel) or, when None, from this checkout."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    code = (
        "import os, sys, kvcert.conformance.cli as cli\n"
        "site = os.environ.get('PYTHONPATH')\n"
        "assert site is None or cli.__file__.startswith(site), cli.__file__\n"
        "sys.argv[0] = 'kvcert'\n"
        "cli.main()\n"
    )
    cmd = [sys.executable, "-c", code, "certify", target, "--json", str(out), "--out", str(cwd / "failures"), *args]
    subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, check=False)
    cert: dict[str, Any] = json.loads(out.read_text())
    return cert


def versus(root: Path, rev: str, target: str, args: Sequence[str], repeats: int, say: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        site = _wheel(root, rev, tmp)
        rates: dict[str, list[float]] = {"baseline": [], "new": []}
        first: dict[str, Path] = {}
        for r, order in enumerate(rounds(repeats, ("baseline", "new"))):
            for side in order:
                out = tmp / f"{side}-{r}.json"
                cert = _certify_from(site if side == "baseline" else None, target, out, args, tmp)
                cells = cert["cells"]
                rates[side].append(sum(c["steps"] for c in cells) / sum(c["seconds"] for c in cells))
                first.setdefault(side, out)
        same = subprocess.run([sys.executable, "-m", "kvcert.conformance.cli", "same", str(first["baseline"]),
                               str(first["new"])], capture_output=True, text=True, cwd=root)  # fmt: skip
        verdict = "same traces" if same.returncode == 0 else "other traces: the generator changed"
        say(f"{target}, baseline {rev}, {repeats} rounds, certify options: {' '.join(args) or '(defaults)'}")
        say(f"baseline {statistics.median(rates['baseline']):,.0f} steps/s, new {statistics.median(rates['new']):,.0f} "
            f"steps/s; new over baseline {spread([n / b for b, n in zip(rates['baseline'], rates['new'])])} "
            f"({verdict})")  # fmt: skip


def run(
    question: str,
    target: str,
    *,
    examples: int,
    repeats: int,
    rows: int = 30,
    rev: str = "",
    args: Sequence[str] = (),
    root: Path = Path(),
    say: Callable[[str], None] = print,
) -> None:
    """Answer one of `QUESTIONS` about `target`."""
    if question not in QUESTIONS:
        raise ValueError(f"unknown question {question!r}; one of {QUESTIONS}")
    if repeats < 1 or examples < 1:
        raise ValueError("repeats and examples must be at least 1")
    if question == "drivers":
        drivers(target, examples, repeats, say)
    elif question == "checks":
        check_costs(target, examples, repeats, say)
    elif question == "profile":
        profile(target, examples, rows, say)
    else:
        if not rev:
            raise ValueError("versus needs a baseline commit (--versus REV)")
        versus(root, rev, target, ["--examples", str(examples), *args], repeats, say)
