# Over 600 lines: one calibration run: the fork's own scheduler state and the spec's admission plan, side by side, read top to bottom.
"""SPEC.md §11.5 admission plans beside the RefAware fork's own scheduler, state by state (calibration R8).

    .venv-refaware/bin/python scripts/admission_vs_fork.py          # the table and the summary
    .venv-refaware/bin/python scripts/admission_vs_fork.py --json   # one JSON object per state
    .venv-refaware/bin/python scripts/admission_vs_fork.py --state retract-or-evict-high

Each `State` is one moment of a device cache: free slots, evictable tokens per ref tier (UNUSED,
LOW_REF, HIGH_REF), free host slots, the running requests (priority, KV they hold, decode tokens
the fork reserves for them) and one incoming request. Page size 1, threshold H = 1 (priority 0 is
low, 2 is high).

**kvcert's side** is `kvcert.spec.admission.plan_admission` over the counters below.

**The fork's side runs the fork's own scheduler code**: `PrefillAdder` from
`reference/sglang/srt/managers/schedule_policy.py` (the fork's file, loaded as a module; the
installed 0.5.10 `schedule_policy` is the base one), called as the scheduler calls it
(`add_one_req(req, has_chunked_req=False, truncation_align_size=None, running_slot_reclaim_need=n)`,
`scheduler.py:2773-2786`), and then the fork's allocation-time eviction
`evict_from_tree_cache(cache, need, high_authorization=adder.authorized_high_full_shortfall)`
(`mem_cache/common.py:226-283`, called so by the batch preflight at `common.py:463-470`). Only
what those call is stood in for, by the fakes below (transcriptions, cited):

* `FakeCache` (a `RefAwareCacheCore`, as the fork's own `tests/test_prefill_adder.py` builds its
  `_LedgerRefAwareCache`): the real `is_high_priority` and `scoped_evict`
  (`ref_aware_cache_core.py:109-120`); tier counters for `safe_evictable_size_by_tier`
  (`ref_aware_cache_mixin.py:180-199`); `evict` takes UNUSED, then LOW_REF if the scope allows,
  then HIGH_REF if it allows, with the plain default scope `(True, False)`
  (`ref_aware_radix_cache.py:42-79`), in tokens (leaves of one token).
* `FakeBatch.release_req` transcribes `schedule_batch.py:2349-2362`: `release_kv_cache(req,
  is_insert=False)` frees the request's own KV (`radix_cache.py:468-511`: the slots past
  `cache_protected_len`; here a running request's KV is all its own), no backup outside PD decode
  (`offload_kv_cache`, `:2352-2355`), then the fork's real `evict_from_tree_cache(cache, remaining
  * SGLANG_RETRACT_DECODE_STEPS)`.
* `FakeReq` carries the fields the adder reads. `new_token_ratio = 1.0`, so a running request's
  reservation (`_get_running_request_total_token_offset`, `schedule_policy.py:521-529`) is exactly
  `reserve` (= `max_new_tokens`, no output yet); the incoming request reserves nothing
  (`max_new_tokens = 0`).

**The mapping between the two** (so that both see the same room): the fork charges every running
request's decode reservation against free slots (`_ref_aware_deficits`, `schedule_policy.py:742-776`)
and counts a retraction's gain as that reservation plus, once really released, the KV it frees. So
kvcert gets `free = free_slots - sum(reserve)` and `Running(tokens = kv + reserve)`;
`evictable = U + L + H`, `held_high = H`, `host_free` as given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from kvcert.spec.admission import AdmissionCounters, plan_admission
from kvcert.spec.types import AdmissionProfile, Running

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("KVCERT_TARGETS", str(ROOT.parent / "shared" / "targets"))) / "refaware-sglang-0.5.10"
FORK_SCHEDULE_POLICY = TARGET / "reference" / "sglang" / "srt" / "managers" / "schedule_policy.py"
THRESHOLD = 1
LOW, HIGH = 0, 2


# --------------------------------------------------------------------------- states


@dataclass(frozen=True)
class Req:
    """A running request: `kv` device tokens it holds (all its own), `reserve` decode tokens the fork reserves."""

    id: int
    priority: int
    kv: int
    reserve: int = 0


@dataclass(frozen=True)
class State:
    name: str
    why: str
    free: int
    unused: int
    low: int
    high: int
    tokens: int
    priority: int
    running: tuple[Req, ...] = ()
    host_free: int = 0
    layers: int = 1
    profile: Optional[AdmissionProfile] = None
    slot_reclaim: int = 0
    """The fork's `running_slot_reclaim_need` (`scheduler.py:2345-2350`): request slots the batch is short."""


