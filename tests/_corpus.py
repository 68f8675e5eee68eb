"""The same-verdict corpus: fixed traces, the targets they run on, and what each run gave.

`tests/test_same_verdict.py` replays every (trace, target) pair of `tests/corpus/` through
today's harness and backends and requires exactly the recorded result: the verdict (pass, or the
failing step with every violation's id and message) and a SHA-256 of every step's outcome. The
results were recorded from the code before the harness and `kvcert.gpu` were split into
components (issue 12), so a refactor that changes any verdict, any message or any outcome fails.

The corpus:

- `zoo/`: every counterexample `kvcert selftest` shrank for a generated mutant, run on its mutant
  (it must fail as it did), on the model and on `kvcert.gpu` (both pass);
- the directed mutants' hand-written traces (`selftest.DIRECTED_TRACES`), the same way;
- `tests/traces/`: the findings and calibration traces, on the model and `kvcert.gpu`;
- `generated/`: every example Hypothesis generated for one cell of each kind (device-only, each
  host write policy, storage with each prefetch stop policy, priority on), about 1,500 steps per
  kind, on the model, `kvcert.gpu` (both layouts) and a few mutants, so failures land mid-trace.

A deliberate spec change that alters a recorded result is written to `corpus/amended.json`, per case, with
the change that did it; nothing else is. Record again only to add traces, never to make a changed result pass:
`python tests/_corpus.py record` (with `PYTHONPATH` at an install of the recorded commit; see
`scripts/corpus_record.sh`). This module uses only `run_trace`, `Trace` and the zoo's factories,
which exist unchanged on both sides of the split.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from kvcert.conformance.certification.certify import load_factory
from kvcert.conformance.harness.driver import ConformanceFailure, run_trace
from kvcert.spec.ops import Op, Trace, op_from_json, op_to_json
from kvcert.spec.types import CacheConfig, KVCertError

CORPUS = Path(__file__).parent / "corpus"
TRACES = Path(__file__).parent / "traces"
EXPECTED = CORPUS / "expected.json"
MODEL, GPU, GPU_PAGE_FIRST = "kvcert.refimpl:factory", "kvcert.gpu:factory", "kvcert.gpu:factory_page_first"

GENERATED_CELLS: dict[str, dict[str, Any]] = {
    "device-ps1-lru": {"page_size": 1, "policy": "lru", "kind": "device"},
    "device-ps4-lfu": {"page_size": 4, "policy": "lfu", "kind": "device"},
    "device-ps2-priority": {"page_size": 2, "policy": "priority", "kind": "device"},
    "host-ps1-write_through": {"page_size": 1, "write_policy": "write_through", "kind": "host"},
    "host-ps4-write_through_selective": {"page_size": 4, "write_policy": "write_through_selective", "kind": "host"},
    "host-ps2-write_back": {"page_size": 2, "write_policy": "write_back", "kind": "host"},
    "storage-ps1-write_through-best_effort": {
        "page_size": 1,
        "write_policy": "write_through",
        "prefetch_policy": "best_effort",
        "kind": "storage",
    },
    "storage-ps4-write_back-timeout": {
        "page_size": 4,
        "write_policy": "write_back",
        "prefetch_policy": "timeout",
        "kind": "storage",
    },
    "storage-ps2-write_through_selective-wait_complete": {
        "page_size": 2,
        "write_policy": "write_through_selective",
        "prefetch_policy": "wait_complete",
        "kind": "storage",
    },
}
"""One cell of each kind, generated on the model (seed 0) until it has about `GENERATED_STEPS` steps."""
GENERATED_STEPS = 1500
GENERATED_MUTANTS = {
    "device": ("evict_frees_less", "match_does_not_touch"),
    "host": ("write_ack_keeps_lock", "reclaim_during_inflight_load"),
    "storage": ("fetch_trusts_storage", "failed_store_visible"),
}
"""Mutants every generated trace of a kind also runs on: failures at varied steps of long traces."""


@dataclass(frozen=True)
class Case:
    """One replay: a trace (its file and index within it) on one target."""

    name: str
    target: str
    config: CacheConfig
    ops: tuple[Op, ...]


def _show(outcome: Any) -> str:
    if isinstance(outcome, KVCertError):
        return f"{type(outcome).__name__}: {outcome}"
    if is_dataclass(outcome) and not isinstance(outcome, type):
        return f"{type(outcome).__name__}{sorted(asdict(outcome).items())}"
    return repr(outcome)


def replay(case: Case) -> dict[str, Any]:
    """The result of one case: its verdict and a digest of every outcome the backend returned."""
    digest = hashlib.sha256()

    def hook(i: int, op: Op, outcome: Any) -> None:
        digest.update(f"{i}:{_show(outcome)}\n".encode())

    factory = load_factory(case.target)
    result: dict[str, Any]
    try:
        run_trace(factory(case.config), case.config, factory.capabilities, list(case.ops), hook=hook)  # type: ignore[attr-defined]
        result = {"verdict": "pass"}
    except ConformanceFailure as failure:
        result = {
            "verdict": "fail",
            "step": failure.step,
            "violations": [[v.inv, v.message] for v in failure.violations],
        }
    result["outcomes"] = digest.hexdigest()
    return result


def _declares(target: str, config: CacheConfig) -> bool:
    caps = load_factory(target).capabilities  # type: ignore[attr-defined]
    return (
        config.page_size in caps.page_sizes
        and config.policy in caps.policies
        and (not config.host_capacity or config.write_policy in caps.write_policies)
        and (not config.prefetch_policy or config.prefetch_policy in caps.prefetch_policies)
    )


def _zoo(name: str) -> str:
    return f"kvcert.conformance.zoo:{name}"


def cases() -> list[Case]:
    """Every case of the corpus on disk, in a fixed order."""
    out: list[Case] = []
    for path in sorted((CORPUS / "zoo").glob("*.json")):
        trace = Trace.from_json(path.read_text())
        for target in (trace.target, MODEL, GPU):
            out.append(Case(f"zoo/{path.name}", target, trace.config, trace.ops))
    directed = json.loads((CORPUS / "directed.json").read_text())
    for name, entry in sorted(directed.items()):
        config, ops = CacheConfig(**entry["config"]), tuple(op_from_json(o) for o in entry["ops"])
        for target in (_zoo(name), MODEL, GPU):
            out.append(Case(f"directed/{name}", target, config, ops))
    for path in sorted(TRACES.glob("*.json")):
        trace = Trace.from_json(path.read_text())
        for target in (MODEL, GPU):
            out.append(Case(f"traces/{path.name}", target, trace.config, trace.ops))
    for path in sorted((CORPUS / "generated").glob("*.json")):
        cell = json.loads(path.read_text())
        config = CacheConfig(**cell["config"])
        targets = [MODEL, GPU, GPU_PAGE_FIRST, *(_zoo(m) for m in GENERATED_MUTANTS[cell["kind"]])]
        for i, ops_json in enumerate(cell["traces"]):
            ops = tuple(op_from_json(o) for o in ops_json)
            for target in targets:
                out.append(Case(f"generated/{path.name}#{i}", target, config, ops))
    return [c for c in out if _declares(c.target, c.config)]


def key(case: Case) -> str:
    return f"{case.name} @ {case.target}"


# ---------------------------------------------------------------------- recording


def _generate(label: str, cell: dict[str, Any]) -> dict[str, Any]:
    """Every example Hypothesis runs on the model for this cell (seed 0), until GENERATED_STEPS steps."""
    from kvcert.conformance.certification import certify
    from kvcert.conformance.generation.machine import CacheMachine

    factory = load_factory(MODEL)
    caps = factory.capabilities  # type: ignore[attr-defined]
    configs, _ = certify.cells_for(
        caps,
        [cell["page_size"]],
        [cell.get("policy", "lru")],
        write_policies=[cell["write_policy"]] if "write_policy" in cell else [],
        device_cells=cell["kind"] == "device",
        prefetch_policies=[cell["prefetch_policy"]] if "prefetch_policy" in cell else [],
        host_cells=cell["kind"] == "host",
    )
    (config,) = configs
    traces: list[list[dict[str, Any]]] = []
    total = [0]

    class Recording(CacheMachine):  # type: ignore[misc,valid-type]
        def teardown(self) -> None:
            try:
                super().teardown()
            finally:
                if total[0] < GENERATED_STEPS:
                    traces.append([op_to_json(op) for op in self.h.ops])
                    total[0] += len(self.h.ops)

    from hypothesis import HealthCheck, Phase, Verbosity, settings

    from kvcert.conformance.generation.determinism import fixed_generation

    bound = CacheMachine.bind(factory, config, caps)
    machine = type("Recording", (Recording, bound), {})
    conf = settings(
        max_examples=GENERATED_STEPS // 10,  # examples run about 35 steps: enough to reach the total
        stateful_step_count=50,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )
    with fixed_generation():
        try:  # the generator since issue 12's runner
            from kvcert.conformance.generation.runner import run_machine
        except ImportError:  # b974eca, where the corpus was recorded: Hypothesis's stateful runner
            from hypothesis.stateful import run_state_machine_as_test

            machine._hypothesis_internal_use_seed = 0  # type: ignore[attr-defined]
            run_state_machine_as_test(machine, settings=conf)
        else:
            run_machine(machine, conf, 0)
    return {"label": label, "kind": cell["kind"], "config": asdict(config), "traces": traces}


def record() -> None:
    """Write the corpus's generated traces and directed traces, then every case's result."""
    from kvcert.conformance.zoo.selftest import DIRECTED_TRACES

    (CORPUS / "generated").mkdir(parents=True, exist_ok=True)
    for label, cell in GENERATED_CELLS.items():
        path = CORPUS / "generated" / f"{label}.json"
        if not path.exists():
            path.write_text(json.dumps(_generate(label, cell), separators=(",", ":")) + "\n")
    directed = {
        name: {"config": asdict(t.config), "ops": [op_to_json(op) for op in t.ops]}
        for name, t in DIRECTED_TRACES.items()
    }
    (CORPUS / "directed.json").write_text(json.dumps(directed, indent=1, sort_keys=True) + "\n")
    results = {key(c): replay(c) for c in cases()}
    EXPECTED.write_text(
        json.dumps(
            {"recorded_at": os.environ.get("KVCERT_CORPUS_COMMIT", "?"), "results": results}, indent=1, sort_keys=True
        )
        + "\n"
    )
    print(f"{len(results)} cases -> {EXPECTED}")


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        raise SystemExit("usage: python tests/_corpus.py record")
    record()
