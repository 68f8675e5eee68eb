"""Print `kvcert bench meta --json` results as the Markdown tables docs/bench.md quotes.

    python scripts/bench_table.py bench.json

One table per (page size, tier): calls/s per operation and the ratio to the section's baseline
(SGLang's Python `RadixCache`, or with a host tier its HiCache on the Python core), as the CLI
prints them. Figures in docs come from this output, pasted with the command beside them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINE = {"device": "sglang-radix", "host": "sglang-hicache-python"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    rows = json.loads(ap.parse_args().results.read_text())
    sections: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        sections.setdefault((row["page_size"], row["mode"]), []).append(row)
    for (ps, mode), group in sections.items():
        base = next((r for r in group if r["implementation"] == BASELINE[mode]), None)
        ops = list(group[0]["calls_per_s"]) or list(group[0]["calls"])
        hits = {r["tokens_hit"] for r in group if r["requests"] == group[0]["requests"]}
        evicts = {r["calls"].get("evict", 0) for r in group if r["requests"] == group[0]["requests"]}
        print(
            f"**Page size {ps}{' with a host tier' if mode == 'host' else ''}** "
            f"({group[0]['requests']:,} requests; tokens hit {', '.join(f'{h:,}' for h in sorted(hits))}; "
            f"evictions {', '.join(f'{e:,}' for e in sorted(evicts))}, for every implementation that ran them all)\n"
        )
        print("| implementation | " + " | ".join(ops) + " | all |")
        print("|---|" + "---|" * (len(ops) + 1))
        for r in group:

            def cell(rate: float | None, base_rate: float | None) -> str:
                if not rate:
                    return "-"
                ratio = f" ({rate / base_rate:.2f}×)" if base_rate else ""
                return f"{rate:,.0f}{ratio}"

            rates = [cell(r["calls_per_s"].get(op), base and base["calls_per_s"].get(op)) for op in ops]
            total = cell(r["all_per_s"], base and base["all_per_s"])
            if r is base:
                total = f"{r['all_per_s']:,.0f} (1.00×)"
            note = (
                f" (stopped after {r['requests']:,} requests: budget)" if r["requests"] < group[0]["requests"] else ""
            )
            err = f" **{r['error']}**" if r.get("error") else ""
            print(f"| {r['name']}{note}{err} | " + " | ".join(rates) + f" | {total} |")
        print()


if __name__ == "__main__":
    main()
