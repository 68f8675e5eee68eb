"""Run one contender in another Python environment (the RefAware fork's, `.venv-refaware`), for `policy.run_one`.

The fork pins SGLang 0.5.10 and cannot share a process with SGLang 0.5.23, so a table that compares them runs
the fork's contender here, in a subprocess of its environment: the workload goes over as a JSONL trace (which
reads back to the same sessions), the costs and seed as JSON, and the run's summary comes back as JSON.

    python -m kvcert.sim.elsewhere REQUEST.json   # the other side: prints the summary as one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from kvcert.sim.costs import Costs
from kvcert.sim.workload import Workload, write_trace

ENVIRONMENTS = {"refaware": ".venv-refaware"}
"""Contender -> the environment (under the repository root) that can build it."""


def python_for(name: str) -> Optional[Path]:
    """The interpreter of `name`'s environment, if this checkout has one (KVCERT_REFAWARE_PYTHON overrides)."""
    if name not in ENVIRONMENTS:
        return None
    override = os.environ.get("KVCERT_REFAWARE_PYTHON")
    path = (
        Path(override) if override else Path(__file__).resolve().parent.parent / ENVIRONMENTS[name] / "bin" / "python"
    )
    here = Path(sys.prefix).resolve() == path.parent.parent.resolve()  # (interpreters symlink to one base Python)
    return path if path.exists() and not here else None


def run_elsewhere(python: Path, name: str, workload: Workload, costs: Costs, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        write_trace(workload, trace)
        request = {
            "contender": name,
            "costs": asdict(costs),
            "seed": seed,
            "trace": str(trace),
            "name": workload.name,
            "max_in_flight": workload.max_in_flight,
            "high_threshold": workload.high_threshold,
        }
        (Path(tmp) / "request.json").write_text(json.dumps(request))
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(
            [str(python), "-m", "kvcert.sim.elsewhere", str(Path(tmp) / "request.json")],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{python} -m kvcert.sim.elsewhere failed ({done.returncode}): {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out["environment"] = str(python)
    return out