STATES: tuple[State, ...] = (
    State(
        "fits-free",
        "room in free slots: nothing to evict or retract",
        free=1000,
        unused=100,
        low=100,
        high=100,
        tokens=800,
        priority=HIGH,
    ),
    State(
        "low-evicts-unused-low",
        "a low request evicts UNUSED then LOW_REF, never HIGH_REF",
        free=200,
        unused=300,
        low=300,
        high=400,
        tokens=600,
        priority=LOW,
        running=(Req(1, LOW, 100),),
    ),
    State(
        "low-refused",
        "a low request short of room even with UNUSED + LOW_REF: refused, nothing retracted",
        free=200,
        unused=200,
        low=200,
        high=800,
        tokens=1000,
        priority=LOW,
        running=(Req(1, LOW, 500, 100),),
    ),
    State(
        "high-evicts-high",
        "no low request runs: a high request evicts into HIGH_REF",
        free=200,
        unused=200,
        low=200,
        high=800,
        tokens=1000,
        priority=HIGH,
        running=(Req(1, HIGH, 300),),
    ),
    State(
        "retract-or-evict-high",
        "room in free + UNUSED + LOW_REF + HIGH_REF; a low request runs",
        free=200,
        unused=200,
        low=200,
        high=800,
        tokens=1000,
        priority=HIGH,
        running=(Req(1, LOW, 600),),
    ),
    State(
        "retract-more-keep-high",
        "HIGH_REF alone is short; covering the rest takes one retraction after HIGH_REF, or two without",
        free=300,
        unused=0,
        low=0,
        high=100,
        tokens=400,
        priority=HIGH,
        running=(Req(1, LOW, 200, 150), Req(2, LOW, 100, 150)),
    ),
    State(
        "kv-not-counted",
        "only retraction makes room; the running request's reservation is small beside its KV",
        free=10,
        unused=0,
        low=0,
        high=0,
        tokens=300,
        priority=HIGH,
        running=(Req(1, LOW, 400, 10),),
        host_free=1000,
    ),
    State(
        "smallest-covering",
        "two low requests each cover the shortfall alone",
        free=300,
        unused=0,
        low=0,
        high=0,
        tokens=200,
        priority=HIGH,
        running=(Req(1, LOW, 250, 100), Req(2, LOW, 150, 100), Req(3, LOW, 60, 100)),
        host_free=300,
    ),
    State(
        "order-by-kv",
        "the fork orders victims by sequence length; the one that frees most has a short prompt and a long reservation",
        free=400,
        unused=0,
        low=0,
        high=0,
        tokens=400,
        priority=HIGH,
        running=(Req(1, LOW, 300, 0), Req(2, LOW, 100, 400)),
    ),
    State(
        "evict-all-first",
        "one retraction covers the whole request; UNUSED tokens are cached as well",
        free=200,
        unused=100,
        low=0,
        high=0,
        tokens=300,
        priority=HIGH,
        running=(Req(1, LOW, 250, 200),),
    ),
    State(
        "backup-kept",
        "the same single retraction on both sides; the host has room for its KV",
        free=300,
        unused=0,
        low=0,
        high=0,
        tokens=300,
        priority=HIGH,
        running=(Req(1, LOW, 250, 200),),
        host_free=500,
    ),
    State(
        "high-never-retracted",
        "even every low request cannot cover; the high one running is never a victim",
        free=100,
        unused=0,
        low=0,
        high=0,
        tokens=500,
        priority=HIGH,
        running=(Req(1, LOW, 100, 100), Req(2, HIGH, 400)),
    ),
    State(
        "partial-residency",
        "4 layers; a low request fits only at 2 resident layers, which the profile allows (100 + 2*400*2 <= 2000)",
        free=100,
        unused=100,
        low=0,
        high=300,
        tokens=400,
        priority=LOW,
        layers=4,
        profile=AdmissionProfile(load=1, store=1, step=100, target=2000),
    ),
    State(
        "batch-full",
        "KV room to spare, but the running batch is at its request limit (pp_max_micro_batch_size)",
        free=1000,
        unused=0,
        low=0,
        high=0,
        tokens=100,
        priority=HIGH,
        running=(Req(1, LOW, 300), Req(2, LOW, 200)),
        slot_reclaim=1,
    ),
)


# --------------------------------------------------------------------------- the two sides


