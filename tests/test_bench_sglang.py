"""The SGLang drivers of `kvcert bench meta` replay a small trace without error (native calls only)."""

from __future__ import annotations

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance import bench  # noqa: E402

SMALL = bench.TraceSpec(page_size=4, pages=64, requests=150, sessions=12, prompts=2, prompt_pages=2, max_context_pages=12)


@pytest.mark.parametrize("label", ["sglang-radix", "sglang-unified-python", "sglang-unified-rust"])
def test_sglang_driver_replays_the_trace(label: str) -> None:
    (make,) = [m for name, m in bench.drivers(4, 64 * 4, [label])]
    res = bench.replay(make(), bench.make_trace(SMALL), budget=60)
    assert res.error == "" and res.requests == SMALL.requests and res.calls["evict"] > 0
