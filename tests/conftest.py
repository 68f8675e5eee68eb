"""Collection order: the zoo first.

`scripts/test.sh` runs pytest in two workers, one test file per worker at a time
(`--dist loadfile`), handing files out in collection order. The zoo is the longest file by far
(every mutant in its own interpreter); started last, it ran alone at the end. Started first, the
other worker runs every other file beside it.
"""

from __future__ import annotations

import pytest

FIRST = ("test_zoo.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the order within files stays
