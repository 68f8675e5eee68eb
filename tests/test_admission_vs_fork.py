"""The R8 calibration's claims replayed: §11.5 plans beside the RefAware fork's own scheduler.

`scripts/admission_vs_fork.py` runs the fork's `PrefillAdder` (in `.venv-refaware`, a subprocess:
the fork cannot share a process with SGLang 0.5.23) beside `kvcert.spec.admission.plan_admission`.
This checks that the differences docs/calibration/refaware.md records for a few of its states still
hold. With `KVCERT_REFAWARE=1` the environment is required: a missing one fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
PYTHON = ROOT / ".venv-refaware" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "admission_vs_fork.py"

# state -> (differences, kvcert's retractions, the fork's retractions, fork admits)
EXPECTED: dict[str, tuple[list[str], list[int], list[int], bool]] = {
    # the fork retracts the running low request before touching HIGH_REF; §11.5 evicts HIGH_REF first
    "retract-or-evict-high": (["retract-count", "high-evicted", "unused-low-evicted"], [], [1], True),
    # the fork's pre-check counts a victim's decode reservation only, not the KV it holds: it refuses
    "kv-not-counted": (["kvcert-admits"], [1], [], False),
    # the fork retracts by sequence length until covered; §11.5 takes the fewest (here the one freeing most)
    "order-by-kv": (["retract-count"], [2], [1, 2], True),
}


def _rows() -> dict[str, dict[str, Any]]:
    if not PYTHON.exists():
        why = f"{PYTHON} missing: run scripts/install_refaware.sh"
        if os.environ.get("KVCERT_REFAWARE", "0") == "1":
            pytest.fail(f"KVCERT_REFAWARE=1 but {why}", pytrace=False)
        pytest.skip(why)
    args = [str(PYTHON), str(SCRIPT), "--json"]
    for name in EXPECTED:
        args += ["--state", name]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["state"]: row for row in rows}


def test_the_recorded_differences_still_hold() -> None:
    rows = _rows()
    assert set(rows) == set(EXPECTED)
    for name, (tags, kvcert_retract, fork_retract, fork_fits) in EXPECTED.items():
        row = rows[name]
        assert row["differences"] == tags, name
        assert row["kvcert"]["fits"], name
        assert row["kvcert"]["retract"] == kvcert_retract, name
        assert row["fork"]["fits"] is fork_fits, name
        assert row["fork"]["retract"] == fork_retract, name
    # HIGH_REF: §11.5 evicts 400 of it, the fork none (it retracts instead)
    assert rows["retract-or-evict-high"]["kvcert"]["evicted"] == [200, 200, 400]
    assert rows["retract-or-evict-high"]["fork"]["evicted"] == [200, 0, 0]
