"""Known defects patched out: a finding's minimal fix, applied to the engine in-process (`kvcert certify --with-fixes`).

A finding may carry its fix as a unified diff against the engine's source tree, paths as in its repository
(`python/sglang/srt/...` for SGLang and the RefAware fork): the patch a maintainer applies with `git apply`, the one
docs/upstream/<finding>/ hands upstream, and the one CI applies to a copy of the installed package to run each
reproducer both ways. In-process the same diff is applied by `patch` to the text of each module it names, and every
function whose text it changed is compiled from the patched text into the module's own namespace and put where the
old one was (on its class, or on the module). Nothing else may change: a fix that adds, removes or edits anything but
function bodies and their decorators is refused, since it could not be applied to the running engine faithfully.
A fix that changes the engine's API (a new request field) is for upstream; in-process only its client half can be
applied, when the finding names one: a client rule the adapter's clients keep under the released API.

A certificate run with fixes lists each one under NOT CHECKED: the walk goes past that defect, so it says nothing of it.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from kvcert.conformance.aliases import canonical_module
from kvcert.conformance.certification import known
from kvcert.spec.types import CLIENT_RULES

__all__ = ["AppliedFix", "FixError", "active", "apply", "applied", "patch_text", "revert"]


class FixError(ValueError):
    """A fix that cannot be applied: unknown finding, none logged, not this target's engine, or not a body edit."""


@dataclass(frozen=True)
class AppliedFix:
    """One finding's fix as applied: what it replaced, so that `revert` can put it back."""

    finding: str
    replaced: tuple[tuple[Any, str, Any], ...]
    """(owner, attribute, the original) for each function put in place."""
    texts: tuple[tuple[str, Optional[str]], ...] = ()
    """(module file, its patched text before this fix, None for the file as installed), for `revert`."""
    client: tuple[ModuleType, ...] = ()
    """For an API fix, the adapter modules whose clients took on its client half (their `CLIENT_HALVES`)."""

    def describe(self) -> str:
        f = {x.id: x for x in known.findings()}[self.finding]
        if self.client:
            return (
                f"fix {self.finding}, its client half only: {f.title}. Its engine half is an API change "
                f"({f.fix_api}), not applied; the clients keep client rule {f.fix_client} instead "
                f"({CLIENT_RULES[f.fix_client]}). The walk goes past this known defect: NOT CHECKED with the engine "
                "as released, nor with clients that break that rule"
            )
        names = ", ".join(
            sorted({f"{getattr(o, '__qualname__', getattr(o, '__name__', '?'))}.{a}" for o, a, _ in self.replaced})
        )
        return (
            f"fix {self.finding} applied ({names}): {f.title}. The walk goes past this known defect: NOT CHECKED "
            f"with the engine as released"
        )


_APPLIED: dict[str, AppliedFix] = {}


def patch_text(finding_id: str, module: str = "") -> str:
    """The finding's fix, a unified diff (the one for the engine adapter `module` drives, when it has its own);
    FixError if the finding has none."""
    f = _finding(finding_id)
    if not f.fix:
        raise FixError(f"finding {finding_id} carries no fix")
    return files("kvcert.conformance").joinpath("findings", f.diff_for(module)).read_text()


def apply(ids: Sequence[str], target: Optional[str] = None) -> list[AppliedFix]:
    """Apply each finding's fix to the engine imported in this process (once: applying again is a no-op). With
    `target` (`module:factory`), each finding must be one logged for the engine that target drives. An API fix is
    applied by its client half: each adapter module of the finding puts the client rule in its `CLIENT_HALVES`."""
    out = []
    for fid in ids:
        f = _finding(fid)
        module = "" if target is None else canonical_module(target.partition(":")[0])
        if target is not None and module not in f.adapters:
            raise FixError(f"finding {fid} is {f.engine}'s; {target} drives another engine")
        if f.fix_api and not f.fix_client:
            raise FixError(f"finding {fid}'s fix changes the engine's API ({f.fix_api}): it is for upstream, not "
                           "applied in-process")  # fmt: skip
        if target is not None and f.fix and module not in f.fixes:
            raise FixError(f"finding {fid}'s fix is written for {', '.join(f.fixes)}, not {target}'s engine")
        if fid not in _APPLIED:
            if f.fix_api:
                _APPLIED[fid] = _client_half(f)
            else:
                undo: list[tuple[str, Optional[str]]] = []
                _APPLIED[fid] = AppliedFix(fid, tuple(_apply_diff(patch_text(fid, module), undo)), texts=tuple(undo))
        out.append(_APPLIED[fid])
    return out


def _client_half(f: known.Finding) -> AppliedFix:
    modules = []
    for name in f.fixes:
        module = importlib.import_module(name)
        halves = getattr(module, "CLIENT_HALVES", None)
        if not isinstance(halves, set):
            raise FixError(f"finding {f.id}: {name} has no CLIENT_HALVES, so its clients cannot take on {f.fix_client}")
        halves.add(f.fix_client)
        modules.append(module)
    return AppliedFix(f.id, (), client=tuple(modules))


def active() -> tuple[str, ...]:
    """The findings whose fixes are applied in this process now, in the order applied: a trace found with them saves
    them, so that its replay applies them again."""
    return tuple(_APPLIED)


def revert(ids: Sequence[str]) -> None:
    """Put back what `apply` replaced for these findings, last applied first."""
    for fid in reversed(list(ids)):
        done = _APPLIED.pop(fid, None)
        if done is not None:
            f = _finding(fid)
            for module in done.client:
                module.CLIENT_HALVES.discard(f.fix_client)
            for file, text in reversed(done.texts):
                if text is None:
                    _TEXT.pop(file, None)
                else:
                    _TEXT[file] = text
            for owner, name, original in reversed(done.replaced):
                setattr(owner, name, original)


