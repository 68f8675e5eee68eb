#!/usr/bin/env bash
# The long certification of stock SGLang 0.5.23 (docs/sglang.md, "Ten times the default budget"):
# every SGLang cell at 2,000 examples (10x certify's default of 200), seed 0, each target's certificate
# written as JSON (with every cell's step digest) to OUT. Hours on 2 cores; not CI.
#
#   KVCERT_SGLANG=1 [PROFILE=core] [EXAMPLES=2000] scripts/long_sglang.sh [OUT] [TARGET...]
#
# PROFILE holds every target to that profile (SPEC.md §6) instead of the one it declares (sglang-0.5.23).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-kvcert-long}"
shift || true
A=kvcert.conformance.adapters
TARGETS=("$@")
if [[ ${#TARGETS[@]} -eq 0 ]]; then
    TARGETS=(
        "$A.sglang_radix:factory"
        "$A.sglang_hicache_backend:factory"
        "$A.sglang_hicache_backend:factory_rust"
        "$A.sglang_hicache_backend:factory_page_first"
        "$A.sglang_hicache_backend:factory_rust_page_first"
        "$A.sglang_hicache_backend:factory_storage --storage-only"
        "$A.sglang_hicache_backend:factory_rust_storage --storage-only"
    )
fi
mkdir -p "$OUT"
status=0
for spec in "${TARGETS[@]}"; do
    read -r target extra <<<"$spec"
    name="${target##*.}"; name="${name//:/-}"
    echo "== $target $extra  ($(date -u +%FT%TZ))"
    # shellcheck disable=SC2086
    "$ROOT/kvcert" certify "$target" $extra --examples "${EXAMPLES:-2000}" --seed 0 ${PROFILE:+--profile "$PROFILE"} \
        --json "$OUT/$name.json" --out "$OUT/failures" > "$OUT/$name.log" 2>&1 || status=1
    tail -n 12 "$OUT/$name.log" | grep -E "CERTIFIED|not checked" || true
done
exit $status
