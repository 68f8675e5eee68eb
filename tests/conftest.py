"""Test order for CI's two workers (`pytest -n 2 --dist loadfile --no-loadscope-reorder`, scripts/test.sh): xdist
then hands out files in collection order, and the served SGLang file goes first, so the short files fill in beside
it instead of it running alone at the end while the other worker idles. Order only: no test depends on another."""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    # Real SGLang servers, about 6 min on one worker that mostly waits on them: the other worker works meanwhile.
    # The zoo's mutant self-test stays last: it runs its own pool of two, so nothing idles beside it.
    "test_served_sglang.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
