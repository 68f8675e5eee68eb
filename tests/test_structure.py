"""The house rules a newcomer can rely on: rooms of at most 600 lines unless the room says why at its top, a
README that fits on a few screens, Hypothesis's internals reached from one module only, a map of its modules atop
every package, and no two modules of a package importing each other. (The import layering between packages is a
contract of its own: scripts/layers.sh, in CI.)"""

from __future__ import annotations

import ast
import importlib.util
import re
from itertools import takewhile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
ROOMS = ("spec", "refimpl", "gpu", "conformance", "sim", "integrations", "scripts", "examples")
LONG = 600
REASON = "# Over 600 lines: "


def _modules() -> list[Path]:
    return sorted(p for room in ROOMS for p in (ROOT / room).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_long_module_says_why_at_its_top(path: Path) -> None:
    lines = path.read_text().splitlines()
    if len(lines) <= LONG:
        return
    head = [line for line in lines[:2] if line.startswith(REASON)]
    assert head and len(head[0]) > len(REASON) + 10, f"{len(lines)} lines and no '{REASON}<why>' line at its top"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_short_module_has_no_stale_reason(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert len(lines) > LONG or not any(line.startswith(REASON) for line in lines[:2]), "no longer over 600 lines"


def test_the_readme_fits_in_150_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_hypothesis_internals_are_imported_in_one_module() -> None:
    """Hypothesis's private modules move between releases: one module names them, so an upgrade breaks in one
    place, at import (conformance/generation/hypothesis_compat.py)."""
    private = ("hypothesis.internal", "hypothesis.strategies._internal")
    users = {
        str(p.relative_to(ROOT))
        for p in [*_modules(), *sorted((ROOT / "tests").rglob("*.py"))]
        if any(m == q or m.startswith(q + ".") for m in _imports(p) for q in private)
    }
    assert users == {"conformance/generation/hypothesis_compat.py"}


PACKAGES = ("spec", "refimpl", "gpu", "sim", "integrations", "conformance")
"""The folders kvcert installs as `kvcert.*` (pyproject's package-dir): each, and every package under it."""
MAP_HEADER = "| module | owns |"


def _packages() -> list[Path]:
    return sorted(p.parent for top in PACKAGES for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts)


def _map_problems(package: Path) -> list[str]:
    """What the map in `package`'s docstring gets wrong. The map is the docstring's Markdown table headed
    `| module | owns |`: its first column names each module (`name`, several to a row allowed) and each
    subpackage (`name/`) in backticks, and nothing else; data folders (findings/, pythonpath/) are prose."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    lines = [line.strip() for line in doc.splitlines()]
    if MAP_HEADER not in lines:
        return [f"no `{MAP_HEADER}` table in its docstring"]
    table = takewhile(lambda line: line.startswith("|"), lines[lines.index(MAP_HEADER) + 2 :])
    rows = [row.split("|") for row in table]
    listed = [name for row in rows for name in re.findall(r"`([^`]+)`", row[1])]
    present = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    present |= {f"{d.name}/" for d in package.iterdir() if (d / "__init__.py").is_file()}
    return [
        f"{what}: {', '.join(names)}"
        for what, names in (
            ("unlisted", sorted(present - set(listed))),
            ("listed but missing", sorted(set(listed) - present)),
            ("listed twice", sorted({n for n in listed if listed.count(n) > 1})),
            ("a row that owns nothing", [row[1].strip() for row in rows if len(row) < 4 or not row[2].strip()]),
        )
        if names
    ]


MAPS_PENDING: dict[str, str] = {}
"""Maps known to be wrong, each fixed by the change that owns its folder. Strict: a map fixed while listed here
fails, so the entry goes with the fix."""


def _map_param(package: Path) -> object:
    room = str(package.relative_to(ROOT))
    marks = [pytest.mark.xfail(strict=True, reason=MAPS_PENDING[room])] if room in MAPS_PENDING else []
    return pytest.param(package, marks=marks, id=room)


@pytest.mark.parametrize("package", [_map_param(p) for p in _packages()])
def test_every_package_maps_exactly_its_modules(package: Path) -> None:
    """Each package's docstring maps its modules in one table (`_map_problems`), kept true: a module added,
    renamed or removed without its row fails here."""
    problems = _map_problems(package)
    assert not problems, f"{package.relative_to(ROOT)}/__init__.py's map: " + "; ".join(problems)


def test_the_map_check_fails_on_an_unlisted_or_a_missing_module(tmp_path: Path) -> None:
    """The check above can fail: a module its map leaves out, a row for a module that is gone, a subpackage."""
    room = tmp_path / "room"
    (room / "sub").mkdir(parents=True)
    (room / "sub" / "__init__.py").write_text("")
    (room / "__init__.py").write_text('"""A room.\n\n| module | owns |\n|---|---|\n| `a`, `gone` | things |\n"""\n')
    for name in ("a", "b"):
        (room / f"{name}.py").write_text("")
    assert _map_problems(room) == ["unlisted: b, sub/", "listed but missing: gone"]
    (room / "__init__.py").write_text(
        '"""A room.\n\n| module | owns |\n|---|---|\n| `a`, `b` | things |\n| `sub/` | more |\n"""'
    )
    assert _map_problems(room) == []
    (room / "__init__.py").write_text('"""A room with no map."""')
    assert _map_problems(room) == [f"no `{MAP_HEADER}` table in its docstring"]


def _sibling_imports(package: Path, dotted: str) -> dict[str, set[str]]:
    """For each module of `package` (imported as `dotted`), the modules of the same package it imports anywhere in
    its text: at module level, under `if TYPE_CHECKING:`, or inside a function."""
    modules = {p.stem: p for p in package.glob("*.py") if p.name != "__init__.py"}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        seen: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                seen.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif isinstance(node, ast.ImportFrom) and node.module == dotted:
                seen.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(dotted + "."):
                seen.add((node.module or "")[len(dotted) + 1 :].split(".")[0])
            elif isinstance(node, ast.Import):
                seen.update(
                    a.name[len(dotted) + 1 :].split(".")[0] for a in node.names if a.name.startswith(dotted + ".")
                )
        out[name] = (seen & modules.keys()) - {name}
    return out


def _circles(package: Path, dotted: str) -> list[tuple[str, str]]:
    imports = _sibling_imports(package, dotted)
    return sorted((a, b) for a in imports for b in imports[a] if a < b and a in imports[b])


def test_no_two_modules_of_a_package_import_each_other() -> None:
    """Two modules that import each other (a function-level import is still an import) are one module in two
    files: whichever loads first sees the other half-built, and neither can be read alone. The shared piece
    belongs in a module of its own, or in the lower of the two."""
    found = [
        f"{p.relative_to(ROOT)}: {a} <-> {b}"
        for p in _packages()
        for a, b in _circles(p, "kvcert." + ".".join(p.relative_to(ROOT).parts))
    ]
    assert not found, f"modules importing each other: {found}"


def test_the_circle_check_finds_a_function_level_import_back(tmp_path: Path) -> None:
    """The check above can fail: `b` imports `a` at the top, `a` imports `b` inside a function."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("def f():\n    from kvcert.planted import b\n\n    return b\n")
    (tmp_path / "b.py").write_text("from kvcert.planted.a import f\n")
    (tmp_path / "c.py").write_text("import kvcert.planted.a\n")
    assert _sibling_imports(tmp_path, "kvcert.planted") == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _circles(tmp_path, "kvcert.planted") == [("a", "b")]


def test_the_results_page_is_what_the_certificates_say() -> None:
    """docs/results.md is generated from docs/runs/ by scripts/results_page.py, never typed: a certificate added or
    removed without regenerating the page fails here."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_page.py"), "--check"], capture_output=True,
                         text=True)  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr


def test_the_tour_page_shows_the_readmes_tour() -> None:
    """docs/tour_output.md holds what the README's tour printed, written by scripts/tour.py: a tour edited without
    rerunning the script fails here; so does a page that shows one command too many or too few."""
    import subprocess
    import sys

    tour = ROOT / "scripts" / "tour.py"
    got = subprocess.run([sys.executable, str(tour), "--check"], capture_output=True, text=True)
    assert got.returncode == 0, got.stdout + got.stderr
    spec = importlib.util.spec_from_file_location("tour", tour)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = "## A short tour\n\n```bash\n./kvcert certify a:f   # one\n./kvcert selftest\n```\n"
    assert module.tour_commands(readme) == ["./kvcert certify a:f", "./kvcert selftest"]
    page = module.render([("./kvcert certify a:f", 0, ["CERTIFIED"])])
    assert module.page_commands(page) == ["./kvcert certify a:f"], "a page missing a command is told apart"


def test_every_relative_link_in_the_docs_resolves() -> None:
    """Rooms move (docs/calibration/, the suite's subpackages): a Markdown link to a file that is not there fails
    here, not in a reader's browser. Run output under docs/runs/ is left as it was printed."""
    import re

    pages = [*ROOT.glob("*.md"), *ROOT.glob("spec/*.md"), *ROOT.glob("examples/**/*.md"), *ROOT.glob("docs/**/*.md")]
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        if "runs" not in page.relative_to(ROOT).parts
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        if not target.startswith(("http:", "https:", "mailto:")) and not (page.parent / target).exists()
    ]
    assert not broken, broken


def _results_page():  # scripts/ is not a package: load scripts/results_page.py by path
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs_kept(runs: Path, docs: list[Path]) -> list[str]:
    """What under `runs` breaks its rule: one certificate per (target, profile, fixes); besides certificates, only files
    a doc (outside `runs`) links to, and the README of a folder that keeps one of either."""
    import re
    from collections import Counter

    results = _results_page()
    certs = results.all_certificates(runs)
    twice = [k for k, n in Counter(results.key(cert) for _, cert in certs).items() if n > 1]
    linked = {
        (page.parent / target).resolve()
        for page in docs
        if runs.resolve() not in page.resolve().parents
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    }
    kept = {path.resolve() for path, _ in certs} | {p for p in linked if runs.resolve() in p.parents}
    folders = {p.parent for p in kept}
    stray = [
        str(p.relative_to(runs))
        for p in sorted(runs.rglob("*"))
        if p.is_file() and p.resolve() not in kept and not (p.name == "README.md" and p.resolve().parent in folders)
    ]
    return [f"two certificates of {t} {prof or '(no profile)'}" + (f" with {fx}" if fx else "") for t, prof, fx in twice] + [
        f"{s}: neither a certificate nor linked from a doc" for s in stray
    ]


def _doc_pages() -> list[Path]:
    return [*ROOT.glob("*.md"), *ROOT.glob("spec/*.md"), *ROOT.glob("examples/**/*.md"), *ROOT.glob("docs/**/*.md")]


def test_docs_runs_keeps_one_certificate_per_target_and_what_the_docs_cite() -> None:
    """docs/runs/ is not an archive: per (target, profile) one certificate, the newest, the one docs/results.md
    shows (a new run replaces the old file; git keeps history). Anything else there is a file a doc links to
    (a figure's printed output), or the README that says which command wrote a kept file."""
    problems = _runs_kept(ROOT / "docs" / "runs", _doc_pages())
    assert not problems, problems


def test_the_runs_rule_fails_on_a_second_certificate_and_on_a_stray_file(tmp_path: Path) -> None:
    """The rule above can fail: a superseded certificate left beside the new one, or a log no doc cites."""
    import json

    runs = tmp_path / "docs" / "runs"
    cert = {"target": "kvcert.gpu:factory", "profile": "core", "cells": [], "total_steps": 0}
    for folder in ("2026-01-01-old", "2026-01-02-new"):
        (runs / folder).mkdir(parents=True)
        (runs / folder / "gpu.json").write_text(json.dumps(cert))
    (runs / "2026-01-02-new" / "gpu.log").write_text("output\n")
    (runs / "2026-01-02-new" / "README.md").write_text("# how\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[the run](runs/2026-01-02-new/gpu.json)\n")
    assert _runs_kept(runs, [page]) == [
        "two certificates of kvcert.gpu:factory core",
        "2026-01-02-new/gpu.log: neither a certificate nor linked from a doc",
    ]
    (runs / "2026-01-01-old" / "gpu.json").unlink()
    (runs / "2026-01-02-new" / "gpu.log").unlink()
    assert _runs_kept(runs, [page]) == []
