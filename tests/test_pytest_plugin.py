"""The pytest plugin: `pytest --kvcert-target MODULE:FACTORY` runs one test per certification cell."""

from __future__ import annotations

import pytest

from kvcert.conformance.certification.certify import cells_for
from kvcert.conformance.certification.pytest_plugin import cell_id
from kvcert.refimpl import RefCache

pytest_plugins = ["pytester"]

CELL = "page_size:1-lru-device"
BUDGET = ["--kvcert-examples", "3", "--kvcert-steps", "8", "-p", "no:cacheprovider"]


def test_one_test_per_certify_cell_named_by_the_cell() -> None:
    configs, _ = cells_for(RefCache.capabilities, None, None)
    ids = [cell_id(c) for c in configs]
    assert len(set(ids)) == len(ids)
    assert {"page_size:1-lru-device", "page_size:4-lru-write_back", "page_size:4-lru-write_back+timeout"} <= set(ids)


def test_selected_cell_runs_and_passes_on_the_model(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--kvcert-target", "kvcert.refimpl:factory", *BUDGET, "-k", CELL)
    result.assert_outcomes(passed=1, deselected=len(cells_for(RefCache.capabilities, None, None)[0]))  # + findings


def test_keyword_selection_by_policy_and_page_size(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--kvcert-target", "kvcert.refimpl:factory", "--collect-only", "-q", "-k", "page_size:4- and write_back"
    )
    lines = [line for line in result.outlines if "test_cell[" in line]
    assert lines and all("page_size:4-" in line and "write_back" in line for line in lines)
    assert any(line.endswith("[page_size:4-lru-write_back]") for line in lines)


def test_a_failing_cell_fails_with_the_invariant_and_the_saved_trace(pytester: pytest.Pytester) -> None:
    """evict_locked (a device-tier zoo mutant: eviction ignores locks) dies within a few examples."""
    out = pytester.path / "failures"
    result = pytester.runpytest(
        "--kvcert-target",
        "kvcert.conformance.zoo:evict_locked",
        "--kvcert-examples",
        "100",
        "--kvcert-steps",
        "20",
        "--kvcert-out",
        str(out),
        "-p",
        "no:cacheprovider",
        "-k",
        CELL,
    )
    result.assert_outcomes(failed=1, deselected=len(cells_for(RefCache.capabilities, None, None)[0]))  # + findings
    text = result.stdout.str()
    assert "INV-EVICT-3" in text and "kvcert replay" in text
    assert list(out.glob("*.json"))


def test_without_a_target_the_plugin_adds_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q")
    assert [line for line in result.outlines if "::" in line] == [
        "test_without_a_target_the_plugin_adds_nothing.py::test_plain"
    ]


def test_a_cell_that_ran_no_step_fails(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--kvcert-target", "kvcert.refimpl:factory", "--kvcert-examples", "0", "-p", "no:cacheprovider", "-k", CELL
    )
    result.assert_outcomes(failed=1, deselected=len(cells_for(RefCache.capabilities, None, None)[0]))
    assert "NO-STEPS" in result.stdout.str()


def test_a_cells_digest_is_checked_against_certifys(pytester: pytest.Pytester) -> None:
    """With `--kvcert-certificate`, each cell must make certify's run, op for op: its digest is compared."""
    import json

    from kvcert.conformance.certification.certify import certify

    cert = certify("kvcert.refimpl:factory", examples=3, steps=8, page_sizes=[1], policies=["lru"],
                   write_policies=[], prefetch_policies=[], out_dir=pytester.path / "f")  # fmt: skip
    good = pytester.path / "cert.json"
    good.write_text(cert.to_json())
    args = ("--kvcert-target", "kvcert.refimpl:factory", *BUDGET, "-k", CELL)
    pytester.runpytest(*args, "--kvcert-certificate", str(good)).assert_outcomes(
        passed=1, deselected=len(cells_for(RefCache.capabilities, None, None)[0])
    )
    body = json.loads(good.read_text())
    body["cells"][0]["digest"] = "0" * 64
    bad = pytester.path / "bad.json"
    bad.write_text(json.dumps(body))
    result = pytester.runpytest(*args, "--kvcert-certificate", str(bad))
    result.assert_outcomes(failed=1, deselected=len(cells_for(RefCache.capabilities, None, None)[0]))
    assert "INV-DET-1" in result.stdout.str()


def test_the_known_findings_are_one_test(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--kvcert-target", "kvcert.refimpl:factory", *BUDGET, "-k", "known_findings")
    result.assert_outcomes(passed=1, deselected=len(cells_for(RefCache.capabilities, None, None)[0]))
