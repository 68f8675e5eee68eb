"""Where one row of a `kvcert bench policy --map X,Y --json` run is at least another's, point by point.

    python scripts/map_versus.py MAP.json BASE ROW [ROW ...]

For each ROW, against BASE at every point of the map: how many points its HP turn>=1 hit is at least BASE's, its HP
TTFT p90 at most BASE's, its LP TTFT p90 at most BASE's; and the points where it is behind on any, tagged H (HP hit),
T (HP TTFT p90), L (LP TTFT p90) with both figures. One run per point: the spread of repeated runs is not in it.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
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
        print(
            f"{row} against {base}, {len(points)} points: HP hit at least at {at_least['H']}, HP TTFT p90 at most at "
            f"{at_least['T']}, LP TTFT p90 at most at {at_least['L']}"
        )
        print("\n".join(behind))


if __name__ == "__main__":
    main(sys.argv[1:])
