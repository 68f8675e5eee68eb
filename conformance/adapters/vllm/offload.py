"""vLLM 0.32's CPU offloading manager at its API: a host tier (`CPUOffloadingManager`, under its "lru" and "arc"
cache policies) judged by the offload contract (`kvcert.spec.offload`).

    .venv-vllm/bin/kvcert certify kvcert.conformance.adapters.vllm.offload:factory

The walk composes the manager's calls as vLLM's `OffloadingConnector` scheduler side makes them: a request opens
with `on_new_request` and ends with `on_request_finished` (no store or load of it after); `lookup` of a key;
`prepare_store` of a few distinct keys, whose copy stays in flight (a store job) until a later `complete_store` of
the keys it took, with success or not; `prepare_load` of keys that are HIT, in flight (a load job) until
`complete_load`; `touch`; `take_events`; `reset_cache` with copies in flight, whose jobs are then dropped, never
completed, as the connector drops them (`_stale_job_threshold`). The harness plays the copy engine: a store writes
each key's KV (`offload.content`) into the chunks its spec names, a failed one leaves torn bytes there, and a load
reads its spec's chunks back when it is prepared and when it completes. After every call it asks `lookup` of every
key and `get_stats` for the pool's occupancy. Each store's victims are the profile's: least recently used first under
lru (INV-OFF-LRU-1), ARC's T1/T2 choice under arc (INV-OFF-ARC-1, the model's `ArcLists`).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.conformance.adapters.vllm import env as _env
from kvcert.conformance.backend import WalkCell, WalkFailure, unexercised
from kvcert.spec import offload as off
from kvcert.spec.invariants import Violation
from kvcert.spec.types import Capabilities

__all__ = ["OffloadTarget", "OffloadWalk", "factory"]

NUM_CHUNKS = 8
"""Host chunks in a cell's pool: small, so stores evict."""
KEYS = 16
"""Keys the walk draws from (about twice the pool, so keys collide and stores evict)."""
GROUPS = 2
"""KV-cache groups: key k is block hash k in group k % GROUPS."""
REQUESTS = 3
"""Request slots: a slot holds one open request at a time."""
TIER = "host (CPU offload)"


@dataclass
class _Job:
    """A copy in flight: the keys a store took, or a load pinned, and the chunks its spec named."""

    id: int
    req: str
    ctx: Any
    keys: list[int]
    chunks: list[int] = field(default_factory=list)


class OffloadTarget:
    """One fresh `CPUOffloadingManager`, its keys, its requests' contexts, and the host chunks the harness's copy
    engine writes (`kv`)."""

    def __init__(self, cell: WalkCell) -> None:
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.num_chunks = int(cell.param("num_chunks", NUM_CHUNKS))
        self.threshold = int(cell.param("store_threshold", 1))
        self.manager = CPUOffloadingManager(
            self.num_chunks,
            cache_policy=cell.policy,
            enable_events=True,
            store_threshold=self.threshold,
            max_tracker_size=int(cell.param("max_tracker_size", 64_000)),
        )
        self.keys = [make_offload_key(hashlib.sha256(f"block-{k}".encode()).digest(), k % GROUPS) for k in range(KEYS)]
        self.key_of = {key: k for k, key in enumerate(self.keys)}
        self.kv: dict[int, bytes] = {}
        """The host buffer, chunk by chunk, as the copy engine left it."""
        self.opened = 0
        self.probe = self.context(-1)[1]
        """The context the harness's own lookups after every call carry (lookup reads no request state)."""

    def context(self, slot: int) -> tuple[str, Any]:
        from vllm.v1.kv_offload.base import ReqContext

        self.opened += 1
        req = f"req-{slot}-{self.opened}"
        return req, ReqContext(req)

    def lookup(self, k: int, ctx: Any) -> str:
        return str(self.manager.lookup(self.keys[k], ctx).name)

    def prepare_store(self, ks: Sequence[int], ctx: Any) -> Optional[off.StoreOutcome]:
        out = self.manager.prepare_store([self.keys[k] for k in ks], ctx)
        if out is None:
            return None
        return off.StoreOutcome(
            tuple(self.key_of[key] for key in out.keys_to_store),
            tuple(int(c) for c in out.store_spec.block_ids),
            tuple(self.key_of[key] for key in out.evicted_keys),
        )

    def prepare_load(self, ks: Sequence[int], ctx: Any) -> list[int]:
        return [int(c) for c in self.manager.prepare_load([self.keys[k] for k in ks], ctx).block_ids]

    def events(self) -> list[off.Event]:
        """The manager's events as the model's; an unknown key, or an event not on the CPU medium, reads as key -1
        (which the model never owes)."""
        out: list[off.Event] = []
        for ev in self.manager.take_events():
            keys = tuple(self.key_of.get(key, -1) for key in ev.keys) if ev.medium.value == "CPU" else (-1,)
            out.append((bool(ev.removed), keys))
        return out

    def usage(self) -> tuple[int, int, int]:
        """(chunks in use, chunks being written, stores skipped) from `get_stats`, the gauges in chunks."""
        stats = self.manager.get_stats()
        got = stats.reduce() if stats is not None else {}
        used = got.get("vllm:kv_offload_cpu_cache_usage_perc", 0.0) * self.num_chunks
        writing = got.get("vllm:kv_offload_cpu_cache_write_usage_perc", 0.0) * self.num_chunks
        return round(used), round(writing), int(got.get("vllm:kv_offload_stores_skipped", 0))


