#!/usr/bin/env bash
# The long runs CI leaves out (docs/ci.md, "kvcert's own CI"): every test marked `long` (tests/long_runs.py), in
# the same environments as CI, and CrossHair on a larger budget. About half an hour on two cores; run it before a
# release and after a change to the zoo, an engine adapter or a served target.
#
#   scripts/long.sh            the long tests
#   scripts/long.sh ARGS       ARGS go to pytest (a file, -k ...)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export KVCERT_SGLANG="${KVCERT_SGLANG:-1}" KVCERT_REFAWARE="${KVCERT_REFAWARE:-1}" KVCERT_RAY="${KVCERT_RAY:-1}"
export KVCERT_VLLM="${KVCERT_VLLM:-1}" KVCERT_KVCR="${KVCERT_KVCR:-1}"
scripts/bootstrap.sh
[[ "$KVCERT_REFAWARE" == "1" ]] && scripts/install_refaware.sh
[[ "$KVCERT_VLLM" == "1" ]] && scripts/install_vllm.sh
[[ "$KVCERT_KVCR" == "1" ]] && scripts/install_kvcr.sh
start=$SECONDS
status=0
# CrossHair at ten seconds a condition, where CI gives three.
for target in spec/pages.py spec/storage.py spec/offload.py; do
    KVCERT_CROSSHAIR_CONDITION=10 KVCERT_CROSSHAIR_TOTAL=900 PYTHON="$ROOT/.venv/bin/python" scripts/crosshair.sh \
        "$target" || status=$?
done
"$ROOT/.venv/bin/pytest" -q -n "${KVCERT_TEST_JOBS:-2}" --dist loadfile --durations=20 -m long "$@" || status=$?
echo "== long runs done in $((SECONDS - start)) s (pytest exit $status)"
exit "$status"
