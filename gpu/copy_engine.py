"""Copy engines: how bytes move between the device and host pools.

The cache issues a copy (`submit`) when SPEC.md §9 says a copy is issued, and learns that it
landed only through `finish`, which the cache calls from `complete(copy)` — the harness decides
when. So the three engines differ only in *when the bytes move*, never in what the cache
observes:

- `DeferredCopyEngine` (CPU, the suite's): records the copy; `finish` moves the bytes. Fully
  deterministic.
- `ThreadedCopyEngine` (CPU, soak runs): a worker thread moves the bytes as soon as the copy is
  submitted; `finish` waits for it. Completion is still reported only through the same ack path.
- `CudaCopyEngine`: a side stream per direction (D2H, H2D), an event per copy; slice copies for
  contiguous runs, one gather/scatter otherwise. Needs `torch.cuda.is_available()`.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcert.gpu.kv import KVPool


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


class ThreadedCopyEngine(CopyEngine):
    """A worker thread moves bytes at submit time; `finish` joins the copy (no timeout)."""

    name = "cpu-threaded"

    def __init__(self) -> None:
        super().__init__()
        self._queue: queue.Queue[Optional[tuple[CopyJob, threading.Event]]] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="kvcert-copy", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, done = item
            try:
                job.run()
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
            self._queue.put((t.job, event))

    def _retry(self, ticket: Ticket) -> None:
        assert isinstance(ticket.event, threading.Event)
        ticket.event.wait()
        self._enqueue(ticket)

    def _land(self, ticket: Ticket) -> None:
        assert isinstance(ticket.event, threading.Event)
        ticket.event.wait()

    def copy_now(self, src: KVPool, src_slots: Sequence[int], dst: KVPool, dst_slots: Sequence[int]) -> None:
        done = threading.Event()
        self._queue.put((CopyJob(src, tuple(src_slots), dst, tuple(dst_slots)), done))
        done.wait()  # in queue order: after every copy submitted before it

    def close(self) -> None:
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()


class CudaCopyEngine(CopyEngine):
    """Side streams for D2H and H2D, an event per copy; the host pool must be pinned for overlap."""

    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs CUDA")
        self.d2h = torch.cuda.Stream()
        self.h2d = torch.cuda.Stream()

    def submit(self, job: Optional[CopyJob]) -> Ticket:
        t = self._ticket(job)
        self._launch(t)
        return t

    def _launch(self, t: Ticket) -> None:
        job = t.job
        event = torch.cuda.Event()
        if job is None:
            event.record()
            t.event = event
            return
        stream = self.d2h if job.src.device.type == "cuda" else self.h2d
        stream.wait_stream(torch.cuda.current_stream())  # the forward pass's writes come first
        with torch.cuda.stream(stream):
            # Contiguous runs are slice copies (asynchronous into pinned memory); a scattered D2H
            # batch is gathered on the device and copied through pageable memory, which blocks.
            job.run(non_blocking=True)
            event.record(stream)
        t.event = event

    def _retry(self, ticket: Ticket) -> None:
        assert isinstance(ticket.event, torch.cuda.Event)
        ticket.event.synchronize()
        self._launch(ticket)

    def _land(self, ticket: Ticket) -> None:
        assert isinstance(ticket.event, torch.cuda.Event)
        ticket.event.synchronize()

    def copy_now(self, src: KVPool, src_slots: Sequence[int], dst: KVPool, dst_slots: Sequence[int]) -> None:
        t = self._ticket(CopyJob(src, tuple(src_slots), dst, tuple(dst_slots)))
        self._launch(t)
        self._land(t)


ENGINES = {"deferred": DeferredCopyEngine, "threaded": ThreadedCopyEngine, "cuda": CudaCopyEngine}


def make_engine(kind: str) -> CopyEngine:
    try:
        return ENGINES[kind]()
    except KeyError:
        raise ValueError(f"unknown copy engine {kind!r}; one of {sorted(ENGINES)}") from None
