"""Benchmarks, measured and never asserted. Every bench repeats its runs, alternating the order of the sides
(`rounds`), and prints each ratio as `spread` does: the median, then the lowest and highest round.

| module | owns |
|---|---|
| `meta` | `kvcert bench meta`: metadata calls/s of every implementation on one trace, as ratios |
| `driver` | what `meta` drives: the trace's `Request`, and the `Driver` each implementation's driver subclasses |
| `sglang` | `meta`'s SGLang drivers, imported when SGLang is |
| `harness` | `kvcert bench harness`: where a checked step's time goes |
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["rounds", "spread"]

T = TypeVar("T")


def rounds(repeats: int, sides: Sequence[T]) -> list[list[T]]:
    """The order of the sides in each of `repeats` rounds: as given, then reversed, and so on, so that a machine
    that slows down or speeds up during a bench weighs on every side alike."""
    return [list(sides) if r % 2 == 0 else list(reversed(sides)) for r in range(repeats)]


def spread(values: Sequence[float], fmt: str = "{:.2f}x") -> str:
    """A figure measured over rounds, as every bench prints it: the median, then the lowest and highest round."""
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))}–{fmt.format(max(values))}]"
