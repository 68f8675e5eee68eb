"""The caches `kvcert bench policy` compares, by name, and what each needs to be built here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcert.sim import engine
from kvcert.sim.bounds import InfiniteBound, OfflineBound
from kvcert.sim.caches import CacheDriver, ProtocolDriver, SGLangDriver, _config
from kvcert.sim.costs import Costs
from kvcert.sim.workload import Workload, pages

__all__ = ["CONTENDERS", "DEFAULT", "SCHEDULERS", "Contender", "Unavailable", "build", "parse"]


class Unavailable(RuntimeError):
    """This cache cannot be built in this environment (its engine is not installed); says how to get it."""


def built(target: str, costs: Costs) -> Any:
    """The cache a kvcert target (`module:factory`, as `kvcert certify` names it) builds over `costs`' pools.

    The simulator reaches every cache through its target, as certification does: it imports no cache and no
    engine adapter, so what it times is what was certified."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(_config(costs))


def _gpu(costs: Costs, w: Workload, priority: bool) -> CacheDriver:
    name = "kvcert.gpu, proactive (SPEC.md §11)" if priority else "kvcert.gpu, priority-blind (LRU)"
    return ProtocolDriver(name, built("kvcert.gpu:factory", costs), priority, costs.load_back_threshold)


def _sglang(costs: Costs, w: Workload) -> CacheDriver:
    try:
        return SGLangDriver(built("kvcert.conformance.adapters.sglang_hicache_backend:factory", costs), costs)
    except ImportError as e:
        raise Unavailable(
            f"SGLang 0.5.23 is not importable here ({e}); run from .venv (KVCERT_SGLANG=1 ./kvcert)"
        ) from e


def _refaware(costs: Costs, w: Workload) -> CacheDriver:
    try:
        backend = built("kvcert.conformance.adapters.refaware_hicache:factory_priority_flow", costs)
    except ImportError as e:
        raise Unavailable(f"the RefAware fork is not importable here ({e}); run from .venv-refaware") from e
    return ProtocolDriver("RefAware fork (SGLang 0.5.10), proactive", backend, True, costs.load_back_threshold)


def _offline(costs: Costs, w: Workload, future: dict[str, float]) -> CacheDriver:
    groups = {s.id: s.prefix for s in w.sessions if s.prefix is not None}
    prefix_pages = {s.prefix: pages(s.prefix_tokens, costs.page_tokens) for s in w.sessions if s.prefix is not None}
    return OfflineBound(
        costs.device_pages,
        costs.device_pages + costs.host_pages,
        lambda s: future.get(s, float("inf")),
        groups,
        prefix_pages,
    )


@dataclass(frozen=True)
class Contender:
    """A cache; the scheduler in front of it is the run's (`SCHEDULERS`), the same for every cache of a table."""

    cache: str
    about: str


CONTENDERS: dict[str, Contender] = {
    "baseline": Contender(
        "sglang", "SGLang 0.5.23 UnifiedRadixCache + HiCache, LRU: the cache users run today, priority-blind"
    ),
    "blind": Contender("gpu", "kvcert.gpu without the priority calls: LRU, priority-blind"),
    "proactive": Contender(
        "gpu-refs", "kvcert.gpu with session refs, scoped eviction and demotion (SPEC.md §11.1-§11.4)"
    ),
    "refaware": Contender(
        "refaware",
        "the RefAware fork's RefAwareHiRadixCache (SGLang 0.5.10) with its refs and scoped eviction, behind the "
        "row's scheduler (refaware@fork: the fork as it ships, behind its own admission)",
    ),
    "infinite": Contender("infinite", "bound: an infinite cache (every token computed before is a hit)"),
    "offline": Contender("offline", "bound: device+host as one pool, evicting what is used furthest ahead"),
}

SCHEDULERS: dict[str, str] = {
    "priority": "SGLang 0.5.23 --enable-priority-scheduling: by priority, then queue time; admitted while free + "
    "evictable less every running request's remaining output covers it; preemption above "
    "--priority-scheduling-preemption-threshold when the batch is full by count; decode retraction "
    "(sim/engine.py cites the lines)",
    "fcfs": "SGLang 0.5.23's default: one queue in arrival order; the same admission and retraction",
    "fork": "the RefAware fork's PrefillAdder (0.5.10 + overlay): priority order; every request against free + "
    "evictable outside HIGH_REF; a high-priority one short of it releases running low-priority requests, largest "
    "first (_plan_high_priority_admission)",
}
assert tuple(SCHEDULERS) == engine.SCHEDULERS

DEFAULT = ("baseline", "proactive", "refaware", "infinite", "offline", "baseline@fcfs", "refaware@fork")
"""Every cache behind the priority scheduler (the fork's server requires --enable-priority-scheduling for its tiers
to act); as extra rows, the blind cache behind SGLang's default FCFS scheduler, and the fork as it ships."""


def parse(row: str) -> tuple[str, str]:
    """A row of the table, `CACHE` or `CACHE@SCHEDULER` (the priority scheduler by default): (cache, scheduler);
    ValueError naming the known ones."""
    name, _, sched = row.partition("@")
    sched = sched or "priority"
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")
    if sched not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {sched!r} in {row!r}; known: {', '.join(SCHEDULERS)}")
    return name, sched


def build(name: str, costs: Costs, workload: Workload, future: dict[str, float]) -> CacheDriver:
    """The named contender's cache over `costs`' pools (a row's scheduler suffix ignored); `Unavailable` if its
    engine is not installed here."""
    name = name.partition("@")[0]
    if name not in CONTENDERS:
        raise ValueError(f"unknown cache {name!r}; known: {', '.join(CONTENDERS)}")
    makers: dict[str, Callable[[], Any]] = {
        "sglang": lambda: _sglang(costs, workload),
        "gpu-refs": lambda: _gpu(costs, workload, True),
        "gpu": lambda: _gpu(costs, workload, False),
        "refaware": lambda: _refaware(costs, workload),
        "infinite": lambda: InfiniteBound(costs.device_pages),
        "offline": lambda: _offline(costs, workload, future),
    }
    driver: CacheDriver = makers[CONTENDERS[name].cache]()
    return driver
