#!/usr/bin/env bash
# The 10-million-step run (docs/ci.md): kvcert.gpu against the reference model over its whole cell matrix
# (5 page sizes x 5 policies on the device; 3 write policies, and 3 prefetch stop policies on storage, on the
# host tiers), once per device layout (layer-first, page-first), on `kvcert fuzz`'s seeded walk. Each layout's
# certificate goes to OUT as JSON and Markdown, with its terminal log. About two hours on one core.
#
#   scripts/ten_million.sh [OUT] [EXAMPLES]      # EXAMPLES per cell, default 1,500 (~10.5M steps in all)
#   KVCERT=path/to/kvcert scripts/ten_million.sh  # another kvcert than ./kvcert (an installed one)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-kvcert-10m}"
EXAMPLES="${2:-1500}"
mkdir -p "$OUT"
status=0
for factory in factory factory_page_first; do
    echo "== kvcert.gpu:$factory  ($(date -u +%FT%TZ))"
    /usr/bin/time -f "$factory: %e s wall" -o "$OUT/$factory.time" \
        "${KVCERT:-$ROOT/kvcert}" fuzz "kvcert.gpu:$factory" --examples "$EXAMPLES" --seed 0 --out "$OUT/failures" \
        --json "$OUT/$factory.json" --markdown "$OUT/$factory.md" > "$OUT/$factory.log" 2>&1 || status=1
    cat "$OUT/$factory.time"
    grep -E "CERTIFIED|FAILED" "$OUT/$factory.log" || true
done
exit $status
