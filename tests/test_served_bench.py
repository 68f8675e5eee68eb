"""`kvcert bench served`'s own parts, without a server: the clients' turns, the figures read from what came back,
the pools the prediction is sized to, and the ratios with their spread. The servers' runs are a documented command
(docs/served.md, "Served figures"): they measure, they assert nothing."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
from typer.testing import CliRunner

from kvcert.conformance.cli import app
from kvcert.conformance.served import bench
from kvcert.conformance.served.client import Ask, Client, Reply
from kvcert.conformance.served.targets import TARGETS


class EchoingEngine(Client):
    """A stand-in engine: answers `max_new_tokens` tokens and reports as cached the longest prefix of the prompt it
    has seen before (an infinite cache), so the clients' prompts can be checked against what it answered."""

    def __init__(self) -> None:
        super().__init__("http://stand-in")
        self.seen: list[tuple[int, ...]] = []
        self.asks: list[Ask] = []
        self.closed: list[str] = []
        self.lock = threading.Lock()

    def generate(self, ask: Ask) -> Reply:
        reply = Reply(ask, t_send=time.monotonic())
        with self.lock:
            self.asks.append(ask)
            best = max((_common(p, ask.prompt) for p in self.seen), default=0)
            output = tuple(3 + (sum(ask.prompt) + i) % 500 for i in range(ask.max_new_tokens))
            self.seen.append(ask.prompt + output)
        reply.status, reply.finish, reply.output, reply.cached = 200, "length", output, best
        reply.t_first = reply.t_send + 0.01
        reply.t_end = reply.t_send + 0.02
        return reply

    def close_session(self, sid: str) -> int:
        with self.lock:
            self.closed.append(sid)
        return 200


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


SMALL = bench.BenchSpec(hp_clients=2, min_turns=2, max_turns=3, think_min=0.0, think_max=0.0)


def test_each_turn_sends_the_last_prompt_its_answer_and_new_tokens() -> None:
    engine = EchoingEngine()
    w = SMALL.workload(0)
    turned = bench.play(engine, w, 0, session_ids=True)
    assert len(turned) == w.turns and all(t.done for t in turned)
    by = {(a.session, a.turn): a for a in engine.asks}
    for s in w.sessions:
        assert len(by[(s.id, 0)].prompt) == s.turns[0].new_tokens
        for k in range(1, len(s.turns)):
            before, now = by[(s.id, k - 1)], by[(s.id, k)]
            answer = engine.seen[engine.asks.index(before)][len(before.prompt) :]
            assert now.prompt[: len(before.prompt) + len(answer)] == before.prompt + answer
            assert len(now.prompt) == len(before.prompt) + len(answer) + s.turns[k].new_tokens
        assert all(by[(s.id, k)].priority == s.priority and by[(s.id, k)].session_id == s.id for k in range(len(s.turns)))
        assert all(a.stream for a in engine.asks)  # the first token is timed from the stream
    assert sorted(engine.closed) == sorted(s.id for s in w.sessions)


def test_without_session_ids_no_turn_names_its_session_and_none_is_closed() -> None:
    engine = EchoingEngine()
    bench.play(engine, SMALL.workload(1), 1, session_ids=False)
    assert engine.asks and all(a.session_id is None for a in engine.asks) and not engine.closed


def test_with_hints_every_turn_but_the_last_carries_its_next_pause_and_the_slack() -> None:
    """The retention hint a served client sends (`sglang-kvcert-retain`): the think time before its session's next
    turn, plus `RETAIN_SLACK_S`, which the simulator's prediction (`-retain-1-wait`) gives its clients too."""
    engine = EchoingEngine()
    w = bench.BenchSpec(hp_clients=2, min_turns=2, max_turns=3, think_min=0.01, think_max=0.03).workload(2)
    bench.play(engine, w, 2, session_ids=True, hints=True)
    by = {(a.session, a.turn): a for a in engine.asks}
    for s in w.sessions:
        for k in range(len(s.turns)):
            want = s.turns[k + 1].think + bench.RETAIN_SLACK_S if k + 1 < len(s.turns) else None
            assert by[(s.id, k)].retain == want
    assert bench.PREDICTED_BY["sglang-kvcert-retain"].endswith("-retain-1-wait") and bench.RETAIN_SLACK_S == 1.0
    plain = EchoingEngine()
    bench.play(plain, w, 2, session_ids=True)
    assert all(a.retain is None for a in plain.asks)


