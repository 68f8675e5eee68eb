"""The bug zoo: source-level mutants of the reference model, one real bug class each.

A mutant is a textual edit of the reference model's modules it names (each `find`
must occur exactly once in them, so a refactor of the model breaks the zoo loudly
instead of silently mutating nothing). `kvcert selftest` certifies every mutant; the suite proves
its power by killing all of them while the unmodified model passes. This module builds and runs them.

| module | owns |
|---|---|
| `mutants` | the model's mutants (`MUTANTS`, `DIRECTED`): textual edits of `refimpl/`, one real bug class each |
| `engines` | the engine zoo: mutants of kvcert's reference engines (SPEC.md §14, §15), built and certified |
| `engine_mutants` | the engine zoo's catalogue: its mutants, and directed traces for those generation reaches at some seeds only |
| `selftest` | `kvcert selftest`: the suite's power measured on the zoo, one report for the CLI and the tests |
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Optional

import kvcert.refimpl.cache as refcache
from kvcert.conformance.backend import Factory
from kvcert.conformance.certification.certificate import Certificate, config_name
from kvcert.conformance.certification.certify import cells_for, certify, run_cell
from kvcert.conformance.zoo.mutants import DIRECTED, MUTANTS, Mutant
from kvcert.spec.types import CacheConfig

__all__ = ["DIRECTED", "MUTANTS", "Mutant", "build", "run_control", "run_mutant", "run_mutant_isolated"]


MODEL = ("records", "tree", "device", "host", "sessions", "storage", "cache")
"""The reference model's modules, each importing only those before it (and the spec)."""


def build(mutant: Mutant) -> Factory:
    """Compile the mutated model as a package of its own and return a factory for it.

    Every module of the model is compiled afresh under `kvcert.refimpl._mutant_<name>`, the mutated ones from their
    edited source, so the mutant shares no class or function with the model the harness runs beside it."""
    model = Path(refcache.__file__).parent
    sources = {f"{m}.py": (model / f"{m}.py").read_text() for m in MODEL}
    unknown = [f for f in mutant.files if f not in sources]
    if not mutant.files or unknown:
        raise AssertionError(f"mutant {mutant.name}: names {mutant.files}, not modules of the model {MODEL}")
    for find, repl in mutant.edits:
        where = [f for f in mutant.files if find in sources[f]]
        count = sum(sources[f].count(find) for f in mutant.files)
        if count != 1:
            raise AssertionError(f"mutant {mutant.name}: edit target occurs {count} times in refimpl/{mutant.files}")
        sources[where[0]] = sources[where[0]].replace(find, repl)
    package = f"kvcert.refimpl._mutant_{mutant.name}"
    sys.modules[package] = types.ModuleType(package)
    module = None
    for m in MODEL:
        module = types.ModuleType(f"{package}.{m}")
        module.__file__ = f"<mutant {mutant.name}: refimpl/{m}.py>"
        sys.modules[module.__name__] = module
        source = sources[f"{m}.py"].replace("from kvcert.refimpl.", f"from {package}.")
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    cls = module.RefCache  # type: ignore[union-attr]

    def factory(config: CacheConfig):
        return cls(config)

    factory.capabilities = replace(cls.capabilities, name=f"mutant:{mutant.name}")  # type: ignore[attr-defined]
    return factory


def run_mutant_isolated(
    mutant: Mutant, *, examples: int, steps: int, seed: int, out_dir: Optional[Path] = None
) -> Certificate:
    """`run_mutant` in a fresh interpreter: a mutant's verdict at a seed is then what a run of it alone
    gives. In one long process verdicts once depended on what ran before: Hypothesis drew from literals
    it harvested from every module imported so far, compiled mutants included
    (`conformance.generation.determinism.fixed_generation` now switches that off; tests/test_determinism.py shows
    a run after another mutant's is the same run). A fresh interpreter per mutant stays: it also isolates
    crashes and leaks, and lets `kvcert selftest --jobs` run mutants side by side."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_run_named, mutant.name, examples, steps, seed, out_dir).result()


def _run_named(name: str, examples: int, steps: int, seed: int, out_dir: Optional[Path]) -> Certificate:
    (mutant,) = [m for m in MUTANTS + DIRECTED if m.name == name]
    return run_mutant(mutant, examples=examples, steps=steps, seed=seed, out_dir=out_dir)


def run_mutant(mutant: Mutant, *, examples: int, steps: int, seed: int, out_dir: Optional[Path] = None) -> Certificate:
    return certify(
        f"kvcert.conformance.zoo:{mutant.name}",
        factory=build(mutant),
        examples=examples * mutant.budget,
        steps=steps,
        seed=seed,
        page_sizes=mutant.page_sizes,
        policies=mutant.policies,
        out_dir=out_dir or Path("kvcert-failures/zoo"),
        fail_fast=True,
        write_policies=mutant.write_policies,
        device_cells=not mutant.write_policies,
        prefetch_policies=mutant.prefetch_policies,
        host_cells=not mutant.prefetch_policies,
    )


def run_control(*, examples: int, steps: int, seed: int, out_dir: Optional[Path] = None) -> Certificate:
    """The unmodified model on every cell some mutant runs: it must pass them all."""
    caps = refcache.RefCache.capabilities
    configs: list[CacheConfig] = []
    budget: dict[CacheConfig, int] = {}
    for m in MUTANTS:
        cells, _ = cells_for(
            caps,
            m.page_sizes,
            m.policies,
            write_policies=m.write_policies,
            device_cells=not m.write_policies,
            prefetch_policies=m.prefetch_policies,
            host_cells=not m.prefetch_policies,
        )
        configs += [c for c in cells if c not in configs]
        for c in cells:
            budget[c] = max(budget.get(c, 1), m.budget)
    cert = Certificate("kvcert.refimpl:factory", caps.name, seed, examples, steps, caps.strict_input)
    cert.planned = [config_name(c) for c in configs]
    for config in configs:
        cert.cells.append(
            run_cell(
                refcache.factory,
                caps,
                config,
                examples=examples * budget[config],
                steps=steps,
                seed=seed,
                target="kvcert.refimpl:factory",
                out_dir=out_dir or Path("kvcert-failures/zoo"),
            )
        )
    return cert


def __getattr__(name: str) -> Factory:
    """`kvcert.conformance.zoo:<mutant>` is a loadable target, so saved zoo traces replay."""
    for m in MUTANTS + DIRECTED:
        if m.name == name:
            return build(m)
    raise AttributeError(name)
