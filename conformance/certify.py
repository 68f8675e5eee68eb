"""Certification: run the state machine for every (page size, policy) cell a backend declares.

A cell fails at its first broken rule; the shrunk trace is saved as JSON and
replayed once more on a fresh backend, so a reported counterexample is known to
reproduce before anyone reads it.
"""

from __future__ import annotations

import importlib
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvcert.conformance.backend import Factory, capabilities_of
from kvcert.conformance.driver import ConformanceFailure, run_trace
from kvcert.conformance.machine import CacheMachine
from kvcert.conformance.shrink import shrink
from kvcert.spec.ops import Op, Trace
from kvcert.spec.types import CacheConfig, Capabilities

CAPACITY_PAGES = 16
"""Pool size per cell, in pages: small, so eviction and exhaustion happen often."""
HOST_PAGES = 24
"""Host pool size per host-tier cell, in pages: larger than the device, small enough to fill."""
HOST_CELL_DEVICE_PAGES = 6
"""Device pool of a host-tier cell, in pages: tight, so demotion, load-back and its refusal are common."""


STORAGE_PAGE_SIZES = (1, 4, 16)
"""Page sizes of the storage cells (write policy x prefetch stop policy x page size)."""
STORAGE_HOST_PAGES = 6
"""Host pool of a storage cell, in pages: small, so pages live in storage alone and prefetch finds them."""


def _tier(config: CacheConfig) -> str:
    if not config.host_capacity:
        return ""
    return f"{config.write_policy}+{config.prefetch_policy}" if config.prefetch_policy else config.write_policy


def load_factory(target: str) -> Factory:
    """Import `module:attribute` and check it declares capabilities."""
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"target must look like module:factory, got {target!r}")
    obj = getattr(importlib.import_module(module), attr)
    capabilities_of(obj)
    return obj


@dataclass
class CellResult:
    page_size: int
    policy: str
    passed: bool
    examples: int
    steps: int
    seconds: float
    failure: Optional[str] = None
    trace_path: Optional[str] = None
    trace_len: Optional[int] = None
    reproduced: Optional[bool] = None
    write_policy: str = ""
    """"" for a device-only cell; else the host tier's write policy."""
    ops: dict[str, int] = field(default_factory=dict)
    """Steps per op kind (`RunStats.ops`): what the cell exercised, in the JSON certificate."""


