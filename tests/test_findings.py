"""The findings log's traces: each still reproduces against SGLang, and each is fine on the model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _sglang import required

from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
from kvcert.refimpl import RefCache
from kvcert.spec.ops import Trace

FINDINGS = sorted((Path(__file__).parent.parent / "conformance" / "findings" / "sglang").glob("*.json"))
EXPECTED = {
    "sglang-unlock-without-lock": {"INV-ERR-1", "INV-LOCK-1", "INV-ACCT-1"},
    "sglang-lock-evicted-node": {"INV-ERR-1", "INV-ACCT-1", "INV-ACCT-2"},
    "sglang-unaligned-insert": {"INV-ERR-1", "INV-ACCT-3"},
    "sglang-short-value": {"INV-ERR-1", "INV-TREE-2"},
    "sglang-negative-token": {"INV-ERR-1"},
}


def test_every_finding_has_an_expectation() -> None:
    assert {p.stem for p in FINDINGS} == set(EXPECTED)


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_the_model_rejects_the_bad_input_cleanly(path: Path) -> None:
    trace = Trace.from_json(path.read_text())
    run_trace(RefCache(trace.config), trace.config, RefCache.capabilities, list(trace.ops))


@pytest.mark.sglang
@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_sglang_still_behaves_as_logged(path: Path) -> None:
    if importlib.util.find_spec("sglang") is None:
        if required():
            pytest.fail("KVCERT_SGLANG=1 but sglang is not installed", pytrace=False)
        pytest.skip("sglang not installed: run scripts/install_sglang.sh")
    from kvcert.conformance.certification.certify import load_factory

    trace = Trace.from_json(path.read_text())
    make = load_factory(trace.target)
    with pytest.raises(ConformanceFailure) as err:
        run_trace(make(trace.config), trace.config, make.capabilities, list(trace.ops))  # type: ignore[attr-defined]
    assert EXPECTED[path.stem] <= {v.inv for v in err.value.violations}
