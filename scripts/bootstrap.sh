#!/usr/bin/env bash
# Make .venv hold kvcert and its pinned dependencies. Idempotent: a stamp of the
# requirement files skips the work when nothing changed.
#
#   scripts/bootstrap.sh            core (what `./kvcert` needs)
#   KVCERT_SGLANG=1 scripts/bootstrap.sh   core + SGLang 0.5.23 (requirements/sglang.txt)
#   KVCERT_RAY=1 scripts/bootstrap.sh      core + Ray (requirements/ray.txt), for --ray
#
# torch: never unpinned. If the base python already imports torch, the venv sees it
# (--system-site-packages); otherwise torch==2.13.0 is installed (the CPU build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCERT_VENV:-$ROOT/.venv}"
BASE_PY="${PYTHON:-python3}"
WANT_SGLANG="${KVCERT_SGLANG:-0}"
WANT_RAY="${KVCERT_RAY:-0}"
PY="$VENV/bin/python"

if [[ ! -x "$PY" ]]; then
    if "$BASE_PY" -c 'import torch' >/dev/null 2>&1; then
        echo "bootstrap: creating $VENV on top of the torch already importable from $BASE_PY" >&2
        "$BASE_PY" -m venv --system-site-packages "$VENV"
    else
        echo "bootstrap: creating $VENV" >&2
        "$BASE_PY" -m venv "$VENV"
    fi
fi

stamp_file="$VENV/.kvcert-stamp"
base="$(cat "$ROOT/pyproject.toml" "$ROOT"/requirements/*.txt | sha256sum | cut -c1-16)"
stamp="$base-sglang$WANT_SGLANG-ray$WANT_RAY"
have="$(cat "$stamp_file" 2>/dev/null || true)"
# up to date: an environment with SGLang (or Ray) also serves a run that does not ask for it
if [[ "$have" == "$base-sglang"[$WANT_SGLANG-1]"-ray"[$WANT_RAY-1] ]]; then
    exit 0
fi

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    echo "bootstrap: installing torch==2.13.0 (CPU build)" >&2
    pip_install torch==2.13.0
fi
echo "bootstrap: installing pinned dependencies and kvcert" >&2
pip_install -c "$ROOT/requirements/constraints.txt" -r "$ROOT/requirements/core.txt"
pip_install --no-deps -e "$ROOT"
"$PY" -c 'import hypothesis, crosshair, typer, rich, torch, kvcert.conformance.cli' || { echo "bootstrap: install failed" >&2; exit 1; }

if [[ "$WANT_RAY" == "1" ]]; then
    echo "bootstrap: installing Ray (pinned)" >&2
    pip_install -c "$ROOT/requirements/constraints.txt" -r "$ROOT/requirements/ray.txt"
    "$PY" -c 'import ray' || { echo "bootstrap: Ray install failed" >&2; exit 1; }
fi
if [[ "$WANT_SGLANG" == "1" ]]; then
    echo "bootstrap: installing SGLang 0.5.23 (--no-deps, pinned)" >&2
    PYTHON="$PY" "$ROOT/scripts/install_sglang.sh" >&2
fi
echo "$stamp" > "$stamp_file"
