"""Decisions as data: one frozen type per choice SPEC.md §6 leaves open, handed to the oracle per operation."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace
from pathlib import Path

import pytest
from _refcache import put

from kvcert.conformance.harness import decide, driver
from kvcert.conformance.harness.driver import run_trace
from kvcert.refimpl import RefCache, alternative
from kvcert.spec import decisions, profiles
from kvcert.spec.ops import Evict, Insert, Match, Op
from kvcert.spec.types import CacheConfig

SPEC = Path(__file__).resolve().parents[1] / "spec" / "SPEC.md"


def _type_name(choice_id: str) -> str:
    return "".join(part.capitalize() for part in choice_id.split("_"))


def test_every_open_choice_is_one_frozen_type_named_as_the_spec_names_it() -> None:
    text = SPEC.read_text()
    table = text[text.index("### 6.1 ") : text.index("### 6.2 ")]
    in_spec = set(re.findall(r"^\| `([A-Z_]+)` \|", table, re.M))
    assert in_spec == {c.id for c in profiles.CHOICES}
    fields = {f.name: f.type for f in dataclasses.fields(decisions.Decisions)}
    for choice in profiles.CHOICES:
        kind = getattr(decisions, _type_name(choice.id))
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert fields[choice.id.lower()] == kind.__name__
    assert len(fields) == len(profiles.CHOICES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decisions.SGLANG_0523.rank.free = True  # type: ignore[misc]


# Four 2-token sequences on an 8-token pool, then an eviction of 5 tokens: three victims, one order decides.
CONFIG = CacheConfig(capacity=8, page_size=1, policy="lru")
TRACE: list[Op] = [
    Insert(None, (1, 2)),
    Insert(None, (3, 4)),
    Insert(None, (5, 6)),
    Insert(None, (7, 8)),
    Match(None, (3, 4)),
    Evict(5),
    Insert(None, (9, 9)),
]


def _attempts(monkeypatch: pytest.MonkeyPatch, reports: bool) -> list[list[decide.Attempt]]:
    """The attempts the harness made at each step of TRACE on the alternative model under the core, with the
    backend reporting its choices or not; and that the oracle kept no decision between steps."""
    made: list[list[decide.Attempt]] = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(decide.attempts(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(driver, "attempts", spy)
    caps = replace(alternative.capabilities, reports_choices=reports)  # type: ignore[attr-defined]
    seen: list[tuple[bool, object]] = []
    harness = run_trace(alternative(CONFIG), CONFIG, caps, [], quiesce=False, close=False)
    try:
        for op in TRACE:
            harness.step(op)
            seen.append((harness.oracle.decided is harness.oracle.own, harness.oracle.room_left))
    finally:
        harness.close()
    assert seen == [(True, None)] * len(TRACE), "the oracle keeps no decision of another's between steps"
    own = harness.oracle.own
    assert own.rank.pick is None and own.demote.pick is None and own.reclaim.drop is None
    return made


def test_a_backend_that_reports_its_choices_is_followed_without_search(monkeypatch: pytest.MonkeyPatch) -> None:
    reported = _attempts(monkeypatch, reports=True)
    assert all(len(step) == 1 for step in reported)
    hidden = _attempts(monkeypatch, reports=False)
    assert max(len(step) for step in hidden) == 2, "three victims, not reported: rank order, then the largest last"


def test_the_oracle_follows_the_decision_it_is_handed_then_its_own() -> None:
    config = CacheConfig(capacity=4, page_size=1, policy="lru")
    cache = RefCache(config)
    first, _ = put(cache, [1, 2]), put(cache, [3, 4])
    newest = decisions.Decisions(rank=decisions.Rank(free=True, pick=lambda tied: tied[-1]))
    with cache.deciding(newest):
        assert cache.decided is newest
        freed = cache.evict(2, choose=newest.rank.pick)
    assert freed == 2 and first in cache.nodes, "the handed chooser took the other leaf"
    assert cache.decided is cache.own