def test_the_same_seed_sends_the_same_prompts() -> None:
    a, b = EchoingEngine(), EchoingEngine()
    bench.play(a, SMALL.workload(3), 3, session_ids=False)
    bench.play(b, SMALL.workload(3), 3, session_ids=False)
    assert sorted(x.prompt for x in a.asks) == sorted(x.prompt for x in b.asks)
    c = EchoingEngine()
    bench.play(c, SMALL.workload(4), 4, session_ids=False)
    assert sorted(x.prompt for x in a.asks) != sorted(x.prompt for x in c.asks)


def test_an_infinite_cache_keeps_every_turn_after_the_first_all_but_its_new_tokens() -> None:
    engine = EchoingEngine()
    w = SMALL.workload(0)
    turned = bench.play(engine, w, 0, session_ids=False)
    for high in (True, False):
        later = [t for t in turned if t.high == high and t.turn > 0]
        f = bench.figures(turned, high)
        assert f["turn1_hit"] == pytest.approx(sum(t.prompt_tokens - SMALL.sub_question_length for t in later)
                                               / sum(t.prompt_tokens for t in later))  # fmt: skip
        assert f["ttft_p90"] == pytest.approx(0.01) and f["not_finished"] == 0


def _turn(turn: int, high: bool, prompt: int, cached: int, finish: str = "length", ttft: float = 0.1) -> bench.Turned:
    return bench.Turned("s", turn, high, prompt, cached, 0, ttft, ttft * 2, finish, 200, 0)


def test_figures_count_turn_one_on_finished_turns_only() -> None:
    turns = [
        _turn(0, True, 100, 90),  # turn 0: not in the hit
        _turn(1, True, 200, 150),
        _turn(2, True, 300, 0, finish="abort"),  # not finished: counted apart, in no figure
        _turn(1, False, 100, 100, ttft=0.5),
    ]
    hp, lp = bench.figures(turns, True), bench.figures(turns, False)
    assert hp["turn1_hit"] == pytest.approx(0.75) and hp["not_finished"] == 1 and hp["turns"] == 3
    assert lp["turn1_hit"] == 1.0 and lp["ttft_p90"] == pytest.approx(0.5)
    assert math.isnan(bench.figures([_turn(0, True, 10, 0)], True)["turn1_hit"])


def test_the_prediction_is_sized_to_each_targets_pools_and_limits() -> None:
    rates = {"prefill_token_s": 1e-5, "decode_step_s": 4e-3}
    plain, hicache, kvcert, retain = (bench.costs_for(TARGETS[n], SMALL, rates) for n in bench.BENCH_TARGETS)
    assert retain == kvcert  # the same server, with retention on
    assert plain.device_tokens == hicache.device_tokens == kvcert.device_tokens == TARGETS["sglang"].pool_tokens
    assert plain.host_tokens == 0 and hicache.host_tokens == kvcert.host_tokens == 2 * TARGETS["sglang"].pool_tokens
    assert {c.page_tokens for c in (plain, hicache, kvcert)} == {TARGETS["sglang"].block}
    assert kvcert.max_running == SMALL.max_running and kvcert.chunked_prefill_tokens == SMALL.chunked_prefill
    assert set(bench.PREDICTED_BY) == set(bench.BENCH_TARGETS)


def test_the_prediction_runs_the_simulator_on_the_same_sessions() -> None:
    rates = {"prefill_token_s": 1e-5, "decode_step_s": 4e-3}
    w = SMALL.workload(0)
    got = bench._predict(TARGETS["sglang"], w, bench.costs_for(TARGETS["sglang"], SMALL, rates))
    assert 0.0 <= got["hp_turn1_hit"] <= 1.0 and got["hp_ttft_p90"] > 0


def test_ratios_pair_runs_by_seed_and_spread_is_median_min_max() -> None:
    def run(target: str, seed: int, hit: float) -> dict[str, Any]:
        return {"target": target, "seed": seed, "high": {"turn1_hit": hit}}

    runs = [run("sglang-kvcert", 0, 0.6), run("sglang", 0, 0.3), run("sglang-kvcert", 1, 0.9), run("sglang", 1, 0.3),
            run("sglang-kvcert", 2, 0.5)]  # fmt: skip
    assert bench.ratios(runs, "sglang-kvcert", "sglang", "high", "turn1_hit") == pytest.approx([2.0, 3.0])
    assert bench.spread([2.0, 3.0, 1.0, float("nan")]) == (2.0, 1.0, 3.0)
    assert all(math.isnan(x) for x in bench.spread([]))


def test_the_command_refuses_an_unknown_target_before_starting_anything() -> None:
    result = CliRunner().invoke(app, ["bench", "served", "--target", "vllm"])
    assert result.exit_code == 2 and "targets are" in result.output
