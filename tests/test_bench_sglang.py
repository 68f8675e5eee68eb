"""The SGLang drivers of `kvcert bench meta` replay a small trace without error (native calls only)."""

from __future__ import annotations

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.bench import meta as bench  # noqa: E402

SMALL = bench.TraceSpec(
    page_size=4, pages=64, requests=150, sessions=12, prompts=2, prompt_pages=2, max_context_pages=12
)


@pytest.mark.parametrize("label", ["sglang-radix", "sglang-unified-python", "sglang-unified-rust"])
def test_sglang_driver_replays_the_trace(label: str) -> None:
    (make,) = [m for name, m in bench.drivers(4, 64 * 4, [label])]
    res = bench.replay(make(), bench.make_trace(SMALL), budget=60)
    assert res.error == "" and res.requests == SMALL.requests and res.calls["evict"] > 0


@pytest.mark.parametrize("label", ["sglang-hicache-python", "sglang-hicache-rust"])
def test_sglang_hicache_driver_replays_the_trace_with_a_host_tier(label: str) -> None:
    (make,) = [m for name, m in bench.host_drivers(4, 64 * 4, [label])]
    driver = make()
    res = bench.replay_host(driver, bench.make_trace(SMALL), budget=60)
    assert res.error == "" and res.requests == SMALL.requests, res.error
    assert res.calls["evict"] > 0 and res.calls["backup"] == SMALL.requests
    assert res.calls["load_back"] == res.loaded > 0, "host hits are loaded back"


def test_kvcert_and_sglang_hicache_see_the_same_host_hits() -> None:
    """The host-tier section compares like with like: the same requests continue on the host."""
    trace = bench.make_trace(SMALL)
    makers = dict(bench.host_drivers(4, 64 * 4, ["gpu", "sglang-hicache-python"]))
    loaded = {label: bench.replay_host(make(), trace, budget=60).loaded for label, make in makers.items()}
    assert loaded["gpu"] == loaded["sglang-hicache-python"] > 0


def test_every_implementation_answers_every_request_alike() -> None:
    """On the request-number clock every tree, SGLang's three included, hits the same tokens on every request."""
    tight = bench.TraceSpec(**{**SMALL.__dict__, "pages": 16, "requests": 200})
    trace = bench.make_trace(tight)
    device = [bench.replay(make(), trace, budget=60) for _, make in bench.drivers(4, 16 * 4, bench.IMPLEMENTATIONS)]
    host = [
        bench.replay_host(make(), trace, budget=60) for _, make in bench.host_drivers(4, 16 * 4, bench.HOST_IMPLEMENTATIONS)
    ]
    assert len(device) == len(bench.IMPLEMENTATIONS) and len(host) == len(bench.HOST_IMPLEMENTATIONS)
    assert bench.disagreements(device) == [] and bench.disagreements(host) == []
    assert any(h for _, h in host[0].hits), "the host section must see host hits"
