"""`kvcert explain`: the rule behind an invariant ID, read from SPEC.md and the checker that enforces it.

A certificate or a CI log names broken rules by ID (INV-ACCT-3); whoever reads it needs the rule's words
without finding the right section of the spec. SPEC.md stays the one source: this module parses the
installed copy (tables whose first column is `ID`, bold bullets, headings), it copies nothing out of it.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from dataclasses import dataclass, field
from importlib.resources import files
from types import ModuleType

from kvcert.spec import contracts, invariants

_FAMILY = r"[A-Z0-9]+(?:-[A-Z][A-Z0-9]*)*"
"""A rule family: one word (ACCT, E2E) or a profile's under its family (OFF-LRU, OFF-ARC)."""
_ID = re.compile(rf"\bINV-({_FAMILY})-(\d+)((?:/\d+)+|\.\.\d+)?")
"""One ID, or a group the spec writes as INV-EVICT-1/2/3/5 or INV-ADMIT-1..4."""
_BULLET = re.compile(rf"^\s*[-*]\s+\*\*(INV-{_FAMILY}-\d+)\*\*:?\s*(.*)$")
_CHECKER_MODULES: tuple[ModuleType, ...] = (invariants, contracts)


def spec_text() -> str:
    """SPEC.md as installed with the package (what this kvcert checks, not a checkout's copy)."""
    return files("kvcert.spec").joinpath("SPEC.md").read_text(encoding="utf-8")


def ids_in(text: str) -> list[str]:
    """The IDs `text` names, groups expanded, in order of appearance."""
    out: list[str] = []
    for m in _ID.finditer(text):
        family, first, rest = m.group(1), int(m.group(2)), m.group(3) or ""
        if rest.startswith(".."):
            numbers = list(range(first, int(rest[2:]) + 1))
        else:
            numbers = [first, *(int(n) for n in rest.split("/") if n)]
        out += [f"INV-{family}-{n}" for n in numbers if f"INV-{family}-{n}" not in out]
    return out


@dataclass
class Definition:
    """Where SPEC.md defines an ID: the section, the defining text, and its one-line rule."""

    section: str
    text: str
    summary: str
    table: bool = False
    """Whether it is a row of an `ID` table (the spec's canonical statement of the rule)."""


@dataclass
class _Spec:
    definitions: dict[str, list[Definition]] = field(default_factory=dict)
    mentions: dict[str, list[str]] = field(default_factory=dict)
    """ID -> sections that name it without defining it, in document order."""


def _section(heading: str) -> str:
    title = heading.lstrip("#").strip()
    return f"§{title}" if title[:1].isdigit() else title


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _paragraph(lines: list[str], i: int) -> str:
    """The block around line `i`: up to the nearest blank lines."""
    start, end = i, i
    while start > 0 and lines[start - 1].strip():
        start -= 1
    while end + 1 < len(lines) and lines[end + 1].strip():
        end += 1
    return "\n".join(lines[start : end + 1])


def _bullet(lines: list[str], i: int) -> str:
    """A bullet item with its indented continuation lines."""
    end = i
    while end + 1 < len(lines) and lines[end + 1].startswith((" ", "\t")) and lines[end + 1].strip():
        end += 1
    return "\n".join(lines[i : end + 1])


