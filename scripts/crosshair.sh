#!/usr/bin/env bash
# CrossHair gate: search for counterexamples to the PEP 316 contracts (`pre:` / `post:`
# docstrings) of spec/pages.py on a fixed, explicit budget.
#
#   scripts/crosshair.sh                  # what CI runs
#   scripts/crosshair.sh path/to/file.py  # other targets (files that use PEP 316 docstrings)
#
# Fails (non-zero) when
#   - CrossHair reports any counterexample or error (its own exit status 1 or 2);
#   - a `post:` line in a target was never analysed, or was analysed without a single
#     execution path reaching it with the preconditions met. `crosshair check` is silent
#     in both cases (an unsatisfiable precondition or an unsupported argument type only
#     shows up as "info" under --report_all), so the gate counts the paths itself;
#   - the whole run exceeds KVCERT_CROSSHAIR_TOTAL seconds of wall clock.
#
# Budget (CPU seconds, CrossHair's own units; override through the environment):
#   KVCERT_CROSSHAIR_CONDITION  per `post:` line   (default 3: CI's; scripts/long.sh runs 10)
#   KVCERT_CROSSHAIR_PATH       per execution path (default 2)
#   KVCERT_CROSSHAIR_TOTAL      wall clock, whole run (default 240)
# Conditions that CrossHair proves over every path stop early; the others ("no
# counterexample within budget") use their full per-condition budget, so the run takes
# about KVCERT_CROSSHAIR_CONDITION times the number of unbounded conditions.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
CONDITION="${KVCERT_CROSSHAIR_CONDITION:-3}"
PATH_BUDGET="${KVCERT_CROSSHAIR_PATH:-2}"
TOTAL="${KVCERT_CROSSHAIR_TOTAL:-240}"

targets=()
for target in "$@"; do
    targets+=("$(realpath "$target")")  # before the cd below: relative to the caller's directory
done
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=("$ROOT/spec/pages.py")
fi

export PYTHONWARNINGS=ignore
cd "$ROOT"
status=0
timeout --kill-after=10 "$TOTAL" "$PYTHON" - "$CONDITION" "$PATH_BUDGET" "${targets[@]}" <<'PY' || status=$?
import ast
import os
import re
import sys
import time

per_condition, per_path, *targets = sys.argv[1:]
targets = [os.path.realpath(t) for t in targets]

# Every `post:` line of every function docstring: what must be analysed.
POST = re.compile(r"^\s*post(\[[^\]]*\])?\s*:")
expected: dict[tuple[str, int], str] = {}
for path in targets:
    with open(path) as f:
        source = f.read()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) is not None:
            doc = node.body[0]
            for lineno in range(doc.lineno, (doc.end_lineno or doc.lineno) + 1):
                if POST.match(lines[lineno - 1]):
                    expected[(path, lineno)] = node.name
if not expected:
    print("crosshair gate: no post: conditions found in " + " ".join(targets), file=sys.stderr)
    sys.exit(2)

# Record, per analysed postcondition, CrossHair's verdict and how many paths confirmed it.
import crosshair.core as core  # noqa: E402
from crosshair.statespace import MessageType  # noqa: E402
from crosshair.main import main  # noqa: E402

analysed: dict[tuple[str, int], tuple[str, int, bool]] = {}
_analyze_calltree = core.analyze_calltree


def recording_analyze_calltree(options, conditions):
    result = _analyze_calltree(options, conditions)
    post = conditions.post[0]
    refuted = any(m.state > MessageType.PRE_UNSAT for m in result.messages)
    analysed[(os.path.realpath(post.filename), post.line)] = (
        result.verification_status.name,
        result.num_confirmed_paths,
        refuted,
    )
    return result


core.analyze_calltree = recording_analyze_calltree

start = time.monotonic()
args = ["check", "--analysis_kind", "PEP316", "--per_condition_timeout", per_condition, "--per_path_timeout", per_path, *targets]
try:
    main(args)
    rc = 0
except SystemExit as exit_:
    rc = exit_.code if isinstance(exit_.code, int) else 1
elapsed = time.monotonic() - start

problems = []
print(f"crosshair gate: {len(expected)} postconditions, {per_condition}s/condition, {per_path}s/path, {elapsed:.0f}s")
for key, fn in sorted(expected.items()):
    path, line = key
    where = f"{os.path.relpath(path)}:{line} {fn}"
    if key not in analysed:
        problems.append(f"{where}: never analysed")
        continue
    verdict, paths, refuted = analysed[key]
    label = {"CONFIRMED": "proved over all paths", "UNKNOWN": "no counterexample within budget"}.get(verdict, verdict.lower())
    if refuted:
        label = "COUNTEREXAMPLE"
    elif paths == 0:
        label = "never reached"
    print(f"  {where}: {label}, {paths} confirmed paths")
    if paths == 0 and not refuted:
        problems.append(f"{where}: no execution path met the preconditions and reached the postcondition")
for problem in problems:
    print(f"crosshair gate: {problem}", file=sys.stderr)
if rc != 0:
    print(f"crosshair gate: crosshair check exited {rc} (counterexample or error above)", file=sys.stderr)
sys.exit(rc or (1 if problems else 0))
PY
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "crosshair gate: exceeded the ${TOTAL}s wall-clock budget" >&2
fi
exit "$status"
