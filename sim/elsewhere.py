"""The other side of `kvcert.sim.remote`: one contender's run in this environment, its summary printed as JSON.

    python -m kvcert.sim.elsewhere REQUEST.json   # REQUEST: the trace, costs, seed and contender `remote` wrote
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from kvcert.sim.costs import Costs
from kvcert.sim.policy import run_one
from kvcert.sim.workload import read_trace

__all__ = ["main"]


def main(argv: list[str]) -> None:
    req = json.loads(Path(argv[0]).read_text())
    w = read_trace(req["trace"], high_threshold=req["high_threshold"])
    w = replace(w, name=req["name"], max_in_flight=req["max_in_flight"])
    summary = run_one(req["contender"], w, Costs(**req["costs"]), req["seed"], elsewhere=False)
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
