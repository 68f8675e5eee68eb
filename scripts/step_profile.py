"""Where a checked step's time goes, function by function: cProfile over the fuzz walk of `harness_breakdown`'s cells.

    python scripts/step_profile.py [TARGET] [EXAMPLES] [ROWS]   # default kvcert.gpu:factory, 60 examples, 30 rows

The walk is `harness_breakdown`'s with every check on. Prints the size of the states the walk checks
(nodes and device slots per backend snapshot, on average), then the functions that take the most time of
their own, each with its share of the walk and its calls per checked step. cProfile slows every call alike,
so the shares, not the times, are what to read. Measured, never asserted (docs/ci.md).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

from harness_breakdown import run  # this folder is first on sys.path: the same nine cells, every check on

from kvcert.conformance.certification.certify import load_factory
from kvcert.conformance.harness import driver


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else "kvcert.gpu:factory"
    examples = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    sizes: list[tuple[int, int]] = []
    check = driver.Harness.check

    def counted(self: driver.Harness, index: int, op: object, snap: driver.Snapshot, found: list) -> None:
        sizes.append((len(snap.nodes), snap.capacity))
        check(self, index, op, snap, found)  # type: ignore[arg-type]

    load_factory(target)  # imported before the profile starts: its import is not a step's time
    driver.Harness.check = counted  # type: ignore[method-assign]
    profile = cProfile.Profile()
    try:
        profile.enable()
        cert = run(target, examples, 0)
        profile.disable()
    finally:
        driver.Harness.check = check  # type: ignore[method-assign]
    steps = cert.total_steps
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    own = sorted(((tt, calls, where) for where, (_, calls, tt, _, _) in stats.items()), reverse=True)
    total = sum(tt for tt, _, _ in own)
    nodes = sum(n for n, _ in sizes) / len(sizes)
    slots = sum(c for _, c in sizes) / len(sizes)
    print(f"{target}, {examples} examples per cell, seed 0, the fuzz walk of harness_breakdown's nine cells")
    print(
        f"{steps:,} checked steps; a checked state has {nodes:.1f} nodes (the root included) and {slots:.0f} device slots on average"
    )
    print(f"{'own time':>9} {'calls/step':>11}  function")
    for tt, calls, (path, line, name) in own[:rows]:
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}" if line else path
        print(f"{tt / total:>9.1%} {calls / steps:>11.1f}  {name} ({where})")


if __name__ == "__main__":
    main()
