#!/usr/bin/env bash
# Install the pinned SGLang set (requirements/sglang.txt) and the S3 pins its `seaweedfs` L3
# backend is certified with (requirements/s3.txt: boto3, moto's S3 server) into the current Python
# environment with pip --no-deps, so nothing can pull in or replace torch.
# Idempotent: pins already satisfied are skipped by pip. Needs torch installed first
# (the CPU build, torch==2.13.0); this script never installs, upgrades or removes it.
#
#   PYTHON=.venv/bin/python scripts/install_sglang.sh
set -euo pipefail

PYTHON="${PYTHON:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQS="$ROOT/requirements/sglang.txt"
S3_REQS="$ROOT/requirements/s3.txt"

for reqs in "$REQS" "$S3_REQS"; do
    if grep -Eiq '^[[:space:]]*torch([[:space:]]*[=<>!~;]|[[:space:]]*$)' "$reqs"; then
        echo "refusing: $reqs names torch; torch is installed separately and never touched here" >&2
        exit 2
    fi
done

torch_before="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || {
    echo "torch is not importable with $PYTHON; install torch==2.13.0 (CPU) first" >&2
    exit 2
}

"$PYTHON" -m pip install --no-deps --disable-pip-version-check -r "$REQS"
"$PYTHON" -m pip install --no-deps --disable-pip-version-check -r "$S3_REQS"

torch_after="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_before" != "$torch_after" ]]; then
    echo "torch changed from $torch_before to $torch_after; this must not happen" >&2
    exit 1
fi

# The adapter's own import path, shims included, must now work (needs kvcert installed: pip install -e .).
"$PYTHON" -W ignore -c 'from kvcert.conformance.adapters.sglang.env import import_sglang; print("sglang", import_sglang().version, "ok with torch", __import__("torch").__version__)'
"$PYTHON" -W ignore -c 'import boto3, moto.server; print("boto3", boto3.__version__, "moto", moto.__version__, "ok")'
# The server's own closure (kvcert serve-certify): what its HTTP front end and scheduler processes import on a CPU.
"$PYTHON" -W ignore -c 'import uvicorn, uvloop, fastapi, multipart, setproctitle, einops, xgrammar, prometheus_client; print("the SGLang server imports ok")'
