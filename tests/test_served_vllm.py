"""vLLM 0.32 served as users deploy it (SPEC.md §16): its own OpenAI server on the model kvcert makes, with prefix
caching, driven over HTTP beside a caching-off twin and judged end to end; and SGLang's known finding SG-OOV given to
vLLM, which refuses the request: the finding's conversation is a defect of SGLang, not of the rules.

The servers run from `.venv-vllm` (scripts/install_vllm.sh); kvcert's client runs here. With `KVCERT_VLLM=1` (CI) the
environment is required.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcert.conformance.served.run import finding_path, replay_file, serve_certify, served_findings
from kvcert.conformance.served.targets import TARGETS, python_of

if not python_of(TARGETS["vllm"]).exists():
    if os.environ.get("KVCERT_VLLM", "0") == "1":
        pytest.fail("KVCERT_VLLM=1 but .venv-vllm is missing: run scripts/install_vllm.sh", pytrace=False)
    pytest.skip(".venv-vllm missing: run scripts/install_vllm.sh", allow_module_level=True)


def test_vllm_serves_certified(tmp_path: Path) -> None:
    cert, run = serve_certify("vllm", examples=2, out_dir=tmp_path, shrink_seconds=0, say=lambda s: None)
    assert cert.passed, (cert.cells[0].failure, cert.not_checked)
    assert run.counts["cached>0"] > 0 and run.counts["tokens compared"] > 100
    assert run.counts["event:stored:GPU"] > 0


def test_sglangs_out_of_vocabulary_finding_is_refused_by_vllm(tmp_path: Path) -> None:
    (oov,) = [f for f in served_findings() if f.id == "SG-OOV"]
    verdict = replay_file(finding_path(oov), say=lambda s: None, out_dir=tmp_path, target_name="vllm")
    assert verdict.passed, verdict.violations
    assert verdict.counts["malformed:prompt-id-out-of-vocab"] == 1
