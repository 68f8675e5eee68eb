# Over 600 lines: SGLang's storage threads stepped by the harness and the bridge they write through: one seam of one engine.
"""SGLang's L3 storage path (HiCache + a storage backend, 0.5.23), stepped by the harness.

SGLang runs storage on four background threads (``HiCacheController``: the prefetch thread
runs the hit query, the io-aux thread the page transfer, the sync thread forwards acks, the
backup thread writes host pages to storage). This module runs their bodies when the harness
says so, never on a timer, so a run is a pure function of its trace:

* the threads are never started (``stepped_threads`` builds them inert); every queue a
  thread consumes is a :class:`StepQueue` that hands out only what the driver released;
* ``prefetch``: ``prefetch_from_storage`` (scheduler side: anchor host lock, submission),
  then one pass of the real ``prefetch_thread_func`` (one ``batch_exists``), then the
  scheduler's drain of the hit queue (host allocation, host eviction for room);
* ``fetch``: the io-aux body (``_page_transfer``) runs on its own thread, but in lockstep:
  the bridge's ``batch_get`` parks it until the harness's next ``fetch`` and the driver
  waits until it parks again or ends (:class:`Transfer`). Its batches are SGLang's
  (``STORAGE_BATCH_SIZE`` = 128 pages): the bridge's ``batch_get`` reads one page per harness
  ``fetch`` and returns the batch after its last page or first miss, so SGLang sees progress
  per batch (SPEC.md §6.1 ``FETCH``);
* ``check_prefetch`` / ``abort_prefetch``: one pass of the real ``prefetch_sync_thread_func``
  (acks to the scheduler), the scheduler's ack drain, then ``check_prefetch_progress`` or
  ``release_aborted_request``; an ended transfer is cancelled (its parked ``batch_get``
  returns a miss without touching storage) and drained, so its host slots come back at once;
* store copies: ``write_backup_storage`` queues a ``StorageOperation`` per backed-up node;
  ``complete`` runs one pass of the real ``backup_thread_func`` on that operation (one
  ``batch_set`` of its pages, ``STORAGE_BATCH_SIZE`` = 128 as shipped), and its ack is
  published in issue order, as the one FIFO backup thread would (:class:`BackupAcks`);
  ``poll`` (``check_hicache_events``) consumes it and releases the node's host lock.

:class:`BridgeStorage` is the ``HiCacheStorage`` SGLang talks to. It forwards to the
harness's store, translating SGLang's page keys (``get_storage_hash_str`` chains) to the
spec's (``kvcert.spec.storage.page_keys``) through the (namespace, token path) it learned
for each, and host pages to spec records: the device pool holds the spec's synthetic KV
(``token_kv``: one float32 head of width 2 is its 8 bytes), so the bytes SGLang writes are
checked by INV-STORE-1 and the bytes it reads back are checked against the content function.
A record that does not decode (torn, corrupt, misfiled) is a miss: the bridge is the
checksumming backend §10.1 asks for, which SGLang's own ``HiCacheFile`` is not (findings.md).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from queue import Empty
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.sglang.env import import_sglang
from kvcert.spec import storage as l3

import_sglang()  # the CPU import shims, before any sglang module

from sglang.srt.managers import cache_controller as _cc_mod  # noqa: E402
from sglang.srt.managers.cache_controller import PrefetchAck  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.utils import poll_timer as _poll_timer  # noqa: E402

for _name in ("sglang.srt.managers.cache_controller", "sglang.srt.mem_cache.unified_radix_cache"):
    # Injected storage faults are logged with tracebacks there (logger.exception); the harness reports outcomes.
    logging.getLogger(_name).setLevel(logging.CRITICAL)
# Storage cells size the host pool like the device pool; SGLang warns about that on every cache it builds.
logging.getLogger("sglang.srt.mem_cache.pool_host.base").setLevel(logging.ERROR)
# HiCacheFile warns of every page it misses; a miss is an outcome the harness reports.
logging.getLogger("sglang.srt.mem_cache.hicache_storage").setLevel(logging.ERROR)

__all__ = ["BridgeStorage", "SteppedStorage", "canonical_kv", "sglang_page_keys", "stepped_threads"]

from kvcert.conformance.adapters.kit.kv import HEAD_DIM, HEAD_NUM, KV_DTYPE  # noqa: E402

BACKUP_BATCH = _cc_mod.STORAGE_BATCH_SIZE
"""SGLang's storage batch (128 pages): a store copy of a node is one batch_set, as §10.2 wants."""
if BACKUP_BATCH != l3.FETCH_BATCH_PAGES:
    raise ImportError(
        f"SGLang's STORAGE_BATCH_SIZE is {BACKUP_BATCH}, the sglang-0.5.23 profile pins {l3.FETCH_BATCH_PAGES} (FETCH)"
    )


