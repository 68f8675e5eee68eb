"""How often generation kills one zoo mutant: its cells at each seed, at a budget you choose.

    .venv/bin/python scripts/kill_rate.py prefetch_end_not_an_access --seeds 0-7 --examples 600 [--jobs 2]

`--examples` is per cell, as `kvcert certify` counts it (the mutant's own budget multiplier is not
applied: the figure is the one you ask for). Prints one line per seed (killed at which cell and
after how many seconds, or missed) and the count.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import time
from dataclasses import replace

from kvcert.conformance import zoo


def _one(name: str, examples: int, seed: int) -> tuple[int, bool, str, float]:
    (mutant,) = [m for m in zoo.MUTANTS if m.name == name]
    start = time.perf_counter()
    cert = zoo.run_mutant(replace(mutant, budget=1), examples=examples, steps=50, seed=seed)
    failed = next((c for c in cert.cells if not c.passed), None)
    cell = f"P={failed.page_size} {failed.write_policy or 'device-only'}" if failed else ""
    return seed, failed is not None, cell, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mutant")
    ap.add_argument("--seeds", default="0-7", help="A-B or a comma list")
    ap.add_argument("--examples", type=int, default=600)
    ap.add_argument("--jobs", type=int, default=2)
    opts = ap.parse_args()
    if "-" in opts.seeds:
        low, high = (int(x) for x in opts.seeds.split("-"))
        seeds = list(range(low, high + 1))
    else:
        seeds = [int(x) for x in opts.seeds.split(",")]
    killed = 0
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(opts.jobs, mp_context=spawn) as pool:
        for seed, dead, cell, seconds in pool.map(
            _one, [opts.mutant] * len(seeds), [opts.examples] * len(seeds), seeds
        ):
            killed += dead
            print(f"seed {seed}: {'killed in ' + cell if dead else 'missed'} ({seconds:.0f} s)", flush=True)
    print(f"{opts.mutant} at {opts.examples} examples per cell: killed at {killed} of {len(seeds)} seeds")


if __name__ == "__main__":
    main()
