"""Certificates for CI: JUnit XML for test dashboards, Markdown for a pull request or a release page.

Both carry what the terminal certificate shows (`cli.print_certificate`), and both say what the run did
not check as plainly as what it did: a green JUnit badge must not read as more than the run covered.
"""

from __future__ import annotations

import hashlib
import platform
import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files
from pathlib import Path
from typing import Optional

from kvcert.conformance.certification.certificate import CellResult, Certificate
from kvcert.conformance.certification.explain import ids_in
from kvcert.conformance.harness.windows import SHORT, WINDOWS
from kvcert.spec.types import KINDS

OPS_LEGEND = (
    "`<Op>:error`: steps the backend answered with a typed error; `LoadBack>0` / `Prefetch>0`: calls that moved "
    "something; `InjectFault:<kind>` / `StorageFault:<kind>`: faults injected, by kind; `event:<name>`: §11 events "
    "that happened."
)


def package_version(name: str) -> str:
    """An installed distribution's version, or "not installed" (torch is optional for the report)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def spec_sha256() -> str:
    """SHA-256 of the installed SPEC.md: names the exact rules a certificate was judged by."""
    return hashlib.sha256(files("kvcert.spec").joinpath("SPEC.md").read_bytes()).hexdigest()


def git_commit() -> str:
    """The kvcert checkout's HEAD, best effort. Only when this package's directory is tracked there: a kvcert
    installed in a virtualenv inside the user's repository must not report the user's commit as kvcert's."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10, check=True)
        return run.stdout.strip()

    try:
        if not git("ls-files", "--", "."):
            return "unknown"
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def environment() -> dict[str, str]:
    """Facts about the code and machine that produced a certificate, for its Markdown."""
    return {
        "kvcert version": package_version("kvcert"),
        "kvcert git commit": git_commit(),
        "SPEC.md SHA-256": spec_sha256(),
        "Python": f"{platform.python_version()} ({platform.python_implementation()})",
        "torch": package_version("torch"),
        "hypothesis": package_version("hypothesis"),
    }


def cell_name(cell: CellResult) -> str:
    """A cell's coordinates; `write_policy` holds "write+prefetch" for a storage cell."""
    write, _, prefetch = cell.write_policy.partition("+")
    parts = [f"page_size={cell.page_size}", f"policy={cell.policy}"]
    parts += [f"write_policy={write}"] if write else []
    parts += [f"prefetch_policy={prefetch}"] if prefetch else []
    return " ".join(parts)


def tiers(cell: CellResult) -> str:
    if cell.tier:
        return cell.tier
    if not cell.write_policy:
        return "device"
    return ("device+host+storage" if "+" in cell.write_policy else "device+host") + f", {cell.write_policy}"


def verdict(cert: Certificate) -> str:
    return "CERTIFIED" if cert.passed else "NOT CERTIFIED"


def verdict_reasons(cert: Certificate) -> list[str]:
    """Why a certificate is NOT CERTIFIED, one phrase each (none for a certified one)."""
    out = []
    failed = sum(not c.passed for c in cert.cells)
    if failed:
        out.append(f"{failed} of {len(cert.cells)} cells failed")
    if not cert.complete:
        why = " (interrupted)" if cert.interrupted else ""
        out.append(f"incomplete{why}: {len(cert.cells)} of {len(cert.planned)} planned cells ran")
    elif not cert.cells:
        out.append("no cell ran")
    known = sorted({f.id for f in cert.findings if f.reproduced})
    if known:
        out.append(f"known findings reproduce: {', '.join(known)}")
    return out


def failure_summary(cell: CellResult) -> str:
    """One line for a failed cell: where it broke and the first rule broken, as the saved trace's note reads."""
    lines = [line.strip() for line in (cell.failure or "").splitlines() if line.strip()]
    if not lines:
        return "failed"
    head = lines[0] if len(lines) == 1 or lines[-1] == lines[0] else f"{lines[0]} — {lines[-1]}"
    return head if len(head) <= 300 else head[:297] + "..."


def failure_detail(cell: CellResult) -> str:
    """The failure as the terminal prints it, plus where the minimal trace was saved and how to replay it."""
    text = cell.failure or "failed"
    if cell.trace_path:
        text += (
            f"\nminimal trace: {cell.trace_len} ops, replay reproduces: {cell.reproduced}"
            f"\nsaved: {cell.trace_path}  (kvcert replay {cell.trace_path})"
        )
    if cell.shrink_note:
        text += f"\n{cell.shrink_note}"
    return text


