"""Running a command in a side environment (vLLM's `.venv-vllm`, the KVCR linker's `.venv-kvcr`) from the main suite."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_side(venv: str, cmd: list[str], hash_seed: str = "0") -> tuple[int, str, str]:
    """`cmd` (its first word a program in `ROOT/venv/bin`) -> (exit status, stdout and stderr, stdout). Skips when that
    environment is missing, and fails instead when its CI variable says it must exist (`.venv-vllm`: KVCERT_VLLM=1,
    `.venv-kvcr`: KVCERT_KVCR=1)."""
    bin_dir = ROOT / venv / "bin"
    if not (bin_dir / "python").exists():
        script, flag = SIDE_VENVS[venv]
        why = f"{venv} missing: run {script}"
        if os.environ.get(flag, "0") == "1":
            pytest.fail(f"{flag}=1 but {why}", pytrace=False)
        pytest.skip(why)
    done = subprocess.run(
        [str(bin_dir / cmd[0]), *cmd[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
    )
    return done.returncode, done.stdout + done.stderr, done.stdout


SIDE_VENVS = {
    ".venv-vllm": ("scripts/install_vllm.sh", "KVCERT_VLLM"),
    ".venv-kvcr": ("scripts/install_kvcr.sh", "KVCERT_KVCR"),
}
"""Each side environment: the script that builds it, and the variable under which CI requires it."""


def run_vllm(cmd: list[str], hash_seed: str = "0") -> tuple[int, str, str]:
    """`run_side` in vLLM's environment."""
    return run_side(".venv-vllm", cmd, hash_seed)


def plant_runs(cmd: list[str]) -> dict[str, dict[str, Any]]:
    """Run a plants script in `.venv-vllm` (`cmd`: its path and arguments) -> its JSON lines, one per plant, by plant."""
    rc, out, stdout = run_vllm(["python", *cmd])
    assert rc == 0, out[-3000:]
    return {r["plant"]: r for r in map(json.loads, (ln for ln in stdout.splitlines() if ln.startswith("{")))}
