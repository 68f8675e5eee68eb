"""The caches `kvcert bench policy` compares, by name, and what each needs to be built here."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvcert.sim import engine
from kvcert.sim.bounds import InfiniteBound, OfflineBound
from kvcert.sim.caches import CacheDriver, ProtocolDriver, SGLangDriver, _config
from kvcert.sim.costs import Costs
from kvcert.sim.workload import Workload, pages
from kvcert.spec.decisions import SGLANG_0523, Decisions, Demote, LoadRoom, Room
from kvcert.spec.profiles import REFAWARE

__all__ = ["CONTENDERS", "DEFAULT", "SCHEDULERS", "Contender", "Unavailable", "build", "parse"]


class Unavailable(RuntimeError):
    """This cache cannot be built in this environment (its engine is not installed); says how to get it."""


def built(target: str, costs: Costs, **kwargs: Any) -> Any:
    """The cache a kvcert target (`module:factory`, as `kvcert certify` names it) builds over `costs`' pools.

    The simulator reaches every cache through its target, as certification does: it imports no cache and no
    engine adapter, so what it times is what was certified."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(_config(costs), **kwargs)


def _gpu(
    costs: Costs, w: Workload, priority: bool, target: str = "kvcert.gpu:factory", scoped: bool = True
) -> CacheDriver:
    name = "kvcert.gpu, proactive (SPEC.md §11)" if priority else "kvcert.gpu, priority-blind (LRU)"
    if target != "kvcert.gpu:factory":
        name += f" ({target})"
    if not scoped:
        name += ", evictions unscoped"
    return ProtocolDriver(name, built(target, costs), priority, costs.load_back_threshold, scoped=scoped)


def _sglang(costs: Costs, w: Workload) -> CacheDriver:
    try:
        return SGLangDriver(built("kvcert.conformance.adapters.sglang.hicache_backend:factory", costs), costs)
    except ImportError as e:
        raise Unavailable(
            f"SGLang 0.5.23 is not importable here ({e}); run from .venv (KVCERT_SGLANG=1 ./kvcert)"
        ) from e


def _refaware(costs: Costs, w: Workload) -> CacheDriver:
    try:
        backend = built("kvcert.conformance.adapters.refaware.hicache:factory_priority_flow", costs)
    except ImportError as e:
        raise Unavailable(f"the RefAware fork is not importable here ({e}); run from .venv-refaware") from e
    return ProtocolDriver("RefAware fork (SGLang 0.5.10), proactive", backend, True, costs.load_back_threshold)


ABLATIONS: dict[str, tuple[Decisions, str]] = {
    "model": (SGLANG_0523, "kvcert's reference model, §11 with SGLang 0.5.23's choice at every open place: "
              "kvcert.gpu's proactive cache, run for run"),
    "model-queued": (replace(SGLANG_0523, demote=Demote(order="queued")),
                     "the model, host pressure demoting in the fork's order (DEMOTE: any high session it queued at a "
                     "registration, raise or restore, fewest tokens when queued; not only idle ones)"),
    "model-earliest": (replace(SGLANG_0523, demote=Demote(restore="earliest")),
                       "the model, a released high session restoring the earliest demotion (the fork's) not the latest"),
    "model-loadroom": (replace(SGLANG_0523, load_room=LoadRoom(scope=(True, False), ask="whole")),
                       "the model, load-back making room for its whole size in a low requester's scope (the fork's)"),
    "model-backup": (replace(SGLANG_0523, room=Room(backup="whole")),
                     "the model, a backup short of host room host-evicting its whole size (the fork's)"),
    "model-fork": (REFAWARE.decisions, "the model with every choice of the fork's profile (refaware-0.5.10)"),
}  # fmt: skip
"""kvcert's model under one choice of the fork's at a time (SPEC.md §6), for the ablation in docs/bench_policy.md."""


RETENTION = re.compile(
    r"gpu-refs(?P<queued>-queued)?(?P<unscoped>-unscoped)?-(?P<kind>retain|ttl)(?:-(?P<s>\d+))?(?P<wait>-wait)?"
)
"""A retaining contender's cache name: the demotion order, unscoped evictions (as SGLang 0.5.23 calls them), a hint
that follows the think time (`retain`, `s` seconds of slack) or a fixed TTL (`ttl`, `s` seconds), and whether the
engine keeps a waiting turn's retention (`-wait`)."""


def _retention(costs: Costs, cache: str) -> CacheDriver:
    """The retaining kvcert.gpu `cache` names (`RETENTION`): the client's hint at each pause, the engine's half with
    `-wait` (SPEC.md §11.7)."""
    m = RETENTION.fullmatch(cache)
    assert m is not None and (m["kind"] == "retain" or m["s"]), cache
    target = "kvcert.gpu:factory_queued" if m["queued"] else "kvcert.gpu:factory"
    seconds = float(m["s"] or 0)
    slack, ttl = (seconds, None) if m["kind"] == "retain" else (None, seconds)
    how = f"for its think time + {seconds:g} s" if ttl is None else f"for a fixed {seconds:g} s"
    name = f"kvcert.gpu, proactive, retaining each paused session {how} (SPEC.md §11.7)"
    if m["wait"]:
        name += ", the engine keeping it while the next turn waits"
    if m["unscoped"]:
        name += ", evictions unscoped"
    if m["queued"]:
        name += f" ({target})"
    backend = built(target, costs)
    return ProtocolDriver(
        name,
        backend,
        True,
        costs.load_back_threshold,
        retain_slack=slack,
        retain_ttl=ttl,
        scoped=not m["unscoped"],
        hold_waiting=bool(m["wait"]),
    )


