"""SLRU and T-LRU (SPEC.md §4.5, §4.7): the reference model and kvcert.gpu evict alike and keep the same histories,
an eviction out of either policy's order is caught, and a policy config SGLang would refuse is refused."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvcert.conformance.certification.certify import certify
from kvcert.conformance.cli import app
from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
from kvcert.gpu import CAPABILITIES
from kvcert.gpu import factory as gpu_factory
from kvcert.gpu.evict_index import EvictionIndex
from kvcert.refimpl import RefCache
from kvcert.spec.ops import Evict, Insert, Match, Trace
from kvcert.spec.types import CacheConfig, InvalidPolicyConfig, KVCertError

CACHES: dict[str, Callable[[CacheConfig], Any]] = {"refimpl": RefCache, "gpu": gpu_factory}


def _insert(cache: Any, now: int, key: tuple[int, ...]) -> None:
    cache.set_clock(now)
    slots = cache.alloc(len(key))
    out = cache.insert(None, key, slots)
    cache.free(slots[: out.prefix_len])


def _paths(cache: Any) -> set[tuple[int, ...]]:
    snap = cache.snapshot()
    return {snap.path_of(n.id)[1] for n in snap.nodes if n.id != snap.root}


@pytest.mark.parametrize("make", CACHES.values(), ids=CACHES.keys())
def test_tlru_drains_the_tel_safe_tail_first_and_keeps_the_branch_budget(make: Callable[[CacheConfig], Any]) -> None:
    # threshold 3, next prompt 1: a branch needs all but its last 2 tokens cached; a node starting there is TEL-safe
    cache = make(CacheConfig(page_size=1, capacity=32, policy="tlru"))
    _insert(cache, 1, (1, 1, 1, 1))  # X: starts at 0 of a 4-token branch: not safe
    _insert(cache, 2, (2, 2, 2, 2))
    _insert(cache, 3, (2, 2, 2, 2, 5, 5))  # Y2 (5, 5) starts at 4 of 6: safe, until ...
    _insert(cache, 4, (2, 2, 2, 2, 5, 5, 3, 3))  # ... Z (3, 3) raises the branch to 8: Z is safe, Y2 is not
    cache.set_clock(5)
    cache.evict(2)
    assert (2, 2, 2, 2, 5, 5, 3, 3) not in _paths(cache)  # Z, the safe one, though X is older (LRU's pick)
    cache.set_clock(6)
    cache.evict(2)
    # Y2 is a leaf again, but its branch keeps its high-water mark (8): not safe, so the older X goes
    assert _paths(cache) == {(2, 2, 2, 2), (2, 2, 2, 2, 5, 5)}


@pytest.mark.parametrize("make", CACHES.values(), ids=CACHES.keys())
def test_slru_evicts_probation_before_protected(make: Callable[[CacheConfig], Any]) -> None:
    cache = make(CacheConfig(page_size=1, capacity=8, policy="slru"))
    _insert(cache, 1, (1, 1))
    _insert(cache, 2, (2, 2))
    _insert(cache, 3, (1, 1))  # a second hit: protected (threshold 2)
    cache.set_clock(4)
    cache.match_prefix(None, (2, 2))  # used last, but one hit: probationary
    cache.set_clock(5)
    cache.evict(2)
    assert _paths(cache) == {(1, 1)}


@pytest.mark.parametrize("policy", ["slru", "tlru"])
def test_the_model_and_gpu_keep_the_same_ranks(policy: str) -> None:
    """A seeded workload of inserts (splits, deeper turns, re-inserts after eviction), matches and evictions: both
    caches evict the same paths, and every node has the same history on both."""
    rng = random.Random(7)
    config = CacheConfig(page_size=2, capacity=24, policy=policy)
    ref, gpu = RefCache(config), gpu_factory(config)
    for now in range(1, 300):
        key = tuple(rng.choice((1, 2)) for _ in range(2 * rng.randint(1, 6)))
        roll, n = rng.random(), rng.choice((2, 4, 6))
        for cache in (ref, gpu):
            cache.set_clock(now)
            if roll < 0.5:
                if len(cache.snapshot().free_slots) < len(key):
                    cache.evict(len(key))
                _insert(cache, now, key)
            elif roll < 0.8:
                cache.match_prefix(None, key)
            else:
                cache.evict(n)
        assert _paths(ref) == _paths(gpu), now
        if policy == "tlru":
            hist_ref = {ref._full_path(n): n.history for n in ref.nodes.values() if n is not ref.root}
            hist_gpu = {gpu.path_tokens(n): n.history for n in gpu.nodes.values() if n is not gpu.root}
            assert hist_ref == hist_gpu, now


# --------------------------------------------------------------------------- planted bugs


def _first_failure(policy: str, tmp_path: Path) -> str:
    cert = certify(
        "kvcert.gpu:factory",
        examples=40,
        steps=30,
        page_sizes=[1],
        policies=[policy],
        write_policies=[],
        prefetch_policies=[],
        out_dir=tmp_path,
    )
    failing = [c.failure or "" for c in cert.cells if not c.passed]
    assert failing, f"the planted {policy} bug went unseen"
    return failing[0]


def test_a_tlru_index_that_ranks_by_recency_alone_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EvictionIndex, "_tlru_entry", lambda self, n: (n.last_access, n.id))
    assert "INV-EVICT-4" in _first_failure("tlru", tmp_path)


def test_a_tlru_history_that_is_never_raised_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def own_depth_only(self: EvictionIndex, n: Any) -> None:
        n.history = n.end

    monkeypatch.setattr(EvictionIndex, "made", own_depth_only)
    failure = _first_failure("tlru", tmp_path)
    assert "INV-META-1" in failure or "INV-EVICT-4" in failure, failure


def test_an_slru_threshold_off_by_one_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated traffic finds this one only after about 2,000 steps at P = 1 (the default budget does); the
    directed trace, the SLRU example above, at once: the node hit twice is protected, the newer one is not."""
    init = EvictionIndex.__init__

    def one_more(self: EvictionIndex, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._protected += 1

    config = CacheConfig(page_size=1, capacity=8, policy="slru")
    ops = [Insert(None, (1, 1)), Insert(None, (2, 2)), Insert(None, (1, 1)), Match(None, (2, 2)), Evict(2)]
    run_trace(gpu_factory(config), config, CAPABILITIES, list(ops))  # as built: passes
    monkeypatch.setattr(EvictionIndex, "__init__", one_more)
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(gpu_factory(config), config, CAPABILITIES, list(ops))
    assert "INV-EVICT-4" in str(failure.value)


# --------------------------------------------------------------------------- the policy config


@pytest.mark.parametrize(
    "policy, config",
    [
        ("tlru", {"threshold": 4, "next_prompt_estimate": 4}),  # never TEL-safe: SGLang refuses it
        ("tlru", {"threshold": 2, "next_prompt_estimate": 5}),
        ("tlru", {"threshold": -1}),
        ("slru", {"protected_threshold": -2}),
        ("slru", {"protected_threshold": True}),
        ("slru", {"protected_threshold": 1.5}),
        ("slru", {"threshold": 8}),  # tlru's key
        ("lru", {"protected_threshold": 2}),  # lru takes none
        ("tlru", [("threshold", 8), ("threshold", 9)]),
        ("tlru", "threshold=8"),
    ],
)
def test_a_bad_policy_config_is_refused_with_a_typed_error(policy: str, config: Any) -> None:
    good = CacheConfig(policy=policy)
    with pytest.raises(InvalidPolicyConfig) as e:
        replace(good, policy_config=config)
    assert isinstance(e.value, KVCertError) and isinstance(e.value, ValueError)
    assert good.policy_config == () and good.policy_params() == CacheConfig(policy=policy).policy_params()


def test_the_defaults_and_sglangs_keys() -> None:
    assert CacheConfig(policy="slru").policy_params() == {"protected_threshold": 2}
    assert CacheConfig(policy="tlru", page_size=4).policy_params() == {"threshold": 12, "next_prompt_estimate": 4}
    config = CacheConfig(policy="tlru", policy_config={"next_prompt_estimate": 1, "threshold": 9})  # type: ignore[arg-type]
    assert config.policy_config == (("next_prompt_estimate", 1), ("threshold", 9))
    assert CacheConfig(policy="lru").policy_params() == {}


def test_a_trace_records_the_policy_config_only_when_it_is_set() -> None:
    plain = Trace(config=CacheConfig(policy="tlru"), ops=())
    assert "policy_config" not in json.loads(plain.to_json())["config"]
    assert Trace.from_json(plain.to_json()) == plain
    tuned = Trace(config=CacheConfig(policy="tlru", policy_config=(("threshold", 9),)), ops=())
    assert json.loads(tuned.to_json())["config"]["policy_config"] == {"threshold": 9}
    assert Trace.from_json(tuned.to_json()) == tuned


def test_the_cli_refuses_a_bad_policy_config_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "failures"
    bad = ["certify", "kvcert.gpu:factory", "--policy", "tlru", "--device-only", "--out", str(out), "--examples", "1"]
    for config in ('{"threshold": 2, "next_prompt_estimate": 2}', '{"protected_threshold": 2}', "[1]", "{"):
        result = CliRunner().invoke(app, [*bad, "--policy-config", config])
        assert result.exit_code == 2 and "error:" in result.output, result.output
        assert not out.exists()
    cert = certify(
        "kvcert.gpu:factory",
        examples=2,
        steps=10,
        page_sizes=[4],
        policies=["tlru"],
        write_policies=[],
        prefetch_policies=[],
        out_dir=out,
        policy_config={"threshold": 20, "next_prompt_estimate": 4},
    )
    assert cert.passed and cert.planned == ["page_size=4 policy=tlru policy_config=next_prompt_estimate:4,threshold:20"]