_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _xml(text: str) -> str:
    """XML 1.0 cannot carry control characters, which a backend's error message may hold."""
    return _XML_BAD.sub("\N{REPLACEMENT CHARACTER}", text)


def _ops_line(cell: CellResult) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(cell.ops.items()))


def junit_xml(cert: Certificate, timestamp: Optional[datetime] = None) -> str:
    """JUnit XML (the Jenkins / Ant format): one testsuite for the certificate, one testcase per cell, a
    skipped testcase per cell or rule not run, and the not-checked list in the suite's system-out."""
    failures = sum(not c.passed for c in cert.cells) + sum(f.reproduced for f in cert.findings)
    tests = len(cert.cells) + len(cert.skipped) + len(cert.findings)
    seconds = f"{cert.seconds:.3f}"
    counts = {"tests": str(tests), "failures": str(failures), "errors": "0"}
    root = ET.Element("testsuites", {"name": "kvcert", "time": seconds, **counts})
    when = (timestamp or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S")
    skipped = len(cert.skipped) + sum(not f.reproduced and "scope" in f.summary for f in cert.findings)
    attrs = {"name": cert.target, "skipped": str(skipped), "time": seconds, "timestamp": when}
    suite = ET.SubElement(root, "testsuite", {**attrs, **counts})
    props = ET.SubElement(suite, "properties")
    for name, value in {
        "seed": cert.seed,
        "examples": cert.examples,
        "steps": cert.steps,
        "profile": cert.profile,
        "with_fixes": ",".join(cert.with_fixes),
        "backend": cert.backend,
        "strict_input": cert.strict_input,
        "total_steps": cert.total_steps,
        "kind": cert.kind,
        "complete": cert.complete,
        "planned_cells": len(cert.planned),
        "verdict": verdict(cert),
        "kvcert.version": package_version("kvcert"),
        "spec.sha256": spec_sha256(),
    }.items():
        ET.SubElement(props, "property", name=name, value=_xml(str(value)))
    for c in cert.cells:
        case = ET.SubElement(suite, "testcase", name=cell_name(c), classname=cert.target, time=f"{c.seconds:.3f}")
        if not c.passed:
            rules = ids_in(c.failure or "")
            failure = ET.SubElement(
                case, "failure", message=_xml(failure_summary(c)), type=rules[0] if rules else "ConformanceFailure"
            )
            failure.text = _xml(failure_detail(c))
        out = ET.SubElement(case, "system-out")
        out.text = f"{tiers(c)}: {c.examples} examples, {c.steps} steps, digest {c.digest}\nops: {_ops_line(c)}"
    for note in cert.skipped:
        case = ET.SubElement(suite, "testcase", name=_xml(note), classname=cert.target, time="0.000")
        ET.SubElement(case, "skipped", message=_xml(note))
    for f in cert.findings:
        case = ET.SubElement(suite, "testcase", name=_xml(f"known finding {f.id}: {f.trace}"), classname=cert.target)
        if f.reproduced:
            ET.SubElement(case, "failure", message=_xml(f.summary), type=f.rules[0] if f.rules else "KnownFinding")
        elif "scope" in f.summary:
            ET.SubElement(case, "skipped", message=_xml(f.summary))
    out = ET.SubElement(suite, "system-out")
    gaps = [f"not checked: {gap}" for gap in cert.not_checked]
    why = verdict_reasons(cert)
    head = f"{verdict(cert)} (profile {cert.profile}, seed {cert.seed}, {cert.kind} target)" + (
        f": {'; '.join(why)}" if why else ""
    )
    notes = [f"adapter: {note}" for note in cert.adapter_notes]
    out.text = _xml("\n".join([head, *gaps, *notes]))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _cell(text: object) -> str:
    """A Markdown table cell: pipes escaped, lines joined, so a message cannot break the table."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def _table(header: list[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def markdown(cert: Certificate, env: Optional[dict[str, str]] = None) -> str:
    """The certificate in Markdown. `env`: facts about the machine that ran it (default: `environment()` here);
    pass the ones recorded where the run happened when rendering a certificate elsewhere."""
    facts = environment() if env is None else env
    rate = cert.total_steps / max(cert.seconds, 1e-9)
    failed = [c for c in cert.cells if not c.passed]
    out = [f"# kvcert certificate: `{cert.target}` — {verdict(cert)}", ""]
    if cert.passed:
        scope = " for what it declares and this run exercised (see *Not checked*)" if cert.not_checked else ""
        out.append(f"**{verdict(cert)}**{scope}: every one of {len(cert.cells)} cells passed.")
    else:
        out.append(f"**{verdict(cert)}**: {'; '.join(verdict_reasons(cert))}.")
    out += ["", "## Run", ""]
    out += _table(
        ["fact", "value"],
        [
            ["target", f"`{cert.target}`"],
            ["backend", cert.backend],
            ["verdict", verdict(cert)],
            ["profile", cert.profile],
            ["findings' fixes applied", ", ".join(cert.with_fixes) or "none: the engine as released"],
            ["target kind", f"{cert.kind}: {KINDS.get(cert.kind, '')}"],
            ["cells", f"{len(cert.cells)} of {len(cert.planned)} planned"],
            ["seed", cert.seed],
            ["examples per cell", cert.examples],
            ["max steps per example", cert.steps],
            ["strict input", cert.strict_input],
            ["total steps", f"{cert.total_steps} in {cert.seconds:.1f} s ({rate:,.0f} steps/s)"],
            *([k, v] for k, v in facts.items()),
        ],
    )
    out += ["", "## Cells", ""]
    out += _table(
        ["cell", "tiers", "verdict", "examples", "steps", "steps/s", "seconds", "failure"],
        [
            [
                cell_name(c),
                tiers(c),
                "pass" if c.passed else "**FAIL**",
                c.examples,
                c.steps,
                f"{c.steps / max(c.seconds, 1e-9):,.0f}",
                f"{c.seconds:.2f}",
                "" if c.passed else failure_summary(c) + (f" (trace: `{c.trace_path}`)" if c.trace_path else ""),
            ]
            for c in cert.cells
        ],
    )
    out += ["", f"Total: {cert.total_steps} steps in {cert.seconds:.1f} s."]
    seen = [w for w in WINDOWS if any(c.ops.get(f"window:{w}") for c in cert.cells)]
    if seen:
        out += ["", "## Race windows entered (steps per cell)", ""]
        out += _table(
            ["cell", *(SHORT[w] for w in seen)],
            [[cell_name(c), *(c.ops.get(f"window:{w}", 0) for w in seen)] for c in cert.cells],
        )
        out += ["", "; ".join(f"{SHORT[w]}: {WINDOWS[w]}" for w in seen) + "."]
    out += ["", "## Op mix (steps per op kind)", ""]
    out += _table(
        ["cell", "ops", "faults injected", "events"],
        [
            [
                cell_name(c),
                ", ".join(
                    f"{k} {v}"
                    for k, v in sorted(c.ops.items())
                    if not k.startswith(("window:", "event:", "InjectFault:", "StorageFault:"))
                ),
                ", ".join(
                    f"{'storage ' if k.startswith('Storage') else ''}{k.split(':', 1)[1]} {v}"
                    for k, v in sorted(c.ops.items())
                    if k.startswith(("InjectFault:", "StorageFault:"))
                )
                or "none",
                ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in sorted(c.ops.items()) if k.startswith("event:"))
                or "none",
            ]
            for c in cert.cells
        ],
    )
    out += ["", OPS_LEGEND]
    if failed:
        out += ["", "## Failures"]
        for c in failed:
            detail = failure_detail(c)
            fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", detail)), default=0))
            out += ["", f"### {cell_name(c)}", "", f"{fence}text", detail, fence]
    out += ["", "## Known findings replayed", ""]
    out += (
        _table(
            ["finding", "trace", "verdict"],
            [[f.id, f"`{f.trace}`", ("**REPRODUCES** — " if f.reproduced else "") + f.summary] for f in cert.findings],
        )
        if cert.findings
        else ["None logged for this target's engine."]
    )
    out += ["", "## Adapter", ""]
    out += [f"- {note}" for note in cert.adapter_notes] or ["No notes."]
    out += ["", "## Not checked", ""]
    out += [f"- {gap}" for gap in cert.not_checked] or [
        "Nothing reported: every part of the spec the suite tracks was declared and exercised."
    ]
    out += ["", "## Skipped", ""]
    out += [f"- {note}" for note in cert.skipped] or ["Nothing asked for was skipped."]
    return "\n".join(out) + "\n"
