"""A finding's fix applied in-process (conformance/certification/fixes.py): the diff's changed functions are put in
place on their class or module, `revert` restores them, and a diff that does not apply or changes more than function
bodies is refused with FixError and changes nothing. The engines' own fixes are exercised where their engines are
(tests/test_sglang_decode.py, tests/test_known_findings.py)."""

from __future__ import annotations

import difflib
import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvcert.conformance.certification import fixes, known

SOURCE = textwrap.dedent(
    '''
    LIMIT = 3


    class Base:
        def size(self) -> int:
            return 1


    class Queue(Base):
        def size(self) -> int:
            return super().size() + LIMIT

        def admit(self, items):
            return [x for x in items if x < LIMIT]


    def total(items):
        return sum(items)
    '''
)


@pytest.fixture()
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """A stand-in engine package `toyengine` with one module, imported from tmp_path."""
    pkg = tmp_path / "src" / "toyengine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sched.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    module = importlib.import_module("toyengine.sched")
    yield module
    for name in ("toyengine.sched", "toyengine"):
        sys.modules.pop(name, None)


def _diff(new: str) -> str:
    lines = difflib.unified_diff(
        SOURCE.splitlines(keepends=True),
        new.splitlines(keepends=True),
        "a/src/toyengine/sched.py",
        "b/src/toyengine/sched.py",
    )
    return "".join(lines)


def test_a_body_edit_is_applied_and_reverted(engine: ModuleType) -> None:
    diff = _diff(SOURCE.replace("if x < LIMIT]", "if x <= LIMIT]").replace("super().size() + LIMIT", "super().size() * 10"))
    q = engine.Queue()
    before = (q.admit([1, 3, 5]), q.size())
    replaced = fixes._apply_diff(diff)
    assert sorted(name for _, name, _ in replaced) == ["admit", "size"]
    assert q.admit([1, 3, 5]) == [1, 3] and q.size() == 10  # zero-argument super() works in the recompiled method
    for owner, name, original in reversed(replaced):
        setattr(owner, name, original)
    assert (q.admit([1, 3, 5]), q.size()) == before == ([1], 4)


def test_a_module_function_is_replaced_on_its_module(engine: ModuleType) -> None:
    replaced = fixes._apply_diff(_diff(SOURCE.replace("return sum(items)", "return sum(items) + 1")))
    assert engine.total([1, 2]) == 4 and [(o, n) for o, n, _ in replaced] == [(engine, "total")]


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda s: s + "\n\ndef added():\n    return 1\n", id="adds-a-function"),
        pytest.param(lambda s: s.replace("LIMIT = 3", "LIMIT = 4"), id="changes-a-module-statement"),
        pytest.param(lambda s: s.replace("class Queue(Base):", "class Queue(Base, object):"), id="changes-a-class"),
    ],
)
def test_more_than_a_body_edit_is_refused_and_changes_nothing(engine: ModuleType, edit) -> None:  # type: ignore[no-untyped-def]
    before = dict(vars(engine.Queue)), dict(vars(engine))
    with pytest.raises(fixes.FixError, match="more than function bodies"):
        fixes._apply_diff(_diff(edit(SOURCE).replace("if x < LIMIT]", "if x <= LIMIT]")))
    assert (dict(vars(engine.Queue)), dict(vars(engine))) == before


def test_a_diff_that_does_not_apply_is_refused_and_changes_nothing(engine: ModuleType) -> None:
    stale = _diff(SOURCE.replace("if x < LIMIT]", "if x <= LIMIT]")).replace("return [x for x", "return [y for y")
    before = dict(vars(engine.Queue))
    with pytest.raises(fixes.FixError, match="does not apply"):
        fixes._apply_diff(stale)
    assert dict(vars(engine.Queue)) == before


def test_an_unknown_or_fixless_finding_is_refused() -> None:
    with pytest.raises(fixes.FixError, match="no finding"):
        fixes.apply(["NO-SUCH-FINDING"])
    fixless = next(f for f in known.findings() if not f.fix)
    with pytest.raises(fixes.FixError, match="carries no fix"):
        fixes.apply([fixless.id])


def test_a_fix_for_another_engine_is_refused() -> None:
    decode = next(f for f in known.findings() if f.id == "SG-DECODE-RETRACT-FINISHED")
    assert decode.fix
    with pytest.raises(fixes.FixError, match="another engine"):
        fixes.apply([decode.id], "kvcert.refimpl:RefCache")


def test_every_logged_fix_is_a_diff_in_the_findings_folder() -> None:
    for f in known.findings():
        if f.fix:
            text = fixes.patch_text(f.id)
            assert text.startswith("--- a/") and "\n+++ b/" in text, f.id


