"""Adapters in rooms by engine: no room reaches into another's, nor into anything underscored outside its own; the
import-linter contract holding it breaks on a planted cross-engine import; and the names targets had before the
rooms (the findings' traces, saved certificates, users' scripts) still run the same modules, the same way."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcert.conformance.aliases import MODULES, canonical
from kvcert.conformance.certification.certify import certify, load_factory

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = ROOT / "conformance" / "adapters"
ENGINES = ("sglang", "refaware", "vllm", "kvcr")
PREFIX = "kvcert.conformance.adapters."


def _imports(path: Path) -> list[str]:
    """Every module (and `module.name` for a `from` import) `path` imports, anywhere in its text."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return out


def _reaches(path: Path, root: Path = ADAPTERS) -> list[str]:
    """The imports of the adapter module `path` that break the rooms' rule: another engine's room, or a name
    starting with `_` inside a room other than `path`'s own."""
    room = path.relative_to(root).parts[0]
    bad = []
    for name in _imports(path):
        if not name.startswith(PREFIX):
            continue
        parts = name[len(PREFIX) :].split(".")
        if parts[0] == room:
            continue
        if parts[0] in ENGINES and room in ENGINES:
            bad.append(f"{name} (another engine's room)")
        elif any(p.startswith("_") for p in parts[1:]):
            bad.append(f"{name} (underscored, outside its room)")
    return bad


def test_no_adapter_reaches_into_another_room() -> None:
    found = {
        str(p.relative_to(ROOT)): bad
        for p in sorted(ADAPTERS.rglob("*.py"))
        if "__pycache__" not in p.parts and p.parent != ADAPTERS and (bad := _reaches(p))
    }
    assert not found, found


def test_the_room_rule_fails_on_a_planted_reach(tmp_path: Path) -> None:
    """The check above can fail: a vLLM adapter importing SGLang's, a room importing the kit's private helper."""
    for room in ("vllm", "kit", "sglang"):
        (tmp_path / room).mkdir()
    (tmp_path / "vllm" / "a.py").write_text("from kvcert.conformance.adapters.sglang import requests\n")
    (tmp_path / "sglang" / "b.py").write_text("from kvcert.conformance.adapters.kit.cpu import _sglang_dir\n")
    (tmp_path / "sglang" / "c.py").write_text("from kvcert.conformance.adapters.sglang import _events\n")
    assert _reaches(tmp_path / "vllm" / "a.py", tmp_path) == [
        "kvcert.conformance.adapters.sglang (another engine's room)",
        "kvcert.conformance.adapters.sglang.requests (another engine's room)",
    ]
    assert _reaches(tmp_path / "sglang" / "b.py", tmp_path) == [
        "kvcert.conformance.adapters.kit.cpu._sglang_dir (underscored, outside its room)"
    ]
    assert _reaches(tmp_path / "sglang" / "c.py", tmp_path) == []


def _lint(tree: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / ".venv" / "bin" / "lint-imports"), "--config", str(config), "--no-cache"],
                          cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True)  # fmt: skip


def test_the_engine_contract_breaks_on_a_planted_cross_engine_import(tmp_path: Path) -> None:
    """pyproject's independence contract over the engines' rooms, run by import-linter on a copy of the suite: it
    keeps the tree as it is, and breaks, naming the import, once a vLLM adapter imports SGLang's."""
    if not (ROOT / ".venv" / "bin" / "lint-imports").exists():
        pytest.fail("import-linter is not installed in .venv (scripts/bootstrap.sh installs it)")
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index('[[tool.importlinter.contracts]]\nname = "an engine\'s adapters never import another')
    contract = text[start : text.index("[[tool.importlinter.contracts]]", start + 1)]
    config = tmp_path / "contract.toml"
    config.write_text(f'[tool.importlinter]\nroot_packages = ["kvcert.conformance"]\n\n{contract}')
    tree = tmp_path / "tree"
    (tree / "kvcert").mkdir(parents=True)
    for package in ("spec", "refimpl", "gpu", "sim", "integrations"):
        (tree / "kvcert" / package).symlink_to(ROOT / package)
    shutil.copytree(ROOT / "conformance", tree / "kvcert" / "conformance",
                    ignore=shutil.ignore_patterns("__pycache__", "findings", "*.json"))  # fmt: skip
    kept = _lint(tree, config)
    assert kept.returncode == 0 and "KEPT" in kept.stdout, kept.stdout + kept.stderr
    planted = tree / "kvcert" / "conformance" / "adapters" / "vllm" / "planted.py"
    planted.write_text("from kvcert.conformance.adapters.sglang import env\n")
    broken = _lint(tree, config)
    assert broken.returncode != 0 and "BROKEN" in broken.stdout, broken.stdout + broken.stderr
    assert "kvcert.conformance.adapters.vllm.planted -> kvcert.conformance.adapters.sglang.env" in broken.stdout


