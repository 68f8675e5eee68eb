# Over 600 lines: one walk target, its world (the linker, its pools, the stand-in core) and the scheduler calls and checks of every op.
"""The seed's KVCR direct linker (SGLang PR #39946, `KVCRDirectLinker`) through its own API, judged by the linker side of
SPEC.md §14 (`kvcert.spec.linker.LinkerSide`, INV-LINK-8..14).

    scripts/install_kvcr.sh
    .venv-kvcr/bin/kvcert certify kvcert.conformance.adapters.kvcr.linker:factory

The linker is the PR's, unmodified, built as the PR's own test `Harness` builds it: over CPU `DevicePoolGroup`s (a KV
pool, K and V, two layers, page size 2), `resolve_hybrid_device_pool_group` patched to return them, `_nixl_probe`
given. Its KVCR core is kvcert's stand-in (`kvcr._core`, through the linker's `_kvcr_factory`), moving real bytes
between the device tensors and the DRAM the linker carved for it.

The walk makes the calls SGLang's PR scheduler and wrapper make: `prepare_request` (with or without a router hint) and
`preparation_ready`, `lookup`, `load`, `start_layer_wise_loading` and the forward's `layer_done_counter.wait_until`,
`num_completed_loads`/`pop_completed_load`, `offload` and `num_completed_offloads`/`pop_completed_offload`,
`release_request`/`finish_request`, `take_removed_page_hashes`, `reset` (the scheduler idle) and `close`, and
`snapshot_stats`; between them the core's faults (operations held late or stuck, failed objects, evictions, a peer
losing a page) and time. The owner thread's loop (`KVCRAdapter._run`, the PR's own) runs on the walk's thread
when time passes, on a virtual clock, so every walk replays exactly.
"""


from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from kvcert.conformance.adapters.kvcr import _core as core
from kvcert.conformance.adapters.kvcr import env as env
from kvcert.conformance.backend import WalkCell, WalkFailure, unexercised
from kvcert.spec.invariants import Violation
from kvcert.spec.linker import LinkerSide
from kvcert.spec.types import Capabilities

__all__ = ["KvcrTarget", "KvcrWalk", "factory"]

PAGE, LAYERS, ROW_BYTES = 2, 2, 8
DEVICE_PAGES = 24
CHAINS, CHAIN_PAGES = 2, 6
REQUESTS = 3
CAPACITY = 8
"""Objects the core's DRAM holds: fewer than the walk's pages, so deposits evict."""
CONFIG = {
    "pin_local_dram": False,
    "preparation_deadline_ms": 50,
    "operation_timeout_ms": 200,
    "abandon_timeout_ms": 400,
    "poll_interval_ms": 0.2,
    "fetch_chunk_pages": 2,
    "stats_log_interval_s": 1e9,
}
LIVE, DEAD = "tcp://127.0.0.1:31001", "tcp://127.0.0.1:31002"
HANG_S = 1.0
"""Virtual seconds the forward waits on a load batch before calling it a hang (five operation timeouts)."""
TIER = "external (KVCR direct linker)"


def page_hash(chain: int, i: int) -> str:
    return hashlib.sha256(f"kvcert-kvcr/{chain}/{i}".encode()).hexdigest()


def span_bytes(page: str, comp: int, layer: int) -> bytes:
    """The true KV of one page's rows in one (component, layer) buffer."""
    return hashlib.blake2b(f"{page}/{comp}/{layer}".encode(), digest_size=PAGE * ROW_BYTES).digest()


def object_bytes(page: str) -> bytes:
    return b"".join(span_bytes(page, c, layer) for c in range(2) for layer in range(LAYERS))


class _Stepped:
    """Mixin over the PR's `KVCRAdapter`: no thread; `pump` runs its own `_run` loop for one iteration."""

    _STOP: Any = None

    def start(self) -> None:  # the walk runs the loop
        return None

    def stop(self, timeout_s: float) -> bool:
        self._commands.put(self._STOP)  # type: ignore[attr-defined]
        self._run()  # type: ignore[attr-defined]
        return True

    def pump(self) -> None:
        if not getattr(self, "_pumping", False):
            self._pumping = True
            self.add_ticker(lambda now: self._commands.put(self._STOP))  # type: ignore[attr-defined]
        self._run()  # type: ignore[attr-defined]


