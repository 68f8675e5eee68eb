"""Certifying an API-level target whose operations are not the radix protocol's: a block pool, an offload tier.

Such a target brings its own `Walk`: the cells it runs in, a seeded generator of operations (JSON-able dicts, drawn
blind from small vocabularies so that they collide; the replay skips one its state makes inapplicable, as the
engine's own caller never sends it), and a replay that checks every rule after every operation on a fresh target.
`certify_walk` runs `examples` walks per cell, shrinks a failing one greedily (dropping runs of operations while the
same rules still break), replays the shrunk trace to see that it reproduces, saves it, and returns the same
`Certificate` the suite prints for every other target. A target declares its walk as `factory.walk`.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from kvcert.conformance.backend import Walk, WalkCell, WalkFailure
from kvcert.conformance.certification.certificate import CellResult, Certificate
from kvcert.spec.types import Capabilities

__all__ = ["WALK_FORMAT", "Walk", "WalkCell", "WalkFailure", "certify_walk", "replay_walk_trace", "shrink_ops"]

WALK_FORMAT = "kvcert-walk/1"
"""The `format` of a saved walk trace (a radix trace is `kvcert-trace/1`)."""
SHRINK_REPLAYS = 400
"""At most this many replays shrink one failure."""


def _rules(failure: Optional[WalkFailure]) -> set[str]:
    return {v.inv for v in failure.violations} if failure is not None else set()


def shrink_ops(ops: list[dict[str, Any]], fails: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """Drop runs of operations, halving the run length, while `fails` still holds (at most SHRINK_REPLAYS tries)."""
    tries, chunk = 0, max(1, len(ops) // 2)
    while chunk >= 1 and tries < SHRINK_REPLAYS:
        i, dropped = 0, False
        while i < len(ops) and tries < SHRINK_REPLAYS:
            candidate = ops[:i] + ops[i + chunk :]
            tries += 1
            if candidate and fails(candidate):
                ops, dropped = candidate, True
            else:
                i += chunk
        if not dropped:
            chunk //= 2
    return ops


def certify_walk(
    target: str,
    factory: Any,
    capabilities: Capabilities,
    *,
    examples: int,
    steps: int,
    seed: int,
    out_dir: Path,
    on_cell: Optional[Callable[[CellResult], None]] = None,
) -> Certificate:
    walk: Walk = factory.walk
    cells = walk.cells(capabilities)
    cert = Certificate(
        target,
        capabilities.name,
        seed,
        examples,
        steps,
        capabilities.strict_input,
        capabilities.profile,
        planned=[c.name for c in cells],
        adapter_notes=list(capabilities.notes),
        kind=capabilities.kind,
    )
    exercised: Counter[str] = Counter()
    for cell in cells:
        result = _run_cell(target, factory, walk, cell, examples, steps, seed, out_dir)
        exercised.update(result.ops)
        cert.cells.append(result)
        if on_cell is not None:
            on_cell(result)
    cert.not_checked = walk.gaps(capabilities, exercised) + [
        f"adapter deviation (the engine as certified differs from the engine as shipped): {d}"
        for d in capabilities.deviations
    ]
    return cert


def _run_cell(
    target: str, factory: Any, walk: Walk, cell: WalkCell, examples: int, steps: int, seed: int, out_dir: Path
) -> CellResult:
    start = time.perf_counter()
    rng = random.Random(f"{seed}/{cell.name}")
    params = ", ".join(f"{k}={v}" for k, v in cell.params)
    result = CellResult(cell.page_size, cell.policy, True, 0, 0, 0.0, tier=f"{cell.tier}, {params}" if params else cell.tier)
    seen: Counter[str] = Counter()
    digest = hashlib.sha256()
    for _ in range(examples):
        ops = walk.generate(rng, cell, steps)
        digest.update(json.dumps(ops, sort_keys=True).encode())
        failure, counts = walk.replay(factory, cell, ops)
        seen.update(counts)
        result.examples += 1
        result.steps += len(ops)
        if failure is None:
            continue
        shrunk = shrink_ops(ops, _same_rules(walk, factory, cell, _rules(failure)))
        again, _ = walk.replay(factory, cell, shrunk)
        path = out_dir / f"{target.replace(':', '-').replace('.', '_')}-{cell.name}-seed{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": WALK_FORMAT, "target": target, "cell": _cell_json(cell), "ops": shrunk}, indent=1))
        shown = again or failure
        result.passed, result.reproduced = False, again is not None
        result.failure = f"{shown}\n(minimal trace: {len(shrunk)} ops)"
        result.trace_path, result.trace_len = str(path), len(shrunk)
        result.failures = [
            {"invariant": v.inv, "step": shown.step, "op": shown.op, "message": v.message, "trace": str(path)}
            for v in shown.violations
        ]
        break
    result.ops = dict(sorted(seen.items()))
    result.digest = digest.hexdigest()
    result.seconds = time.perf_counter() - start
    return result


def _same_rules(
    walk: Walk, factory: Any, cell: WalkCell, rules: set[str]
) -> Callable[[list[dict[str, Any]]], bool]:
    """The shrinker's verdict: a candidate still breaks one of `rules` on a fresh target."""
    return lambda ops: bool(_rules(walk.replay(factory, cell, ops)[0]) & rules)


def _cell_json(cell: WalkCell) -> dict[str, Any]:
    return {"policy": cell.policy, "page_size": cell.page_size, "params": [list(p) for p in cell.params], "tier": cell.tier}


def replay_walk_trace(path: Path, factory: Any) -> Optional[WalkFailure]:
    """Replay a saved walk trace on a fresh target: its failure, or None."""
    data = json.loads(path.read_text())
    c = data["cell"]
    cell = WalkCell(c["policy"], c["page_size"], tuple((k, v) for k, v in c["params"]), c["tier"])
    return factory.walk.replay(factory, cell, data["ops"])[0]  # type: ignore[no-any-return]
