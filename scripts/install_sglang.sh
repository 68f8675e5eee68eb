#!/usr/bin/env bash
# Install the pinned SGLang set (requirements/sglang.txt) into the current Python
# environment with pip --no-deps, so nothing can pull in or replace torch.
# Idempotent: pins already satisfied are skipped by pip. Needs torch installed first
# (the CPU build, torch==2.13.0); this script never installs, upgrades or removes it.
#
#   PYTHON=.venv/bin/python scripts/install_sglang.sh
set -euo pipefail

PYTHON="${PYTHON:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$ROOT/requirements/sglang.txt"

if grep -Eiq '^[[:space:]]*torch([[:space:]]*[=<>!~;]|[[:space:]]*$)' "$REQS"; then
    echo "refusing: $REQS names torch; torch is installed separately and never touched here" >&2
    exit 2
fi

torch_before="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || {
    echo "torch is not importable with $PYTHON; install torch==2.13.0 (CPU) first" >&2
    exit 2
}

"$PYTHON" -m pip install --no-deps --disable-pip-version-check -r "$REQS"

torch_after="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_before" != "$torch_after" ]]; then
    echo "torch changed from $torch_before to $torch_after; this must not happen" >&2
    exit 1
fi

# The adapter's own import path, shims included, must now work (needs kvcert installed: pip install -e .).
"$PYTHON" -W ignore -c 'from kvcert.conformance.adapters._sglang_env import import_sglang; print("sglang", import_sglang().version, "ok with torch", __import__("torch").__version__)'