@dataclass
class Side:
    fits: bool
    retract: list[int] = field(default_factory=list)
    keep: list[bool] = field(default_factory=list)
    evicted: tuple[int, int, int] = (0, 0, 0)
    """Tokens evicted from UNUSED, LOW_REF, HIGH_REF."""
    layers: int = 0
    lost: int = 0
    """KV tokens of retracted requests not backed up: recomputed when they run again."""
    note: str = ""


def by_tier(n: int, unused: int, low: int, high: int, allow_high: bool) -> tuple[int, int, int]:
    """An eviction of `n` tokens in tier order (§11.3: UNUSED, LOW_REF, then HIGH_REF when in scope)."""
    u = min(n, unused)
    lo = min(n - u, low)
    hi = min(n - u - lo, high) if allow_high else 0
    return (u, lo, hi)


def kvcert_side(s: State) -> Side:
    reserved = sum(r.reserve for r in s.running)
    assert s.free >= reserved, f"{s.name}: free slots below the reservations"
    counters = AdmissionCounters(
        page_size=1,
        layers=s.layers,
        high_threshold=THRESHOLD,
        free=s.free - reserved,
        evictable=s.unused + s.low + s.high,
        held_high=s.high,
        host_free=s.host_free,
    )
    running = [Running(r.id, r.priority, r.kv + r.reserve) for r in s.running]
    plan = plan_admission(counters, s.tokens, s.priority, running, s.profile)
    if not plan.fits:
        return Side(False, note="does not fit")
    kv = {r.id: r.kv for r in s.running}
    return Side(
        True,
        list(plan.retract),
        list(plan.keep),
        by_tier(plan.evict, s.unused, s.low, s.high, plan.allow_high),
        plan.layers,
        sum(kv[i] for i, kept in zip(plan.retract, plan.keep) if not kept),
        f"evict {plan.evict}, slots {plan.slots}",
    )


