"""Run each upstream reproducer both ways: it must fail on the released engine and pass with its fix.

    .venv/bin/python scripts/upstream_check.py [ID ...]

Each folder of docs/upstream/ is one finding (its name is the finding's id): a pytest file in the engine's own test
style and `fix.patch`, the finding's minimal fix as a diff against the engine's repository (`python/sglang/...`).
The reproducer runs in the engine's environment (.venv for SGLang, .venv-refaware for the RefAware fork), first as
installed, then over an overlay: a tree of links to the installed package with the patched files copied in and
patched by `patch`, put first on PYTHONPATH, so the engine that passes is the released one plus the diff and nothing
else. Prints one line per finding; exit 1 if any reproducer passes unpatched or fails patched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcert.conformance.certification import known

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "docs" / "upstream"
ENVS = {"refaware": ROOT / ".venv-refaware", "sglang": ROOT / ".venv"}
"""The environment each engine's reproducers run in, by the findings log's adapter room."""


def _finding(fid: str) -> known.Finding:
    by_id = {f.id: f for f in known.findings()}
    if fid not in by_id:
        raise SystemExit(f"{fid}: no such finding in conformance/findings/index.json")
    return by_id[fid]


def _env(finding: known.Finding) -> Path:
    """The fork's environment for a finding logged only for the fork's adapters, else SGLang's."""
    fork = all(".refaware" in a for a in finding.adapters)
    return ENVS["refaware" if fork else "sglang"]


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip())


def _overlay(patch: Path, site: Path, into: Path) -> None:
    """Links to every installed file of the packages the patch touches; the patched files as real, patched copies."""
    text = patch.read_text()
    files = re.findall(r"(?m)^\+\+\+ b/(\S+)", text)
    tops = {Path(f).parts[1] if f.startswith("python/") else Path(f).parts[0] for f in files}
    for top in tops:
        subprocess.run(["cp", "-rs", str(site / top), str(into / top)], check=True)
    for f in files:
        rel = Path(*Path(f).parts[1:]) if f.startswith("python/") else Path(f)
        target = into / rel
        target.unlink()
        shutil.copyfile(site / rel, target)
    strip = "2" if files[0].startswith("python/") else "1"
    subprocess.run(["patch", f"-p{strip}", "--fuzz=0", "-s", "-d", str(into), "-i", str(patch)], check=True)


def _pytest(python: Path, folder: Path, overlay: Path | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    if overlay is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(folder)],
        cwd=UPSTREAM, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def check(fid: str) -> tuple[bool, str]:
    """(as expected, a line saying how each way ended)."""
    folder = UPSTREAM / fid
    python = _env(_finding(fid)) / "bin" / "python"
    if not python.exists():
        return False, f"{fid}: {python.parent.parent.name} missing (install the engine's environment)"
    stock = _pytest(python, folder, None)
    with tempfile.TemporaryDirectory() as tmp:
        _overlay(folder / "fix.patch", _site_packages(python), Path(tmp))
        fixed = _pytest(python, folder, Path(tmp))
    ok = stock.returncode == 1 and fixed.returncode == 0
    last = lambda p: (p.stdout.strip().splitlines() or ["(no output)"])[-1]  # noqa: E731
    line = f"{fid}: released: {last(stock)} | with fix.patch: {last(fixed)}"
    if not ok:
        line += "\n" + (stock.stdout + stock.stderr)[-2000:] + "\n" + (fixed.stdout + fixed.stderr)[-2000:]
    return ok, line


def main(ids: list[str]) -> int:
    ids = ids or sorted(p.name for p in UPSTREAM.iterdir() if p.is_dir() and (p / "fix.patch").exists())
    bad = 0
    for fid in ids:
        ok, line = check(fid)
        print(("ok    " if ok else "WRONG ") + line, flush=True)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
