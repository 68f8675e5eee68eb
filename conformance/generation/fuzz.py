"""`kvcert fuzz`: the certification machine driven by a seeded random walk instead of Hypothesis.

The machine's rules take every choice as a primitive draw (`conformance.generation.draws`: an integer in a
range, a boolean, spans that label them). Hypothesis's `ConjectureData` records, mutates and
replays those choices: what finds a bug in a small budget, and what a long run does not need.
`RandomChoices` answers the same draws from a seeded PRNG, so a fuzz run is the same op
vocabulary, the same swarm (each example switches a random subset of rules off), the same
harness checks after every step, and the same failure path: the failing example's ops are
shrunk as a trace (`conformance.generation.shrink`), replayed on a fresh backend and saved.

Determinism: example `k` of cell `c` draws from `Random("kvcert-fuzz/<seed>/<k>")`, whatever ran
before it, so `--examples N` is one exact run and a `--seconds` run is a prefix of one (how many
examples fit is the clock's business, what each example did is the seed's).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, Optional

from kvcert.conformance.generation.runner import rules_of, run_example

__all__ = ["RandomChoices", "run_random"]


class RandomChoices:
    """The primitive choices `conformance.generation.draws` and the machine's rules make, from a seeded PRNG.

    Stands in for Hypothesis's `ConjectureData` (duck-typed: the draws call nothing else).
    """

    __slots__ = ("_random",)

    def __init__(self, seed: str) -> None:
        self._random = random.Random(seed).random

    def draw_integer(self, low: int, high: int) -> int:
        return low + int(self._random() * (high - low + 1))

    def draw_boolean(self, p: float = 0.5) -> bool:
        return self._random() < p

    def start_span(self, label: int) -> None:
        pass

    def stop_span(self, discard: bool = False) -> None:
        pass


def run_random(
    machine: Callable[[], Any],
    steps: int,
    seed: int,
    *,
    examples: Optional[int] = None,
    seconds: Optional[float] = None,
) -> int:
    """Run examples of `machine` as `runner.run_machine` does, until `examples` ran or `seconds` passed.

    Raises what a rule or the teardown raised (the machine keeps the failing example's ops). Returns
    the examples run. At least one of `examples` and `seconds` bounds the run.
    """
    if examples is None and seconds is None:
        raise ValueError("bound the run: examples, seconds or both")
    init, rules = rules_of(machine)  # type: ignore[arg-type]
    if not rules:
        raise TypeError("a machine with no rules")
    deadline = time.perf_counter() + seconds if seconds is not None else float("inf")
    k = 0
    while (examples is None or k < examples) and time.perf_counter() < deadline:
        run_example(machine, RandomChoices(f"kvcert-fuzz/{seed}/{k}"), init, rules, steps)
        k += 1
    return k