def load_fork() -> SimpleNamespace:
    """The fork's `PrefillAdder` (from its reference scheduler file) and its allocation-time eviction."""
    warnings.filterwarnings("ignore")
    from kvcert.conformance.adapters.refaware.env import import_refaware
    from kvcert.conformance.adapters.sglang.env import quiet_imports

    import_refaware()
    if not FORK_SCHEDULE_POLICY.is_file():
        raise ImportError(f"the fork's scheduler file is missing: {FORK_SCHEDULE_POLICY}")
    spec = importlib.util.spec_from_file_location("refaware_fork_schedule_policy", FORK_SCHEDULE_POLICY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    with quiet_imports():
        spec.loader.exec_module(module)
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache import common
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult, IncLockRefResult
        from sglang.srt.mem_cache.ref_aware_cache_core import RefAwareCacheCore
        from sglang.srt.server_args import set_global_server_args_for_scheduler

    # PrefillAdder reads these through get_global_server_args (nsa / context-parallel gates, and
    # release_req's disaggregation mode); a real ServerArgs wants a model, the fork's tests use "dummy".
    set_global_server_args_for_scheduler(
        SimpleNamespace(
            disaggregation_mode="null",
            enable_prefill_context_parallel=False,
            enable_nsa_prefill_context_parallel=False,
            nsa_prefill_cp_mode="",
            pp_max_micro_batch_size=None,
        )
    )
    return SimpleNamespace(
        PrefillAdder=module.PrefillAdder,
        evict_from_tree_cache=common.evict_from_tree_cache,
        RefAwareCacheCore=RefAwareCacheCore,
        EvictResult=EvictResult,
        IncLockRefResult=IncLockRefResult,
        retract_decode_steps=envs.SGLANG_RETRACT_DECODE_STEPS.get(),
    )


def fork_side(s: State, fork: SimpleNamespace) -> Side:
    """Admit `s`'s request with the fork's scheduler code, then allocate as its batch preflight does."""

    class FakeAllocator:
        def __init__(self, free: int) -> None:
            self.free = free

        def available_size(self) -> int:
            return self.free

    class FakeReqPool:
        def available_size(self) -> int:
            return 1 << 20  # request slots are not the subject here (batch-full uses slot_reclaim)

        def req_slot_need(self, req: Any) -> int:
            return int(req.req_pool_idx is None)

    class FakeCache(fork.RefAwareCacheCore):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:  # the tier counters only; no tree
            self.token_to_kv_pool_allocator = FakeAllocator(s.free)
            self.req_to_token_pool = FakeReqPool()
            self.tiers = [s.unused, s.low, s.high]
            self.evicted = [0, 0, 0]
            self.disable = False
            self.high_priority_threshold = THRESHOLD
            self._enable_priority_scheduling = True  # R6: the threshold applies only with it on
            self._evict_scope_stack: list[tuple[bool, bool]] = []

        def supports_mamba(self) -> bool:
            return False

        def supports_swa(self) -> bool:
            return False

        def is_tree_cache(self) -> bool:
            return True

        def is_chunk_cache(self) -> bool:
            return False

        def safe_evictable_size_by_tier(self, allow_low: bool = True, allow_high: bool = False) -> int:
            return self.tiers[0] + (self.tiers[1] if allow_low else 0) + (self.tiers[2] if allow_high else 0)

        def evict(self, params: Any) -> Any:
            allow_low, allow_high = self._evict_scope_stack[-1] if self._evict_scope_stack else (True, False)
            left = params.num_tokens
            for tier, allowed in ((0, True), (1, allow_low), (2, allow_high)):
                take = min(left, self.tiers[tier]) if allowed else 0
                self.tiers[tier] -= take
                self.evicted[tier] += take
                self.token_to_kv_pool_allocator.free += take
                left -= take
            return fork.EvictResult(num_tokens_evicted=params.num_tokens - left)

        def inc_lock_ref(self, node: Any) -> Any:
            return fork.IncLockRefResult()

        def dec_lock_ref(self, node: Any, params: Any = None) -> Any:
            return None

    class FakeReq:
        def __init__(self, rid: str, priority: int, tokens: int, *, running: bool, reserve: int = 0) -> None:
            self.rid, self.priority = rid, priority
            self.origin_input_ids = list(range(tokens))
            self.output_ids: list[int] = []
            self.fill_ids = list(range(tokens))
            self.prefix_indices: list[int] = []
            self.extend_input_len = 0 if running else tokens
            self.host_hit_length = 0
            self.last_node = object()
            self.req_pool_idx = 0 if running else None
            self.mamba_pool_idx = None
            self.sampling_params = SimpleNamespace(max_new_tokens=reserve, ignore_eos=False)
            self.kv = tokens

        def finished(self) -> bool:
            return False

        def set_extend_input_len(self, n: int) -> None:
            self.extend_input_len = n

    cache = FakeCache()

    class FakeBatch:
        def __init__(self, reqs: list[FakeReq]) -> None:
            self.reqs = reqs

        def batch_size(self) -> int:
            return len(self.reqs)

        def release_req(self, idx: int, remaining: int, server_args: Any) -> None:
            # schedule_batch.py:2349-2362 (no PD decode: no offload_kv_cache backup)
            cache.token_to_kv_pool_allocator.free += self.reqs[idx].kv  # release_kv_cache(is_insert=False)
            fork.evict_from_tree_cache(cache, remaining * fork.retract_decode_steps)

        def filter_batch(self, keep_indices: Sequence[int]) -> None:
            self.reqs = [self.reqs[i] for i in keep_indices]

    reqs = [FakeReq(f"r{r.id}", r.priority, r.kv, running=True, reserve=r.reserve) for r in s.running]
    adder = fork.PrefillAdder(
        page_size=1,
        tree_cache=cache,
        token_to_kv_pool_allocator=cache.token_to_kv_pool_allocator,
        running_batch=FakeBatch(reqs),
        new_token_ratio=1.0,
        rem_input_tokens=1 << 20,
        rem_chunk_tokens=None,
        enable_ref_aware_kv_buffer=True,
        high_priority_threshold=THRESHOLD,
    )
    req = FakeReq("incoming", s.priority, s.tokens, running=False)

    # Side-effect-free reads of the fork's own ledger, for the table's note.
    demand = adder._make_ref_aware_demand(req, truncation_align_size=None)
    deficit = int(adder._ref_aware_deficits(demand)[0])
    victims = adder._running_low_priority_victims()
    bound = sum(adder._release_gain_lower_bound(v)[0] for v in victims) + adder._high_evictable_capacity()[0]
    high = s.priority >= THRESHOLD

    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None, running_slot_reclaim_need=s.slot_reclaim)
    retracted = [int(r.rid[1:]) for r in adder.requeue_after_scan]
    lost = sum(r.kv for r in s.running if r.id in retracted)
    if req not in adder.can_run_list:
        why = (
            f"deficit {deficit} > reclaim bound {bound}"
            if high
            else f"deficit {deficit}, a low request reclaims nothing"
        )
        return Side(False, retracted, [False] * len(retracted), tuple(cache.evicted), 0, lost, f"refused ({why})")  # type: ignore[arg-type]
    authorized = adder.authorized_high_full_shortfall
    fork.evict_from_tree_cache(cache, demand.full_current, high_authorization=authorized)
    assert cache.token_to_kv_pool_allocator.free >= demand.full_current, f"{s.name}: the fork's preflight would fail"
    note = f"deficit {deficit}, bound {bound}, HIGH authorized {authorized}" if deficit else "deficit 0"
    return Side(True, retracted, [False] * len(retracted), tuple(cache.evicted), s.layers, lost, note)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- comparison


