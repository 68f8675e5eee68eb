"""SGLang 0.5.23's decode server of PD disaggregation (conformance/adapters/sglang_decode.py): its own decode event
loop, prealloc and transfer queues and decode-side HiCache, certified through its request path; and the bugs PR
#26560's review found (seed 003), planted into SGLang's own code (tests/sglang_decode_plants.py), each failing the
certification under the rule it breaks. Skipped as a whole without the `sglang` extra (required with
KVCERT_SGLANG=1)."""

from __future__ import annotations

import functools
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _sglang import require_sglang

require_sglang()

import sglang_decode_plants as plants  # noqa: E402

from kvcert.conformance.adapters import sglang_decode  # noqa: E402
from kvcert.conformance.certification.certify import certify  # noqa: E402
from kvcert.conformance.harness.requests import RequestHarness  # noqa: E402
from kvcert.spec.ops import Step, Submit  # noqa: E402
from kvcert.spec.types import CacheConfig  # noqa: E402

pytestmark = pytest.mark.sglang

TARGET = "kvcert.conformance.adapters.sglang_decode:factory"
EXAMPLES = 20
"""Examples per host cell: enough for the unmodified engine to restore L2 prefixes and fail restored transfers."""

CAUGHT = {
    "commit-keeps-device-lock": {"INV-LIVE-1"},
    "failed-restore-keeps-lock": {"INV-LIVE-1"},
    "unevict-frees-host-copy": {"INV-HOST-4", "INV-HOST-5"},
}
"""Each plant the certification reaches, and the rules any of which its failure must name."""

NOT_REACHED = {
    "prefetch-never-issued": "the decode target runs no L3 tier: the certification skips storage cells on request "
    "paths, and without a storage backend `_start_hicache_prefetch` returns before it issues anything",
}
"""Plants the certification cannot catch, and what it does not reach."""


@functools.cache
def _run(plant: str) -> dict[str, Any]:
    """The host cells (page sizes 1 and 4, three write policies) certified under `plant`, once per test process."""
    reached: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as out, plants.counted(reached), plants.planted(plant):
        cert = certify(TARGET, examples=EXAMPLES, out_dir=Path(out), device_cells=False)
    rules = sorted({f["invariant"] for c in cert.cells for f in c.failures})
    return {"passed": cert.passed, "rules": rules, "reached": dict(reached), "steps": sum(c.steps for c in cert.cells)}


def test_a_prompt_with_an_l2_prefix_is_restored_and_decodes() -> None:
    """Two requests share a prefix; the first's KV is backed up, then evicted by a third, and the fourth restores it
    from the host: SGLang's load-back runs and every step's bytes (device, host, each request's row) are right."""
    config = CacheConfig(page_size=4, policy="lru", capacity=32, host_capacity=64, write_policy="write_through")
    h = RequestHarness(sglang_decode.factory(config), config, sglang_decode.factory.capabilities)
    reached: Counter[str] = Counter()
    with plants.counted(reached):
        prefix = tuple(range(1, 13))
        for rid, tokens in (("a", prefix), ("b", tuple(range(40, 60))), ("c", prefix + (90, 91, 92, 93))):
            h.step(Submit(request=rid, namespace=None, tokens=tokens, priority=0, output=2))
            for _ in range(8):
                h.step(Step())
        h.quiesce()
    assert reached["l2_hits"] >= 1 and reached["restores"] >= 1, reached
    assert {r: v.state for r, v in h.finished.items()} == {"a": "finished", "b": "finished", "c": "finished"}


def test_the_unmodified_engine_is_certified() -> None:
    """Every cell at a small budget, device-only ones included: CERTIFIED."""
    with tempfile.TemporaryDirectory() as out:
        cert = certify(TARGET, examples=8, out_dir=Path(out))
    assert cert.passed, [c.failure for c in cert.cells if not c.passed]
    assert {c.page_size for c in cert.cells} == {1, 4} and any(not c.write_policy for c in cert.cells)
    said = " ".join(cert.not_checked)
    assert "transfer backend: SGLang's fake one" in said and "distinct-ids" in said


def test_the_host_cells_reach_restores_and_failed_restores() -> None:
    """The run the plants are judged against: CERTIFIED, and it reached what each plant breaks."""
    clean = _run("none")
    assert clean["passed"] and clean["rules"] == [], clean
    reached = clean["reached"]
    assert reached.get("l2_hits", 0) > 0 and reached.get("restores", 0) > 0, reached
    assert reached.get("failed_with_restore_lock", 0) > 0 and reached.get("unevicted", 0) > 0, reached


@pytest.mark.parametrize("plant", sorted(CAUGHT))
def test_a_planted_bug_fails_under_the_rule_it_breaks(plant: str) -> None:
    got = _run(plant)
    assert not got["passed"] and set(got["rules"]) & CAUGHT[plant], got


@pytest.mark.parametrize("plant", sorted(NOT_REACHED))
def test_a_plant_outside_the_targets_reach_passes(plant: str) -> None:
    """Named so that a certification that starts to reach it (an L3 tier on request paths) is noticed: then it
    must move to CAUGHT."""
    got = _run(plant)
    assert got["passed"] and got["reached"].get("l3_hits", 0) == 0, (NOT_REACHED[plant], got)