@functools.cache
def _parse() -> _Spec:
    """Every definition and mention of an ID in SPEC.md, each with the section it is under."""
    spec = _Spec()
    lines = spec_text().splitlines()
    heading, fenced = "", False
    header: list[str] = []
    defined_at: dict[str, set[int]] = {}

    def define(inv: str, at: int, d: Definition) -> None:
        spec.definitions.setdefault(inv, []).append(d)
        defined_at.setdefault(inv, set()).add(at)

    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        if line.startswith("#"):
            heading = line
            for inv in ids_in(line):
                body = _paragraph(lines, i + 2) if i + 2 < len(lines) and lines[i + 1] == "" else ""
                define(
                    inv,
                    i,
                    Definition(_section(heading), f"{line}\n{body}".strip(), line.split(inv, 1)[-1].strip(" :—-")),
                )
            continue
        if line.startswith("|"):
            if not (i and lines[i - 1].startswith("|")):
                header = _cells(line)
            elif header and header[0].lower() == "id" and not set(line) <= set("|-: "):
                cells = _cells(line)
                text = "\n".join(f"{h}: {c}" for h, c in zip(header[1:], cells[1:]))
                for inv in ids_in(cells[0]):
                    define(inv, i, Definition(_section(heading), text, cells[-1], table=True))
            continue
        m = _BULLET.match(line)
        if m:
            text = _bullet(lines, i)
            define(m.group(1), i, Definition(_section(heading), text, m.group(2).split(";")[0].strip()))
    heading, fenced = "", False
    for i, line in enumerate(lines):  # second pass: the sections that only mention an ID
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("#") and not fenced:
            heading = line
        for inv in ids_in(line):
            if i in defined_at.get(inv, set()):
                continue
            if inv not in spec.definitions:  # named but never defined: its first paragraph stands in
                define(inv, i, Definition(_section(heading), _paragraph(lines, i), line.strip()))
                continue
            where = spec.mentions.setdefault(inv, [])
            if _section(heading) not in where:
                where.append(_section(heading))
    return spec


def _natural(inv: str) -> tuple[str, int]:
    family, _, number = inv.rpartition("-")
    return family, int(number)


def invariant_ids() -> list[str]:
    """Every ID SPEC.md defines, INV-HOST-2 before INV-HOST-10."""
    return sorted(_parse().definitions, key=_natural)


def summary(inv_id: str) -> str:
    """The one-line rule of `inv_id`: its `ID` table row's, else its first definition's."""
    found = _parse().definitions[normalize(inv_id)]
    return next((d for d in found if d.table), found[0]).summary


def normalize(inv_id: str) -> str:
    """`acct-3`, `inv-acct-3` and `INV-ACCT-3` all name INV-ACCT-3."""
    inv = inv_id.strip().upper()
    return inv if inv.startswith("INV-") else f"INV-{inv}"


def checkers(inv_id: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the functions that check `inv_id`: the `SNAPSHOT_INVARIANTS` entry, and
    every public function of kvcert.spec.invariants / .contracts whose docstring's first line names it."""
    inv = normalize(inv_id)
    found = [invariants.SNAPSHOT_INVARIANTS[inv]] if inv in invariants.SNAPSHOT_INVARIANTS else []
    for module in _CHECKER_MODULES:
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            doc = inspect.getdoc(fn) or ""
            if fn.__module__ == module.__name__ and not name.startswith("_") and inv in ids_in(doc.split("\n")[0]):
                found.append(fn)
    unique = list(dict.fromkeys(found))
    return [(f"{fn.__module__}.{fn.__qualname__}", inspect.getdoc(fn) or "") for fn in unique]


def suggestions(inv_id: str) -> list[str]:
    """Known IDs close to a mistyped one."""
    return difflib.get_close_matches(normalize(inv_id), invariant_ids(), n=5, cutoff=0.6)


def explain(inv_id: str) -> str:
    """What SPEC.md says `inv_id` is, where, and which checker enforces it. KeyError for an unknown ID."""
    inv = normalize(inv_id)
    spec = _parse()
    if inv not in spec.definitions:
        raise KeyError(inv)
    out: list[str] = []
    for d in spec.definitions[inv]:
        out += [f"{inv} — SPEC.md {d.section}", *(f"  {t}" for t in d.text.splitlines()), ""]
    found = checkers(inv)
    for name, doc in found:
        out += [f"checker: {name}", *(f"  {t}" for t in doc.splitlines()), ""]
    if not found:
        out += [
            "checker: no function of kvcert.spec.invariants / kvcert.spec.contracts names it; "
            "the harness checks it (conformance/harness/checks.py and the modules SPEC.md §8 lists)",
            "",
        ]
    if spec.mentions.get(inv):
        out.append("also named in SPEC.md " + "; ".join(spec.mentions[inv]))
    return "\n".join(out).rstrip() + "\n"
