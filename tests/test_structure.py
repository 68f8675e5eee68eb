"""The house rules a newcomer can rely on: rooms of at most 600 lines unless the room says why at its top, a
README that fits on a few screens, and Hypothesis's internals reached from one module only. (The import layering
is a contract of its own: scripts/layers.sh, in CI.)"""

from __future__ import annotations

import ast
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
