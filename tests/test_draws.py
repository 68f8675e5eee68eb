"""What rules draw (`conformance.generation.draws`): one primitive choice per value, read from Hypothesis's choice sequence."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from kvcert.conformance.generation.draws import MAX_PAGES, Draws, booleans, integers, sampled_from, tokens_of
from kvcert.conformance.generation.hypothesis_compat import ConjectureData


def _fed(choices: Sequence[object]) -> tuple[Draws, ConjectureData]:
    data = ConjectureData.for_choices(list(choices))  # type: ignore[arg-type]
    return Draws(data), data


def test_each_value_is_the_choice_it_was_fed() -> None:
    d, data = _fed([3, True, 2, False])
    assert d.integer(0, 7, "at") == 3
    assert d.boolean("warm") is True
    assert d.choice(["x", "y", "z"], "pick") == "z"
    assert d.boolean() is False
    assert len(data.choices) == 4


def test_a_forced_value_takes_no_choice() -> None:
    d, data = _fed([])
    assert d.integer(4, 4) == 4
    assert d.choice(["only"]) == "only"
    assert len(data.choices) == 0


def test_choosing_from_nothing_is_a_clear_error() -> None:
    d, _ = _fed([])
    with pytest.raises(ValueError, match="nothing to choose from for handle"):
        d.choice([], "handle")
    with pytest.raises(ValueError, match="sampled_from of nothing"):
        sampled_from([])


def test_codes_grow_while_the_choices_say_more_and_stop_at_the_maximum() -> None:
    d, _ = _fed([True, True, False, 1, 3])
    assert d.codes(0, MAX_PAGES) == [1, 3]
    d, _ = _fed([True, 0, 2])  # a minimum of 1, one more, then the maximum of 2 stops asking
    assert d.codes(1, 2) == [0, 2]
    d, data = _fed([])
    assert d.codes(0, 0) == [] and not data.choices


def test_cut_is_the_whole_key_or_any_cut() -> None:
    d, _ = _fed([False])
    assert d.cut(4) == 4
    d, _ = _fed([True, 1])
    assert d.cut(4) == 1


def test_subset_keeps_the_options_the_choices_keep_in_order() -> None:
    d, _ = _fed([True, False, True])
    assert d.subset(["error", "drop", "corrupt"]) == ["error", "corrupt"]


def test_rule_arguments_are_one_integer_choice() -> None:
    data = ConjectureData.for_choices([1, 0, 2])
    assert booleans().draw(data) is True
    assert integers(0, 3).draw(data) == 0
    assert sampled_from("abc").draw(data) == "c"


def test_random_codes_cover_every_length_and_code() -> None:
    lengths: Counter[int] = Counter()
    codes: Counter[int] = Counter()
    for i in range(400):
        data = ConjectureData(random=__import__("random").Random(i))
        got = Draws(data).codes(0, MAX_PAGES)
        lengths[len(got)] += 1
        codes.update(got)
    assert set(lengths) == set(range(MAX_PAGES + 1))
    assert lengths[1] > lengths[2] > lengths[4], "below the maximum, shorter keys are likelier"
    assert set(codes) == {0, 1, 2, 3}


def test_tokens_of_page_codes() -> None:
    assert tokens_of([0, 3], 2, tail=1) == (0, 0, 0, 1, 2)
