"""What the state machine's rules draw from: Hypothesis's choices, and the token patterns keys are made of.

Token ids are drawn from a few *page patterns* so sequences share prefixes often, and one
pattern differs from another only in its last token, so matches diverge inside a page as well as
at page boundaries.
"""

from __future__ import annotations

from typing import Optional, TypeVar

from hypothesis import strategies as st
from hypothesis.internal.conjecture.data import ConjectureData
from hypothesis.strategies import SearchStrategy
from hypothesis.strategies._internal.lazy import unwrap_strategies

MAX_PAGES = 5
"""Pages in a drawn key at most."""
_T = TypeVar("_T")


class Draws:
    """What a rule draws from: Hypothesis's choice sequence itself.

    `st.data()` wraps every draw in bookkeeping for Hypothesis's own failure report (a numbered note
    per draw, a check that the strategy did not touch `random`), which this suite never prints: it
    reports the shrunk trace of ops. The choices drawn are the same; a draw costs about half.
    Labels stay in the rules as documentation.
    """

    __slots__ = ("_data",)

    def __init__(self, data: ConjectureData) -> None:
        self._data = data

    def draw(self, strategy: SearchStrategy[_T], label: Optional[str] = None) -> _T:
        return self._data.draw(strategy)


class _DrawsStrategy(SearchStrategy[Draws]):
    def do_draw(self, data: ConjectureData) -> Draws:
        return Draws(data)

    def calc_label(self) -> int:
        return _DATA_LABEL  # `st.data()`'s: Hypothesis groups and mutates spans by label

    def __repr__(self) -> str:
        return "draws()"


_DATA_LABEL: int = unwrap_strategies(st.data()).label


def draws() -> SearchStrategy[Draws]:
    return _DrawsStrategy()


PAGES = st.lists(st.integers(0, 3), max_size=MAX_PAGES)
TAIL = st.lists(st.integers(0, 3), min_size=1, max_size=2)
MORE_ON_INSERT = st.one_of(TAIL, st.just([]))
MORE_ON_MATCH = st.one_of(st.just([]), TAIL)
_CUTS: dict[int, SearchStrategy[int]] = {}
"""Strategies built once (Hypothesis validates a strategy on first draw): the choices are the same."""


def cut_of(n: int) -> SearchStrategy[int]:
    """The whole of an n-page key, or any cut of it."""
    if n not in _CUTS:
        _CUTS[n] = st.one_of(st.just(n), st.integers(0, n))
    return _CUTS[n]


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
