#!/usr/bin/env bash
# The linker certificates docs/linkers.md and docs/results.md show: SGLang 0.5.23's direct-linker request path with the
# harness's store (sglang_linker:factory, and :factory_rust on the Rust tree core) at the default budget (seed 0, 200 examples per cell), as JSON in OUT, and
# what SGLang's calls reached in the store, summed over the run. About two minutes on 2 cores.
#
#   scripts/linker_docs.sh [OUT]        # default docs/runs/<today>-linker
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/runs/$(date -u +%Y-%m-%d)-linker}"
mkdir -p "$OUT"
for target in sglang_linker:factory sglang_linker:factory_rust; do
    name="${target/:/-}"
    echo "== $target"
    PYTHONHASHSEED=0 "$ROOT/.venv/bin/kvcert" certify "kvcert.conformance.adapters.$target" --seed 0 \
        --json "$OUT/$name.json" --out "$(mktemp -d)" 2>/dev/null | grep -E "^(NOT )?CERTIFIED"
    "$ROOT/.venv/bin/python" - "$OUT/$name.json" <<'PY'
import json, sys
cert = json.load(open(sys.argv[1]))
for cell in cert["cells"]:
    reached = {k[len("linker:"):]: v for k, v in sorted(cell["ops"].items()) if k.startswith("linker:")}
    print(f"page_size={cell['page_size']}: {cell['steps']} steps;", ", ".join(f"{k} {v}" for k, v in reached.items()))
PY
done
