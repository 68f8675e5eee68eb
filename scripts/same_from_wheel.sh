#!/usr/bin/env bash
# Run a certificate's command again from another install and process, and compare the two runs.
#
#   KVCERT_SGLANG=1 scripts/same_from_wheel.sh CERT.json OUT.json [CELL OPTIONS...]
#
# Builds kvcert as a wheel from this checkout's HEAD, installs it into a bare site-packages directory,
# and certifies CERT.json's target at its seed and budget from outside the repository with
# another PYTHONHASHSEED; the cell options (--page-size 4 --write-policy write_back, ...) pick
# some of its cells. Then `kvcert same --common CERT.json OUT.json`: every cell both ran must
# print "same run" (exit 1 otherwise). docs/sglang.md quotes its output.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CERT="$(realpath "$1")"
OUT="$(realpath -m "$2")"
shift 2
"$ROOT/scripts/bootstrap.sh"
PY="$ROOT/.venv/bin/python"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
git -C "$ROOT" archive HEAD --prefix=src/ | tar -x -C "$TMP"
"$PY" -m pip --disable-pip-version-check -q wheel --no-deps --no-build-isolation -w "$TMP/dist" "$TMP/src"
"$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$TMP/site-packages" "$TMP"/dist/kvcert-*.whl
read -r target seed examples steps < <("$PY" -c '
import json, sys
c = json.load(open(sys.argv[1]))
print(c["target"], c["seed"], c["examples"], c["steps"])' "$CERT")
cd "$TMP"
PYTHONPATH="$TMP/site-packages" PYTHONHASHSEED=4242 "$PY" -c '
import sys
import os
from kvcert.conformance import cli
assert cli.__file__.startswith(os.environ["PYTHONPATH"]), cli.__file__  # the wheel, not this checkout
main = cli.main
sys.argv[0] = "kvcert"
main()' certify "$target" --seed "$seed" --examples "$examples" --steps "$steps" "$@" \
    --json "$OUT" --out "$TMP/failures" || true
cd "$ROOT"
exec "$ROOT/.venv/bin/kvcert" same --common "$CERT" "$OUT"
