"""Where one row of a `kvcert bench policy --map X,Y --json` run is at least another's, point by point.

    python scripts/map_versus.py [--means] MAP.json BASE ROW [ROW ...]

For each ROW, against BASE at every point of the map: how many points its HP turn>=1 hit is at least BASE's, its HP
TTFT p90 at most BASE's, its LP TTFT p90 at most BASE's; and the points where it is behind on any, tagged H (HP hit),
T (HP TTFT p90), L (LP TTFT p90) with both figures. One run per point: the spread of repeated runs is not in it.

Where the map's runs carry it (`around_p90`, sim/report.py), each point behind on a TTFT p90 is followed by what that
p90 is made of in both rows: the turns ranked within two percent either side of the class's 90th percentile TTFT, as
medians: their time queued before the scheduler first admitted them, their time from admission to the first token,
their prefix hit; and their share of first turns and of retracted turns. Summed over those points, per class: how much
the row's p90 exceeds BASE's, and how much of that the medians' longer wait in the queue accounts for.

`--means`: one more line per ROW, at how many points each class's mean and median TTFT are at most BASE's (a p90
behind while the mean is ahead moved the tail, not the class's service as a whole).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    means = "--means" in argv
    argv = [a for a in argv if a != "--means"]
    path, base, rows = argv[0], argv[1], argv[2:]
    runs = json.load(open(path))["runs"]
    by = {(r["x"], r["y"], r["contender"]): r for r in runs}
    points = sorted({(r["x"], r["y"]) for r in runs})
    x_name, y_name = runs[0].get("map", ("x", "y"))
    figures = (
        ("H", lambda r: r["high"]["turn1_cache_hit"], 1),
        ("T", lambda r: r["high"]["ttft"]["p90"], -1),
        ("L", lambda r: r["low"]["ttft"]["p90"], -1),
    )
    for row in rows:
        at_least = dict.fromkeys("HTL", 0)
        behind = []
        excess = {"high": [0, 0.0, 0.0], "low": [0, 0.0, 0.0]}  # points behind, p90 excess, queued excess
        for p in points:
            a, b = by[(*p, row)], by[(*p, base)]
            lost = []
            for tag, get, sign in figures:
                if sign * (get(a) - get(b)) >= -1e-9:
                    at_least[tag] += 1
                else:
                    lost.append(f"{tag} {get(a):.4g} vs {get(b):.4g}")
            if lost:
                behind.append(f"  {x_name} {p[0]:g}, {y_name} {p[1]:g}: " + "; ".join(lost))
                for tag, cls in (("T", "high"), ("L", "low")):
                    if any(x.startswith(tag) for x in lost) and a[cls].get("around_p90"):
                        behind += [f"      {cls} around p90, {who}: {_around(r[cls]['around_p90'])}"
                                   for who, r in ((row, a), (base, b))]  # fmt: skip
                        e = excess[cls]
                        e[0] += 1
                        e[1] += a[cls]["ttft"]["p90"] - b[cls]["ttft"]["p90"]
                        e[2] += a[cls]["around_p90"]["queued_s"] - b[cls]["around_p90"]["queued_s"]
        print(
            f"{row} against {base}, {len(points)} points: HP hit at least at {at_least['H']}, HP TTFT p90 at most at "
            f"{at_least['T']}, LP TTFT p90 at most at {at_least['L']}"
        )
        if means:
            counts = [
                sum(by[(*p, row)][cls]["ttft"][stat] <= by[(*p, base)][cls]["ttft"][stat] + 1e-9 for p in points)
                for cls in ("high", "low")
                for stat in ("mean", "p50")
            ]
            print(
                f"  TTFT at most {base}'s: HP mean at {counts[0]}, HP median at {counts[1]}, LP mean at {counts[2]}, "
                f"LP median at {counts[3]}"
            )
        print("\n".join(behind))
        for cls, (n, p90, queued) in excess.items():
            if n:
                print(
                    f"  {cls}: over the {n} point{'s' if n != 1 else ''} behind on its TTFT p90, the p90s exceed "
                    f"{base}'s by {p90:.1f} s in all; the medians around them wait {queued:.1f} s longer in the queue "
                    f"({queued / p90:.2f})"
                )


def _around(t: dict[str, float]) -> str:
    return (
        f"median TTFT {t['ttft_s']:.1f} s: queued {t['queued_s']:.1f}, admitted to first token "
        f"{t['admitted_to_first_s']:.1f}; first turns {t['first_turns']:.2f}, hit {t['hit']:.2f}, "
        f"retracted {t['retracted']:.2f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