def differences(k: Side, f: Side, s: State) -> list[str]:
    """What differs, as tags (legend in `TAGS`)."""
    if k.fits != f.fits:
        return ["kvcert-admits" if k.fits else "fork-admits"]
    if not k.fits:
        return []
    tags = []
    if k.layers < s.layers:
        tags.append("partial-residency")
    if len(k.retract) != len(f.retract):
        tags.append("retract-count")
    elif sorted(k.retract) != sorted(f.retract):
        tags.append("retract-choice")
    if k.evicted[2] != f.evicted[2]:
        tags.append("high-evicted")
    if k.evicted[:2] != f.evicted[:2]:
        tags.append("unused-low-evicted")
    if any(k.keep):
        tags.append("backup")
    return tags


TAGS = {
    "kvcert-admits": "kvcert admits, the fork refuses",
    "fork-admits": "the fork admits, kvcert refuses",
    "partial-residency": "kvcert admits with fewer resident layers (the fork has none)",
    "retract-count": "a different number of retractions",
    "retract-choice": "as many retractions, other requests",
    "high-evicted": "different HIGH_REF tokens evicted",
    "unused-low-evicted": "different UNUSED / LOW_REF tokens evicted",
    "backup": "kvcert backs a retracted request up to host (the fork never does)",
}


def compare(s: State, fork: SimpleNamespace) -> dict[str, Any]:
    k, f = kvcert_side(s), fork_side(s, fork)
    return {"state": s.name, "kvcert": asdict(k), "fork": asdict(f), "differences": differences(k, f, s)}


def describe(side: dict[str, Any], layers: int) -> str:
    if not side["fits"]:
        return side["note"]
    u, lo, hi = side["evicted"]
    parts = [f"admit {side['layers']}/{layers} layers" if side["layers"] < layers else "admit"]
    parts.append(f"evict U{u} L{lo} H{hi}" if u + lo + hi else "evict 0")
    if side["retract"]:
        kept = side["keep"]
        parts.append(
            "retract " + ", ".join(f"r{i}{' (kept)' if kept[n] else ''}" for n, i in enumerate(side["retract"]))
        )
        parts.append(f"recompute {side['lost']}")
    return "; ".join(parts)


def request_text(s: State) -> str:
    cls = "high" if s.priority >= THRESHOLD else "low"
    run = " ".join(
        f"r{r.id}:{'H' if r.priority >= THRESHOLD else 'L'}{r.kv}" + (f"+{r.reserve}" if r.reserve else "")
        for r in s.running
    )
    text = f"{cls} {s.tokens} | free {s.free} U{s.unused} L{s.low} H{s.high} host {s.host_free}"
    if run:
        text += f" | {run}"
    if s.slot_reclaim:
        text += f" | slots short {s.slot_reclaim}"
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per state instead of the table")
    parser.add_argument("--state", action="append", help="only this state (repeatable)")
    args = parser.parse_args(argv)
    states = [s for s in STATES if not args.state or s.name in args.state]
    if args.state and len(states) != len(set(args.state)):
        parser.error(f"unknown state; known: {', '.join(s.name for s in STATES)}")
    fork = load_fork()
    rows = [compare(s, fork) for s in states]
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return 0

    from rich.console import Console
    from rich.table import Table

    table = Table(title="§11.5 plan (kvcert.spec.admission) vs the RefAware fork's PrefillAdder", show_lines=True)
    for col in ("state", "request | room | running (id:class kv+reserve)", "kvcert", "fork", "differences"):
        table.add_column(col, overflow="fold")
    for s, row in zip(states, rows):
        table.add_row(
            s.name,
            request_text(s),
            describe(row["kvcert"], s.layers),
            describe(row["fork"], s.layers) + ("" if not row["fork"]["fits"] else f" ({row['fork']['note']})"),
            ", ".join(row["differences"]) or "agree",
        )
    console = Console(width=160)
    console.print(table)
    agree = sum(1 for row in rows if not row["differences"])
    console.print(f"{len(rows)} states: {agree} agree, {len(rows) - agree} differ")
    counts: dict[str, int] = {}
    for row in rows:
        for tag in row["differences"]:
            counts[tag] = counts.get(tag, 0) + 1
    for tag, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        console.print(f"  {tag}: {n}  ({TAGS[tag]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
