"""vLLM 0.32.0's prefix cache runs here, in its own environment (`.venv-vllm`, scripts/install_vllm.sh): its
`KVCacheManager` driven with real `Request` objects keeps requests that differ in a key (cache salt, LoRA name or
path, an image) apart and reuses across requests whose keys agree (scripts/vllm_smoke.py). Both halves are shown
able to fail: vLLM with its extra keys dropped fails the partition cases, vLLM with caching off the positive
controls. Groundwork for vLLM's targets (issue 35)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _smoke(*args: str) -> tuple[int, dict[str, object]]:
    if not PYTHON.exists():
        why = ".venv-vllm missing: run scripts/install_vllm.sh"
        if os.environ.get("KVCERT_VLLM", "0") == "1":
            pytest.fail(f"KVCERT_VLLM=1 but {why}", pytrace=False)
        pytest.skip(why)
    done = subprocess.run(
        [str(PYTHON), str(ROOT / "scripts" / "vllm_smoke.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_keeps_keys_apart_and_reuses_where_they_agree() -> None:
    rc, out = _smoke()
    cases = out["vllm_cases"]
    assert isinstance(cases, list) and len(cases) == 11
    assert rc == 0 and out["failed"] == [], out
    assert any(c["hit_tokens"] > 0 for c in cases) and any(c["hit_tokens"] == 0 for c in cases)


@pytest.mark.parametrize(
    ("plant", "broken"),
    [("keyless", "another LoRA path"), ("cold", "the same prompt (positive control)")],
)
def test_the_cases_catch_a_vllm_that_drops_its_keys_or_never_reuses(plant: str, broken: str) -> None:
    rc, out = _smoke("--plant", plant)
    assert rc == 1 and broken in out["failed"], out
