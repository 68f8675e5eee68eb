"""PEP 316 docstring contracts (`pre:` / `post:` lines) as Hypothesis tests.

CrossHair searches the same contracts symbolically in CI (scripts/crosshair.sh); this runs them
on generated inputs, so a contract that CrossHair cannot reach is still exercised.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

CONDITION = re.compile(r"^\s*(pre|post):\s*(.+?)\s*$")


def conditions(fn: Any) -> tuple[list[str], list[str]]:
    """(preconditions, postconditions) of `fn`'s docstring, as expressions."""
    pre: list[str] = []
    post: list[str] = []
    for line in (fn.__doc__ or "").splitlines():
        m = CONDITION.match(line)
        if m:
            (pre if m.group(1) == "pre" else post).append(m.group(2))
    return pre, post


def contracted(module: ModuleType) -> dict[str, Callable[..., Any]]:
    """The functions defined in `module` that state at least one postcondition."""
    return {
        name: fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and fn.__module__ == module.__name__ and conditions(fn)[1]
    }


def check_contract(
    module: ModuleType, fn: Callable[..., Any], args: st.SearchStrategy[dict[str, Any]], examples: int
) -> None:
    """Call `fn` on generated arguments that meet its preconditions; every postcondition must hold."""
    pre, post = conditions(fn)

    @settings(max_examples=examples, deadline=None)
    @given(args)
    def check(kwargs: dict[str, Any]) -> None:
        scope = {**vars(module), **kwargs}
        assume(all(eval(p, scope) for p in pre))
        scope["__return__"] = fn(**kwargs)
        for p in post:
            assert eval(p, scope), f"{fn.__name__}{kwargs}: post `{p}` is false"

    check()
