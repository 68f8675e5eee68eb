"""The generator's loop: Hypothesis makes every choice, the machine's rules turn choices into ops.

`run_machine` is a lean stand-in for `hypothesis.stateful.run_state_machine_as_test`. One
Hypothesis test case is one example: the machine's `@initialize` rule, then up to
`stateful_step_count` steps, each a rule drawn uniformly among those enabled and whose
preconditions hold, its arguments drawn from its strategies. As in Hypothesis's runner, each
example first switches a random subset of the rules off (swarm testing: Groce et al., ISSTA
2012), and each step is one span of the choice sequence, so Hypothesis's engine mutates and
splices examples step by step.

What it leaves out is what this suite never uses: bundles, invariants, step printing, and
Hypothesis's shrinking (failures are shrunk as traces of ops, `conformance.generation.shrink`). Hypothesis's
own runner spends about a third of a conformance step choosing the rule (a filtered draw that
re-evaluates every precondition and its bookkeeping several times a step); here a step's rule
costs one integer draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

from hypothesis import given, seed, settings
from hypothesis.strategies import SearchStrategy

from kvcert.conformance.generation.draws import EXAMPLE, Draws
from kvcert.conformance.generation.hypothesis_compat import calc_label_from_name

_F = TypeVar("_F", bound=Callable[..., Any])
_RULE, _INIT, _PRE = "_kvcert_rule", "_kvcert_initialize", "_kvcert_preconditions"
STEP_LABEL = calc_label_from_name("kvcert step")
STOP_EARLY = 2**-16
"""The chance a step ends the example, as in Hypothesis's runner: rare at random, but a branch Hypothesis's
engine explores on purpose, so examples come in every length (and reach their teardown from every depth)."""
SWARM_LEVELS = 255
"""The probability that a rule is off in an example is drawn from {0, 1/255, ..., 254/255}, as Hypothesis's own."""


def rule(**arguments: Any) -> Callable[[_F], _F]:
    """Mark a method as a rule; each keyword is drawn for every call, from a Hypothesis strategy or a
    `conformance.generation.draws` argument (one primitive choice, or the step's `Draws`)."""

    def mark(f: _F) -> _F:
        setattr(f, _RULE, arguments)
        return f

    return mark


def initialize(**arguments: Any) -> Callable[[_F], _F]:
    """Mark the one method every example runs first."""

    def mark(f: _F) -> _F:
        setattr(f, _INIT, arguments)
        return f

    return mark


def precondition(check: Callable[[Any], bool]) -> Callable[[_F], _F]:
    """The rule is drawn only in states where `check(machine)` holds."""

    def mark(f: _F) -> _F:
        setattr(f, _PRE, (*getattr(f, _PRE, ()), check))
        return f

    return mark


@dataclass(frozen=True)
class Rule:
    name: str
    function: Callable[..., None]
    arguments: tuple[tuple[str, Any], ...]
    preconditions: tuple[Callable[[Any], bool], ...]

    def ready(self, machine: Any) -> bool:
        for check in self.preconditions:  # (a loop, not all() over a generator: asked of every rule, every step)
            if not check(machine):
                return False
        return True

    def run(self, machine: Any, cd: Any) -> None:
        self.function(
            machine, **{k: cd.draw(s) if isinstance(s, SearchStrategy) else s.draw(cd) for k, s in self.arguments}
        )


def rules_of(machine: type) -> tuple[Optional[Rule], list[Rule]]:
    """The machine's initialize rule and its rules (every marked method of its classes).

    Rules are ordered by argument count, then name, as Hypothesis orders them: the first rule is
    the one a draw of 0 picks, the simplest choice, so a machine puts there the rule that starts
    something (CacheMachine: `insert`)."""
    found: dict[str, tuple[Callable[..., None], str]] = {}
    for klass in reversed(machine.__mro__):
        for name, f in vars(klass).items():
            for marker in (_RULE, _INIT):
                if callable(f) and hasattr(f, marker):
                    found[name] = (f, marker)
    init: Optional[Rule] = None
    rules: list[Rule] = []
    for name in sorted(found):
        f, marker = found[name]
        made = Rule(name, f, tuple(sorted(getattr(f, marker).items())), tuple(getattr(f, _PRE, ())))
        if marker == _INIT:
            if init is not None:
                raise TypeError(f"{machine.__name__}: two initialize rules, {init.name} and {name}")
            init = made
        else:
            rules.append(made)
    rules.sort(key=lambda r: (len(r.arguments), r.name))
    return init, rules


def run_machine(machine: Callable[[], Any], conf: settings, seed_value: int) -> None:
    """Run `conf.max_examples` examples of `machine` (a class whose methods carry the markers above).

    Raises what a rule or the machine's teardown raised, once Hypothesis has replayed it.
    """
    init, rules = rules_of(machine)  # type: ignore[arg-type]
    if not rules:
        raise TypeError("a machine with no rules")
    steps = conf.stateful_step_count

    @seed(seed_value)
    @conf
    @given(EXAMPLE)
    def example(d: Draws) -> None:
        run_example(machine, d._data, init, rules, steps)

    example()


def run_example(machine: Callable[[], Any], cd: Any, init: Optional[Rule], rules: list[Rule], steps: int) -> None:
    """One example: a fresh machine, its initialize rule, the swarm, then up to `steps` steps, every choice drawn
    from `cd` (Hypothesis's `ConjectureData`, or `conformance.generation.fuzz.RandomChoices`: the same draws either way)."""
    m = machine()
    try:
        if init is not None:
            init.run(m, cd)
        p_off = cd.draw_integer(0, SWARM_LEVELS - 1) / SWARM_LEVELS
        on = [r for r in rules if not cd.draw_boolean(p_off)] or [rules[cd.draw_integer(0, len(rules) - 1)]]
        for _ in range(steps):
            ready = [r for r in on if r.ready(m)]
            if not ready:
                break
            cd.start_span(STEP_LABEL)
            if cd.draw_boolean(STOP_EARLY):  # Hypothesis's novelty search explores both branches: examples of
                cd.stop_span()  # every length, not only the full `steps`
                break
            chosen = ready[cd.draw_integer(0, len(ready) - 1)] if len(ready) > 1 else ready[0]
            chosen.run(m, cd)
            cd.stop_span()
    finally:
        m.teardown()
