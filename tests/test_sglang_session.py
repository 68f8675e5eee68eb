"""SGLang 0.5.23's session-ref UnifiedRadixCache (`enable_session_radix_cache`) against SPEC.md §11.

Every calibration trace in conformance/findings/session/ still shows what docs/calibration/session.md records and is
fine on the model; what SGLang and §11 agree on still passes; SGLang's generation fencing (S7, which no
kvcert op reaches) still drops a request that outlives its session's close; and each factory of
`conformance/adapters/sglang/session.py` runs a small certificate whose failures are all calibrated.
Skipped as a whole without the `sglang` extra (required with KVCERT_SGLANG=1).
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang import session as sglang_session  # noqa: E402
from kvcert.conformance.certification.certify import certify, load_factory  # noqa: E402
from kvcert.conformance.certification.replay import judged_as, replay_failure  # noqa: E402
from kvcert.conformance.harness.driver import run_trace  # noqa: E402
from kvcert.refimpl import RefCache  # noqa: E402
from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, Match, Op, Poll, RegisterRef, Trace  # noqa: E402
from kvcert.spec.types import CacheConfig  # noqa: E402

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parent.parent
FINDINGS = sorted((ROOT / "conformance" / "findings" / "session").glob("S*.json"))
EXPECTED = {
    "S2-one-ref-class": {"INV-TIER-4", "INV-EVICT-4", "INV-TREE-4"},
    "S3-no-scope-low": {"INV-TIER-3"},
    "S3-no-scope-unused": {"INV-TIER-3"},
    "S3-generated-moves-ps1-lru": {"INV-TIER-3"},
    "S4-register-adds-branch": {"INV-TIER-1", "INV-TIER-5"},
    "S4-register-at-root-ignored": {"INV-TIER-5"},
    "S4-generated-planned-ps4-lru": {"INV-TIER-5"},
    "S5-register-ancestor-counts-twice": {"INV-TIER-1"},
    "S6-release-unknown": {"INV-ERR-1"},
    "S6-release-twice": {"INV-ERR-1"},
    "S8-host-evicts-high-no-demotion": {"INV-TIER-4", "INV-TIER-5"},
    "S8-generated-planned-ps4-write_through": {"INV-TIER-4", "INV-TIER-5"},
    "S9-no-admission-planner": {"INV-ERR-3"},
}
"""Each trace -> rules its replay must break (at least these)."""

CALIBRATED = {
    "INV-ERR-3",  # S9: no planner
    "INV-TIER-1",  # S4, S5
    "INV-TIER-3",  # S3
    "INV-TIER-4",  # S2, S8
    "INV-TIER-5",  # S2-S5, S8
    "INV-EVICT-4",  # S2, S3: the victim the one-class rank or the missing scope chose
    "INV-EVICT-5",  # S3
    "INV-TREE-4",  # S2, S3
    "INV-HOST-10",  # S3 with a host tier: the out-of-scope victim went to host
    "INV-ADMIT-4",  # S3 inside an applied plan (factory_planned*): its scoped evict is SGLang's plain one
}
"""Rules a certificate of these factories may break: only ever together with the S-item that explains them."""

DEVICE = CacheConfig(page_size=1, capacity=16)
HOST = CacheConfig(page_size=1, capacity=6, host_capacity=24)


def test_every_finding_has_an_expectation() -> None:
    assert {p.stem for p in FINDINGS} == set(EXPECTED)


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_sglang_still_behaves_as_calibrated(path: Path) -> None:
    trace = Trace.from_json(path.read_text())
    make = load_factory(trace.target)
    failure = replay_failure(make, judged_as(make.capabilities, trace), trace.config, list(trace.ops))
    assert failure is not None, f"{path.stem} passes now: SGLang changed, recalibrate"
    assert EXPECTED[path.stem] <= {v.inv for v in failure.violations}, str(failure)


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_the_model_passes_each_calibration_trace(path: Path) -> None:
    trace = Trace.from_json(path.read_text())
    run_trace(RefCache(trace.config), trace.config, RefCache.capabilities, list(trace.ops))


AGREES: dict[str, tuple[CacheConfig, list[Op]]] = {
    # One class, low: SGLang's (session_ref > 0, session_ref, LRU) is §11.3's (tier, high_ref, low_ref, LRU).
    "rank-low": (
        DEVICE,
        [Insert(None, (1,)), Insert(None, (2,)), RegisterRef("a", 0, 0), RegisterRef("b", 1, 0)]
        + [RegisterRef("c", 1, 0), Evict(1), Evict(1)],
    ),
    # One class, high: the same order.
    "rank-high": (
        DEVICE,
        [Insert(None, (1,)), Insert(None, (2,)), RegisterRef("a", 0, 2), RegisterRef("b", 1, 1)]
        + [RegisterRef("c", 1, 2), Evict(1)],
    ),
    # An unreferenced leaf goes before a referenced one, both classes (soft protection).
    "unused-first": (
        DEVICE,
        [Insert(None, (1,)), Insert(None, (2,)), RegisterRef("a", 0, 1), RegisterRef("b", 0, 0), Evict(1)],
    ),
    # A split gives the new prefix node the suffix's refs; the session still ends at the suffix.
    "split": (DEVICE, [Insert(None, (1, 2)), RegisterRef("a", 0, 1), Insert(None, (1, 3)), Match(None, (1,))]),
    # Deleting a session's node moves it to the deepest surviving ancestor.
    "deletion": (DEVICE, [Insert(None, (1,)), Insert(None, (1, 2)), RegisterRef("a", 1, 0), Evict(1)]),
    # Demotion to host moves no refs; a LOW_REF host copy may go.
    "host-low": (
        HOST,
        [Insert(None, (1,)), Complete(0), Poll(), RegisterRef("a", 0, 0), Evict(1), EvictHost(1)],
    ),
}


@pytest.mark.parametrize("name", sorted(AGREES))
def test_what_sglang_and_the_spec_agree_on(name: str) -> None:
    config, ops = AGREES[name]
    make = sglang_session.factory
    failure = replay_failure(make, make.capabilities, config, ops)  # type: ignore[attr-defined]
    assert failure is None, str(failure)


def test_generation_fencing_drops_a_request_that_outlives_its_session() -> None:
    """S7: a request that arrived before its session's close is not registered when it finishes after it,
    even once a later request has reopened the session; the later request's registration counts."""
    b = sglang_session.factory(DEVICE)
    cache = b.h.cache
    node = b.insert(None, [1, 2], b.alloc(2)).node
    full = b._full.component_type

    def ref() -> int:
        return int(cache.tree_core.node_by_id(node).component_data[full].session_ref)

    def request(generation: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(session_id="s", session=None, session_generation=generation)

    with b.h._in_sglang():
        old = cache.ensure_session_generation("s")
        cache.release_radix_session("s")
        cache.session_refs.register_session_ref(request(old), leaf=node)
        assert ref() == 0 and "s" in cache.session_refs._closed_session_ids
        new = cache.ensure_session_generation("s")
        assert new != old and "s" not in cache.session_refs._closed_session_ids
        cache.session_refs.register_session_ref(request(old), leaf=node)
        assert ref() == 0
        cache.session_refs.register_session_ref(request(new), leaf=node)
        assert ref() == 1
    b.close()


def test_sessions_build_the_python_core_whatever_core_is_asked_for() -> None:
    """S1: SGLang's registry turns a Rust selection with sessions on into the Python core."""
    b = sglang_session.factory_rust(DEVICE)
    assert type(b.h.cache.tree_core).__name__ == "UnifiedTreeCore"
    assert b.fallback and "session" in b.fallback
    b.close()


FACTORIES = ["factory", "factory_rust", "factory_planned", "factory_rust_planned", "factory_planned_moves"]


@pytest.mark.parametrize("name", FACTORIES)
def test_a_small_certificate_breaks_only_calibrated_rules(name: str, tmp_path: Path) -> None:
    target = f"kvcert.conformance.adapters.sglang.session:{name}"
    cert = certify(
        target, examples=8, steps=30, seed=0, page_sizes=[1, 4], policies=["lru"], host_cells=False, out_dir=tmp_path
    )
    cells = [c for c in cert.cells if not c.write_policy]
    assert len(cells) == 2 and all(c.steps > 0 for c in cells)
    for c in cert.cells:
        if not c.passed:
            broken = set(re.findall(r"INV-[A-Z]+-\d+", c.failure or ""))
            assert broken and broken <= CALIBRATED, (c.page_size, c.write_policy, c.failure)
            assert c.reproduced, c.failure


def test_the_rust_selection_certifies_the_same_cache(tmp_path: Path) -> None:
    """S1 again, as a run: same ops, same digests (the factories differ only in the core they ask for)."""
    runs = [
        certify(
            f"kvcert.conformance.adapters.sglang.session:{name}",
            examples=5,
            steps=20,
            seed=1,
            page_sizes=[4],
            host_cells=False,
            out_dir=tmp_path / name,
        )
        for name in ("factory_planned", "factory_rust_planned")
    ]
    assert [c.digest for c in runs[0].cells] == [c.digest for c in runs[1].cells]
