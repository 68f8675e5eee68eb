"""Checked steps per second: `kvcert fuzz`'s random walk beside Hypothesis-driven certify, same cells, same process.

    python scripts/fuzz_speed.py [TARGET] [EXAMPLES]     # default kvcert.gpu:factory, 200 examples per cell

Both drivers run the same machine, harness and checks over every cell of the target (device, host and storage);
each gets the same number of examples per cell, and the table prints steps/s per cell and in all, with the ratio.
Measured, never asserted (docs/bench.md).
"""

from __future__ import annotations

import sys
from pathlib import Path
from tempfile import mkdtemp

from kvcert.conformance.certification.certify import certify


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else "kvcert.gpu:factory"
    examples = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    out = Path(mkdtemp())
    runs = {d: certify(target, examples=examples, seed=0, out_dir=out, driver=d) for d in ("hypothesis", "random")}
    h, r = runs["hypothesis"], runs["random"]
    print(f"{target}, {examples} examples per cell, seed 0")
    print(f"{'cell':<58} {'certify steps/s':>16} {'fuzz steps/s':>13} {'ratio':>6}")
    for a, b in zip(h.cells, r.cells):
        name = f"ps{a.page_size} {a.policy} {a.write_policy or 'device'}"
        ra, rb = a.steps / a.seconds, b.steps / b.seconds
        print(f"{name:<58} {ra:>16,.0f} {rb:>13,.0f} {rb / ra:>5.2f}x")
    ra, rb = h.total_steps / h.seconds, r.total_steps / r.seconds
    print(f"{'all cells':<58} {ra:>16,.0f} {rb:>13,.0f} {rb / ra:>5.2f}x")
    print(
        f"steps: certify {h.total_steps:,} in {h.seconds:.1f}s, fuzz {r.total_steps:,} in {r.seconds:.1f}s;"
        f" verdicts {h.passed}, {r.passed}"
    )


if __name__ == "__main__":
    main()