@dataclass
class _Req:
    rid: str
    pages: list[str]
    handle: Any
    request_id: str
    prepared_at: float
    lookup: Optional[tuple[list[str], list[int]]] = None
    load: str = ""
    """"" none, "queued", "started", "done", "failed"."""
    dest: list[int] = field(default_factory=list)


class KvcrTarget:
    """One fresh linker over its CPU pools, its stand-in core's world, and the device pages the walk uses."""

    def __init__(self, cell: WalkCell) -> None:
        import json
        import logging
        import time as real_time
        from unittest import mock

        import torch

        mod = env.import_linker()
        logging.getLogger("sglang.srt.mem_cache.storage.kvcr").setLevel(logging.CRITICAL)  # faults are the walk's
        core.install_stub_modules()
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import DevicePoolEntry, DevicePoolGroup
        from sglang.srt.mem_cache.storage.kvcr import kvcr_adapter
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        self.torch, self.PoolName = torch, PoolName
        self.hint = bool(cell.param("hint", 0))
        self.world = core.World(content=lambda key, n: object_bytes(key.decode().split("#", 1)[0])[:n])
        self.world.peers = {
            LIVE: core.Peer(LIVE, True, {int(page_hash(c, i)[:16], 16) for c in range(CHAINS) for i in range(CHAIN_PAGES)}),
            DEAD: core.Peer(DEAD, False),
        }
        # virtual time for the linker and its owner loop; a sleep in the linker (reset's drain) lets time pass
        mod.time = SimpleNamespace(monotonic=lambda: self.world.now, perf_counter=real_time.perf_counter, sleep=self._sleep)  # type: ignore[attr-defined]
        kvcr_adapter.time = SimpleNamespace(monotonic=lambda: self.world.now, sleep=lambda s: None)
        stepped = type("SteppedKVCRAdapter", (_Stepped, kvcr_adapter.KVCRAdapter), {"_STOP": kvcr_adapter._STOP})
        mod.KVCRAdapter = stepped  # type: ignore[attr-defined]

        extra = {**CONFIG, "local_dram_bytes_per_worker": CAPACITY * 2 * LAYERS * PAGE * ROW_BYTES, "policy": cell.policy}
        if self.hint:
            extra.update(enable_remote_hint=True, control_port=31000, control_advertise_host="127.0.0.1")
        set_global_server_args_for_scheduler(ServerArgs(
            model_path="dummy", page_size=PAGE, enable_unified_cache_external_linker=True,
            unified_cache_external_linker_backend="kvcr", hicache_storage_backend_extra_config=json.dumps(extra)))  # fmt: skip
        rows = DEVICE_PAGES * PAGE
        self.buffers = [[torch.zeros(rows, ROW_BYTES, dtype=torch.uint8) for _ in range(LAYERS)] for _ in range(2)]
        group = DevicePoolGroup([DevicePoolEntry(
            name=PoolName.KV, indices_from_pool=PoolName.KV, device_pool=None, components=self.buffers,
            layer_mapping={i: i for i in range(LAYERS)}, page_size=PAGE, rows_are_pages=False)], LAYERS, PAGE)  # fmt: skip
        params = SimpleNamespace(
            page_size=PAGE, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: None),
            attn_tp_cache_group=None, tp_cache_group=None, attn_cp_rank=0, attn_cp_size=1, pp_rank=0, pp_size=1,
            is_eagle=False, mtp_draft_device_pools=())  # fmt: skip
        self.cores: list[core.StandInCore] = []

        def make_core(config: Any, bindings: Any, backend: Any) -> core.StandInCore:
            self.cores.append(core.StandInCore(config, bindings, backend, self.world))
            return self.cores[-1]

        with mock.patch.object(mod, "resolve_hybrid_device_pool_group", return_value=group):
            self.linker = mod.KVCRDirectLinker(None, params, components=set(), _kvcr_factory=make_core,
                                               _nixl_probe=lambda backend: {"DRAM_SEG", "VRAM_SEG"})  # fmt: skip
        self.linker._gc_frozen = True  # gc.freeze() once per walk would keep every earlier walk's cycles alive
        self.free = list(range(DEVICE_PAGES))

    @property
    def core(self) -> core.StandInCore:
        return self.cores[-1]

    def key(self, page: str) -> bytes:
        return f"{page}#kvcr-linker-v1#{self.linker.digest}#kv".encode()

    def _sleep(self, dt: float) -> None:
        self.world.advance(dt)
        self.linker._adapter.pump()

    def pump(self) -> None:
        """The owner loop until nothing is left for it (posted commands, completions)."""
        for _ in range(64):
            self.linker._adapter.pump()
            if self.linker._adapter._commands.empty() and not self.core.completed:
                return

    def indices(self, pages: Sequence[int]) -> Any:
        return self.torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=self.torch.int64)

    def write(self, dev: int, page: str) -> None:
        for c in range(2):
            for layer in range(LAYERS):
                data = self.torch.frombuffer(bytearray(span_bytes(page, c, layer)), dtype=self.torch.uint8)
                self.buffers[c][layer][dev * PAGE : (dev + 1) * PAGE] = data.reshape(PAGE, ROW_BYTES)

    def holds(self, dev: int, page: str) -> bool:
        got = b"".join(bytes(self.buffers[c][layer][dev * PAGE : (dev + 1) * PAGE].flatten().tolist())
                       for c in range(2) for layer in range(LAYERS))  # fmt: skip
        return got == object_bytes(page)

    def transfer(self, pages: Sequence[str], dev: Optional[Sequence[int]] = None) -> list[Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        idx = self.indices(dev) if dev is not None else None
        return [PoolTransfer(name=self.PoolName.KV, device_indices=idx, keys=list(pages))]


@dataclass
class _Run:
    t: KvcrTarget
    side: LinkerSide
    seen: Counter[str]
    reqs: dict[int, _Req] = field(default_factory=dict)
    offloads: list[list[int]] = field(default_factory=list)
    """Device pages of each accepted offload whose result is not taken, in queue order."""
    batch: Optional[tuple[int, list[int], int]] = None
    """The started load batch not yet forwarded: (counter index, request slots, deliver ops seen before it)."""
    fed: tuple[int, int, int] = (0, 0, 0)
    """How much of the current core's submissions, completions and the world's evictions the side has seen."""
    evicted_seen: int = 0
    attempts: int = 0
    pumped_at: float = -1.0


class KvcrWalk:
    """Blind ops over three request slots, two chains of six pages and the core's faults; an op the state makes
    inapplicable (a lookup before a prepare, a load with nothing reported, a reset with requests open) is skipped,
    as the scheduler never sends it."""

    def cells(self, capabilities: Capabilities) -> list[WalkCell]:
        return [WalkCell(p, PAGE, (("hint", h),), tier=TIER) for p in capabilities.policies for h in (0, 1)]

    def generate(self, rng: random.Random, cell: WalkCell, steps: int) -> list[dict[str, Any]]:
        """Each request slot follows the scheduler's story (prepare, time, ready, lookup, load, start, time, forward,
        finish) one op at a time, interleaved with blind ops: offloads, polls, time, the core's faults, resets."""
        hint = bool(cell.param("hint", 0))

        def story(r: int) -> list[dict[str, Any]]:
            return [
                {"op": "prepare", "req": r, "chain": rng.randrange(CHAINS), "n": rng.randint(1, CHAIN_PAGES),
                 "hint": rng.choice([-1, 0, 0, 1]) if hint else -1},
                {"op": "tick", "ms": rng.choice([1, 2, 5, 80])},
                {"op": "ready", "req": r},
                {"op": "lookup", "req": r, "skip": rng.choice([0, 0, 0, 1])},
                {"op": "load", "req": r},
                {"op": "start"},
                {"op": "tick", "ms": rng.choice([1, 2, 5])},
                {"op": "forward"},
                {"op": "finish", "req": r, "how": rng.choice(["release", "finish"])},
            ]  # fmt: skip

        table: list[tuple[float, Callable[[], dict[str, Any]]]] = [
            (10, lambda: {"op": "offload", "chain": rng.randrange(CHAINS), "n": rng.randint(1, CHAIN_PAGES)}),
            (6, lambda: {"op": "poll"}),
            (2, lambda: {"op": "removed"}),
            (10, lambda: {"op": "tick", "ms": rng.choice([1, 1, 2, 5, 30, 80, 250, 500])}),
            (6, lambda: {"op": "fault", "kind": rng.choice(["hold", "stuck", "fail"]),
                         "what": rng.choice(["fetch", "deposit", "deliver"])}),  # fmt: skip
            (2, lambda: {"op": "unhold"}),
            (3, lambda: {"op": "evict"}),
            (5, lambda: {"op": "reset"}),
            (3, lambda: {"op": "finish", "req": rng.randrange(REQUESTS), "how": rng.choice(["release", "finish"])}),
        ]
        if hint:
            table.append((2, lambda: {"op": "peer_drop", "chain": rng.randrange(CHAINS), "i": rng.randrange(CHAIN_PAGES)}))
        weights = [w for w, _ in table]
        stories: dict[int, list[dict[str, Any]]] = {}
        out: list[dict[str, Any]] = []
        while len(out) < steps:
            if rng.random() < 0.55:
                r = rng.randrange(REQUESTS)
                if not stories.get(r):
                    stories[r] = story(r)
                out.append(stories[r].pop(0))
            else:
                out.append(rng.choices(table, weights)[0][1]())
        return out

    def replay(
        self, factory: Callable[[WalkCell], Any], cell: WalkCell, ops: Sequence[dict[str, Any]]
    ) -> tuple[Optional[WalkFailure], Counter[str]]:
        t: KvcrTarget = factory(cell)
        run = _Run(t, LinkerSide(), Counter())
        step, op = len(ops), {"op": "close"}
        try:
            for step, op in enumerate([*ops, {"op": "close"}]):
                found = self._apply(run, op)
                if found is None:
                    run.seen["skipped"] += 1
                    continue
                run.seen[f"op:{op['op']}"] += 1
                self._feed(run)
                found += run.side.found
                if found:
                    return WalkFailure(step, op, found), run.seen
        except Exception as err:  # out of the linker's code: the scheduler, and the engine with it, exits
            return WalkFailure(step, op, [Violation("INV-ERR-3", f"the linker raised {type(err).__name__}: {err}")]), run.seen
        return None, run.seen

    # ------------------------------------------------------------------ the calls

    def _apply(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        kind = op["op"]
        handler = getattr(self, f"_{kind}", None)
        if handler is None:
            raise ValueError(f"unknown op {kind!r}")
        return handler(run, op)  # type: ignore[no-any-return]

    def _prepare(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LinkerRequestContext

        t, slot = run.t, op["req"]
        old = run.reqs.get(slot)
        if old is not None and old.load:
            return None
        run.attempts += 1
        rid = old.rid if old is not None else f"r{slot}.{run.attempts}"
        pages = [page_hash(op["chain"], i) for i in range(op["n"])]
        handle = CacheRequestHandle(rid=rid, attempt_id=run.attempts)
        hint = None
        if op["hint"] >= 0:
            hint = {"protocol_version": "0.1", "message_id": "m", "actions": [{
                "action_id": "a", "action_type": "kv.fetch", "action_version": "1.0",
                "payload": {"source_control_endpoint": (LIVE, DEAD)[op["hint"]],
                            "block_hashes": [int(p[:16], 16) for p in pages]}}]}  # fmt: skip
            run.seen["prepare:hinted-" + ("live" if op["hint"] == 0 else "dead")] += 1
        run.seen["prepare:supersedes"] += old is not None
        t.linker.prepare_request(LinkerRequestContext(request=handle, router_hint=hint), t.transfer(pages))
        gen = t.linker._generation
        run.reqs[slot] = _Req(rid, pages, handle, f"{rid}#{run.attempts}#{gen}", t.world.now)
        return []

    def _ready(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        r = run.reqs.get(op["req"])
        if r is None or r.load:
            return None
        ready = run.t.linker.preparation_ready(r.handle)
        run.seen[f"ready:{bool(ready)}"] += 1
        late = run.pumped_at - r.prepared_at > CONFIG["preparation_deadline_ms"] / 1000.0 + 0.002
        if not ready and late:
            run.side.hung(f"request {r.rid}'s preparation, {1000 * (run.t.world.now - r.prepared_at):.0f} ms past its "
                          "prepare with a deadline of 50 ms,")  # fmt: skip
        return []

    def _lookup(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        t, r = run.t, run.reqs.get(op["req"])
        if r is None or r.load or op["skip"] >= len(r.pages):
            return None
        asked = r.pages[op["skip"] :]
        got = [int(n) for n in t.linker.lookup(r.rid, t.transfer(asked))]
        run.seen["lookup:hit" if got else "lookup:miss"] += 1
        run.seen["lookup:realigned"] += bool(got) and op["skip"] > 0
        confirmed = 0
        for page in asked:
            key = t.key(page)
            if not (t.core.resident(key) and r.request_id in t.core.claimed_by(key) and t.core.read(key) == object_bytes(page)):
                break
            confirmed += 1
        run.seen["lookup:short-of-asked"] += bool(got) and max(got) < len(asked)
        run.side.lookup(r.rid, len(asked), got, confirmed)
        r.lookup = (asked, got)
        return []

    def _load(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        t, r = run.t, run.reqs.get(op["req"])
        if r is None or r.load or not r.lookup or not r.lookup[1] or len(t.free) < max(r.lookup[1]):
            return None
        pages = r.lookup[0][: max(r.lookup[1])]
        r.dest, t.free = t.free[: len(pages)], t.free[len(pages) :]
        for dev in r.dest:  # the slots hold garbage until the load lands
            t.write(dev, "garbage")
        assert t.linker.load(r.rid, t.transfer(pages, r.dest))
        r.load, r.lookup, r.pages = "queued", None, pages
        return []

    def _start(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if run.batch is not None:
            return None  # the scheduler forwards a batch before it starts the next
        index = run.t.linker.start_layer_wise_loading()
        slots = [s for s, r in run.reqs.items() if r.load == "queued"]
        if index < 0 and not slots:
            return None
        for s in slots:
            run.reqs[s].load = "started"
        run.batch = (index, slots, sum(1 for kind, _, _ in run.t.core.submissions if kind == "deliver"))
        return [] if index >= 0 else [Violation("INV-LINK-10", f"start_layer_wise_loading starts no batch with "
                                                f"{len(slots)} loads queued: they never land")]  # fmt: skip

    def _forward(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        t = run.t
        if run.batch is None:
            return None
        index, slots, before = run.batch
        run.batch = None
        counter = t.linker.layer_done_counter
        counter.set_consumer(index)
        waited = 0.0
        while not all(f.done() for f in counter.futures.get(index, [])):
            if waited > HANG_S:
                run.side.hung(f"load batch {index}")
                return []
            t.world.advance(0.005)
            waited += 0.005
            t.pump()
            run.pumped_at = t.world.now
        completed = True
        for layer in range(LAYERS):
            try:
                counter.wait_until(layer)
            except RuntimeError:
                completed = False
        t.pump()
        delivers = [op_id for kind, op_id, _ in t.core.submissions if kind == "deliver"][before:]
        failed = sum(1 for kind, op_id, res in t.core.log if kind == "deliver" and op_id in delivers
                     for ok in res.values() if not ok)  # fmt: skip
        wrong = [p for s in slots for dev, p in zip(run.reqs[s].dest, run.reqs[s].pages) if not t.holds(dev, p)]
        run.seen["load:landed" if completed else "load:failed"] += 1
        run.seen["load:late"] += waited > 0.05
        run.side.load(index, completed, failed, wrong)
        published = [t.linker.pop_completed_load() for _ in range(t.linker.num_completed_loads())]
        want = sorted(run.reqs[s].rid for s in slots)
        if [sorted(p) for p in published] != [want]:
            return [Violation("INV-LINK-10", f"load batch {index} of {want} is published as {published}")]
        for s in slots:
            run.reqs[s].load = "done" if completed else "failed"
        return []

    def _offload(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        t = run.t
        if len(t.free) < op["n"]:
            return None
        pages = [page_hash(op["chain"], i) for i in range(op["n"])]
        dev, t.free = t.free[: op["n"]], t.free[op["n"] :]
        for d, p in zip(dev, pages):
            t.write(d, p)
        if t.linker.offload(t.transfer(pages, dev)):
            run.offloads.append(dev)
            run.side.offload([t.key(p).decode() for p in pages])
        else:
            run.seen["offload:declined"] += 1
            t.free += dev
        return []

    def _poll(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        t = run.t
        n = t.linker.num_completed_offloads()
        if n > len(run.offloads):
            return [Violation("INV-LINK-9", f"{n} offload results published, {len(run.offloads)} offloads queued")]
        for _ in range(n):
            ok = bool(t.linker.pop_completed_offload())
            run.seen["offload:stored" if ok else "offload:failed"] += 1
            run.side.published(ok)
            t.free += run.offloads.pop(0)
        return []

    def _finish(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        r = run.reqs.get(op["req"])
        if r is None or r.load in ("queued", "started"):
            return None  # the scheduler keeps a request whose load is in flight (cancel_queued_load refuses)
        getattr(run.t.linker, f"{op['how']}_request")(r.rid)
        run.t.free += r.dest
        del run.reqs[op["req"]]
        return []

    def _removed(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        got = run.t.linker.take_removed_page_hashes()
        run.seen["removed:hashes"] += len(got)
        run.side.taken_removed([h & ((1 << 64) - 1) for h in got])
        return []

    def _tick(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        t = run.t
        t.world.advance(op["ms"] / 1000.0)
        t.pump()
        run.pumped_at = t.world.now
        self._feed(run)
        return self._settled(run)

    def _fault(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        table = {"fail": run.t.world.fail, "hold": run.t.world.hold, "stuck": run.t.world.stuck}[op["kind"]]
        table[op["what"]] = table.get(op["what"], 0) + 1
        return []

    def _unhold(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        run.seen["late:released"] += sum(c.release_held() for c in run.t.cores)
        return []

    def _evict(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        linker = run.t.linker
        fetching = any(p.state == "fetching" for p in linker._preparations.values())
        if run.t.core.evict_one() is None:
            return None
        run.seen["evict:between-prepare-and-fetch"] += fetching
        return []

    def _peer_drop(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        run.t.world.peers[LIVE].pages.discard(int(page_hash(op["chain"], op["i"])[:16], 16))
        return []

    def _reset(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        if run.reqs or run.batch is not None:
            return None  # SGLang flushes only an idle scheduler
        return self._lifecycle(run, "reset")

    def _close(self, run: _Run, op: dict[str, Any]) -> Optional[list[Violation]]:
        for slot in list(run.reqs):  # the scheduler's requests end first
            if run.reqs[slot].load not in ("queued", "started"):
                run.t.linker.finish_request(run.reqs.pop(slot).rid)
        return self._lifecycle(run, "close")

    def _lifecycle(self, run: _Run, what: str) -> list[Violation]:
        t = run.t
        old = t.core
        in_flight_before = old.held_ops()
        getattr(t.linker, what)()
        self._feed(run)  # what the old core was handed while it stopped belongs to what the reset drops
        in_flight = old.held_ops()
        quarantined = any(q[0] is old for q in t.linker._quarantine)
        run.seen[f"{what}:quarantined" if quarantined else f"{what}:quiescent"] += 1
        run.seen[f"{what}:in-flight"] += bool(in_flight_before)
        dram = t.linker._local_dram
        lo, hi = dram.data_ptr(), dram.data_ptr() + dram.numel()
        shared = what == "reset" and any(
            q[1].data_ptr() < hi and lo < q[1].data_ptr() + q[1].numel() for q in t.linker._quarantine
        )
        run.side.reset(in_flight, old.closed, quarantined, shared)
        found: list[Violation] = []
        if what == "reset":
            run.offloads.clear()
            t.free = list(range(DEVICE_PAGES))
            run.fed = (0, 0, run.fed[2])
            left = (t.linker.num_completed_offloads(), t.linker.num_completed_loads())
            if any(left):
                found.append(Violation("INV-LINK-14", f"after a reset the linker still publishes {left[0]} offload "
                                       f"results and {left[1]} loads queued before it"))  # fmt: skip
            stats = t.linker.snapshot_stats()
            if stats["outstanding_claims"] or stats["prepare_inflight_bytes"] or stats["offload_inflight_bytes"]:
                found.append(Violation("INV-LINK-14", f"after a reset the linker still accounts claims or bytes: {stats}"))
        elif not quarantined:
            stray = sorted(old.claims)
            run.side.stray_claims([f"claim {h} on {old.claims[h][1]}" for h in stray])
        return found

    # ------------------------------------------------------------------ after every op

    def _feed(self, run: _Run) -> None:
        """The store's facts since the last op, into the side's ledger."""
        t, (subs, logs, evs) = run.t, run.fed
        for kind, op_id, keys in t.core.submissions[subs:]:
            if kind == "deposit":
                run.side.submitted(op_id, [k.decode() for k in keys])
        for kind, op_id, res in t.core.log[logs:]:
            if kind == "deposit":
                run.side.stored(op_id, {k.decode(): ok for k, ok in res.items()})
        evicted = t.world.evictions[evs:]
        run.side.evicted([int(k.decode()[:16], 16) for keys in evicted for k in keys])
        run.seen["evicted"] += len(evicted)
        run.fed = (len(t.core.submissions), len(t.core.log), len(t.world.evictions))

    def _settled(self, run: _Run) -> list[Violation]:
        """After the owner loop ran dry: every claim owned, and an idle linker holds nothing (INV-LINK-12)."""
        t = run.t
        live = {r.request_id for r in run.reqs.values() if r.load in ("", "queued", "started")}
        stray = [f"claim {h} on {rid}" for h, (key, rid) in t.core.claims.items()
                 if t.core.claim_op_done(h) and rid not in live]  # fmt: skip
        run.side.stray_claims(stray)
        if not run.reqs and run.batch is None and not t.core.held_ops():
            run.seen["idle"] += 1
            run.side.idle(t.linker.snapshot_stats(), len(t.core.claims))
        if t.linker.snapshot_stats().get("late_completions", 0):
            run.seen["late:drained"] += 1
        return []

    # ------------------------------------------------------------------ what the certificate does not cover

    def gaps(self, capabilities: Capabilities, exercised: Counter[str]) -> list[str]:
        return [
            "KVCR itself: the core is kvcert's stand-in (_kvcr_core), written from what the linker expects of it "
            "(query, fetch with claims, deposit, deliver, release, capacity eviction, operation timeouts); the real "
            "core's residency and claim semantics, NIXL and its memory registration are not run",
            "SGLang's scheduler and UnifiedCacheLinkerWrapper around the linker (the PR's are not packaged, 0.5.23's "
            "cannot drive it): the walk makes their calls; the cache side of §14 (INV-LINK-1..7) is not judged here",
            "the owner thread's concurrency: its loop (the PR's own KVCRAdapter._run) runs on the walk's thread when "
            "time passes, so races between it and the scheduler thread are not explored",
            "SWA and other trailing-window pools, speculative draft pools, several ranks, and GPU streams/events",
        ] + unexercised(
            exercised,
            (
                ("a hit (a lookup that reported pages)", "lookup:hit"),
                ("a load that landed", "load:landed"),
                ("a failed load", "load:failed"),
                ("an offload that failed", "offload:failed"),
                ("a capacity eviction", "evicted"),
                ("an eviction between prepare and fetch", "evict:between-prepare-and-fetch"),
                ("a reset that quarantined a core", "reset:quarantined"),
                ("a reset that closed a quiescent core", "reset:quiescent"),
                ("a late completion drained", "late:drained"),
                ("an idle check", "idle"),
            )
            + ((("a live peer's hint", "prepare:hinted-live"), ("a dead peer's hint", "prepare:hinted-dead"))
               if any(c.param("hint", 0) for c in self.cells(capabilities)) else ()),  # fmt: skip
        )


def factory(cell: WalkCell) -> KvcrTarget:
    return KvcrTarget(cell)


factory.walk = KvcrWalk()  # type: ignore[attr-defined]
factory.capabilities = Capabilities(  # type: ignore[attr-defined]
    name="sglang 0.5.23 + PR #39946 KVCRDirectLinker (direct linker, API level, stand-in KVCR core)",
    policies=("lru", "fifo"),
    kind="linker",
    profile="core",
    notes=(
        "KVCRDirectLinker built as the PR's test Harness builds it: CPU DevicePoolGroup (KV pool, K and V, 2 layers, "
        f"page size {PAGE}, {DEVICE_PAGES} device pages), _nixl_probe given, its KVCR core kvcert's stand-in through "
        f"_kvcr_factory with DRAM for {CAPACITY} pages; policy lru|fifo; remote hints off and on (a live and a dead peer)",
        "calls as SGLang's PR scheduler and wrapper make them: prepare_request, preparation_ready, lookup, load, "
        "start_layer_wise_loading, layer_done_counter.wait_until, pop_completed_load, offload, pop_completed_offload, "
        "release_request/finish_request, take_removed_page_hashes, reset (scheduler idle), close, snapshot_stats",
        "the core's faults on the trace's cue: an operation held (completes when released or fails at the operation "
        "timeout), stuck (past the reset's drain), a failed object (a torn deliver), an eviction, a peer losing a page",
        "time is virtual: preparation deadline 50 ms, operation timeout 200 ms; the owner loop runs when time passes",
    ),
    deviations=(
        "the linker's owner thread is not started: KVCRAdapter.start is a no-op and the walk runs the adapter's own "
        "_run loop one iteration at a time (stop runs it to the stop marker); time.monotonic and time.sleep in the "
        "linker and adapter modules are the walk's virtual clock",
        "gc.freeze() is skipped (_gc_frozen set): frozen walks would keep each other's garbage",
    ),
)
