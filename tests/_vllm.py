"""Running a command in vLLM's own environment (`.venv-vllm`, scripts/install_vllm.sh) from the main suite."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM = ROOT / ".venv-vllm" / "bin"


def run_vllm(cmd: list[str], hash_seed: str = "0") -> tuple[int, str, str]:
    """`cmd` (its first word a program in `.venv-vllm/bin`) -> (exit status, stdout and stderr, stdout). Skips when the
    environment is missing, and fails instead under KVCERT_VLLM=1 (CI)."""
    if not (VLLM / "python").exists():
        why = ".venv-vllm missing: run scripts/install_vllm.sh"
        if os.environ.get("KVCERT_VLLM", "0") == "1":
            pytest.fail(f"KVCERT_VLLM=1 but {why}", pytrace=False)
        pytest.skip(why)
    done = subprocess.run(
        [str(VLLM / cmd[0]), *cmd[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
    )
    return done.returncode, done.stdout + done.stderr, done.stdout


def plant_runs(cmd: list[str]) -> dict[str, dict[str, Any]]:
    """Run a plants script in `.venv-vllm` (`cmd`: its path and arguments) -> its JSON lines, one per plant, by plant."""
    rc, out, stdout = run_vllm(["python", *cmd])
    assert rc == 0, out[-3000:]
    return {r["plant"]: r for r in map(json.loads, (ln for ln in stdout.splitlines() if ln.startswith("{")))}
