#!/usr/bin/env bash
# Build .venv-refaware: the priority-aware ("ref-aware") SGLang fork (base sglang 0.5.10) on CPU,
# in its own environment (SGLang 0.5.10 and 0.5.23 cannot share one), plus kvcert itself so
# that an adapter can run there. Idempotent: a stamp of the inputs skips the work when
# nothing changed.
#
#   scripts/install_refaware.sh
#   .venv-refaware/bin/python scripts/refaware_smoke.py
#
# Steps: torch==2.13.0 (the CPU build; never unpinned), requirements/refaware.txt with
# pip --no-deps, the fork's changed files (the target's overlay/sglang) copied over the
# installed sglang package, then the fork's scheduler: its four reference scheduler files
# (reference/sglang/srt/managers/{scheduler,scheduler_output_processor_mixin,schedule_policy,
# io_struct}.py) copied over the package and the six other scheduler-side files of
# reference/fork-vs-base.diff patched in (each hunk applied once: one already applied is left
# alone, one that fits neither way stops the install), kvcert's core requirements and kvcert
# (editable, --no-deps), then an import check of both caches and of the fork's scheduler.
#
# Environment: KVCERT_TARGETS (default $ROOT/../shared/targets) locates the fork's files;
# KVCERT_REFAWARE_VENV (default $ROOT/.venv-refaware); PYTHON (default python3) creates the venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCERT_REFAWARE_VENV:-$ROOT/.venv-refaware}"
BASE_PY="${PYTHON:-python3}"
TARGETS="${KVCERT_TARGETS:-$ROOT/../shared/targets}"
TARGET="$TARGETS/refaware-sglang-0.5.10"
OVERLAY="$TARGET/overlay/sglang"
REFERENCE="$TARGET/reference"
# The fork's scheduler (the request path a kvcert request-path target drives): whole files from reference/,
# and the diff's hunks for the other files its scheduler changes (none of them is in the overlay).
SCHEDULER_FILES=(scheduler.py scheduler_output_processor_mixin.py schedule_policy.py io_struct.py)
SCHEDULER_HUNKS=(
    disaggregation/prefill.py
    dllm/mixin/scheduler.py
    entrypoints/http_server.py
    managers/tokenizer_communicator_mixin.py
    managers/tokenizer_manager.py
    observability/scheduler_metrics_mixin.py
)
REQS="$ROOT/requirements/refaware.txt"

if [[ ! -d "$OVERLAY" ]]; then
    echo "install_refaware: the fork's overlay is missing: $OVERLAY" >&2
    echo "  (expected the target refaware-sglang-0.5.10 under \$KVCERT_TARGETS, default \$ROOT/../shared/targets)" >&2
    exit 2
fi
for f in "${SCHEDULER_FILES[@]}"; do
    if [[ ! -f "$REFERENCE/sglang/srt/managers/$f" ]]; then
        echo "install_refaware: the fork's scheduler file is missing: $REFERENCE/sglang/srt/managers/$f" >&2
        exit 2
    fi
done
if [[ ! -f "$REFERENCE/fork-vs-base.diff" ]]; then
    echo "install_refaware: the fork's diff is missing: $REFERENCE/fork-vs-base.diff" >&2
    exit 2
fi
NAME=refaware
# shellcheck source=scripts/_side_venv.sh
source "$ROOT/scripts/_side_venv.sh"
# The stamp covers everything that decides the environment's content.
stamp="$(
    {
        side_venv_inputs
        cat "$0"
        (cd "$OVERLAY" && find . -type f -name '*.py' | LC_ALL=C sort | xargs sha256sum)
        (cd "$REFERENCE" && sha256sum fork-vs-base.diff "${SCHEDULER_FILES[@]/#/sglang/srt/managers/}")
    } | sha256sum | cut -c1-16
)"
side_venv_open "$stamp" || exit 0
side_torch

echo "install_refaware: installing the fork's pinned set (--no-deps)" >&2
pip_install --no-deps -r "$REQS"

SITE="$("$PY" -c 'import sglang, os; print(os.path.dirname(sglang.__file__))' 2>/dev/null)" || {
    echo "install_refaware: sglang did not install" >&2
    exit 1
}
echo "install_refaware: copying the fork's overlay over $SITE" >&2
cp -R "$OVERLAY/." "$SITE/"

echo "install_refaware: copying the fork's scheduler files and patching in its other scheduler hunks" >&2
for f in "${SCHEDULER_FILES[@]}"; do
    cp "$REFERENCE/sglang/srt/managers/$f" "$SITE/srt/managers/$f"
done
hunk_dir="$(mktemp -d)"
trap 'rm -rf "$hunk_dir"' EXIT
for f in "${SCHEDULER_HUNKS[@]}"; do
    hunk="$hunk_dir/$(echo "$f" | tr / _).diff"
    awk -v want="a/python/sglang/srt/$f" '/^diff --git /{keep = ($3 == want)} keep' \
        "$REFERENCE/fork-vs-base.diff" > "$hunk"
    if [[ ! -s "$hunk" ]]; then
        echo "install_refaware: fork-vs-base.diff has no hunk for $f" >&2
        exit 1
    fi
    # the diff's paths are python/sglang/...; the package's parent directory holds sglang/
    if patch -d "$(dirname "$SITE")" -p2 -R --dry-run -s -f < "$hunk" > /dev/null 2>&1; then
        continue  # applied by an earlier run (pip leaves an installed sglang's files alone)
    fi
    if ! patch -d "$(dirname "$SITE")" -p2 --dry-run -s -f < "$hunk" > /dev/null 2>&1; then
        echo "install_refaware: the fork's hunk for $f applies neither way to $SITE" >&2
        exit 1
    fi
    patch -d "$(dirname "$SITE")" -p2 -s -f --no-backup-if-mismatch < "$hunk"
done

side_kvcert

"$PY" -W ignore -c '
from kvcert.conformance.adapters.refaware.env import import_refaware
ra = import_refaware()
import torch
print("install_refaware: sglang", ra.version, "+ ref-aware overlay:", ra.RefAwareRadixCache.__name__, "and",
      ra.RefAwareHiRadixCache.__name__, "import with torch", torch.__version__)
from kvcert.conformance.adapters.refaware.env import import_refaware_scheduler
sched = import_refaware_scheduler()
assert hasattr(sched.Scheduler, "handle_release_ref"), "the fork scheduler did not install"
print("install_refaware: the fork scheduler imports:", sched.Scheduler.__module__ + ".Scheduler")
' || { echo "install_refaware: import check failed" >&2; exit 1; }
"$PY" -W ignore -c 'import uvicorn, uvloop, fastapi, multipart, setproctitle, einops, xgrammar, jsonschema; print("install_refaware: the fork server imports ok")' \
    || { echo "install_refaware: the fork server's closure does not import" >&2; exit 1; }
side_venv_close "$stamp"
