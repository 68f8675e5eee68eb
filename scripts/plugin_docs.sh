#!/usr/bin/env bash
# The certificates docs/sglang-plugin.md and docs/results.md show for kvcert's own cache inside SGLang 0.5.23
# (`--radix-cache-backend kvcert`, through SGLang's scheduler): sglang_kvcert:factory, :factory_sessions and :factory_retention at the
# default budget (seed 0, 200 examples per cell), as JSON in OUT. A few minutes on 2 cores.
#
#   scripts/plugin_docs.sh [OUT]        # default docs/runs/<today>-sglang-plugin
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/runs/$(date -u +%Y-%m-%d)-sglang-plugin}"
mkdir -p "$OUT"
for target in sglang_kvcert:factory sglang_kvcert:factory_sessions sglang_kvcert:factory_retention; do
    name="${target/:/-}"
    echo "== $target"
    KVCERT_SGLANG=1 PYTHONHASHSEED=0 "$ROOT/.venv/bin/kvcert" certify "kvcert.conformance.adapters.$target" --seed 0 \
        --json "$OUT/$name.json" --out "$(mktemp -d)" 2>/dev/null | grep -E "^(NOT )?CERTIFIED"
done
