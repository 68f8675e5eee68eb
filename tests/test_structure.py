"""The house rules a newcomer can rely on: rooms of at most 600 lines unless the room says why at its top, a
README that fits on a few screens, and Hypothesis's internals reached from one module only. (The import layering
is a contract of its own: scripts/layers.sh, in CI.)"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
ROOMS = ("spec", "refimpl", "gpu", "conformance", "sim", "scripts", "examples")
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
