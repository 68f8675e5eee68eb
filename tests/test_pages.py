"""The pure page functions: their PEP 316 contracts under Hypothesis, and brute-force references.

`test_docstring_contracts` evaluates the very `pre:` / `post:` lines CrossHair
checks (scripts/crosshair.sh), on random inputs: a fast mirror that runs on every
`pytest`. The CrossHair run itself is opt-in here (KVCERT_CROSSHAIR=1) because
CI runs the script directly and it takes a minute or more.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _contracts import check_contract, conditions, contracted
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.spec import pages
from kvcert.spec.pages import (
    RANKED_POLICIES,
    common_prefix_len,
    first_page,
    is_aligned,
    match_len,
    min_rank_ids,
    overshoot_ok,
    page_ceil,
    page_floor,
    policy_rank,
    split_key,
)
from kvcert.spec.types import POLICIES

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=300, deadline=None)

# --------------------------------------------------------------------------- the docstring contracts

CONTRACTED = contracted(pages)

tokens = st.lists(st.integers(0, 2), max_size=12)
sequences = st.one_of(tokens, tokens.map(tuple))
small = st.integers(-3, 40)


@st.composite
def _split_args(draw: st.DrawFn) -> dict[str, Any]:
    ps = draw(st.integers(1, 5))
    n_pages = draw(st.integers(2, 4))
    key = tuple(draw(st.lists(st.integers(0, 9), min_size=ps * n_pages, max_size=ps * n_pages)))
    return {"key": key, "at": ps * draw(st.integers(1, n_pages - 1)), "page_size": ps}


STRATEGIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "page_floor": st.fixed_dictionaries({"n": st.integers(-3, 300), "page_size": st.integers(-1, 17)}),
    "page_ceil": st.fixed_dictionaries({"n": st.integers(-3, 300), "page_size": st.integers(-1, 17)}),
    "is_aligned": st.fixed_dictionaries({"n": st.integers(-20, 300), "page_size": st.integers(-1, 17)}),
    "common_prefix_len": st.fixed_dictionaries({"a": sequences, "b": sequences}),
    "match_len": st.fixed_dictionaries({"a": sequences, "b": sequences, "page_size": st.integers(-1, 6)}),
    "split_key": _split_args(),
    "first_page": st.fixed_dictionaries({"key": sequences, "page_size": st.integers(-1, 6)}),
    "policy_rank": st.fixed_dictionaries(
        {
            "policy": st.sampled_from([*RANKED_POLICIES, "random"]),
            "last_access": small,
            "hit_count": small,
            "creation": small,
            "priority": small,
            "protected_threshold": st.integers(0, 4),
            "depth": st.integers(0, 24),
            "size": st.integers(0, 12),
            "history": st.integers(0, 30),
            "threshold": st.integers(0, 12),
            "next_prompt_estimate": st.integers(0, 8),
        }
    ),
    "min_rank_ids": st.fixed_dictionaries(
        {
            "candidates": st.lists(
                st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=2).map(tuple), st.integers(0, 5)),
                max_size=6,
            )
        }
    ),
    "overshoot_ok": st.fixed_dictionaries(
        {"freed": st.integers(-1, 20), "asked": st.integers(-2, 20), "last_node_size": st.integers(-1, 20)}
    ),
}


def test_every_contracted_function_has_a_strategy() -> None:
    assert set(CONTRACTED) == set(STRATEGIES)
    assert sum(len(conditions(fn)[1]) for fn in CONTRACTED.values()) >= 20


def test_ranked_policies_are_the_spec_policies() -> None:
    assert set(RANKED_POLICIES) == set(POLICIES)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_docstring_contracts(name: str) -> None:
    check_contract(pages, CONTRACTED[name], STRATEGIES[name], examples=300)


# --------------------------------------------------------------------------- brute-force references


@FAST
@given(st.integers(0, 300), st.integers(1, 17))
def test_page_floor_is_the_largest_page_multiple(n: int, ps: int) -> None:
    assert page_floor(n, ps) == max(k for k in range(0, n + 1, ps))
    assert is_aligned(n, ps) == (page_floor(n, ps) == n)
    assert page_ceil(n, ps) == min(k for k in range(0, n + ps, ps) if k >= n)


@FAST
@given(sequences, sequences)
def test_common_prefix_len_brute_force(a: Any, b: Any) -> None:
    n = max(i for i in range(min(len(a), len(b)) + 1) if list(a[:i]) == list(b[:i]))
    assert common_prefix_len(a, b) == n


@FAST
@given(sequences, sequences, st.integers(1, 5))
def test_match_len_brute_force(a: Any, b: Any, ps: int) -> None:
    n = max(i for i in range(0, min(len(a), len(b)) + 1, ps) if list(a[:i]) == list(b[:i]))
    assert match_len(a, b, ps) == n


def test_page_examples() -> None:
    assert page_floor(7, 4) == 4 and page_floor(8, 4) == 8 and page_floor(3, 4) == 0
    assert page_ceil(7, 4) == 8 and page_ceil(8, 4) == 8 and page_ceil(0, 4) == 0 and page_ceil(1, 16) == 16
    assert not is_aligned(-4, 4) and is_aligned(0, 4) and not is_aligned(6, 4)
    assert match_len([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9], 2) == 4
    assert match_len([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9], 4) == 4
    assert match_len([1, 2, 3], [1, 2, 3], 2) == 2
    assert split_key((1, 2, 3, 4, 5, 6), 4, 2) == ((1, 2, 3, 4), (5, 6))
    assert first_page([7, 8, 9, 10], 2) == (7, 8)


# Five leaves whose metadata make every policy pick a different first victim:
#             creation  last_access  hits  priority
LEAVES = {
    "W": (1, 6, 3, 5),  # created first             -> fifo's victim
    "X": (2, 2, 2, 5),  # used longest ago          -> lru's victim
    "Y": (3, 7, 1, 5),  # fewest hits               -> lfu's victim
    "Z": (4, 8, 2, 5),  # used most recently        -> mru's victim
    "V": (5, 5, 4, 0),  # lowest priority           -> priority's victim
}
FIRST_VICTIM = {"fifo": "W", "lru": "X", "lfu": "Y", "mru": "Z", "priority": "V"}


@pytest.mark.parametrize("policy", sorted(FIRST_VICTIM))
def test_policy_rank_orders_leaves_as_the_policy_says(policy: str) -> None:
    ranks = [(policy_rank(policy, la, hits, c, prio), name) for name, (c, la, hits, prio) in LEAVES.items()]
    assert min(ranks)[1] == FIRST_VICTIM[policy]


def test_slru_protects_nodes_hit_often_enough() -> None:
    # SGLang's SLRUStrategy: (hit_count >= protected_threshold, last_access); the threshold is SGLang's 2 by default.
    assert policy_rank("slru", 9, 1, 0, 0) < policy_rank("slru", 1, 2, 0, 0)  # probationary before protected
    assert policy_rank("slru", 1, 2, 0, 0) < policy_rank("slru", 2, 5, 0, 0)  # recency within a segment
    assert policy_rank("slru", 9, 2, 0, 0, protected_threshold=3) < policy_rank("slru", 1, 3, 0, 0, protected_threshold=3)


def test_tlru_evicts_the_tel_safe_tail_first() -> None:
    # A branch 12 tokens deep (history 12), threshold 6, next prompt 2: 12 + 2 - 6 = 8 tokens must stay cached, so
    # a node whose ancestors hold 8 or more (it starts at 8 or deeper) is TEL-safe and goes before any other.
    def rank(last_access: int, depth: int, size: int) -> tuple[int, ...]:
        return policy_rank(
            "tlru", last_access, 0, 0, 0, depth=depth, size=size, history=12, threshold=6, next_prompt_estimate=2
        )

    assert rank(9, 12, 4) < rank(1, 8, 4)  # starts at 8: safe, though used later
    assert rank(1, 8, 4) == (0, 1)  # starts at 4: not safe
    assert rank(9, 12, 4) == (-1, 9)
    # the history sets the budget: the same node on a branch only 8 deep (budget 4) is safe
    assert policy_rank("tlru", 1, 0, 0, 0, depth=8, size=4, history=8, threshold=6, next_prompt_estimate=2)[0] == -1


def test_policy_rank_tie_breaks() -> None:
    # lfu and priority fall back to recency on a tie of their primary key; lru and mru have only recency.
    assert policy_rank("lfu", 1, 3, 0, 0) < policy_rank("lfu", 2, 3, 0, 0)
    assert policy_rank("priority", 1, 0, 0, 3) < policy_rank("priority", 2, 0, 0, 3)
    assert policy_rank("lru", 1, 9, 9, 9) == policy_rank("lru", 1, 0, 0, 0)
    assert policy_rank("fifo", 9, 9, 1, 9) == policy_rank("fifo", 0, 0, 1, 0)


@FAST
@given(STRATEGIES["min_rank_ids"])
def test_min_rank_ids_brute_force(args: dict[str, Any]) -> None:
    cands = args["candidates"]
    want = [i for r, i in cands if not any(other < r for other, _ in cands)]
    assert min_rank_ids(cands) == want


def test_overshoot_examples() -> None:
    assert overshoot_ok(0, 0, 0)  # nothing evicted is never an overshoot
    assert overshoot_ok(5, 4, 2)  # without the last node only 3 of 4: it was needed
    assert not overshoot_ok(5, 3, 2)  # 3 were freed before the last node: it was not
    assert not overshoot_ok(1, 0, 1)  # asked for nothing


# --------------------------------------------------------------------------- CrossHair gate
# CI runs scripts/crosshair.sh over spec/pages.py directly; this proves the gate can fail.


def _gate(*targets: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "crosshair.sh"), *targets],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )


def test_crosshair_gate_fails_on_a_broken_contract(tmp_path: Path) -> None:
    source = (ROOT / "spec" / "pages.py").read_text()
    unfloored = "    return page_floor(common_prefix_len(a, b), page_size)\n"
    assert source.count(unfloored) == 1
    (tmp_path / "pages.py").write_text(source.replace(unfloored, "    return common_prefix_len(a, b)\n"))
    run = _gate(str(tmp_path / "pages.py"), KVCERT_CROSSHAIR_CONDITION="2", KVCERT_CROSSHAIR_PATH="1")
    assert run.returncode == 1
    assert "error:" in run.stdout and "match_len" in run.stdout