def sglang_page_keys(namespace: Optional[str], tokens: Sequence[int], page_size: int) -> list[str]:
    """SGLang's storage keys of every whole page of `tokens` (the chain its tree stores as hash_value)."""
    key = RadixKey(array("q", tokens), extra_key=namespace)
    out = get_storage_hash_str(key, None, page_size=page_size)
    return list(out) if isinstance(out, list) else [out]


def canonical_kv(namespace: Optional[str], tokens: Sequence[int], layers: int) -> torch.Tensor:
    """[2, layers, len(tokens), HEAD_NUM, HEAD_DIM] float32: the spec's KV of `tokens` (SPEC.md §10.1)."""
    digests = l3.prefix_digests(namespace, tokens)
    raw = b"".join(l3.token_kv(d, layer, w) for w in l3.KV_PARTS for layer in range(layers) for d in digests)
    flat = torch.frombuffer(bytearray(raw), dtype=KV_DTYPE)
    return flat.view(2, layers, len(tokens), HEAD_NUM, HEAD_DIM).clone()


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


# --------------------------------------------------------------------------- threads and queues


class _InertThread:
    """Stands in for threading.Thread while the controller starts its storage threads: never runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = str(kwargs.get("target", "storage-thread"))

    def start(self) -> None:
        pass

    def join(self, timeout: Optional[float] = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


@contextlib.contextmanager
def stepped_threads() -> Iterator[None]:
    """Build HiCacheController storage threads inert (cache_controller's `threading.Thread` only)."""
    real = _cc_mod.threading
    shim = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    shim.Thread = _InertThread
    _cc_mod.threading = shim  # type: ignore[assignment]
    try:
        yield
    finally:
        _cc_mod.threading = real


class StepQueue:
    """A thread's input queue whose `get` hands out only items the driver released, then stops the loop.

    `put` holds an item; :meth:`release` makes held items available to the next pass of the
    thread body. When nothing released is left, `get` sets the controller's stop event and
    raises Empty, so the body's ``while not stop`` loop ends after exactly the released items;
    the driver clears the event afterwards (:meth:`SteppedStorage._run_body`).
    """

    def __init__(self, stop: threading.Event) -> None:
        self.held: list[Any] = []
        self.ready: deque[Any] = deque()
        self._stop = stop

    def put(self, item: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if item is not None:  # None is _stop_storage_threads' wake-up
            self.held.append(item)

    put_nowait = put

    def release(self, items: Optional[Sequence[Any]] = None) -> None:
        """Make `items` (default: every held one) available, in the given order."""
        chosen = list(self.held) if items is None else list(items)
        for item in chosen:
            self.held.remove(item)
        self.ready.extend(chosen)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        if self.ready:
            return self.ready.popleft()
        self._stop.set()
        raise Empty

    get_nowait = get

    def empty(self) -> bool:
        return not self.ready

    def qsize(self) -> int:
        return len(self.ready)


class BackupAcks:
    """ack_backup_queue: acks are published in issue order, as one FIFO backup thread produces them.

    The harness may finish store copies in any order (the bytes go to storage when it says);
    an ack waits here until every store issued before it has finished.
    """

    def __init__(self) -> None:
        self.issued: list[int] = []
        """StorageOperation ids in issue order, not yet published."""
        self.finished: dict[int, Any] = {}
        self.published: deque[Any] = deque()

    def put(self, operation: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        self.finished[operation.id] = operation
        while self.issued and self.issued[0] in self.finished:
            self.published.append(self.finished.pop(self.issued.pop(0)))

    put_nowait = put

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        if not self.published:
            raise Empty
        return self.published.popleft()

    get_nowait = get

    def empty(self) -> bool:
        return not self.published

    def qsize(self) -> int:
        return len(self.published)


_CURRENT = threading.local()
"""The Transfer whose io-aux body runs on this thread (the bridge's batch_get parks on it)."""


class Transfer:
    """One prefetch's io-aux body (``_page_transfer`` + its completion ack), run in lockstep with the driver.

    The body runs on a thread of its own, but only one side runs at a time: the bridge's
    ``batch_get`` parks the body (:meth:`gate`) until :meth:`step`, and :meth:`step` waits until
    the body parks again or ends. No timing is involved: every hand-over is a semaphore.
    """

    def __init__(self, cc: Any, operation: Any) -> None:
        self.cc, self.operation = cc, operation
        self.cancelled = False
        self.missed = False
        """A page read came back missing: the batch is over for the harness (SGLang uses nothing after it)."""
        self.done = False
        self.error: Optional[BaseException] = None
        self._go = threading.Semaphore(0)
        self._parked = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._body, name=f"kvcert-transfer-{operation.id}", daemon=True)
        self._thread.start()
        self._parked.acquire()

    def _body(self) -> None:
        _CURRENT.transfer = self
        try:
            try:
                self.cc._page_transfer(self.operation)  # prefetch_io_aux_func's body
            finally:
                self.cc.prefetch_sync_queue.put(
                    PrefetchAck(rid=self.operation.request_id, completed_req=True, operation=self.operation)
                )
        except BaseException as err:  # surfaced on the driver's thread by step()
            self.error = err
        finally:
            self.done = True
            self._parked.release()

    def gate(self) -> bool:
        """Called by the body before each storage read: park until the driver steps; False once cancelled."""
        self._parked.release()
        self._go.acquire()
        return not self.cancelled

    def step(self) -> None:
        """Let the body read one page (one batch_get) and run until it parks again or ends."""
        assert not self.done
        self._go.release()
        self._parked.acquire()
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        """Cancel: every read still to come is a miss without a storage call; run the body to its end."""
        self.cancelled = True
        while not self.done:
            self.step()
        self._thread.join()


# --------------------------------------------------------------------------- the bridge


class BridgeStorage(HiCacheStorage):
    """SGLang's storage backend interface over the harness's store (kvcert.spec.storage.StorageBackend).

    Keys: SGLang's page key -> (namespace, token path to the end of the page), learned from every
    token sequence the driver hands SGLang (:meth:`learn`), -> ``page_keys(...)[-1]``. Values: a
    host page (SGLang's flat data page: K|V, layer, token, head, dim) is the spec payload's bytes.
    """

    def __init__(self, page_size: int, layers: int, model_id: str) -> None:
        self.page_size = page_size
        self.layers = layers
        self.digest = l3.canonical_digest(page_size, model_id)
        self.store: Optional[l3.StorageBackend] = None
        self.paths: dict[str, tuple[Optional[str], tuple[int, ...]]] = {}
        self.calls: list[tuple[str, int]] = []
        """(method, pages) of every call SGLang made, in order."""
        self.reads = 0
        """Pages read from the harness's store (a batch_get reads one per harness fetch)."""

    # ------------------------------------------------------------------ translation

    def learn(self, namespace: Optional[str], tokens: Sequence[int]) -> None:
        """Remember SGLang's key of every whole page of `tokens` (and so of every prefix)."""
        toks = tuple(int(t) for t in tokens)
        for i, key in enumerate(sglang_page_keys(namespace, toks, self.page_size)):
            self.paths.setdefault(key, (namespace, toks[: (i + 1) * self.page_size]))

    def spec_key(self, key: str) -> Optional[str]:
        known = self.paths.get(key)
        if known is None:
            return None
        ns, path = known
        return l3.page_keys(ns, path, self.page_size, self.digest)[-1]

    def _payload_ok(self, key: str, payload: bytes) -> bool:
        ns, path = self.paths[key]
        page = len(path) // self.page_size - 1
        return payload == l3.page_payload(ns, path, page, self.page_size, self.layers)

    # ------------------------------------------------------------------ HiCacheStorage

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        spec: list[str] = []
        for key in keys:
            sk = self.spec_key(key)
            if sk is None:  # a page of a path this driver never saw: no peer can have stored it either
                break
            spec.append(sk)
        assert self.store is not None, "no storage attached"
        self.calls.append(("batch_exists", len(keys)))
        return int(self.store.batch_exists(spec)) if spec else 0

    def batch_get(
        self, keys: list[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> list[Optional[torch.Tensor]]:
        """One of SGLang's storage batches, read page by page: under a transfer each page waits for the harness's
        ``fetch``; reading stops at the first miss (the rest are misses SGLang never uses)."""
        transfer: Optional[Transfer] = getattr(_CURRENT, "transfer", None)
        assert self.store is not None, "no storage attached"
        self.calls.append(("batch_get", len(keys)))
        out: list[Optional[torch.Tensor]] = [None] * len(keys)
        for i, key in enumerate(keys):
            if transfer is not None and not transfer.gate():
                break  # the prefetch ended while this read waited: no storage call
            page = self._read(key)
            if page is None:
                break
            out[i] = page
        return out

    def _read(self, key: str) -> Optional[torch.Tensor]:
        """One page from the harness's store, checked: a missing, torn, corrupt or misfiled record is a miss."""
        assert self.store is not None
        sk = self.spec_key(key)
        if sk is None:
            return None
        self.reads += 1
        blob = self.store.batch_get([sk])[0]
        payload = l3.decode_page(sk, blob)
        if payload is None or not self._payload_ok(key, payload):
            return None  # never wrong KV
        return torch.frombuffer(bytearray(payload), dtype=KV_DTYPE).clone()

    def batch_set(
        self,
        keys: list[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        assert self.store is not None and values is not None, "no storage attached"
        spec = [self.spec_key(k) for k in keys]
        unknown = [k for k, sk in zip(keys, spec) if sk is None]
        assert not unknown, f"SGLang stores page keys of no path this driver handed it: {unknown[:2]}"
        records = [l3.encode_page(sk, _bytes(v)) for sk, v in zip(spec, values)]  # type: ignore[arg-type]
        self.calls.append(("batch_set", len(keys)))
        return all(self.store.batch_set(spec, records))  # type: ignore[arg-type]

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def set(
        self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1


# --------------------------------------------------------------------------- the stepped L3 path


class _LogicalClock:
    """poll_timer's `time`: PollTimer (the timeout policy's wait) reads the harness's logical clock.

    Process-wide once this module is imported; besides the prefetch wait only the scheduler's
    request statistics use PollTimer, and no adapter drives a scheduler.
    """

    now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


CLOCK = _LogicalClock()
_poll_timer.time = CLOCK  # type: ignore[assignment]


class Prefetch:
    """One harness prefetch: SGLang's request handle, its operation and its lockstep transfer."""

    def __init__(self, pid: int, request: Any, operation: Any) -> None:
        self.id, self.request, self.operation = pid, request, operation
        self.transfer: Optional[Transfer] = None


def _gate_reads(backend: Any) -> None:
    """SGLang's own backend, stepped: each page its ``batch_get`` reads (one ``get`` per page, HiCacheFile's loop)
    waits for the harness's next fetch; a read after the prefetch ended is a miss that touches no file. Only when
    a page is read changes: what it reads, and how, is the backend's."""
    read = backend.get

    def get(key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        transfer: Optional[Transfer] = getattr(_CURRENT, "transfer", None)
        if transfer is None or transfer.missed:  # past a miss SGLang uses nothing: the rest of the batch is read free
            return read(key, target_location, target_sizes)
        if not transfer.gate():
            return None
        page = read(key, target_location, target_sizes)
        transfer.missed = page is None
        return page

    backend.get = get


class SteppedStorage:
    """The L3 half of the driver: SGLang's storage threads' bodies, run when the harness says."""

    def __init__(
        self, driver: Any, cache: Any, page_size: int, layers: int, model_id: str, bridge: bool = True
    ) -> None:
        self.driver = driver
        """The SGLangHiCache: store copies take their ids from its op counter, so copy ids stay in issue order."""
        self.cache = cache
        self.cc = cc = cache.cache_controller
        assert cc is not None and cc.enable_storage, "the cache was built without a storage backend"
        self.page_size = page_size
        self.bridge: Optional[BridgeStorage] = None
        """The harness's store behind SGLang's backend interface; None keeps SGLang's own backend (`file`), whose
        page reads then wait for the harness's fetches the same way (:func:`_gate_reads`)."""
        self.learners: list[Any] = []
        """Whatever translates SGLang's page keys to the spec's: told every token sequence SGLang is handed."""
        if bridge:
            self.bridge = BridgeStorage(page_size, layers, model_id)
            with contextlib.suppress(Exception):
                cc.storage_backend.close()
            cc.storage_backend = self.bridge
            self.learners.append(self.bridge.learn)
        else:
            _gate_reads(cc.storage_backend)
        stop = cc.storage_stop_event
        cc.prefetch_queue = StepQueue(stop)
        cc.prefetch_buffer = StepQueue(stop)
        cc.backup_queue = StepQueue(stop)
        cc.prefetch_sync_queue = StepQueue(stop)
        self.acks = cc.ack_backup_queue = BackupAcks()
        self.prefetches: dict[int, Prefetch] = {}
        """Running prefetches by id, in issue order."""
        self._next_prefetch = 0
        self.stores: dict[int, Any] = {}
        """StorageOperation id -> the operation, from issue until its ack is consumed."""
        self.store_done: set[int] = set()
        self.copy_ids: dict[int, int] = {}
        """StorageOperation id -> copy id (the driver's op counter: one order across writes, loads, stores)."""
        write_storage = cc.write_storage

        def issue_store(*args: Any, **kwargs: Any) -> int:
            op_id = int(write_storage(*args, **kwargs))
            self.acks.issued.append(op_id)
            self.stores[op_id] = cc.backup_queue.held[-1]
            self.copy_ids[op_id] = driver._next_op
            driver._next_op += 1
            return op_id

        cc.write_storage = issue_store

    # ------------------------------------------------------------------ thread bodies

    def _run_body(self, body: Any) -> None:
        """One pass of a storage thread's loop over what its queue released; the stop event is cleared after."""
        stop = self.cc.storage_stop_event
        assert not stop.is_set()
        try:
            body()
        finally:
            stop.clear()

    def _sync_acks(self, p: Prefetch) -> None:
        """prefetch_sync_thread_func over the acks prefetch `p`'s transfer produced, then the scheduler's drain.

        Only `p`'s: a prefetch whose completion ack is drained ends there (``_handle_prefetch_result``
        inserts it), so each prefetch's acks reach the scheduler at its own check or abort (docs/calibration/hicache.md D12).
        """
        queue = self.cc.prefetch_sync_queue
        queue.release([ack for ack in queue.held if ack.operation is p.operation])
        self._run_body(self.cc.prefetch_sync_thread_func)
        self.cache._drain_storage_control_queues_impl(
            n_storage_hit=None,
            n_ack_prefetch=None,
            n_backup=0,
            n_release=None,
            extra_release_counts={name: None for name in getattr(self.cc, "extra_host_mem_release_queues", {})},
            log_metrics=False,
        )

    # ------------------------------------------------------------------ prefetch

    def prefetch(
        self, anchor: int, namespace: Optional[str], matched: Sequence[int], new_tokens: Sequence[int], last_hash: Any
    ) -> int:
        """prefetch_from_storage + the hit query + host allocation; the tokens requested (0: none)."""
        pid = self._next_prefetch
        self._next_prefetch += 1
        request = CacheRequestHandle(f"kvcert-prefetch-{pid}", 0)
        for learn in self.learners:
            learn(namespace, list(matched) + list(new_tokens))
        self.cache.prefetch_from_storage(
            request,
            anchor,
            array("q", new_tokens),  # tree keys are arrays (RadixKey.match_at asserts one token type)
            last_hash,
            None,
            matched_prefix_tokens=list(matched),
            extra_key=namespace,
        )
        info = self.cache.ongoing_prefetch.get(request)
        if info is None:
            return 0
        self.cc.prefetch_queue.release()
        self._run_body(self.cc.prefetch_thread_func)  # the hit query: one batch_exists
        self.cache._drain_storage_control_queues_impl(
            n_storage_hit=None,
            n_ack_prefetch=0,
            n_backup=0,
            n_release=0,
            extra_release_counts={},
            log_metrics=False,
        )
        info = self.cache.ongoing_prefetch.get(request)
        if info is None or info.host_indices is None:
            return 0
        p = Prefetch(pid, request, info.operation)
        self.prefetches[pid] = p
        assert self.cc.prefetch_buffer.held == [info.operation]
        self.cc.prefetch_buffer.held.clear()
        p.transfer = Transfer(self.cc, info.operation)
        return int(info.operation.storage_hit_count)

    def fetch(self, pid: int) -> bool:
        """The next page of prefetch `pid`; False if it has none left to read (finished or failed)."""
        p = self.prefetches.get(pid)
        if p is None or p.transfer is None or p.transfer.done:
            return False
        p.transfer.step()
        return True

    def progress(self, pid: int) -> tuple[int, int, bool]:
        """(requested, fetched, failed) as the transfer left them: acks produced, drained or not."""
        p = self.prefetches[pid]
        op = p.operation
        fetched = int(op.completed_tokens)
        for ack in self.cc.prefetch_sync_queue.held:
            if ack.operation is op and ack.completed_tokens is not None:
                fetched = max(fetched, int(ack.completed_tokens))
        requested = int(op.storage_hit_count)
        failed = p.transfer is not None and p.transfer.done and fetched < requested
        return requested, fetched, failed

    def _end(self, p: Prefetch) -> None:
        if p.transfer is not None and not p.transfer.done:
            p.transfer.finish()
        self._sync_acks(p)  # the completion ack releases the unfetched host slots
        del self.prefetches[p.id]

    def check(self, pid: int) -> Optional[int]:
        """check_prefetch_progress after the acks so far reached the scheduler; None: still running."""
        p = self.prefetches[pid]
        self._sync_acks(p)
        if p.request in self.cache.ongoing_prefetch and not self.cache.check_prefetch_progress(p.request):
            return None
        self._end(p)
        return int(self.cache.pop_prefetch_loaded_tokens(p.request))

    def abort(self, pid: int) -> None:
        p = self.prefetches[pid]
        self.cache.release_aborted_request(p.request)  # before its acks reach the scheduler: nothing is inserted
        self._end(p)

    # ------------------------------------------------------------------ store copies

    def store_of(self, copy_id: int) -> Optional[int]:
        """The StorageOperation id of pending, unfinished store copy `copy_id`, or None."""
        for op_id, cid in self.copy_ids.items():
            if cid == copy_id and op_id in self.stores and op_id not in self.store_done:
                return op_id
        return None

    def complete_store(self, op_id: int) -> None:
        """One pass of backup_thread_func on store `op_id`: one batch_set of its pages."""
        op = self.stores[op_id]
        assert op_id not in self.store_done
        self.store_done.add(op_id)
        self.cc.backup_queue.release([op])
        self._run_body(self.cc.backup_thread_func)

    def pending_stores(self) -> list[tuple[int, int, bool]]:
        """(operation id, node id, finished) of every store whose ack is not consumed yet, in issue order."""
        out = []
        for op_id in sorted(self.stores):
            entry = self.cache.ongoing_backup.get(op_id)
            if entry is None:  # consumed by _drain_backup
                del self.stores[op_id]
                self.store_done.discard(op_id)
                self.copy_ids.pop(op_id, None)
                continue
            out.append((self.copy_ids[op_id], int(entry[0]), op_id in self.store_done))
        return out

    def close(self) -> None:
        for p in list(self.prefetches.values()):
            if p.transfer is not None and not p.transfer.done:
                p.transfer.finish()
