"""Where a checked step's time goes: the fuzz walk over the same cells with every check on, with the state checks
off, and with the state and contract checks off, in one process.

    python scripts/harness_breakdown.py [TARGET] [EXAMPLES]     # default kvcert.gpu:factory, 60 examples per cell

The cells: page sizes 1, 4 and 16 under LRU, each on the device alone, with a write-through host tier, and with
write-through + best-effort storage. Switching checks off is done here by replacing `Checks.state` and
`Checks.contract` with no-ops (nothing in kvcert can switch them off). What is left with both off is the walk
itself: the backend's and the oracle's operations, their snapshots, steering and the bookkeeping; its rate is the
ceiling a faster harness alone could reach. Measured, never asserted (docs/ci.md).
"""

from __future__ import annotations

import sys
from pathlib import Path
from tempfile import mkdtemp

from kvcert.conformance.certification.certify import Certificate, certify
from kvcert.conformance.harness import checks

MODES = ("every check on", "state checks off", "state and contract checks off")


def run(target: str, examples: int, mode: int) -> Certificate:
    state, contract = checks.Checks.state, checks.Checks.contract
    try:
        if mode >= 1:
            checks.Checks.state = lambda self, *a, **k: []  # type: ignore[method-assign]
        if mode >= 2:
            checks.Checks.contract = lambda self, *a, **k: None  # type: ignore[method-assign]
        return certify(
            target,
            examples=examples,
            seed=0,
            out_dir=Path(mkdtemp()),
            driver="random",
            page_sizes=[1, 4, 16],
            policies=["lru"],
            write_policies=["write_through"],
            prefetch_policies=["best_effort"],
        )
    finally:
        checks.Checks.state, checks.Checks.contract = state, contract  # type: ignore[method-assign]


def rate(steps: int, seconds: float) -> str:
    return f"{steps / seconds:>22,.0f} steps/s ({1e6 * seconds / steps:>3.0f} µs)"


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else "kvcert.gpu:factory"
    examples = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    certs = [run(target, examples, m) for m in range(len(MODES))]
    print(f"{target}, {examples} examples per cell, seed 0, the fuzz walk")
    print(f"{'cell':<40}" + "".join(f"{m:>32}" for m in MODES))
    for cells in zip(*(c.cells for c in certs)):
        a = cells[0]
        name = f"ps{a.page_size} {a.policy} {a.write_policy or 'device'}"
        assert len({c.steps for c in cells}) == 1, "the same walk in every mode"
        print(f"{name:<40}" + "".join(rate(c.steps, c.seconds) for c in cells))
    full, none = certs[0], certs[-1]
    print(f"{'all cells':<40}" + "".join(rate(c.total_steps, c.seconds) for c in certs))
    share = 1 - none.seconds / full.seconds
    print(
        f"steps per mode: {full.total_steps:,}; the checks take {share:.0%} of a checked step; verdicts {[c.passed for c in certs]}"
    )


if __name__ == "__main__":
    main()