@contextmanager
def applied(ids: Sequence[str], target: Optional[str] = None) -> Iterator[list[AppliedFix]]:
    """The fixes applied for the block's length (tests)."""
    fresh = [i for i in ids if i not in _APPLIED]
    try:
        yield apply(ids, target)
    finally:
        revert(fresh)


def _finding(fid: str) -> known.Finding:
    by_id = {f.id: f for f in known.findings()}
    if fid not in by_id:
        raise FixError(f"no finding {fid!r} in the log (docs/findings.md lists them)")
    return by_id[fid]


# ---------------------------------------------------------------------------------------------- applying a diff


def _files(diff: str) -> list[tuple[str, str]]:
    """The diff split by file: (the path after `+++ b/`, that file's part of the diff)."""
    parts = re.split(r"(?m)^(?=--- )", diff)
    out = []
    for part in parts:
        m = re.search(r"(?m)^\+\+\+ (?:b/)?(\S+)", part)
        if m and part.startswith("--- "):
            out.append((m.group(1), part))
    if not out:
        raise FixError("the fix is not a unified diff")
    return out


def _module_of(path: str) -> ModuleType:
    """The imported module a repository path names: `python/sglang/srt/x.py` is `sglang.srt.x` (the leading folders
    before an imported top-level package are the repository's layout)."""
    parts = Path(path).with_suffix("").parts
    for i, part in enumerate(parts):
        if part in sys.modules:
            name = ".".join(parts[i:])
            __import__(name)
            return sys.modules[name]
    raise FixError(f"{path}: no package of it is imported in this process (load the target first)")


def _patched(original: str, part: str, rel: str) -> str:
    """`original` with this file's part of the diff applied by `patch` (exact context: no fuzz)."""
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / rel
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(original)
        done = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch", "-s", "-d", tmp],
            input=part, text=True, capture_output=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise FixError(f"{rel}: the fix does not apply to the installed engine: {done.stdout}{done.stderr}")
        return file.read_text()


def _functions(tree: ast.Module, text: str) -> dict[str, tuple[Optional[str], ast.AST, str]]:
    """qualname -> (its class's name or None, node, its text with decorators), for module functions and methods of
    module-level classes; and '<module>' -> everything else, so edits outside function bodies are seen."""
    lines = text.splitlines(keepends=True)
    out: dict[str, tuple[Optional[str], ast.AST, str]] = {}
    rest: list[str] = []

    def segment(node: Any) -> str:
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        return "".join(lines[start - 1 : node.end_lineno])

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = (None, node, segment(node))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = (node.name, item, segment(item))
                else:
                    rest.append(ast.dump(item))
            rest.append(
                ast.dump(
                    ast.ClassDef(
                        name=node.name,
                        bases=node.bases,
                        keywords=node.keywords,
                        body=[],
                        decorator_list=node.decorator_list,
                    )
                )
            )
        else:
            rest.append(ast.dump(node))
    out["<module>"] = (None, tree, "\n".join(rest))
    return out


_TEXT: dict[str, str] = {}
"""A module file's text with the fixes applied in this process so far: a later fix is patched onto it, so that two
fixes of one function (Q6's and RA-STARVE's `_add_one_ref_aware_req`) both hold."""


def _apply_diff(diff: str, undo: Optional[list[tuple[str, Optional[str]]]] = None) -> list[tuple[Any, str, Any]]:
    """Put the functions the diff changes in place (patched onto the text earlier fixes left); with `undo`, record
    each file's patched text for the next fix, and (file, its text before) in `undo` for `revert`."""
    replaced: list[tuple[Any, str, Any]] = []
    texts: list[tuple[str, str]] = []
    try:
        for path, part in _files(diff):
            module = _module_of(path)
            file = module.__file__ or ""
            original = _TEXT.get(file) or Path(file).read_text()
            patched = _patched(original, part, path)
            texts.append((file, patched))
            before, after = _functions(ast.parse(original), original), _functions(ast.parse(patched), patched)
            if before.keys() != after.keys() or before["<module>"][2] != after["<module>"][2]:
                raise FixError(f"{path}: the fix changes more than function bodies; it cannot be applied in-process")
            changed = [q for q in before if q != "<module>" and before[q][2] != after[q][2]]
            if not changed:
                raise FixError(f"{path}: the fix changes no function")
            for qual in changed:
                cls_name, node, text = after[qual]
                owner: Any = getattr(module, cls_name) if cls_name else module
                name = qual.rpartition(".")[2]
                fn = _compile(module, owner if cls_name else None, name, text, node)
                replaced.append((owner, name, owner.__dict__[name]))
                setattr(owner, name, fn)
    except BaseException:
        for owner, name, original_fn in reversed(replaced):
            setattr(owner, name, original_fn)
        raise
    if undo is not None:
        for file, patched in texts:
            undo.append((file, _TEXT.get(file)))
            _TEXT[file] = patched
    return replaced


def _compile(module: ModuleType, cls: Optional[type], name: str, text: str, node: Any) -> Any:
    """The function `text` defines, compiled in `module`'s globals, with `__class__` bound to `cls` so that a method's
    zero-argument super() works as in its class body; line numbers are the patched file's."""
    body = textwrap.indent(textwrap.dedent(text), "    ")
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    source = "\n" * max(0, first - 2) + f"def __kvcert_fix(__class__):\n{body}\n    return {name}\n"
    space: dict[str, Any] = {}
    exec(compile(source, module.__file__ or name, "exec"), module.__dict__, space)
    return space["__kvcert_fix"](cls)