def test_the_cli_refuses_an_unknown_fix_before_anything_runs(tmp_path: Path) -> None:
    """`kvcert certify --with-fixes` with a finding not in the log: exit 2, the reason, no certificate written."""
    from typer.testing import CliRunner

    from kvcert.conformance.cli import app

    out = tmp_path / "cert.json"
    got = CliRunner().invoke(app, ["certify", "kvcert.refimpl:RefCache", "--with-fixes", "NOPE", "--json", str(out)])
    assert got.exit_code == 2 and "no finding 'NOPE'" in got.output, got.output
    assert not out.exists()


def test_a_finding_shared_by_two_versions_carries_a_diff_for_each() -> None:
    """SG-ABORT is SGLang 0.5.23's and the fork's 0.5.10 base's: `fix` is 0.5.23's diff and `fix_by` the fork's, so
    each target gets the diff written against its engine, and `all` takes it on both."""
    from kvcert.conformance.cli import _fix_ids

    shared = next(f for f in known.findings() if f.id == "SG-ABORT")
    fork, stock = "kvcert.conformance.adapters.refaware.requests", "kvcert.conformance.adapters.sglang.requests"
    assert set(shared.fixes) == {fork, stock}
    assert fixes.patch_text("SG-ABORT", fork) != fixes.patch_text("SG-ABORT", stock) == fixes.patch_text("SG-ABORT")
    assert "@@ -3548," in fixes.patch_text("SG-ABORT", fork)  # 0.5.10's abort_request, not 0.5.23's
    assert "SG-ABORT" in _fix_ids(fork + ":factory", "all") and "SG-ABORT" in _fix_ids(stock + ":factory", "all")


def test_a_fix_written_for_one_version_only_is_refused_for_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared finding whose diff is written for one version only (`fix_for`, no `fix_by`): `--with-fixes` refuses it
    on the other's target, and `all` leaves it out there."""
    from dataclasses import replace

    from kvcert.conformance.cli import _fix_ids

    shared = next(f for f in known.findings() if f.id == "SG-ABORT")
    one = replace(shared, fix_by=())
    monkeypatch.setattr(known, "findings", lambda: tuple(one if f.id == "SG-ABORT" else f for f in _ALL))
    fork = "kvcert.conformance.adapters.refaware.requests:factory"
    with pytest.raises(fixes.FixError, match="written for"):
        fixes.apply([shared.id], fork)
    assert "SG-ABORT" not in _fix_ids(fork, "all")
    assert "SG-ABORT" in _fix_ids("kvcert.conformance.adapters.sglang.requests:factory", "all")


_ALL = known.findings()


def test_a_trace_found_with_fixes_names_them_and_round_trips() -> None:
    """A failure saved while fixes were applied names them (`Trace.fixes`, from `fixes.active()`), so that
    `kvcert replay` applies them again before it plays the trace."""
    from kvcert.spec.ops import Step, Trace
    from kvcert.spec.types import CacheConfig

    assert fixes.active() == ()
    fixes._APPLIED["X"] = fixes.AppliedFix("X", ())
    try:
        assert fixes.active() == ("X",)
    finally:
        fixes._APPLIED.pop("X")
    trace = Trace(config=CacheConfig(), ops=(Step(),), target="m:f", fixes=("R1", "Q5"))
    back = Trace.from_json(trace.to_json())
    assert back.fixes == ("R1", "Q5") and back == trace
    assert "fixes" not in Trace.from_json(Trace(config=CacheConfig(), ops=()).to_json()).to_json()


def test_a_fix_that_changes_the_engines_api_applies_only_its_client_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4's fix adds a request field, so in-process only its client half applies: the fork's clients keep client rule
    `releases-one-shot` (the adapter's CLIENT_HALVES) and nothing of the engine is replaced; revert takes the rule
    back. An API fix without a client half is refused. (The fork's own run: tests/test_refaware_requests.py.)"""
    from dataclasses import replace

    from kvcert.conformance.cli import _fix_ids

    q4 = next(f for f in known.findings() if f.id == "Q4")
    fork = "kvcert.conformance.adapters.refaware.requests"
    assert q4.fix and q4.fix_api and q4.fix_client == "releases-one-shot" and q4.fixes == (fork,)
    assert "Q4" in _fix_ids(fork + ":factory", "all")
    adapter = ModuleType(fork)
    adapter.CLIENT_HALVES = set()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fork, adapter)
    with fixes.applied(["Q4"], fork + ":factory") as done:
        assert adapter.CLIENT_HALVES == {"releases-one-shot"}  # type: ignore[attr-defined]
        assert done[0].replaced == () and "its client half only" in done[0].describe()
    assert adapter.CLIENT_HALVES == set()  # type: ignore[attr-defined]
    bare = replace(q4, fix_client="")
    monkeypatch.setattr(known, "findings", lambda: tuple(bare if f.id == "Q4" else f for f in _ALL))
    assert bare.fixes == () and "Q4" not in _fix_ids(fork + ":factory", "all")
    with pytest.raises(fixes.FixError, match="changes the engine's API"):
        fixes.apply(["Q4"], fork + ":factory")
