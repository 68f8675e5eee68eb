"""`kvcert explain` and the CI reports of a certificate: JUnit XML (schema-valid) and Markdown."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from importlib.resources import files
from pathlib import Path

import pytest
import xmlschema
from typer.testing import CliRunner

from kvcert.conformance.certification import explain, reports
from kvcert.conformance.certification.certificate import CellResult, Certificate
from kvcert.conformance.certification.certify import certify
from kvcert.conformance.cli import app
from kvcert.spec.invariants import SNAPSHOT_INVARIANTS

SCHEMA = xmlschema.XMLSchema(str(Path(__file__).parent / "data" / "junit.xsd"))
SPEC = files("kvcert.spec").joinpath("SPEC.md").read_text(encoding="utf-8")
TARGET = "kvcert.refimpl:factory"


def spec_rule(inv: str) -> str:
    """The rule column of `inv`'s row in an `| ID | family | rule |` table of SPEC.md, read here independently of
    the parser under test (other tables key rows by ID too: §6.4's)."""
    rows = [line.strip().strip("|").split("|") for line in SPEC.splitlines() if line.startswith(f"| {inv} |")]
    return next(cells[-1].strip() for cells in rows if len(cells) == 3)


# explain


@pytest.mark.parametrize("inv", ["INV-ACCT-3", "INV-HOST-6", "INV-TREE-1", "INV-SLOT-4"])
def test_explain_prints_the_spec_rule_its_section_and_its_checker(inv: str) -> None:
    res = CliRunner().invoke(app, ["explain", inv.lower()])
    assert res.exit_code == 0, res.output
    assert inv in res.output
    assert spec_rule(inv) in res.output
    checker = SNAPSHOT_INVARIANTS[inv]
    assert f"{checker.__module__}.{checker.__name__}" in res.output
    assert (checker.__doc__ or "").split("\n")[0].strip() in res.output
    section = "§9.9" if inv.startswith("INV-HOST") else "§5.1"
    assert f"SPEC.md {section}" in res.output


def test_every_snapshot_invariant_and_every_id_the_spec_names_is_explainable() -> None:
    known = explain.invariant_ids()
    assert set(SNAPSHOT_INVARIANTS) <= set(known)
    named = set(re.findall(r"\bINV-[A-Z0-9]+-\d+\b", SPEC))
    assert named <= set(known), named - set(known)
    for inv in SNAPSHOT_INVARIANTS:
        text = explain.explain(inv)
        assert text.startswith(inv) and spec_rule(inv) in text
        assert SNAPSHOT_INVARIANTS[inv].__name__ in text
    assert all(explain.summary(inv) for inv in known)


def test_explain_list_prints_every_id_with_its_rule() -> None:
    res = CliRunner().invoke(app, ["explain", "--list"])
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert [line.split()[0] for line in lines] == explain.invariant_ids()
    row = next(line for line in lines if line.startswith("INV-ACCT-3 "))
    assert spec_rule("INV-ACCT-3") in row
    assert explain.invariant_ids().index("INV-HOST-2") < explain.invariant_ids().index("INV-HOST-10")


def test_explain_finds_checkers_named_by_a_group_of_ids() -> None:
    assert explain.ids_in("INV-EVICT-1/2/3/5 and INV-ADMIT-1..3.") == [
        "INV-EVICT-1",
        "INV-EVICT-2",
        "INV-EVICT-3",
        "INV-EVICT-5",
        "INV-ADMIT-1",
        "INV-ADMIT-2",
        "INV-ADMIT-3",
    ]
    assert "kvcert.spec.contracts.eviction_bounds" in explain.explain("INV-EVICT-2")
    assert "kvcert.spec.contracts.plan_violations" in explain.explain("INV-ADMIT-3")
    # a rule only the harness checks says so rather than printing nothing
    assert "the harness checks it" in explain.explain("INV-TREE-4")


def test_unknown_id_exits_2_with_close_matches() -> None:
    res = CliRunner().invoke(app, ["explain", "INV-ACCT-9"])
    assert res.exit_code == 2
    assert "unknown invariant ID INV-ACCT-9" in res.output and "did you mean" in res.output
    assert "INV-ACCT-3" in res.output
    with pytest.raises(KeyError):
        explain.explain("INV-NOPE-1")
    res = CliRunner().invoke(app, ["explain"])
    assert res.exit_code == 2


# reports of a real run


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    cert = certify(
        TARGET,
        examples=5,
        steps=10,
        seed=0,
        page_sizes=[1, 4],
        policies=["lru"],
        out_dir=tmp_path_factory.mktemp("failures"),
        write_policies=["write_through"],
        prefetch_policies=[],
    )
    cert.skipped.append("page_size=3: not declared")  # what `cells_for` reports for an undeclared size
    return cert


def test_junit_of_a_real_run_is_schema_valid_and_complete(real: Certificate) -> None:
    text = reports.junit_xml(real)
    SCHEMA.validate(text)
    suite = ET.fromstring(text).find("testsuite")
    assert suite is not None and suite.get("name") == TARGET
    cases = suite.findall("testcase")
    assert suite.get("tests") == str(len(cases)) == str(len(real.cells) + 1)
    assert suite.get("failures") == "0" and suite.get("skipped") == "1"
    assert [c.get("name") for c in cases[: len(real.cells)]] == [reports.cell_name(c) for c in real.cells]
    assert {c.get("classname") for c in cases} == {TARGET}
    assert "page_size=4 policy=lru write_policy=write_through" in [c.get("name") for c in cases]
    assert cases[-1].find("skipped") is not None and cases[-1].get("name") == "page_size=3: not declared"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["seed"] == "0" and props["examples"] == "5" and props["steps"] == "10"
    assert props["profile"] == real.profile and props["kvcert.version"] == reports.package_version("kvcert")
    out = suite.find("system-out")
    assert out is not None and all(f"not checked: {gap}" in (out.text or "") for gap in real.not_checked)


def test_the_schema_rejects_what_is_not_junit(real: Certificate) -> None:
    """The validation above means something: the schema fails broken documents."""
    root = ET.fromstring(reports.junit_xml(real))
    suite = root.find("testsuite")
    assert suite is not None
    suite.set("tests", "many")
    assert not SCHEMA.is_valid(ET.tostring(root, encoding="unicode"))
    root = ET.fromstring(reports.junit_xml(real))
    case = root.find("testsuite/testcase")
    assert case is not None
    del case.attrib["name"]
    assert not SCHEMA.is_valid(ET.tostring(root, encoding="unicode"))
    root = ET.fromstring(reports.junit_xml(real))
    ET.SubElement(root, "testcase", name="outside any suite")
    assert not SCHEMA.is_valid(ET.tostring(root, encoding="unicode"))


def test_markdown_of_a_real_run(real: Certificate) -> None:
    md = reports.markdown(real)
    assert md.startswith(f"# kvcert certificate: `{TARGET}` — CERTIFIED")
    assert "NOT CERTIFIED" not in md
    sha = hashlib.sha256(files("kvcert.spec").joinpath("SPEC.md").read_bytes()).hexdigest()
    assert f"| SPEC.md SHA-256 | {sha} |" in md
    commit = re.search(r"^\| kvcert git commit \| (.*) \|$", md, re.M)
    assert commit and re.fullmatch(r"[0-9a-f]{40}( \(with uncommitted changes\))?|unknown", commit.group(1))
    for fact in ("kvcert version", "kvcert git commit", "Python", "torch", "hypothesis", "max steps per example"):
        assert f"| {fact} |" in md
    for c in real.cells:
        assert f"| {reports.cell_name(c)} | {reports.tiers(c)} | pass | {c.examples} | {c.steps} |" in md
    assert f"Total: {real.total_steps} steps" in md
    assert real.not_checked, "a device-and-host run leaves parts unchecked"
    not_checked = md.split("## Not checked\n", 1)[1].split("\n## ", 1)[0]
    assert all(f"- {gap}\n" in not_checked for gap in real.not_checked)
    assert "- page_size=3: not declared" in md.split("## Skipped\n", 1)[1]
    assert "## Op mix" in md and "Insert" in md
    env = {"runner": "ci-42"}
    assert "| runner | ci-42 |" in reports.markdown(real, env) and "SHA-256" not in reports.markdown(real, env)


# a failing certificate, by hand


def failing_certificate(trace: Path) -> Certificate:
    bad = CellResult(
        page_size=4,
        policy="lru",
        passed=False,
        examples=3,
        steps=12,
        seconds=0.25,
        failure="step 4: Evict(n=2)\n  INV-EVICT-3: locked node 2 (lock_ref 1) was evicted | \x01 raw",
        trace_path=str(trace),
        trace_len=5,
        reproduced=True,
        write_policy="write_back+timeout",
        ops={"Evict": 4, "Insert": 8, "InjectFault:copy": 1, "StorageFault:corrupt": 3, "window:split-under-write": 2},
    )
    good = CellResult(1, "lru", True, 3, 20, 0.5, ops={"Insert": 20})
    return Certificate(
        TARGET,
        "refimpl",
        7,
        3,
        10,
        False,
        cells=[good, bad],
        planned=["page_size=1 policy=lru", "page_size=4 policy=lru write_policy=write_back prefetch_policy=timeout"],
        skipped=["policy=lfu: not declared"],
        not_checked=["retraction (SPEC.md §9.11, INV-RETRACT-1/2): not declared by the backend"],
    )


def test_a_failing_cell_is_a_junit_failure(tmp_path: Path) -> None:
    cert = failing_certificate(tmp_path / "trace.json")
    text = reports.junit_xml(cert)
    SCHEMA.validate(text)
    suite = ET.fromstring(text).find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    name = "page_size=4 policy=lru write_policy=write_back prefetch_policy=timeout"
    case = next(c for c in suite.findall("testcase") if c.get("name") == name)
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == "INV-EVICT-3"
    message = failure.get("message") or ""
    assert "step 4: Evict(n=2)" in message and "INV-EVICT-3: locked node 2" in message
    assert str(tmp_path / "trace.json") in (failure.text or "") and "kvcert replay" in (failure.text or "")
    assert "\x01" not in text, "a control character would make the XML unreadable"
    passing = next(c for c in suite.findall("testcase") if c.get("name") == "page_size=1 policy=lru")
    assert passing.find("failure") is None


def test_a_failing_certificate_in_markdown(tmp_path: Path) -> None:
    cert = failing_certificate(tmp_path / "trace.json")
    md = reports.markdown(cert, env={})
    assert md.startswith(f"# kvcert certificate: `{TARGET}` — NOT CERTIFIED")
    assert "1 of 2 cells failed" in md
    row = next(line for line in md.splitlines() if line.startswith("| page_size=4 policy=lru write_policy=write_back"))
    assert "**FAIL**" in row and "\\|" in row and str(tmp_path / "trace.json") in row
    assert len(re.split(r"(?<!\\)\|", row)) == 8 + 2, "the message's pipe must not add a column"
    assert "## Failures" in md and "minimal trace: 5 ops, replay reproduces: True" in md
    assert "| cell | split/write |" in md and "| page_size=1 policy=lru | 0 |" in md
    assert "copy 1, storage corrupt 3" in md and "StorageFault:corrupt" not in md  # in the faults column, by kind
    assert "- retraction (SPEC.md §9.11, INV-RETRACT-1/2): not declared by the backend" in md
    assert "- policy=lfu: not declared" in md


# the CLI


def test_certify_writes_junit_and_markdown(tmp_path: Path) -> None:
    junit, md, cert_json = tmp_path / "cert.xml", tmp_path / "cert.md", tmp_path / "cert.json"
    res = CliRunner().invoke(
        app,
        ["certify", TARGET, "--examples", "3", "--steps", "8", "--device-only", "--page-size", "1"]
        + ["--policy", "lru", "--out", str(tmp_path / "failures")]
        + ["--junit", str(junit), "--markdown", str(md), "--json", str(cert_json)],
    )
    assert res.exit_code == 0, res.output
    SCHEMA.validate(junit.read_text(encoding="utf-8"))
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "1" and suite.get("failures") == "0"
    text = md.read_text(encoding="utf-8")
    assert "— CERTIFIED" in text and "| page_size=1 policy=lru | device | pass | 3 |" in text
    assert "## Not checked" in text and cert_json.exists()


def test_git_commit_is_kvcerts_own_or_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcert installed in a virtualenv inside the user's repository must not report the user's commit."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    user = tmp_path / "users-repo"
    (user / "src").mkdir(parents=True)
    (user / "src" / "app.py").write_text("")
    git = ["git", "-C", str(user), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "src"], ["commit", "-qm", "x"]):
        subprocess.run(git + args, check=True, capture_output=True)
    installed = user / ".venv" / "kvcert" / "conformance"
    installed.mkdir(parents=True)
    monkeypatch.setattr(reports, "__file__", str(installed / "reports.py"))
    assert reports.git_commit() == "unknown"
    monkeypatch.setattr(reports, "__file__", str(tmp_path / "reports.py"))  # not in any repository
    assert reports.git_commit() == "unknown"
