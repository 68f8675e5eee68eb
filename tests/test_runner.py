"""The generator's loop (`conformance.generation.runner`): rules, preconditions, swarm, seeds, failures."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st

from kvcert.conformance.generation.runner import initialize, precondition, rule, rules_of, run_machine


def _conf(examples: int, steps: int = 20) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )


def _counting() -> tuple[type, list[list[tuple[str, object]]]]:
    log: list[list[tuple[str, object]]] = []

    class Machine:
        def __init__(self) -> None:
            self.seen: list[tuple[str, object]] = []
            self.stack = 0
            log.append(self.seen)

        @initialize(n=st.integers(0, 3))
        def start(self, n: int) -> None:
            self.seen.append(("start", n))

        @rule(x=st.integers(0, 9))
        def push(self, x: int) -> None:
            self.stack += 1
            self.seen.append(("push", x))

        @precondition(lambda self: self.stack > 0)
        @rule()
        def pop(self) -> None:
            assert self.stack > 0, "a precondition that did not hold"
            self.stack -= 1
            self.seen.append(("pop", None))

        def teardown(self) -> None:
            self.seen.append(("teardown", None))

    return Machine, log


def test_rules_are_found_in_name_order_with_their_arguments_and_preconditions() -> None:
    machine, _ = _counting()
    init, rules = rules_of(machine)
    assert init is not None and init.name == "start" and [a for a, _ in init.arguments] == ["n"]
    assert [r.name for r in rules] == ["pop", "push"]  # fewer arguments first, then by name
    assert len(rules[0].preconditions) == 1 and not rules[1].preconditions


def test_every_example_starts_with_initialize_respects_preconditions_and_tears_down() -> None:
    machine, log = _counting()
    run_machine(machine, _conf(60), 0)
    assert len(log) >= 60
    kinds: Counter[str] = Counter()
    for seen in log:
        assert seen[0][0] == "start" and seen[-1][0] == "teardown"
        assert all(name != "start" for name, _ in seen[1:])
        kinds.update(name for name, _ in seen)
    assert kinds["push"] > 0 and kinds["pop"] > 0, "both rules ran"


def test_swarm_switches_rules_off_in_some_examples() -> None:
    machine, log = _counting()
    run_machine(machine, _conf(80), 0)
    only_push = [s for s in log if any(n == "push" for n, _ in s) and not any(n == "pop" for n, _ in s)]
    assert only_push, "some example ran with pop switched off (or never ready)"


def test_same_seed_same_examples_other_seed_others() -> None:
    runs = []
    for seed_value in (3, 3, 4):
        machine, log = _counting()
        run_machine(machine, _conf(30), seed_value)
        runs.append(log)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_a_failing_rule_fails_the_run() -> None:
    class Failing:
        @rule(x=st.integers(0, 100))
        def step(self, x: int) -> None:
            assert x < 50, "found it"

        def teardown(self) -> None:
            pass

    with pytest.raises(AssertionError, match="found it"):
        run_machine(Failing, _conf(200), 0)


def test_a_machine_without_rules_is_a_clear_error() -> None:
    class Empty:
        def teardown(self) -> None:
            pass

    with pytest.raises(TypeError, match="no rules"):
        run_machine(Empty, _conf(1), 0)
