"""Every use kvcert makes of Hypothesis's internals, in one module.

The generator drives Hypothesis below its public API in three places, each for a reason the public API does not
serve: `ConjectureData` and `calc_label_from_name` let the suite's own draws (`draws.Draws`) and rules
(`runner.rule`) read from Hypothesis's choice sequence with labels, so that shrinking works on them;
`unwrap_strategies` resolves a lazy strategy to the one it stands for; `providers` holds the pool of module
constants that `determinism.fixed_generation` empties while a run generates. requirements/core.txt pins the
Hypothesis these were written against; a release that moves one fails here, at import, not in a run.
"""

from __future__ import annotations

from typing import Any

from hypothesis.internal.conjecture.data import ConjectureData
from hypothesis.internal.conjecture.utils import calc_label_from_name
from hypothesis.strategies._internal.lazy import unwrap_strategies

providers: Any  # the module, or None; its private names are what fixed_generation swaps
try:
    from hypothesis.internal.conjecture import providers
except ImportError:  # pragma: no cover - Hypothesis before 6.131 harvests no constants, so there is nothing to empty
    providers = None

__all__ = ["ConjectureData", "calc_label_from_name", "providers", "unwrap_strategies"]