@dataclass
class Certificate:
    target: str
    backend: str
    seed: int
    examples: int
    steps: int
    strict_input: bool
    cells: list[CellResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.cells) and all(c.passed for c in self.cells)

    @property
    def total_steps(self) -> int:
        return sum(c.steps for c in self.cells)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.cells)

    def to_json(self) -> str:
        body = asdict(self)
        body.update(
            passed=self.passed,
            total_steps=self.total_steps,
            steps_per_second=round(self.total_steps / max(self.seconds, 1e-9), 1),
        )
        return json.dumps(body, indent=1)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def run_cell(
    factory: Factory,
    capabilities: Capabilities,
    config: CacheConfig,
    *,
    examples: int,
    steps: int,
    seed: int,
    target: str,
    out_dir: Path,
    bad_input: Optional[bool] = None,
) -> CellResult:
    machine = CacheMachine.bind(factory, config, capabilities, bad_input)
    machine._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]  # Hypothesis's own @seed hook
    conf = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
        report_multiple_bugs=False,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),  # shrinking happens on the trace: conformance/shrink.py
    )
    start = time.perf_counter()
    result = CellResult(config.page_size, config.policy, True, 0, 0, 0.0, write_policy=_tier(config))
    try:
        run_state_machine_as_test(machine, settings=conf)
    except ConformanceFailure:
        ops = shrink(
            machine.last_trace(), lambda ops: failure_ids(factory, capabilities, config, ops), config.page_size
        )
        failure = replay_failure(factory, capabilities, config, ops)
        trace = Trace(
            config=config, ops=tuple(ops), target=target, note=str(failure).splitlines()[-1].strip() if failure else ""
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        tier = f"-{_tier(config)}" if config.host_capacity else ""
        path = out_dir / f"{_slug(target)}-ps{config.page_size}-{config.policy}{tier}-seed{seed}.json"
        path.write_text(trace.to_json())
        result.passed, result.failure, result.trace_path, result.trace_len = False, str(failure), str(path), len(ops)
        result.reproduced = failure is not None
    except Flaky as flaky:
        # Same ops, different outcome: the backend (or its adapter) is not deterministic.
        result.passed = False
        result.failure = f"INV-DET-1: the backend is not deterministic under a fixed trace ({type(flaky).__name__}: {str(flaky).splitlines()[0]})"
    result.seconds = time.perf_counter() - start
    result.examples, result.steps = machine.stats.examples, machine.stats.steps
    result.ops = dict(sorted(machine.stats.ops.items()))
    return result


def replay_failure(
    factory: Factory, capabilities: Capabilities, config: CacheConfig, ops: list[Op]
) -> Optional[ConformanceFailure]:
    """Run `ops` on a fresh backend; the failure, or None if the trace passes."""
    try:
        run_trace(factory(config), config, capabilities, ops)
    except ConformanceFailure as failure:
        return failure
    return None


def failure_ids(
    factory: Factory, capabilities: Capabilities, config: CacheConfig, ops: list[Op]
) -> Optional[list[str]]:
    failure = replay_failure(factory, capabilities, config, ops)
    return [v.inv for v in failure.violations] if failure else None


def replay_fails(factory: Factory, capabilities: Capabilities, trace: Trace) -> bool:
    return replay_failure(factory, capabilities, trace.config, list(trace.ops)) is not None


def _tiered(page_size: int, policy: str, write_policy: str, prefetch_policy: str = "") -> CacheConfig:
    """A host-tier cell, or with `prefetch_policy` a storage cell (whose host pool is smaller)."""
    host_pages = STORAGE_HOST_PAGES if prefetch_policy else HOST_PAGES
    return CacheConfig(
        page_size=page_size,
        policy=policy,
        capacity=HOST_CELL_DEVICE_PAGES * page_size,
        host_capacity=host_pages * page_size,
        write_policy=write_policy,
        load_back_threshold=page_size,
        prefetch_policy=prefetch_policy,
    )


def cells_for(
    capabilities: Capabilities,
    page_sizes: Optional[Iterable[int]],
    policies: Optional[Iterable[str]],
    bad_input: Optional[bool] = None,
    write_policies: Optional[Iterable[str]] = None,
    device_cells: bool = True,
    prefetch_policies: Optional[Iterable[str]] = None,
    host_cells: bool = True,
) -> tuple[list[CacheConfig], list[str]]:
    """The cells to run, and what was asked for but not declared.

    Device-only cells: every page size x policy. Host-tier cells (backends that declare
    write policies): every page size x write policy, under LRU unless policies are named.
    Storage cells (backends that declare prefetch policies): write policy x prefetch policy x
    page size in STORAGE_PAGE_SIZES, faults on.
    """
    want_ps = [p for p in (page_sizes or capabilities.page_sizes)]
    want_pol = list(policies) if policies else list(capabilities.policies)
    want_wp = list(capabilities.write_policies if write_policies is None else write_policies)
    skipped = [f"page_size={p}: not declared" for p in want_ps if p not in capabilities.page_sizes]
    skipped += [f"policy={p}: not declared" for p in want_pol if p not in capabilities.policies]
    skipped += [f"write_policy={w}: not declared" for w in want_wp if w not in capabilities.write_policies]
    sizes = [p for p in want_ps if p in capabilities.page_sizes]
    pols = [p for p in want_pol if p in capabilities.policies]
    host_pols = pols if policies else [p for p in pols if p == "lru"] or pols[:1]
    configs = [
        CacheConfig(page_size=ps, policy=pol, capacity=CAPACITY_PAGES * ps)
        for ps in sizes
        for pol in pols
        if device_cells
    ]
    configs += [
        _tiered(ps, pol, wp)
        for ps in sizes
        for wp in want_wp
        if wp in capabilities.write_policies and host_cells
        for pol in host_pols
    ]
    want_pf = list(capabilities.prefetch_policies if prefetch_policies is None else prefetch_policies)
    skipped += [f"prefetch_policy={p}: not declared" for p in want_pf if p not in capabilities.prefetch_policies]
    configs += [
        _tiered(ps, pol, wp, pf)
        for ps in sizes
        if ps in STORAGE_PAGE_SIZES or page_sizes
        for wp in want_wp
        if wp in capabilities.write_policies
        for pf in want_pf
        if pf in capabilities.prefetch_policies
        for pol in host_pols
    ]
    if not capabilities.write_policies:
        skipped.append("host tier: backend declares no write policy")
    if bad_input is False or (bad_input is None and not capabilities.strict_input):
        skipped.append("bad-input rules: backend does not declare strict_input")
    elif bad_input and not capabilities.strict_input:
        skipped.append("bad-input rules forced on a backend that does not declare strict_input: failures are advisory")
    if not capabilities.namespaces:
        skipped.append("namespaces: backend does not declare them")
    return configs, skipped


def certify(
    target: str,
    *,
    factory: Optional[Factory] = None,
    examples: int = 200,
    steps: int = 50,
    seed: int = 0,
    page_sizes: Optional[Iterable[int]] = None,
    policies: Optional[Iterable[str]] = None,
    out_dir: Path = Path("kvcert-failures"),
    on_cell: Optional[Callable[[CellResult], None]] = None,
    bad_input: Optional[bool] = None,
    fail_fast: bool = False,
    write_policies: Optional[Iterable[str]] = None,
    device_cells: bool = True,
    prefetch_policies: Optional[Iterable[str]] = None,
    host_cells: bool = True,
) -> Certificate:
    """Run every cell; the certificate passes only if every cell does. `fail_fast` stops at the first failing cell."""
    factory = factory or load_factory(target)
    caps = capabilities_of(factory)
    configs, skipped = cells_for(
        caps, page_sizes, policies, bad_input, write_policies, device_cells, prefetch_policies, host_cells
    )
    cert = Certificate(target, caps.name, seed, examples, steps, caps.strict_input, skipped=skipped)
    for config in configs:
        cell = run_cell(
            factory,
            caps,
            config,
            examples=examples,
            steps=steps,
            seed=seed,
            target=target,
            out_dir=out_dir,
            bad_input=bad_input,
        )
        cert.cells.append(cell)
        if on_cell is not None:
            on_cell(cell)
        if fail_fast and not cell.passed:
            break
    return cert
