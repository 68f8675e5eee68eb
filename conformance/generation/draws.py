"""What the state machine's rules draw from: Hypothesis's choices, and the token patterns keys are made of.

Every value a rule draws is one of Hypothesis's primitive choices (an integer in a range, a
boolean), taken straight from its choice sequence. Drawing through strategies (`data.draw(st...)`)
made the same kind of choices but cost three to seven times as much per value (validation,
timing, a span and a recorded value per draw, a fresh `sampled_from` strategy per call), about a
seventh of a certification; the suite needs none of it, since it shrinks its failures as traces of
ops (`conformance.generation.shrink`) and never prints Hypothesis's report.

What it does need are the spans Hypothesis's engine mutates: it copies one span's choices over
another span of the same label, which is how a key drawn in one step comes back in a later one.
Each step is one span (`conformance.generation.runner`), and so is each key (`codes`) and each choice among
options (`choice`), labelled by what it means: without them, generation made half as many
load-backs that landed (host hits need a key to come back).

Token ids are drawn from a few *page patterns* so sequences share prefixes often, and one
pattern differs from another only in its last token, so matches diverge inside a page as well as
at page boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Optional, TypeVar

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from kvcert.conformance.generation.hypothesis_compat import ConjectureData, calc_label_from_name, unwrap_strategies

MAX_PAGES = 5
"""Pages in a drawn key at most."""
MORE = 0.75
"""The chance a drawn list of page codes grows by one more (while below its maximum): lengths fall off
geometrically, as Hypothesis's lists do, averaging about 2.3 of at most 5 pages."""
_T = TypeVar("_T")


class Draws:
    """What a rule draws from: Hypothesis's choice sequence itself, one primitive choice per value.

    Labels name what each choice means; they document the rules and cost nothing.
    """

    __slots__ = ("_data",)

    def __init__(self, data: ConjectureData) -> None:
        self._data = data

    def integer(self, low: int, high: int, label: str = "") -> int:
        """An integer in [low, high]; the simplest choice is `low`."""
        return self._data.draw_integer(low, high) if high > low else low

    def boolean(self, label: str = "", p: float = 0.5) -> bool:
        """True with probability `p`; the simplest choice is False."""
        return self._data.draw_boolean(p)

    def choice(self, options: Sequence[_T], label: str = "") -> _T:
        """One of `options` (uniformly), one span; the simplest choice is the first. There must be one."""
        if not options:
            raise ValueError(f"nothing to choose from for {label or 'a choice'}")
        if len(options) == 1:
            return options[0]
        data = self._data
        data.start_span(_label(label))
        i = data.draw_integer(0, len(options) - 1)
        data.stop_span()
        return options[i]

    def subset(self, options: Sequence[_T], label: str = "") -> list[_T]:
        """Each of `options` in or out with even odds (in their order)."""
        return [x for x in options if self._data.draw_boolean(0.5)]

    def codes(self, min_size: int, max_size: int, label: str = "") -> list[int]:
        """A list of page codes (0..3), `min_size` to `max_size` long, shorter lengths likelier; one span."""
        data = self._data
        data.start_span(_label(label))
        n = min_size
        while n < max_size and data.draw_boolean(MORE):
            n += 1
        out = [data.draw_integer(0, 3) for _ in range(n)]
        data.stop_span()
        return out

    def cut(self, n: int, label: str = "") -> int:
        """The whole of an n-page key half the time, else any cut of it (0..n)."""
        return n if not self._data.draw_boolean(0.5) else self.integer(0, n)


_LABELS: dict[str, int] = {}


def _label(name: str) -> int:
    got = _LABELS.get(name)
    if got is None:
        got = _LABELS[name] = calc_label_from_name(f"kvcert {name}")
    return got


@dataclass(frozen=True)
class Choice(Generic[_T]):
    """A rule argument drawn as one integer choice: `options[i]`, or `i` itself where there are none."""

    low: int
    high: int
    options: Optional[tuple[_T, ...]] = None

    def draw(self, data: ConjectureData) -> Any:
        i = data.draw_integer(self.low, self.high) if self.high > self.low else self.low
        return i if self.options is None else self.options[i]


def integers(low: int, high: int) -> Choice[int]:
    return Choice(low, high)


def booleans() -> Choice[bool]:
    return Choice(0, 1, (False, True))


def sampled_from(options: Sequence[_T]) -> Choice[_T]:
    if not options:
        raise ValueError("sampled_from of nothing")
    return Choice(0, len(options) - 1, tuple(options))


class _DrawsArg:
    """The `data=draws()` argument of a rule: the step's `Draws`, no choice made."""

    def draw(self, data: ConjectureData) -> Draws:
        return Draws(data)


DRAWS = _DrawsArg()


def draws() -> _DrawsArg:
    return DRAWS


class _DrawsStrategy(SearchStrategy[Draws]):
    """What `run_machine`'s one Hypothesis test takes: the example's `Draws`."""

    def do_draw(self, data: ConjectureData) -> Draws:
        return Draws(data)

    def calc_label(self) -> int:
        return _DATA_LABEL  # `st.data()`'s: Hypothesis groups and mutates spans by label

    def __repr__(self) -> str:
        return "draws()"


_DATA_LABEL: int = unwrap_strategies(st.data()).label
EXAMPLE = _DrawsStrategy()


def page_tokens(code: int, page_size: int) -> tuple[int, ...]:
    """Page pattern `code`: 0..2 are runs of one token; 3 is page 0 with its last token changed."""
    if code < 3:
        return (code,) * page_size
    return (0,) * (page_size - 1) + (1,)


def tokens_of(codes: list[int], page_size: int, tail: int = 0) -> tuple[int, ...]:
    out: tuple[int, ...] = ()
    for c in codes:
        out += page_tokens(c, page_size)
    return out + (2,) * tail
