"""Print certificates (`kvcert certify --json`) as the Markdown tables the docs quote.

    python scripts/cert_table.py kvcert-long/*.json            # one row per certificate
    python scripts/cert_table.py --cells kvcert-long/x.json    # one row per cell
    python scripts/cert_table.py --cells kvcert-long/x.log     # the cells a run printed before it was stopped
    python scripts/cert_table.py --ops gpu.json                # what the run exercised: op counters, summed
    python scripts/cert_table.py --mix old.json new.json       # two runs' op mixes per 1,000 steps, by cell kind

Figures in docs come from this output, pasted with the command beside them, never typed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# One line of `kvcert certify`'s output per finished cell.
CELL_LINE = re.compile(
    r"page_size=(\d+)\s+policy=(\w+)\s+(\S+)\s+(PASS|FAIL)\s+(\d+) examples, (\d+) steps, ([\d,]+) steps/s"
)


def _profile_line(line: str) -> bool:
    """The certificate's lines about its profile: the profile column says it."""
    return line.startswith(("choice ", "pinned under every profile", "not relaxed under any profile"))


def _cells_of_log(path: Path) -> dict:
    """A certificate's cells as far as a (possibly interrupted) run's printed lines say: no digests."""
    cells = []
    for m in CELL_LINE.finditer(path.read_text()):
        ps, policy, tier, verdict, examples, steps, rate = m.groups()
        wp = tier.removeprefix("host=") if tier.startswith("host=") else ""
        seconds = int(steps) / max(int(rate.replace(",", "")), 1)
        cells.append(
            dict(
                page_size=int(ps),
                policy=policy,
                write_policy=wp,
                passed=verdict == "PASS",
                examples=int(examples),
                steps=int(steps),
                seconds=seconds,
                digest="(log)",
            )
        )
    return {"target": path.name.split(".")[0], "cells": cells}


def _tier(cell: dict) -> str:
    wp = cell["write_policy"]
    if not wp:
        return "device-only"
    return ("storage " if "+" in wp else "host ") + wp


def _gap(line: str) -> str:
    """`storage tier (SPEC.md §10: …): not declared by the backend` -> `storage tier (not declared)`."""
    what, _, why = line.partition(": ")
    what = what.split(" (")[0]
    for reason in ("not declared", "declared, but no step of this run exercised it", "not run"):
        if reason in line:
            return f"{what} ({'unexercised' if reason.startswith('declared') else reason})"
    return what


def _kind(cell: dict) -> str:
    wp = cell["write_policy"]
    return "device-only" if not wp else ("storage" if "+" in wp else "host")


def _mix(old: dict, new: dict) -> None:
    """Ops per 1,000 steps of each cell kind, old beside new, for the ops either run does 2 times in 1,000."""
    rates: list[dict[str, dict[str, float]]] = []
    for cert in (old, new):
        per: dict[str, dict[str, float]] = {}
        for c in cert["cells"]:
            kind = per.setdefault(_kind(c), {"": 0.0})
            kind[""] += c["steps"]
            for k, v in c.get("ops", {}).items():
                kind[k] = kind.get(k, 0.0) + v
        rates.append({kk: {k: v * 1000 / d[""] for k, v in d.items() if k} for kk, d in per.items()})
    print("| cells | op | old /1k steps | new /1k steps | new/old |")
    print("|---|---|---|---|---|")
    for kind in ("device-only", "host", "storage"):
        a, b = rates[0].get(kind, {}), rates[1].get(kind, {})
        for op in sorted(set(a) | set(b)):
            x, y = a.get(op, 0.0), b.get(op, 0.0)
            if ":error" in op or max(x, y) < 2:
                continue
            ratio = f"{y / x:.2f}" if x else "new"
            print(f"| {kind} | {op} | {x:.1f} | {y:.1f} | {ratio} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("certificates", nargs="+", type=Path)
    ap.add_argument("--cells", action="store_true", help="one row per cell instead of one per certificate")
    ap.add_argument("--ops", action="store_true", help="the cells' op counters, summed, per certificate")
    ap.add_argument("--mix", action="store_true", help="two certificates' op mixes side by side, by cell kind")
    args = ap.parse_args()
    if args.mix:
        _mix(*[json.loads(p.read_text()) for p in args.certificates])
        return
    if args.ops:
        for path in args.certificates:
            cert = json.loads(path.read_text())
            total: dict[str, int] = {}
            for c in cert["cells"]:
                for k, v in c.get("ops", {}).items():
                    total[k] = total.get(k, 0) + v
            print(f"{cert['target']}: {cert['total_steps']:,} steps")
            for k in sorted(total):
                print(f"  {k:32s} {total[k]:>10,}")
        return
    if args.cells:
        print("| target | page size | policy | tier | verdict | examples | steps | steps/s | digest |")
        print("|---|---|---|---|---|---|---|---|---|")
    else:
        print("| target | profile | cells | verdict | examples/cell | steps | time | steps/s | not checked |")
        print("|---|---|---|---|---|---|---|---|---|")
    for path in args.certificates:
        cert = _cells_of_log(path) if path.suffix == ".log" else json.loads(path.read_text())
        if path.suffix == ".log" and not args.cells:
            raise SystemExit(f"{path}: a run's log has cells, not a certificate: use --cells")
        target = cert["target"].split(".")[-1]
        if args.cells:
            for c in cert["cells"]:
                rate = c["steps"] / max(c["seconds"], 1e-9)
                verdict = "pass" if c["passed"] else "**FAIL**"
                print(
                    f"| `{target}` | {c['page_size']} | {c['policy']} | {_tier(c)} | {verdict} | {c['examples']:,} "
                    f"| {c['steps']:,} | {rate:,.0f} | `{c.get('digest', '')[:12]}` |"
                )
            continue
        cells = cert["cells"]
        passed = sum(c["passed"] for c in cells)
        seconds = sum(c["seconds"] for c in cells)
        known = sorted({f["id"] for f in cert.get("findings", []) if f.get("reproduced")})
        verdict = "CERTIFIED" if cert["passed"] else f"**{len(cells) - passed} FAIL**" if passed < len(cells) else ""
        if known:  # a logged finding that still reproduces: NOT CERTIFIED though every cell passed
            verdict = (verdict + " " if verdict else "") + f"**known: {', '.join(known)}**"
        gaps = "; ".join(_gap(line) for line in cert.get("not_checked", []) if not _profile_line(line)) or "—"
        profile = cert.get("profile", "—")  # certificates before profiles (issue 13) were judged as sglang-0.5.23
        print(
            f"| `{target}` | {profile} | {len(cells)} | {verdict} | {cert['examples']:,} | {cert['total_steps']:,} "
            f"| {seconds / 60:,.0f} min | {cert['steps_per_second']:,.0f} | {gaps} |"
        )


if __name__ == "__main__":
    main()
