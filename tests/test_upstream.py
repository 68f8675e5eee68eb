"""docs/upstream/: every reproducer fails on the released engine and passes with its fix.patch (scripts/upstream_check.py,
in the engine's own environment, the fix applied to an overlay of the installed package by `patch`)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from kvcert.conformance.certification import fixes, known

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import upstream_check  # noqa: E402

FOLDERS = sorted(p.name for p in (ROOT / "docs" / "upstream").iterdir() if p.is_dir() and p.name != "__pycache__")
ENGINE_FLAG = {"refaware": "KVCERT_REFAWARE", "sglang": "KVCERT_SGLANG"}


def test_every_folder_is_a_logged_finding_with_its_fix() -> None:
    log = {f.id: f for f in known.findings()}
    for name in FOLDERS:
        folder = ROOT / "docs" / "upstream" / name
        assert name in log, f"docs/upstream/{name} is no finding of the log"
        assert (folder / "README.md").exists() and list(folder.glob("test_*.py")), name
        assert (folder / "fix.patch").read_text() == fixes.patch_text(name)


@pytest.mark.parametrize("fid", FOLDERS)
def test_the_reproducer_fails_released_and_passes_fixed(fid: str) -> None:
    env = upstream_check._env(upstream_check._finding(fid))
    if not (env / "bin" / "python").exists():
        flag = ENGINE_FLAG["refaware" if "refaware" in env.name else "sglang"]
        if os.environ.get(flag, "0") == "1":
            pytest.fail(f"{flag}=1 but {env.name} is missing", pytrace=False)
        pytest.skip(f"{env.name} missing")
    if "refaware" not in env.name and importlib.util.find_spec("sglang") is None and os.environ.get("KVCERT_SGLANG") != "1":
        pytest.skip("sglang not installed")
    ok, line = upstream_check.check(fid)
    assert ok, line
