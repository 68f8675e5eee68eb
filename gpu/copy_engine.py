"""Copy engines: how bytes move between the device and host pools.

The cache issues a copy (`submit`) when SPEC.md §9 says a copy is issued, and learns that it
landed only through `finish`, which the cache calls from `complete(copy)` — the harness decides
when. So the engines differ only in *when the bytes move*, never in what the cache observes:

- `DeferredCopyEngine` (CPU, the suite's): records the copy; `finish` moves the bytes. Fully
  deterministic.
- `ThreadedCopyEngine` (CPU, soak runs): a worker thread moves the bytes as soon as the copy is
  submitted; `finish` waits for it. Completion is still reported only through the same ack path.
- `CudaCopyEngine`: copies by plan (`kvcert.gpu.kv.plan_copy`) on a side stream per direction
  (D2H, H2D) that first waits for the forward pass's stream; an event per copy and, for a
  load-back, one per layer (`wait_layer`: a forward pass can run layer `l` once its KV landed).
  Cells are merged into runs contiguous in the host pool: a few runs contiguous on both sides are
  single copies; otherwise one device gather (D2H) or scatter (H2D) through a contiguous device
  buffer and one DMA per host run, straight into / out of the pinned host pool (`dma`); or, for
  runs too short to DMA one by one, one DMA through a pinned staging buffer and one CPU
  scatter / gather (`staged`; a staged D2H's CPU scatter runs in `finish`, after the event).
  Needs `torch.cuda.is_available()`.
- `PlannedCopyEngine`: the CUDA engine's plans run synchronously on CPU pools: certifies the
  plans and dry-runs scripts/gpu_check.py without a GPU.

A pool with no cell matrix (`KVPool.planned` False: an engine's per-layer tensors, such as SGLang's)
cannot be planned over cell rows: both planned engines copy it by its own gather / scatter through one
staging buffer (`_pooled`), a D2H's host scatter still waiting for the copy's event.

A store copy (host to storage) has no tensor work: its ticket carries no job and the cache writes
storage itself once `finish` says the copy did not fail.

Faults (`inject_fault("copy")`) are armed here, in the engine: the next `finish` reports failure
instead of landing; the job is resubmitted (the cache retries it, SPEC.md §10.5). Synchronous
copies (`copy_now`: write-back backups at eviction, retraction) are not `complete`d by anyone and
never consume a fault.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch

from kvcert.gpu.kv import MIN_RUN_BYTES, PLAN_STRATEGIES, CopyPlan, KVPool, PlanGroup, plan_copy


@dataclass
class CopyJob:
    """Bytes of `src_slots` in `src` to `dst_slots` in `dst`."""

    src: KVPool
    src_slots: tuple[int, ...]
    dst: KVPool
    dst_slots: tuple[int, ...]

    def run(self, non_blocking: bool = False) -> None:
        self.dst.copy_from(self.src, self.src_slots, self.dst_slots, non_blocking=non_blocking)


@dataclass
class Ticket:
    """One submitted copy; `job` is None for a store copy (no tensor work)."""

    id: int
    job: Optional[CopyJob]
    done: bool = False
    event: object = field(default=None, repr=False)
    """Engine-specific completion handle (a threading.Event, a torch.cuda.Event)."""
    layer_events: Optional[list[Any]] = field(default=None, repr=False)
    """CUDA load-back: one event per layer, in layer order (`CudaCopyEngine.wait_layer`)."""
    plan: Optional[CopyPlan] = field(default=None, repr=False)
    """How a planned engine moves it (None: not planned)."""
    keep: list[object] = field(default_factory=list, repr=False)
    """Buffers the copy still uses while in flight (indices, staging): released when it lands."""
    post: list[Callable[[], object]] = field(default_factory=list, repr=False)
    """Host work that must wait for the device work (a staged D2H's CPU scatter): run by `finish`."""
    errors: list[BaseException] = field(default_factory=list, repr=False)
    """What the threaded engine's worker raised moving it: re-raised by `finish` on the caller's thread."""


class CopyEngine:
    """Base: numbering, fault arming and the synchronous path."""

    name = "base"

    def __init__(self) -> None:
        self._next = 0
        self.failures = 0

    def _ticket(self, job: Optional[CopyJob]) -> Ticket:
        t = Ticket(self._next, job)
        self._next += 1
        return t

    def arm_failure(self) -> None:
        self.failures += 1

    def submit(self, job: Optional[CopyJob]) -> Ticket:
        raise NotImplementedError

    def _land(self, ticket: Ticket) -> None:
        raise NotImplementedError

    def finish(self, ticket: Ticket) -> bool:
        """Make sure the copy's bytes landed. False: an injected failure hit it (it is resubmitted)."""
        if self.failures:
            self.failures -= 1
            self._retry(ticket)
            return False
        if not ticket.done:
            self._land(ticket)
            ticket.done = True
        return True

    def _retry(self, ticket: Ticket) -> None:
        """A failed copy will be tried again: nothing to do for an engine that has not run it."""

    def copy_now(self, src: KVPool, src_slots: Sequence[int], dst: KVPool, dst_slots: Sequence[int]) -> None:
        """A synchronous copy the caller waits for (never faulted)."""
        CopyJob(src, tuple(src_slots), dst, tuple(dst_slots)).run()

    def drain(self) -> None:
        """Wait until no copy is in motion: every copy submitted so far that moves its bytes on its own
        (a worker thread, a stream) has moved them. Acknowledges nothing; `finish` still must be called.
        Engines that move bytes only in `finish` (deferred) have nothing in motion."""

    def close(self) -> None:
        pass


class DeferredCopyEngine(CopyEngine):
    """Bytes move inside `finish`: the harness's `complete` is the copy."""

    name = "cpu-deferred"

    def submit(self, job: Optional[CopyJob]) -> Ticket:
        return self._ticket(job)

    def _land(self, ticket: Ticket) -> None:
        if ticket.job is not None:
            ticket.job.run()


_Work = Optional[tuple[Optional[CopyJob], threading.Event, list[BaseException]]]


class ThreadedCopyEngine(CopyEngine):
    """A worker thread moves bytes at submit time; `finish` joins the copy (no timeout)."""

    name = "cpu-threaded"

    def __init__(self) -> None:
        super().__init__()
        self._queue: queue.Queue[_Work] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="kvcert-copy", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, done, errors = item
            try:
                if job is not None:
                    job.run()
            except BaseException as err:  # re-raised on the caller's thread by finish / copy_now
                errors.append(err)
            finally:
                done.set()

    def submit(self, job: Optional[CopyJob]) -> Ticket:
        t = self._ticket(job)
        self._enqueue(t)
        return t

    def _enqueue(self, t: Ticket) -> None:
        event = threading.Event()
        t.event = event
        if t.job is None:
            event.set()
        else:
            self._queue.put((t.job, event, t.errors))

    def _join(self, ticket: Ticket) -> None:
        assert isinstance(ticket.event, threading.Event)
        ticket.event.wait()
        if ticket.errors:
            raise ticket.errors[0]

    def _retry(self, ticket: Ticket) -> None:
        self._join(ticket)
        self._enqueue(ticket)

    def _land(self, ticket: Ticket) -> None:
        self._join(ticket)

    def copy_now(self, src: KVPool, src_slots: Sequence[int], dst: KVPool, dst_slots: Sequence[int]) -> None:
        done, errors = threading.Event(), list[BaseException]()
        self._queue.put((CopyJob(src, tuple(src_slots), dst, tuple(dst_slots)), done, errors))
        done.wait()  # in queue order: after every copy submitted before it
        if errors:
            raise errors[0]

    def drain(self) -> None:
        done = threading.Event()
        self._queue.put((None, done, []))
        done.wait()  # one worker, FIFO: every job queued before the marker has run

    def close(self) -> None:
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()


def _host_pieces(cells: torch.Tensor, firsts: Sequence[int], lengths: Sequence[int]) -> list[torch.Tensor]:
    """Views of rows [first, first + length) of `cells` for ascending, disjoint runs: one C++ split, not a slice each."""
    bounds: list[int] = []
    for first, n in zip(firsts, lengths):
        bounds += (first, first + n)
    return list(cells.tensor_split(bounds)[1::2])


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """dsts[i].copy_(srcs[i]) for every i, launched from C++ where torch has it."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dsts, srcs, non_blocking=non_blocking)
            return
        except (RuntimeError, TypeError):  # e.g. mixed devices where a torch build refuses them: copy one by one
            pass
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=non_blocking)


class PlannedCopyEngine(CopyEngine):
    """Copies by plan (`kvcert.gpu.kv.plan_copy`): the CUDA engine's path, run synchronously on CPU pools.

    Bytes of a `dma` plan move at submit; a `staged` D2H lands its CPU scatter in `finish`, as on
    CUDA. Which pool is the device tier: the one not on the CPU; with both on the CPU,
    `device_pool` (unbound: the source of every copy is taken as the device pool).
    """

    name = "planned"
    pin = False
    """Staging buffers in pinned memory (CUDA)."""
    non_blocking = False

    def __init__(
        self,
        strategy: str = "auto",
        by_layer: bool = True,
        min_run_bytes: int = MIN_RUN_BYTES,
        device_pool: Optional[KVPool] = None,
    ) -> None:
        super().__init__()
        if strategy not in PLAN_STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; one of {PLAN_STRATEGIES}")
        self.strategy, self.by_layer, self.min_run_bytes = strategy, by_layer, min_run_bytes
        self.device_pool = device_pool
        self.plans = {"dma": 0, "staged": 0, "pooled": 0}
        """Copies planned per strategy (what `auto` chose); `pooled`: through a pool's own gather and scatter."""
        self._unsettled: dict[int, Ticket] = {}
        """Tickets whose host work (`post`) has not run yet: `drain` runs it."""

    # -- planning
    def _direction(self, job: CopyJob) -> Optional[str]:
        src_dev, dst_dev = job.src.device.type != "cpu", job.dst.device.type != "cpu"
        if src_dev != dst_dev:
            return "d2h" if src_dev else "h2d"
        if src_dev:
            return None  # device to device: not a tier copy
        if self.device_pool is not None:
            return "d2h" if job.src is self.device_pool else "h2d"
        if not (job.src.planned and job.dst.planned):  # an engine's own pool (no cell matrix) is the device tier
            return "d2h" if not job.src.planned else "h2d"
        return "d2h"

    def plan(self, job: CopyJob) -> Optional[CopyPlan]:
        """The plan for `job` (None: nothing to plan, a device-to-device copy or no slots)."""
        direction = self._direction(job)
        if direction is None or len(job.src_slots) == 0:
            return None
        if direction == "d2h":
            host, host_slots, dev, dev_slots = job.dst, job.dst_slots, job.src, job.src_slots
        else:
            host, host_slots, dev, dev_slots = job.src, job.src_slots, job.dst, job.dst_slots
        plan = plan_copy(
            host,
            host_slots,
            dev,
            dev_slots,
            direction,
            by_layer=self.by_layer and direction == "h2d",
            strategy=self.strategy,
            min_run_bytes=self.min_run_bytes,
        )
        self.plans[plan.strategy] += 1
        return plan

    # -- hooks the CUDA engine overrides
    def _mark(self) -> Any:
        """An event recorded where the copy's work so far is queued (None: the work is done)."""
        return None

    def _wait(self, ticket: Ticket) -> None:
        """Block until the ticket's device work is done."""

    def _to_device(self, ticket: Ticket, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        return rows

    def _launch(self, ticket: Ticket, synchronous: bool = False) -> None:
        job = ticket.job
        ticket.event, ticket.layer_events = None, None
        if job is None:
            ticket.event = self._mark()
            return
        if not (job.src.planned and job.dst.planned) and self._direction(job) is not None:
            self._pooled(ticket, job)
            return
        plan = self.plan(job)
        ticket.plan = plan
        if plan is None:
            job.run(non_blocking=self.non_blocking)
            ticket.event = self._mark()
            return
        self._execute(ticket, plan, job)

    def _pooled(self, t: Ticket, job: CopyJob) -> None:
        """A tier copy with a pool that has no cell matrix (an engine's per-layer tensors): the device side through
        its own gather / scatter into a contiguous device buffer, one DMA between that and pinned staging, the host
        side on the CPU (a D2H's scatter into the host pool after the event, in `finish`, as a staged plan's)."""
        self.plans["pooled"] += 1
        nb = self.non_blocking
        d2h = self._direction(job) == "d2h"
        dev, dev_slots, host, host_slots = (
            (job.src, job.src_slots, job.dst, job.dst_slots) if d2h else (job.dst, job.dst_slots, job.src, job.src_slots)
        )
        if not dev_slots:
            t.event = self._mark()
            return
        idx = self._to_device(t, torch.tensor(dev_slots, dtype=torch.long), dev.device)
        rows = torch.tensor(host_slots, dtype=torch.long)
        if d2h:
            stage = dev.gather(idx)
            buf = torch.empty(stage.shape, dtype=torch.uint8, pin_memory=self.pin)
            buf.copy_(stage, non_blocking=nb)
            t.post.append(lambda: host.scatter(rows, buf))  # after the event: see finish
        else:
            buf = host.gather(rows)
            if self.pin:
                buf = buf.pin_memory()
            dev.scatter(idx, buf.to(dev.device, non_blocking=nb))
        t.keep.append(buf)
        t.event = self._mark()
        if t.post:
            self._unsettled[id(t)] = t

    # -- the plan, run where the current stream is
    def _execute(self, t: Ticket, plan: CopyPlan, job: CopyJob) -> None:
        dev, host = (job.src, job.dst) if plan.direction == "d2h" else (job.dst, job.src)
        layers: list[Any] = []
        for group in plan.groups:
            if plan.strategy == "staged":
                self._staged(t, plan, group, dev, host)
            else:
                self._dma(t, plan, group, dev, host)
            if group.layer is not None:
                layers.append(self._mark())
        t.event = layers[-1] if layers else self._mark()
        t.layer_events = layers or None
        if t.post:
            self._unsettled[id(t)] = t

    def _dma(self, t: Ticket, plan: CopyPlan, g: PlanGroup, dev: KVPool, host: KVPool) -> None:
        nb = self.non_blocking
        runs = g.host_runs()
        if not runs:
            return
        d2h = plan.direction == "d2h"
        if g.direct:  # few runs, contiguous on both sides: one copy each, no staging
            for h, d, n in runs:
                if d2h:
                    host.cells[h : h + n].copy_(dev.cells[d : d + n], non_blocking=nb)
                else:
                    dev.cells[d : d + n].copy_(host.cells[h : h + n], non_blocking=nb)
            return
        idx = self._to_device(t, g.dev_rows, dev.device)
        pieces = _host_pieces(host.cells, [h for h, _, _ in runs], g.lengths)
        if d2h:
            stage = dev.cells.index_select(0, idx)  # one gather, in host-run order
            _copy_all(pieces, list(stage.split(g.lengths)), nb)  # one DMA per host run
        else:
            stage = torch.empty((len(g.host_rows), plan.width), dtype=torch.uint8, device=dev.device)
            _copy_all(list(stage.split(g.lengths)), pieces, nb)
            dev.cells.index_copy_(0, idx, stage)  # one scatter
        # `idx` and `stage` live on the device and are used only on this (side) stream: freed now, their
        # memory is reused only by later work on the same stream, so they need no keeping.

    def _staged(self, t: Ticket, plan: CopyPlan, g: PlanGroup, dev: KVPool, host: KVPool) -> None:
        nb = self.non_blocking
        m = len(g.host_rows)
        if m == 0:
            return
        idx = self._to_device(t, g.dev_rows, dev.device)
        buf = torch.empty((m, plan.width), dtype=torch.uint8, pin_memory=self.pin)
        if plan.direction == "d2h":
            stage = dev.cells.index_select(0, idx)
            buf.copy_(stage, non_blocking=nb)  # one DMA into pinned staging
            rows = g.host_rows
            t.post.append(lambda: host.cells.index_copy_(0, rows, buf))  # after the event: see finish
        else:
            torch.index_select(host.cells, 0, g.host_rows, out=buf)  # CPU gather into pinned staging
            stage = buf.to(dev.device, non_blocking=nb)
            dev.cells.index_copy_(0, idx, stage)
        t.keep.append(buf)  # host memory a DMA reads or writes: alive until the copy lands

    # -- engine protocol
    def submit(self, job: Optional[CopyJob]) -> Ticket:
        t = self._ticket(job)
        self._launch(t)
        return t

    def _settle(self, ticket: Ticket) -> None:
        """Wait for the device work, then run the host work that depends on it; drop the buffers."""
        self._wait(ticket)
        post, ticket.post = ticket.post, []
        self._unsettled.pop(id(ticket), None)
        for work in post:
            work()
        ticket.keep = []

    def drain(self) -> None:
        for ticket in list(self._unsettled.values()):
            self._settle(ticket)

    def _land(self, ticket: Ticket) -> None:
        self._settle(ticket)

    def _retry(self, ticket: Ticket) -> None:
        self._settle(ticket)  # the first attempt may still be in flight: let it end before relaunching
        self._launch(ticket)

    def copy_now(self, src: KVPool, src_slots: Sequence[int], dst: KVPool, dst_slots: Sequence[int]) -> None:
        t = self._ticket(CopyJob(src, tuple(src_slots), dst, tuple(dst_slots)))
        self._launch(t, synchronous=True)
        self._settle(t)


class CudaCopyEngine(PlannedCopyEngine):
    """Plans on side streams (D2H, H2D per device), an event per copy and per layer of a load-back.

    Each launch first makes its stream wait for the device's current stream: the forward pass's
    writes of the KV a backup reads, and its reads of the slots a load overwrites, come first. A
    synchronous copy (`copy_now`) also waits for the other direction's stream. `finish`
    synchronises the copy's last event (then runs a staged D2H's CPU scatter): only then may the
    host read the bytes. Host buffers a DMA uses (pinned indices, pinned staging) stay referenced
    by the ticket until then; device buffers are allocated and used on the side stream only, so
    the caching allocator reuses them only for later work on that stream.
    """

    name = "cuda"
    pin = True
    non_blocking = True

    def __init__(self, strategy: str = "auto", by_layer: bool = True, min_run_bytes: int = MIN_RUN_BYTES) -> None:
        super().__init__(strategy, by_layer, min_run_bytes)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs CUDA")
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}

    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=index)
        return self._streams[key]

    def _mark(self) -> Any:
        event = torch.cuda.Event()
        event.record()  # on the current stream: the side stream inside _launch
        return event

    def _wait(self, ticket: Ticket) -> None:
        if ticket.event is not None:
            assert isinstance(ticket.event, torch.cuda.Event)
            ticket.event.synchronize()

    def _to_device(self, ticket: Ticket, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        pinned = rows.pin_memory()  # an async copy from pageable memory would wait for the stream
        ticket.keep.append(pinned)
        return pinned.to(device, non_blocking=True)

    def _launch(self, ticket: Ticket, synchronous: bool = False) -> None:
        job = ticket.job
        if job is None:
            ticket.event, ticket.layer_events = self._mark(), None  # a store: nothing to move
            return
        if job.src.device.type == "cpu" and job.dst.device.type == "cpu":
            super()._launch(ticket)  # both pools on the CPU: nothing for a stream to do
            return
        on_device = job.src if job.src.device.type == "cuda" else job.dst
        device = on_device.device
        direction = "d2h" if job.src is on_device else "h2d"
        with torch.cuda.device(device):
            stream = self._stream(device, direction)
            stream.wait_stream(torch.cuda.current_stream(device))
            if synchronous:
                stream.wait_stream(self._stream(device, "h2d" if direction == "d2h" else "d2h"))
            with torch.cuda.stream(stream):
                super()._launch(ticket)

    def wait_layer(self, ticket: Ticket, layer: int, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Make `stream` (default: the current one) wait, on the device, for layer `layer` of a load-back."""
        event = ticket.layer_events[layer] if ticket.layer_events else ticket.event
        if isinstance(event, torch.cuda.Event):
            (stream or torch.cuda.current_stream()).wait_event(event)

    def drain(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
        super().drain()  # staged D2H copies: their CPU scatter

    def close(self) -> None:
        self.drain()


ENGINES: dict[str, Callable[[], CopyEngine]] = {
    "deferred": DeferredCopyEngine,
    "threaded": ThreadedCopyEngine,
    "cuda": CudaCopyEngine,
    "cuda-dma": partial(CudaCopyEngine, strategy="dma"),
    "cuda-staged": partial(CudaCopyEngine, strategy="staged"),
    "planned": PlannedCopyEngine,
    "planned-dma": partial(PlannedCopyEngine, strategy="dma"),
    "planned-staged": partial(PlannedCopyEngine, strategy="staged"),
}
"""`make_factory(engine=...)` names: `cuda-dma` / `cuda-staged` force a strategy (what `cuda`'s `auto` picks per copy)."""


def make_engine(kind: str) -> CopyEngine:
    try:
        return ENGINES[kind]()
    except KeyError:
        raise ValueError(f"unknown copy engine {kind!r}; one of {sorted(ENGINES)}") from None
