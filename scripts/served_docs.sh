#!/usr/bin/env bash
# Every served target's certificate, as docs/served.md and docs/runs/<date>-served/ show them:
#   scripts/served_docs.sh [OUT_DIR] [EXAMPLES]
# Each target runs from the environment its pinned script builds (SGLang: KVCERT_SGLANG=1 scripts/bootstrap.sh;
# vLLM: scripts/install_vllm.sh; the fork: scripts/install_refaware.sh). A target that cannot be served on this
# machine is listed by `kvcert serve-certify --list` with the reason, and skipped here.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/runs/$(date -u +%F)-served}"
EXAMPLES="${2:-20}"
mkdir -p "$OUT"
cd "$ROOT"
for target in sglang sglang-hicache sglang-kvcert vllm vllm-hybrid refaware; do
    echo "== $target"
    start=$(date +%s)
    .venv/bin/kvcert serve-certify "$target" --examples "$EXAMPLES" --seed 0 --json "$OUT/$target.json" \
        --out "${TMPDIR:-/tmp}/kvcert-served-docs" > "$OUT/$target.txt" 2>&1
    echo "exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/$target.txt"
    grep -E "CERTIFIED|known finding|FAIL" "$OUT/$target.txt" | head -8
done
