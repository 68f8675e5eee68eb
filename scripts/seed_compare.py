"""The simulator beside the seed's own measurements: each figure the seed's stress test printed, for its baseline
and its proactive manager at 64/96/128 HP clients, next to the same figure of a `kvcert bench policy --table
--json` run (baseline and proactive contenders).

    kvcert bench policy --table --json table.json && python scripts/seed_compare.py table.json [SEED_TEXT]

SEED_TEXT defaults to ../shared/seeds/000_*.txt (the proactive manager's write-up). Its figures are read from its
metric blocks ("High-priority TTFT mean/p90/p99: ..."), never typed here. Measured, never asserted
(docs/bench_policy.md).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = {"baseline": "baseline", "Proactive KVcache manager": "proactive"}
# (label, the seed's line, which number on it, where the simulator's JSON keeps it)
FIGURES: list[tuple[str, str, int, tuple[str, ...]]] = [
    ("HP turn>=1 hit", "High-priority turn>=1 cache hit", 0, ("high", "turn1_cache_hit")),
    ("HP TTFT p90 s", "High-priority TTFT mean/p90/p99", 1, ("high", "ttft", "p90")),
    ("HP TTFT mean s", "High-priority TTFT mean/p90/p99", 0, ("high", "ttft", "mean")),
    ("HP turn0 TTFT p90 s", "High-priority turn0 TTFT p90/p99", 0, ("high", "turn0_ttft", "p90")),
    ("HP turn>=1 TTFT p90 s", "High-priority turn>=1 TTFT p90/p99", 0, ("high", "turn1_ttft", "p90")),
    ("HP out tok/s (wall)", "High-priority out tok (wall)", 0, ("high", "out_tok_per_s")),
    ("HP makespan s", "High-priority makespan", 0, ("high", "makespan_s")),
]
TTFT_P90, TURN0_P90 = 1, 3
"""FIGURES' rows the ratio and the cold prefill rate are taken from."""


def seed_blocks(text: str) -> dict[tuple[str, int], dict[str, list[float]]]:
    """(contender, HP clients) -> {line label: its numbers}, from the seed's stress-test metric blocks."""
    out: dict[tuple[str, int], dict[str, list[float]]] = {}
    section, clients = None, None
    for raw in text.splitlines():
        line = raw.strip()
        if line in SECTIONS:
            section, clients = SECTIONS[line], None
        elif section and re.fullmatch(r"\d+", line):
            clients = int(line)
            out.setdefault((section, clients), {})
        elif section and clients is not None and line.startswith("High-priority") and ":" in line:
            label, _, rest = line.partition(":")
            numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", rest.split("tok/s")[0])]
            out[(section, clients)].setdefault(label.strip(), numbers)
    return out


def pick(run: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = run
    for key in path:
        value = value[key]
    return float(value)


def main() -> None:
    table = json.loads(Path(sys.argv[1]).read_text())
    seed_path = Path(sys.argv[2]) if len(sys.argv) > 2 else next((ROOT.parent / "shared" / "seeds").glob("000_*.txt"))
    seed = seed_blocks(seed_path.read_text())
    runs = {(r["contender"], r["hp_clients"]): r for r in table["runs"]}

    def values(contender: str, clients: int, figure: int) -> tuple[Optional[float], Optional[float]]:
        """FIGURES[figure] for one contender at one load: the seed's, the simulator's (None where absent)."""
        _, line, at, path = FIGURES[figure]
        numbers = seed.get((contender, clients), {}).get(line)
        run = runs.get((contender, clients))
        return (numbers[at] if numbers else None), (pick(run, path) if run else None)

    def shown(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:,.4g}"

    slower: list[float] = []
    print(f"seed: {seed_path.name}; simulator: {sys.argv[1]}")
    print(
        f"{'HP':>4} {'figure':<24} {'seed baseline':>14} {'sim baseline':>13} {'seed proactive':>15} {'sim proactive':>14}"
    )
    for clients in sorted({c for _, c in seed}):
        for k, (label, *_) in enumerate(FIGURES):
            (sb, mb), (sp, mp) = values("baseline", clients, k), values("proactive", clients, k)
            print(f"{clients:>4} {label:<24} {shown(sb):>14} {shown(mb):>13} {shown(sp):>15} {shown(mp):>14}")
        (sb, mb), (sp, mp) = values("baseline", clients, TTFT_P90), values("proactive", clients, TTFT_P90)
        ratio = [f"{b / p:.1f}x" if b is not None and p is not None else "-" for b, p in ((sb, sp), (mb, mp))]
        print(f"{clients:>4} {'HP TTFT p90 ratio':<24} {'seed ' + ratio[0]:>29} {'sim ' + ratio[1]:>30}")
        cold, sim_cold = values("proactive", clients, TURN0_P90)
        if cold is not None and sim_cold is not None:  # turn 0 is all misses: the engine's cold prefill rate
            slower.append(cold / sim_cold)
            what = f"{slower[-1]:.2f}x slower in the seed (HP turn0 TTFT p90, HP first)"
            print(f"{clients:>4} {'cold prefill, seed/sim':<24} {what:>60}")
    if slower:
        print(f"cold prefill: the seed's engine is {sum(slower) / len(slower):.2f}x slower than this run's, on average")


if __name__ == "__main__":
    main()
