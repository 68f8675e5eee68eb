#!/usr/bin/env bash
# Every figure of docs/bench_policy.md, printed by the command that makes it: the 3 x N table, the three
# sensitivity sweeps and the two maps at 128 HP clients, and both shared-prefix workloads. Each run's text, JSON and plots go to
# OUT. About 20 minutes on 2 cores; needs SGLang (KVCERT_SGLANG=1) and, for the fork's rows, .venv-refaware.
#
#   KVCERT_SGLANG=1 scripts/bench_policy_docs.sh [OUT]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-bench-policy}"
mkdir -p "$OUT"
K=("$ROOT/kvcert" bench policy)
ALL=(--cache baseline --cache proactive --cache refaware --cache blind --cache infinite --cache offline --cache baseline@fcfs
     --cache proactive@fork --cache refaware@fork)
echo "== table"
/usr/bin/time -f "table: %e s wall" -o "$OUT/table.time" "${K[@]}" --table "${ALL[@]}" --json "$OUT/table.json" --plots "$OUT" > "$OUT/table.txt"
cat "$OUT/table.time"
echo "== 128 HP clients: every run's metric block and per-turn breakdown"
"${K[@]}" --hp 128 --json "$OUT/hp128.json" > "$OUT/hp128.txt"
for s in host think speed; do
    echo "== sweep $s"
    "${K[@]}" --hp 128 --sweep "$s" --cache baseline --cache proactive --cache refaware --cache infinite --cache baseline@fcfs \
        --json "$OUT/sweep-$s.json" --plots "$OUT" > "$OUT/sweep-$s.txt"
done
for m in host,think lp,growth; do
    echo "== map $m"
    "${K[@]}" --hp 128 --map "$m" --json "$OUT/map-${m/,/-}.json" --plots "$OUT" > "$OUT/map-${m/,/-}.txt"
done
for g in groups-10x50 groups-50x10; do
    echo "== $g (default pools; then a quarter of the device pool and twice that on the host, 8 prompts/s)"
    "${K[@]}" --workload "$g" "${ALL[@]}" --no-breakdown --json "$OUT/$g.json" > "$OUT/$g.txt"
    "${K[@]}" --workload "$g" "${ALL[@]}" --no-breakdown --set device_tokens=229248 --set host_tokens=458496 --rate 8 \
        --json "$OUT/$g-small.json" > "$OUT/$g-small.txt"
done
"$ROOT/scripts/bench_policy_seed.sh" "$OUT"
