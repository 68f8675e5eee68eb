#!/usr/bin/env bash
# The test suite, as CI runs it: environment (with SGLang), lint, types, CrossHair, pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
KVCERT_SGLANG="${KVCERT_SGLANG:-1}" scripts/bootstrap.sh
V="$ROOT/.venv/bin"

echo "== ruff"
"$V/ruff" check .
echo "== mypy spec refimpl"
"$V/mypy" spec refimpl
echo "== crosshair (spec contracts)"
PYTHON="$V/python" scripts/crosshair.sh
echo "== pytest"
"$V/pytest" -q "$@"
