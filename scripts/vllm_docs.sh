#!/usr/bin/env bash
# The vLLM certificates docs/results.md shows: each vLLM 0.32 target at the default budget (seed 0, 200 examples
# per cell), written as JSON into OUT, and the key-partitioning run's report. A few minutes on 2 cores; needs
# .venv-vllm (scripts/install_vllm.sh). Then `python scripts/results_page.py` rewrites docs/results.md.
#
#   scripts/vllm_docs.sh [OUT]        # default docs/runs/<today>-vllm
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/runs/$(date -u +%Y-%m-%d)-vllm}"
K="$ROOT/.venv-vllm/bin/kvcert"
mkdir -p "$OUT"
for target in vllm_requests:factory vllm_requests:factory_async vllm_requests:factory_hybrid vllm_requests:factory_priority \
        vllm_requests:factory_connector \
        vllm_block_pool:factory \
        vllm_offload:factory; do
    name="${target/:/-}"
    echo "== $target"
    PYTHONHASHSEED=0 VLLM_LOGGING_LEVEL=ERROR "$K" certify "kvcert.conformance.adapters.$target" --seed 0 \
        --json "$OUT/$name.json" --out "$(mktemp -d)" | grep -E "^(NOT )?CERTIFIED"
done
echo "== partition (vllm_kv:probe_scheduler)"
PYTHONHASHSEED=0 VLLM_LOGGING_LEVEL=ERROR "$K" partition kvcert.conformance.adapters.vllm.kv:probe_scheduler --cases 1000 --json "$OUT/partition.json" \
    | tail -n 3