@dataclass
class _Run:
    """One replay's state beside the target: the model, the open requests, the copies in flight."""

    t: OffloadTarget
    model: off.OffloadModel
    seen: Counter[str]
    open: dict[int, tuple[str, Any]] = field(default_factory=dict)
    stores: list[_Job] = field(default_factory=list)
    loads: list[_Job] = field(default_factory=list)
    jobs: int = 0
    held: int = 0
    """New keys the threshold held back in this op (what get_stats must report skipped)."""


class OffloadWalk:
    """The walk: blind ops over three request slots and sixteen keys; an op its state makes inapplicable (a store
    or load by a slot with no open request, a completion with no copy in flight, a load of keys none of which is
    HIT) is skipped, as the connector never sends it. Under arc, half the lookups are touches instead: reuses move
    keys to T2 and ghost hits move the target, so more victims turn on them."""

    def cells(self, capabilities: Capabilities) -> list[WalkCell]:
        base = (("num_chunks", NUM_CHUNKS),)
        out = [WalkCell(p, params=base, tier=TIER) for p in capabilities.policies]
        out += [
            WalkCell(p, params=(*base, ("store_threshold", 2), ("max_tracker_size", 12)), tier=TIER)
            for p in capabilities.policies
        ]
        return out

    def generate(self, rng: random.Random, cell: WalkCell, steps: int) -> list[dict[str, Any]]:
        def keys(most: int) -> list[int]:
            return rng.sample(range(KEYS), rng.randint(1, most))

        reuse = cell.policy == "arc"
        out: list[dict[str, Any]] = [{"op": "on_new_request", "req": r} for r in range(REQUESTS)]
        for _ in range(max(steps - REQUESTS, 0)):
            r, kind = rng.randrange(REQUESTS), rng.random()
            if kind < 0.06:
                out.append({"op": "on_new_request", "req": r})
            elif kind < 0.10:
                out.append({"op": "on_request_finished", "req": r})
            elif reuse and 0.16 <= kind < 0.22:  # arc: half the lookups are touches, reuses that fill T2
                out.append({"op": "touch", "req": r, "keys": keys(4)})
            elif kind < 0.22:
                out.append({"op": "lookup", "req": r, "key": rng.randrange(KEYS)})
            elif kind < 0.46:
                out.append({"op": "prepare_store", "req": r, "keys": keys(4)})
            elif kind < 0.61:
                out.append({"op": "complete_store", "job": rng.randrange(4), "success": rng.random() < 0.8})
            elif kind < 0.75:
                out.append({"op": "prepare_load", "req": r, "keys": keys(4)})
            elif kind < 0.87:
                out.append({"op": "complete_load", "job": rng.randrange(4)})
            elif kind < 0.97:
                out.append({"op": "touch", "req": r, "keys": keys(4)})
            elif kind < 0.995:
                out.append({"op": "take_events"})
            else:
                out.append({"op": "reset_cache"})
        return out

    def replay(
        self, factory: Callable[[WalkCell], Any], cell: WalkCell, ops: Sequence[dict[str, Any]]
    ) -> tuple[Optional[WalkFailure], Counter[str]]:
        t: OffloadTarget = factory(cell)
        model = off.OffloadModel(
            t.num_chunks,
            cell.policy,
            t.threshold,
            int(cell.param("max_tracker_size", 64_000)),
            GROUPS,
        )
        run = _Run(t, model, Counter())
        for step, op in enumerate(ops):
            run.held = 0
            hits = model.arc.hits
            try:
                found = self._apply(run, op)
                if found is not None:
                    found += self._state(run, op)
            except Exception as err:  # out of vLLM's code: the scheduler, and the engine with it, exits
                return WalkFailure(
                    step, op, [Violation("INV-ERR-3", f"vLLM raised {type(err).__name__}: {err}")]
                ), run.seen
            if found is None:
                run.seen["skipped"] += 1
                run.seen[f"skip:{op['op']}"] += 1
                continue
            run.seen[f"op:{op['op']}"] += 1
            if cell.policy == "arc":
                run.seen["arc:ghost-hits"] += model.arc.hits - hits
            if found:
                return WalkFailure(step, op, found), run.seen
        return None, run.seen

    # ------------------------------------------------------------------ the calls, as the connector makes them

    def _apply(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        kind = op["op"]
        if kind == "on_new_request":
            return self._open(run, op["req"])
        if kind == "on_request_finished":
            return self._finish(run, op["req"])
        if kind == "lookup":
            return self._lookup(run, op)
        if kind == "prepare_store":
            return self._store(run, op)
        if kind == "complete_store":
            return self._complete_store(run, op)
        if kind == "prepare_load":
            return self._load(run, op)
        if kind == "complete_load":
            return self._complete_load(run, op)
        if kind == "touch":
            return self._touch(run, op)
        if kind == "take_events":
            want = run.model.take_events()
            got = run.t.events()
            run.seen["events:stored"] += sum(1 for removed, _ in got if not removed)
            run.seen["events:removed"] += sum(1 for removed, _ in got if removed)
            return off.check_events(want, got)
        if kind == "reset_cache":
            return self._reset(run)
        raise ValueError(f"unknown op {kind!r}")

    def _open(self, run: _Run, slot: int) -> Optional[list[Violation]]:
        if slot in run.open:
            return None
        req, ctx = run.t.context(slot)
        run.t.manager.on_new_request(ctx)
        run.model.open(req)
        run.open[slot] = (req, ctx)
        return []

    def _finish(self, run: _Run, slot: int) -> Optional[list[Violation]]:
        if slot not in run.open:
            return None
        req, ctx = run.open.pop(slot)
        run.t.manager.on_request_finished(ctx)
        run.model.finish(req)
        run.seen["finish:copies-in-flight"] += any(j.req == req for j in run.stores + run.loads)
        return []

    def _lookup(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if op["req"] not in run.open:
            return None
        k = op["key"]
        got = run.t.lookup(k, run.open[op["req"]][1])
        run.seen[f"lookup:{got}"] += 1
        run.seen["lookup:after-failed-store"] += k in run.model.failed
        return off.check_lookup(run.model, k, got)

    def _store(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if op["req"] not in run.open:
            return None
        req, ctx = run.open[op["req"]]
        asked = list(op["keys"])
        offer = run.model.offer(req, asked)
        run.held = offer.held
        outcome = run.t.prepare_store(asked, ctx)
        found = off.check_store(run.model, offer, outcome)
        if outcome is None:
            run.seen["store:none"] += 1
            return found
        if outcome.evicted:
            run.seen["evicted"] += len(outcome.evicted)
            run.seen["evict:while-loading"] += bool(run.loads)
            run.seen["evict:while-writing"] += bool(run.stores)
        run.seen["threshold:held"] += offer.held
        # The model takes what the tier reported, legal or not: the checks after the call compare with it.
        if run.model.policy == "arc" and outcome.evicted:
            self._count_arc(run, offer, outcome)
        run.model.apply_store(outcome, req)
        if outcome.stored:
            for k, c in zip(outcome.stored, outcome.chunks):
                run.t.kv[c] = off.content(k)  # the copy engine writes the block into the chunk the spec names
            run.jobs += 1
            run.stores.append(_Job(run.jobs, req, ctx, list(outcome.stored), list(outcome.chunks)))
        return found

    @staticmethod
    def _count_arc(run: _Run, offer: off.Offer, outcome: off.StoreOutcome) -> None:
        """What ARC's choice turned on: victims from T2, and victims its target decided (T1 would have given others)."""
        arc = run.model.arc
        run.seen["arc:t2-victims"] += sum(1 for k in outcome.evicted if k in arc.t2)
        untargeted = off.arc_victims(arc.t1, arc.t2, 0.0, offer.candidates, len(outcome.evicted))
        run.seen["arc:target-decided"] += [k for k, _ in untargeted or ()] != list(outcome.evicted)

    def _complete_store(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if not run.stores:
            return None
        job = run.stores.pop(op["job"] % len(run.stores))
        success = bool(op["success"])
        if not success:
            for c in job.chunks:
                run.t.kv[c] = b"torn:" + run.t.kv.get(c, b"")[:8]  # a failed copy leaves part of a block behind
        run.t.manager.complete_store([run.t.keys[k] for k in job.keys], job.ctx, success=success)
        run.model.complete_store(job.keys, success)
        run.seen["store:ok" if success else "store:failed"] += 1
        return []

    def _load(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if op["req"] not in run.open:
            return None
        req, ctx = run.open[op["req"]]
        ks = [k for k in op["keys"] if run.model.lookup(k) == off.HIT]  # the connector loads only what lookup hit
        if not ks:
            return None
        run.seen["load:shared"] += any(run.model.entries[k].pins > 0 for k in ks)
        run.seen["load:beside-store"] += bool(run.stores)
        want = run.model.prepare_load(req, ks)
        chunks = run.t.prepare_load(ks, ctx)
        found = off.check_kv(ks, chunks, [run.t.kv.get(c) for c in chunks], "prepare_load")
        found += off.check_load(run.model, ks, chunks, want)
        run.seen["kv:reads"] += len(chunks)
        run.jobs += 1
        run.loads.append(_Job(run.jobs, req, ctx, ks, chunks))
        return found

    def _complete_load(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if not run.loads:
            return None
        job = run.loads.pop(op["job"] % len(run.loads))
        found = off.check_kv(job.keys, job.chunks, [run.t.kv.get(c) for c in job.chunks], "complete_load")
        run.seen["kv:reads"] += len(job.chunks)
        run.t.manager.complete_load([run.t.keys[k] for k in job.keys], job.ctx)
        run.model.complete_load(job.keys)
        return found

    def _touch(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if op["req"] not in run.open:
            return None
        run.t.manager.touch([run.t.keys[k] for k in op["keys"]], run.open[op["req"]][1])
        run.model.touch(list(op["keys"]))
        return []

    def _reset(self, run: _Run) -> list[Violation]:
        run.seen["reset:in-flight"] += bool(run.stores or run.loads)
        run.t.manager.reset_cache()
        run.model.reset()
        run.stores.clear()  # the connector drops every job in flight: their completions never reach the manager
        run.loads.clear()
        return []

    # ------------------------------------------------------------------ after every call

    def _state(self, run: _Run, op: dict[str, Any]) -> list[Violation]:
        """Every key's lookup against the model (filed under the rule of the call that should have set it), the
        model's pool, and the tier's own count of it."""
        t, model = run.t, run.model
        found: list[Violation] = []
        for k in range(KEYS):
            got = t.lookup(k, t.probe)
            found += off.check_lookup(model, k, got, self._probe_rule(op, k, got, model))
        found += off.check_capacity(model)
        found += off.check_usage(model, *t.usage(), run.held)
        return found

    @staticmethod
    def _probe_rule(op: dict[str, Any], k: int, got: str, model: off.OffloadModel) -> str:
        if op["op"] == "complete_store":
            return "INV-OFF-7"
        if op["op"] == "prepare_store" and got == off.MISS and k in model.entries:
            return "INV-OFF-3"  # a key gone that the store did not report evicted
        return "INV-OFF-1"

    # ------------------------------------------------------------------ what the certificate does not cover

    def gaps(self, capabilities: Capabilities, exercised: Counter[str]) -> list[str]:
        out = [
            "the OffloadingConnector and its worker: the harness plays the connector's scheduler side (the calls) and "
            "the copy engine (the bytes); no GPU, no CPU tensors, no swap kernels",
            "the TieringManager (secondary tiers, promotions, cascades) and get_load_source: not driven",
            "a store copy still running at reset_cache beside a later store into the same chunk: the connector "
            "flushes its jobs to the workers, and their order on the worker decides; the harness writes at "
            "prepare_store",
            "the events' order against the engine's AllBlocksCleared at a reset (reset_cache removes every key and "
            "announces none; events queued before it are still yielded after it)",
            "ReqContext key positions (set_offload_key_position): never set, so a request's keys finish in first-seen "
            "order, group by group",
            "prepare_store or prepare_load of a key twice in one call, or after on_request_finished: the connector "
            "never sends them (the manager asserts on the second)",
        ]
        if "arc" in capabilities.policies:
            out.append("ARC's lists (T1, T2, B1, B2) and target themselves: not read; compared only through the victims "
                       "they give (INV-OFF-ARC-1)")  # fmt: skip
            out += unexercised(
                exercised,
                (
                    ("ARC victims taken from T2", "arc:t2-victims"),
                    ("an ARC ghost hit (its target moved)", "arc:ghost-hits"),
                    ("ARC victims its target decided", "arc:target-decided"),
                ),
            )
        out += unexercised(
            exercised,
            (
                ("evictions", "evicted"),
                ("an eviction with loads in flight", "evict:while-loading"),
                ("a failed store", "store:failed"),
                ("a lookup while a store is in flight (HIT_PENDING)", "lookup:HIT_PENDING"),
                ("a lookup of a key whose store failed", "lookup:after-failed-store"),
                ("a prepare_store that cannot fit (None)", "store:none"),
                ("a reset with copies in flight", "reset:in-flight"),
                ("a key the store threshold held back", "threshold:held"),
                ("a removed event", "events:removed"),
                ("KV read back from a chunk", "kv:reads"),
            ),
        )
        return out


def factory(cell: WalkCell) -> OffloadTarget:
    return OffloadTarget(cell)


factory.walk = OffloadWalk()  # type: ignore[attr-defined]
factory.capabilities = Capabilities(  # type: ignore[attr-defined]
    name=f"vllm {_env.VLLM_VERSION} CPUOffloadingManager (host tier, API level)",
    policies=("lru", "arc"),
    kind="offload",
    profile="vllm-0.32",
    notes=(
        f"CPUOffloadingManager(num_chunks={NUM_CHUNKS}, cache_policy=lru|arc, enable_events=True), store_threshold 1 "
        "and 2 (max_tracker_size 12): one fresh manager a walk",
        "calls composed as the OffloadingConnector's scheduler side makes them: on_new_request, lookup, prepare_store, "
        "complete_store (success or not), prepare_load of HIT keys, complete_load, touch, on_request_finished, "
        "take_events, reset_cache",
        "copies stay in flight across other calls; reset_cache drops them, never completed (the connector's "
        "_stale_job_threshold)",
        f"{KEYS} keys (sha256 block hashes in {GROUPS} KV-cache groups), {REQUESTS} request slots",
        "the harness is the copy engine: a store writes each key's KV into its spec's chunks, a failed store leaves "
        "torn bytes, a load reads its chunks when prepared and when completed",
        "after every call: lookup of every key, and get_stats' usage gauges",
        "each store's victims against the profile's: LRU's order (INV-OFF-LRU-1), ARC's T1/T2 lists, ghost lists and "
        "target (INV-OFF-ARC-1); under arc half the lookups are touches",
    ),
    deviations=(),
)