def test_every_old_name_names_a_module_that_exists() -> None:
    missing = {old: new for old, new in MODULES.items() if importlib.util.find_spec(new) is None}
    assert not missing, missing
    assert canonical("kvcert.conformance.adapters.sglang_kvcert:factory_retention") == (
        "kvcert.conformance.adapters.sglang.plugin:factory_retention"
    )
    assert canonical("kvcert.gpu:factory") == "kvcert.gpu:factory"
    assert canonical("kvcert.conformance.engine") == "kvcert.conformance.reference.engine"


def _saved_targets() -> dict[str, str]:
    """Every target a saved trace or certificate names (the findings log, tests' traces and data, docs/runs), by
    one file that names it."""
    out: dict[str, str] = {}
    for folder in ("conformance/findings", "tests/traces", "tests/data", "docs/runs"):
        for path in sorted((ROOT / folder).rglob("*.json")):
            raw = json.loads(path.read_text())
            for item in raw if isinstance(raw, list) else [raw]:
                target = item.get("target") if isinstance(item, dict) else None
                if isinstance(target, str) and ":" in target:
                    out.setdefault(target, str(path.relative_to(ROOT)))
    return out


def _defines(source: Path, name: str) -> bool:
    """Whether the module at `source` binds `name` at its top level (a def, a class, an assignment, an import) or
    answers attributes itself (a module `__getattr__`)."""
    bound: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return name in bound or "__getattr__" in bound


def test_every_saved_target_still_names_a_factory_module() -> None:
    """Old names in saved traces and certificates resolve through the alias table to a module that exists and
    binds the factory: they replay unchanged. (Importing each engine is its own tests' job: this runs in any
    environment.)"""
    targets = _saved_targets()
    old = [t for t in targets if t.partition(":")[0] in MODULES]
    assert len(old) >= 10, f"only {len(old)} saved targets name an old module: the alias check would check little"
    bad = {}
    for target, where in targets.items():
        module, _, attr = canonical(target).partition(":")
        if not module.startswith("kvcert."):
            continue  # a user's module (examples.tinycache...) or a planted one, not kvcert's to rename
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            bad[target] = f"{where}: no module {module}"
        elif not _defines(Path(spec.origin), attr):
            bad[target] = f"{where}: {module} binds no {attr}"
    assert not bad, bad


def test_an_old_target_name_is_the_same_run(tmp_path: Path) -> None:
    """The reference engine under its old name and its new one: the same factory, and certify's digests cell by cell
    the same (what `kvcert same` compares)."""
    old, new = "kvcert.conformance.engine:factory", "kvcert.conformance.reference.engine:factory"
    assert load_factory(old).capabilities == load_factory(new).capabilities  # type: ignore[attr-defined]
    a = certify(old, examples=4, steps=20, seed=3, page_sizes=[4], policies=["lru"], out_dir=tmp_path)
    b = certify(new, examples=4, steps=20, seed=3, page_sizes=[4], policies=["lru"], out_dir=tmp_path)
    assert [c.digest for c in a.cells] == [c.digest for c in b.cells]
    assert all(c.passed for c in a.cells) and a.cells