def _model(costs: Costs, name: str) -> CacheDriver:
    decisions, _ = ABLATIONS[name]
    backend = built("kvcert.refimpl:RefCache", costs, decisions=decisions)
    return ProtocolDriver(f"kvcert model ({name})", backend, True, costs.load_back_threshold)


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
    "proactive-unscoped": Contender(
        "gpu-refs-unscoped",
        "kvcert.gpu as proactive, every eviction unscoped (all tiers, §11's order): the cache as SGLang 0.5.23 runs "
        "it (--radix-cache-backend kvcert), whose scheduler never says which request an eviction makes room for",
    ),
    "proactive-queued": Contender(
        "gpu-refs-queued",
        "kvcert.gpu as proactive, host pressure demoting in the RefAware fork's queue order (kvcert.gpu:factory_queued, "
        "DEMOTE \"queued\", certified under its profile kvcert-queued)",
    ),
    "proactive-retain": Contender(
        "gpu-refs-retain",
        "kvcert.gpu as proactive, each session's client retaining its path for its think time when its turn ends "
        "(retain(session, ttl), SPEC.md §11.7: the hint the offline bound has, given to the cache)",
    ),
    "proactive-retain-30": Contender(
        "gpu-refs-retain-30",
        "as proactive-retain, each retention 30 s longer than the think time (it covers the next turn's wait in the "
        "queue, where an expired retention no longer protects the path)",
    ),
    "proactive-retain-120": Contender(
        "gpu-refs-retain-120", "as proactive-retain, each retention 120 s longer than the think time"
    ),
    "proactive-queued-retain-30": Contender(
        "gpu-refs-queued-retain-30", "kvcert.gpu:factory_queued with retention as proactive-retain-30"
    ),
    "proactive-queued-retain-120": Contender(
        "gpu-refs-queued-retain-120",
        "kvcert.gpu:factory_queued with each retention 120 s longer than the think time: long enough to outlast the "
        "next turn's wait in the queue where sessions outgrow the pools",
    ),
    "proactive-queued-retain-600": Contender(
        "gpu-refs-queued-retain-600",
        "kvcert.gpu:factory_queued with each retention 600 s longer than the think time: a retention that lasts "
        "until the next turn is admitted (no turn of the maps waits that long; each run counts the turns admitted "
        "after their retention expired)",
    ),
    "proactive-retain-600": Contender(
        "gpu-refs-retain-600",
        "as proactive-retain, each retention 600 s longer than the think time: it lasts until the next turn is "
        "admitted",
    ),
    "proactive-ttl-10": Contender(
        "gpu-refs-ttl-10",
        "kvcert.gpu as proactive, each paused session retained for a fixed 10 s: a TTL that does not know the pause "
        "(the client knows it is running a tool, not for how long)",
    ),
    "proactive-ttl-30": Contender(
        "gpu-refs-ttl-30",
        "kvcert.gpu as proactive, each paused session retained for a fixed 30 s: a TTL that does not know the pause",
    ),
    "proactive-ttl-600": Contender(
        "gpu-refs-ttl-600",
        "kvcert.gpu as proactive, each paused session retained for a fixed 600 s: a client that does not know its "
        "pause gives a TTL long enough to outlast it and the next turn's wait in the queue",
    ),
    **{
        f"proactive{q}-{hint}-wait": Contender(
            f"gpu-refs{q}-{hint}-wait",
            ("kvcert.gpu:factory_queued" if q else "kvcert.gpu") + f" as proactive-{hint}, the engine keeping a "
            "retention while the session's next turn waits in its queue (retain_waiting, SPEC.md §11.7: the TTL "
            "covers the pause, the engine the wait)",
        )
        for q in ("", "-queued")
        for hint in ("retain-1", "retain-5", "ttl-10", "ttl-30")
    },
    "proactive-unscoped-retain-1-wait": Contender(
        "gpu-refs-unscoped-retain-1-wait",
        "as proactive-unscoped (the cache as SGLang 0.5.23 runs it), each client retaining for its think time + 1 s "
        "and the engine keeping a retention while the next turn waits: the plugin with KVCERT_RETENTION=1",
    ),
    "refaware": Contender(
        "refaware",
        "the RefAware fork's RefAwareHiRadixCache (SGLang 0.5.10) with its refs and scoped eviction, behind the "
        "row's scheduler (refaware@fork: the fork as it ships, behind its own admission)",
    ),
    "infinite": Contender("infinite", "bound: an infinite cache (every token computed before is a hit)"),
    "offline": Contender("offline", "bound: device+host as one pool, evicting what is used furthest ahead"),
    **{name: Contender(name, about) for name, (_, about) in ABLATIONS.items()},
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
        "gpu-refs-queued": lambda: _gpu(costs, workload, True, "kvcert.gpu:factory_queued"),
        "gpu-refs-unscoped": lambda: _gpu(costs, workload, True, scoped=False),
        "gpu": lambda: _gpu(costs, workload, False),
        "refaware": lambda: _refaware(costs, workload),
        "infinite": lambda: InfiniteBound(costs.device_pages),
        "offline": lambda: _offline(costs, workload, future),
        **{m: (lambda m=m: _model(costs, m)) for m in ABLATIONS},  # type: ignore[misc]
    }
    cache = CONTENDERS[name].cache
    driver: CacheDriver = _retention(costs, cache) if RETENTION.fullmatch(cache) else makers[cache]()
    return driver
