"""The caches `kvcert bench policy` compares, by name, and what each needs to be built here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcert.sim.caches import CacheDriver, InfiniteBound, OfflineBound, ProtocolDriver, SGLangDriver, _config
from kvcert.sim.costs import Costs
from kvcert.sim.workload import Workload, pages

__all__ = ["CONTENDERS", "DEFAULT", "Contender", "Unavailable", "build"]


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
    """A cache and the scheduler in front of it."""

    cache: str
    priority_first: bool
    """HP-first admission (SGLang's `--enable-priority-scheduling`, the fork's scheduler) or FCFS (SGLang's default)."""
    about: str


CONTENDERS: dict[str, Contender] = {
    "baseline": Contender(
        "sglang",
        False,
        "SGLang 0.5.23 UnifiedRadixCache + HiCache, LRU, with SGLang's default FCFS scheduler: what users run today",
    ),
    "baseline-hp": Contender(
        "sglang", True, "the same SGLang cache behind HP-first scheduling: priority in the scheduler only"
    ),
    "proactive": Contender(
        "gpu-refs", True, "kvcert.gpu with session refs, scoped eviction, demotion and admission plans (SPEC.md §11)"
    ),
    "refaware": Contender(
        "refaware", True, "the RefAware fork's RefAwareHiRadixCache (SGLang 0.5.10), driven as its scheduler drives it"
    ),
    "blind": Contender(
        "gpu", False, "kvcert.gpu without the priority calls, FCFS: the baseline's policy on kvcert's cache"
    ),
    "infinite": Contender("infinite", True, "bound: an infinite cache (every token computed before is a hit)"),
    "offline": Contender("offline", True, "bound: device+host as one pool, evicting what is used furthest ahead"),
}
DEFAULT = ("baseline", "baseline-hp", "proactive", "refaware", "infinite", "offline")


def build(name: str, costs: Costs, workload: Workload, future: dict[str, float]) -> CacheDriver:
    """The named contender's cache over `costs`' pools; `Unavailable` if its engine is not installed here."""
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
