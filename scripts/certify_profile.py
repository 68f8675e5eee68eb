"""Where a certification's time goes: each part of a step, timed inside `run_cell`.

    .venv/bin/python scripts/certify_profile.py [--target kvcert.gpu:factory] [--page-size 4] [--examples 100]

Runs the device-only LRU cell, a write-through-selective cell, a write-back cell and a write-back
storage cell of one page size, with a timer around each part of the harness (the backend's
snapshot, the oracle's op and steering, the contract, the state invariants, the KV check, ...),
the rules' draws and the machine's setup and teardown, and prints each part's share of the
cells' seconds and its microseconds per step. Parts nest (the state check holds the invariants
and the KV check; a rule's run holds its steps and draws); what no part holds is Hypothesis's
engine. The timers cost a little themselves: the steps/s printed is below an untimed run's.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvcert.conformance.generation.draws as draws
import kvcert.conformance.generation.machine as machine
import kvcert.conformance.generation.runner as runner
import kvcert.conformance.harness.checks as checks
import kvcert.conformance.harness.driver as driver
from kvcert.conformance.backend import capabilities_of
from kvcert.conformance.certification.certify import cells_for, load_factory, run_cell

SPENT: dict[str, float] = defaultdict(float)
ACTIVE: set[str] = set()


def timed(owner: Any, name: str, part: str) -> None:
    """Time every call of `owner.name` into `part`; a call inside a call of the same part counts once."""
    real: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if part in ACTIVE:
            return real(*args, **kwargs)
        ACTIVE.add(part)
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            SPENT[part] += time.perf_counter() - start
            ACTIVE.discard(part)

    setattr(owner, name, wrapper)


PARTS: list[tuple[Any, str, str]] = [  # printed in this order, indented by nesting
    (machine.CacheMachine, "__init__", "example setup (backend, oracle, first check)"),
    (runner.Rule, "ready", "preconditions"),
    (runner.Rule, "run", "a rule's run (its draws and steps)"),
    (driver.Harness, "step", "  Harness.step"),
    (driver.Harness, "_snapshot", "    backend snapshot"),
    (driver.Harness, "_follow", "    oracle op and steering"),
    (checks.Checks, "contract", "    op contract"),
    (driver.Harness, "_record", "    ledger"),
    (driver.Harness, "spec_snapshot", "    oracle snapshot"),
    (checks.Checks, "state", "    state check (all of it)"),
    (checks, "check_snapshot", "      state invariants"),
    (checks.Checks, "kv", "      KV bytes"),
    (machine.CacheMachine, "teardown", "teardown (quiesce: its steps)"),
]
ORDER = [p for _, _, p in PARTS[:4]] + ["  draws"] + [p for _, _, p in PARTS[4:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="kvcert.gpu:factory")
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    for owner, name, part in PARTS:
        timed(owner, name, part)
    for name in ("integer", "boolean", "choice", "subset", "codes", "cut"):
        timed(draws.Draws, name, "  draws")
    factory = load_factory(opts.target)
    caps = capabilities_of(factory)
    configs, _ = cells_for(caps, [opts.page_size], ["lru"])
    device = [c for c in configs if not c.host_capacity][:1]
    wanted = [("write_through_selective", ""), ("write_back", ""), ("write_back", "timeout")]
    picked = device + [
        c for w, p in wanted for c in configs if c.host_capacity and (c.write_policy, c.prefetch_policy) == (w, p)
    ]
    steps, seconds = 0, 0.0
    for config in picked:
        cell = run_cell(
            factory,
            caps,
            config,
            examples=opts.examples,
            steps=50,
            seed=opts.seed,
            target=opts.target,
            out_dir=Path("kvcert-failures/profile"),
        )
        steps, seconds = steps + cell.steps, seconds + cell.seconds
    print(
        f"{opts.target}, page size {opts.page_size}, {len(picked)} cells: {steps} steps in {seconds:.1f}s "
        f"({steps / seconds:.0f} steps/s, timers on)"
    )
    for part in ORDER:
        spent = SPENT[part]
        print(f"{part:48s} {spent / seconds:6.1%}  {spent * 1e6 / steps:6.0f} us/step")


if __name__ == "__main__":
    main()
