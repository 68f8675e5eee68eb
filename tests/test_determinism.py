"""Same seed, same run, in any process: generation depends on the seed and the cell, nothing else.

Three fresh interpreters run the same work: an editable install that imports the CLI and the
bench first (as `kvcert selftest` does), a wheel installed into a site-packages directory that
imports nothing else (as a user's CI does), and an editable one that first certifies another
mutant in the same process (process history). Each reports every cell's step digest
(`conformance.generation.determinism.StepDigest`: every op every example executed) and the bytes of the
shrunk trace it saved; all three must be equal byte for byte. Different PYTHONHASHSEEDs (and
ASLR, which moves every object address) ride along.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

WORK = r"""
import importlib, json, sys
from pathlib import Path
out = Path(sys.argv[1])
first, *imports = sys.argv[2:]
for name in imports:
    importlib.import_module(name)
import kvcert.conformance.certification.certify as certify_mod
from kvcert.conformance import zoo
from kvcert.refimpl import factory
from kvcert.spec.types import CacheConfig

def mutant(name):
    (m,) = [m for m in zoo.MUTANTS if m.name == name]
    return m

if first:  # history: another mutant's whole run in this process first
    zoo.run_mutant(mutant(first), examples=80, steps=40, seed=3, out_dir=out / "history")
cert = zoo.run_mutant(mutant("load_back_refusal_leaks_lock"), examples=600, steps=50, seed=0, out_dir=out / "zoo")
cells = [[c.digest, c.passed, c.steps, Path(c.trace_path).read_text() if c.trace_path else None] for c in cert.cells]
config = CacheConfig(page_size=4, capacity=24, host_capacity=24, write_policy="write_back", prefetch_policy="timeout")
model = certify_mod.run_cell(
    factory, factory.capabilities, config, examples=40, steps=40, seed=5, target="kvcert.refimpl:factory", out_dir=out
)
print(json.dumps({"where": certify_mod.__file__, "mutant": cells, "model": [model.digest, model.passed, model.steps]}))
"""


def _run(tmp: Path, name: str, *, pythonpath: str = "", hashseed: str, first: str = "", imports: tuple = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONHASHSEED"] = hashseed
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = tmp / name
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", WORK, str(out), first, *imports],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvcert built as a wheel from a copy of this tree and installed into a `site-packages` directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "kvcert-failures", "__pycache__"),
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)], check=True)
    site = tmp / "site-packages"
    (wheel,) = (tmp / "dist").glob("kvcert-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    return site


def test_generation_is_independent_of_install_imports_and_history(tmp_path: Path, wheel_site: Path) -> None:
    editable = _run(
        tmp_path, "editable-cli", hashseed="0", imports=("kvcert.conformance.cli", "kvcert.conformance.bench.meta")
    )
    wheel = _run(tmp_path, "wheel", pythonpath=str(wheel_site), hashseed="12345")
    history = _run(tmp_path, "history", hashseed="random", first="prefetch_anchor_unpinned")
    assert str(ROOT) in editable["where"] and "/site-packages/" not in editable["where"]
    assert wheel["where"].startswith(str(wheel_site)), wheel["where"]
    assert editable["mutant"] and any(not passed for _, passed, _, _ in editable["mutant"]), "the mutant must be killed"
    assert editable["model"][1] and editable["model"][2] > 500  # a real run, passed
    for other in (wheel, history):
        assert other["mutant"] == editable["mutant"]  # digests, verdicts, step counts, saved trace bytes
        assert other["model"] == editable["model"]
