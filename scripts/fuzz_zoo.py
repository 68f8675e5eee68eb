"""The bug zoo under both drivers: each mutant certified by Hypothesis and by `kvcert fuzz`'s random walk, at the
same examples per cell (200 x the mutant's budget), 50 steps, seed 0, on the mutant's own cells, stopping at the
first failing cell. Prints one line per mutant (KILL or live, steps, seconds) and the kill counts.

    python scripts/fuzz_zoo.py [MUTANT,...]      # default: every mutant of conformance.zoo.MUTANTS (~30 min)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from kvcert.conformance import zoo
from kvcert.conformance.certification.certify import certify


def main() -> None:
    names = set(sys.argv[1].split(",")) if len(sys.argv) > 1 and sys.argv[1] else {m.name for m in zoo.MUTANTS}
    kills = {"hypothesis": 0, "random": 0}
    out = Path(tempfile.mkdtemp())
    for m in zoo.MUTANTS:
        if m.name not in names:
            continue
        row = []
        for driver in ("hypothesis", "random"):
            t = time.time()
            c = certify(
                f"kvcert.conformance.zoo:{m.name}",
                factory=zoo.build(m),
                examples=200 * m.budget,
                steps=50,
                seed=0,
                page_sizes=m.page_sizes,
                policies=m.policies,
                fail_fast=True,
                write_policies=m.write_policies,
                device_cells=not m.write_policies,
                prefetch_policies=m.prefetch_policies,
                host_cells=not m.prefetch_policies,
                out_dir=out,
                driver=driver,
            )
            kills[driver] += not c.passed
            row.append(f"{driver}:{'KILL' if not c.passed else 'live'} {c.total_steps} {time.time() - t:.1f}s")
        print(m.name, *row, flush=True)
    print(kills, len(names))


if __name__ == "__main__":
    main()
