#!/usr/bin/env bash
# The simulator beside the seed's measurements (docs/bench_policy.md, "Against the seed's own figures"): the
# 3 x N table on the seed-calibrated engine (`--engine seed`: prefill at the seed's measured cold rate), and
# `scripts/seed_compare.py` on both that table and the physical one (OUT/table.json, from bench_policy_docs.sh).
# About 4 minutes on 2 cores; needs SGLang (KVCERT_SGLANG=1).
#
#   KVCERT_SGLANG=1 scripts/bench_policy_seed.sh [OUT]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-bench-policy}"
mkdir -p "$OUT/seed-engine"
K=("${KVCERT:-$ROOT/kvcert}" bench policy)
PY="${PYTHON:-$ROOT/.venv/bin/python}"
echo "== table, --engine seed"
"${K[@]}" --table --engine seed --cache baseline --cache proactive --cache refaware --cache infinite --cache baseline@fcfs \
    --json "$OUT/seed-engine/table.json" --plots "$OUT/seed-engine" > "$OUT/seed-engine/table.txt"
for t in "$OUT/table.json" "$OUT/seed-engine/table.json"; do
    echo "== seed_compare $t"
    "$PY" "$ROOT/scripts/seed_compare.py" "$t" > "${t%.json}-vs-seed.txt"
    cat "${t%.json}-vs-seed.txt"
done
