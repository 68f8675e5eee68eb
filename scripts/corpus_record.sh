#!/usr/bin/env bash
# Record the same-verdict corpus's results (tests/corpus/expected.json) from an install of REV.
#
#   scripts/corpus_record.sh REV
#
# Builds kvcert at REV as a wheel, installs it into a bare site-packages and runs
# `tests/_corpus.py record` from this checkout against that install, so the results are what
# REV's harness and backends give. tests/test_same_verdict.py then requires today's code to give
# the same. Record only to add traces (issue 12 recorded them at b974eca, before the split).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REV="$(git -C "$ROOT" rev-parse "${1:?usage: scripts/corpus_record.sh REV}")"
"$ROOT/scripts/bootstrap.sh"
PY="$ROOT/.venv/bin/python"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
git -C "$ROOT" archive "$REV" --prefix=src/ | tar -x -C "$TMP"
"$PY" -m pip --disable-pip-version-check -q wheel --no-deps --no-build-isolation -w "$TMP/dist" "$TMP/src"
"$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$TMP/site-packages" "$TMP"/dist/kvcert-*.whl
cd "$TMP"
PYTHONPATH="$TMP/site-packages" KVCERT_CORPUS_COMMIT="$REV" "$PY" -c '
import os, runpy, sys
import kvcert.conformance.harness.driver as d
assert d.__file__.startswith(os.environ["PYTHONPATH"]), d.__file__  # the recorded commit, not this checkout
sys.path.insert(0, sys.argv[1])
sys.argv = ["_corpus.py", "record"]
runpy.run_path(sys.argv[0] if False else os.path.join(sys.path[0], "_corpus.py"), run_name="__main__")' "$ROOT/tests"
