"""The refactor changes no verdict: every corpus case gives exactly the result recorded before it.

See `tests/_corpus.py` for what the corpus holds and how its results were recorded (at b974eca,
before the harness and `kvcert.gpu` were split into components, issue 12).
"""

from __future__ import annotations

import json

import pytest
from _corpus import EXPECTED, Case, cases, key, replay

EXPECTED_RESULTS: dict[str, dict[str, object]] = json.loads(EXPECTED.read_text())["results"]
AMENDED: dict[str, dict[str, object]] = json.loads((EXPECTED.parent / "amended.json").read_text())
"""Results a spec change altered on purpose, each with the change that did it (`why`), replacing the recorded one:
a refactor still has to give every other recorded result, and these the amended ones."""
CASES = cases()


def test_every_case_has_a_recorded_result_and_every_result_a_case() -> None:
    on_disk = {key(c) for c in CASES}
    assert len(on_disk) == len(CASES), "two cases share a name"
    assert on_disk == set(EXPECTED_RESULTS), (
        f"missing results {sorted(on_disk - set(EXPECTED_RESULTS))[:3]}, "
        f"results without a case {sorted(set(EXPECTED_RESULTS) - on_disk)[:3]}"
    )


def test_the_corpus_has_failures_and_passes_of_every_kind() -> None:
    """A corpus of passes alone could not tell a refactor that stopped checking from one that kept checking."""
    verdicts = {(k.split("/")[0], r["verdict"]) for k, r in EXPECTED_RESULTS.items()}
    assert {
        ("zoo", "fail"),
        ("zoo", "pass"),
        ("directed", "fail"),
        ("generated", "fail"),
        ("generated", "pass"),
    } <= verdicts
    zoo_own = [r for c in CASES if c.name.startswith("zoo/") and "zoo:" in c.target for r in [EXPECTED_RESULTS[key(c)]]]
    assert zoo_own and all(r["verdict"] == "fail" for r in zoo_own), "a zoo counterexample that passes its mutant"


@pytest.mark.parametrize("case", CASES, ids=key)
def test_same_result_as_recorded(case: Case) -> None:
    amended = AMENDED.get(key(case))
    assert replay(case) == (amended["result"] if amended is not None else EXPECTED_RESULTS[key(case)])


def test_each_amendment_names_its_spec_change_and_changes_a_result() -> None:
    """An amendment exists only where a deliberate spec change altered the recorded result, and says which."""
    assert set(AMENDED) <= set(EXPECTED_RESULTS)
    for name, amended in AMENDED.items():
        assert "SPEC.md" in str(amended["why"]), name
        assert amended["result"] != EXPECTED_RESULTS[name], f"{name}: amended to the result it already had"
