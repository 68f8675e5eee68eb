#!/usr/bin/env bash
# Build .venv-kvcr: SGLang 0.5.23 with the files of SGLang PR #39946 (the seed's KVCR direct linker, a
# certification target in ../shared/targets/kvcr-linker-sglang/) copied over it, for the walk target
# kvcert.conformance.adapters.kvcr.linker. Idempotent: a stamp of the inputs skips the work when nothing changed.
#
#   scripts/install_kvcr.sh
#   .venv-kvcr/bin/kvcert certify kvcert.conformance.adapters.kvcr.linker:factory
#
# Cheap by design: everything but sglang comes from .venv (torch==2.13.0 CPU, msgspec, kvcert editable; built by
# scripts/bootstrap.sh with KVCERT_SGLANG=1, never touched here). The environment is
#   .venv-kvcr/site/        pip install --no-deps --target: sglang==0.5.23, then the target's overlay/sglang over it
#   .venv-kvcr/bin/python   .venv's python with site/ first on PYTHONPATH (and bin/kvcert, bin/pytest likewise)
# so that the overlaid sglang shadows .venv's unmodified one only there. No kvcr or nixl is installed: the walk
# target brings a stand-in KVCR core (the target's README says why the real one cannot be had).
#
# Environment: KVCERT_KVCR_VENV (default $ROOT/.venv-kvcr), KVCERT_VENV (the base, default $ROOT/.venv),
# KVCERT_KVCR_TARGET (default $ROOT/../shared/targets/kvcr-linker-sglang).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCERT_KVCR_VENV:-$ROOT/.venv-kvcr}"
BASE="${KVCERT_VENV:-$ROOT/.venv}"
TARGET="${KVCERT_KVCR_TARGET:-$ROOT/../shared/targets/kvcr-linker-sglang}"
SGLANG_PIN="sglang==0.5.23"
BASE_PY="$BASE/bin/python"
SITE="$VENV/site"
STAMP_FILE="$VENV/.kvcert-kvcr-stamp"

[[ -x "$BASE_PY" ]] || { echo "install_kvcr: $BASE_PY missing: run scripts/bootstrap.sh first" >&2; exit 2; }
[[ -d "$TARGET/overlay/sglang" ]] || { echo "install_kvcr: no overlay at $TARGET/overlay/sglang" >&2; exit 2; }
torch_before="$("$BASE_PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || {
    echo "install_kvcr: torch is not importable with $BASE_PY; install torch==2.13.0 (CPU) first" >&2; exit 2; }

stamp="$({ echo "$SGLANG_PIN $BASE_PY $torch_before"; cat "$0"; (cd "$TARGET" && find overlay -type f -print0 | sort -z | xargs -0 sha256sum); } | sha256sum | cut -c1-16)"
if [[ -x "$VENV/bin/python" && "$(cat "$STAMP_FILE" 2>/dev/null || true)" == "$stamp" ]]; then
    echo "install_kvcr: $VENV is up to date" >&2
    exit 0
fi
rm -f "$STAMP_FILE"
mkdir -p "$VENV/bin"

if [[ "$(cat "$SITE/.kvcert-sglang-pin" 2>/dev/null || true)" != "$SGLANG_PIN" ]]; then
    echo "install_kvcr: installing $SGLANG_PIN into $SITE (--no-deps --target)" >&2
    rm -rf "$SITE"
    "$BASE_PY" -m pip install --disable-pip-version-check -q --no-deps --no-compile --target "$SITE" "$SGLANG_PIN" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    [[ -f "$SITE/sglang/version.py" ]] || { echo "install_kvcr: pip did not install sglang into $SITE" >&2; exit 1; }
    # --target also drops console scripts here; only the package is wanted
    rm -rf "$SITE/bin"
    echo "$SGLANG_PIN" > "$SITE/.kvcert-sglang-pin"
fi
# The PR's files over the wheel's (two replace 0.5.23's, the storage/kvcr/ package is new).
(cd "$TARGET/overlay" && find sglang -type f -name '*.py' -print0) | while IFS= read -r -d '' rel; do
    mkdir -p "$SITE/$(dirname "$rel")"
    cp "$TARGET/overlay/$rel" "$SITE/$rel"
done

for tool in python kvcert pytest; do
    cat > "$VENV/bin/$tool" <<SH
#!/usr/bin/env bash
# .venv's $tool with SGLang 0.5.23 + PR #39946 (scripts/install_kvcr.sh) first on the path
export PYTHONPATH="$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
exec "$BASE/bin/$tool" "\$@"
SH
    chmod +x "$VENV/bin/$tool"
done

"$VENV/bin/python" -W ignore - <<'PY' || { echo "install_kvcr: an import the walk target needs failed" >&2; exit 1; }
from kvcert.conformance.adapters.kvcr import env as _kvcr_env

linker = _kvcr_env.import_linker()
assert _kvcr_env.overlaid(), "sglang is not the overlaid copy"
print("install_kvcr: KVCRDirectLinker imports from", linker.__file__)
PY
torch_after="$("$BASE_PY" -c 'import torch; print(torch.__version__)')"
[[ "$torch_after" == "$torch_before" ]] || { echo "install_kvcr: torch changed ($torch_before -> $torch_after)" >&2; exit 1; }
echo "$stamp" > "$STAMP_FILE"
echo "install_kvcr: $VENV ready (sglang 0.5.23 + PR #39946 overlay, torch $torch_after from $BASE)" >&2
