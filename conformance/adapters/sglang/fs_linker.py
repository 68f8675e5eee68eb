"""`sglang-fs-linker` 0.1.0 (PyPI), an out-of-tree filesystem `UnifiedCacheLinker`, behind SGLang 0.5.23's wrapper,
judged through SGLang's own scheduler (SPEC.md §14).

    kvcert certify kvcert.conformance.adapters.sglang.fs_linker:factory

The package's `FileSystemLinker` keeps one file per KV page (`torch.save` of every layer's K and V rows) under a
directory, writes an offload's pages synchronously inside `offload()` (temporary file, then `os.replace`), reads a
batch's pages inside `start_layer_wise_loading()` (`torch.load`), and answers a lookup from the directory (no
claims). It targets an older linker contract (SGLang PR #40595): under 0.5.23 SGLang's own
`create_unified_cache_linker` refuses it as shipped (`finish_layer_wise_loading` is abstract;
tests/test_sglang_fs_linker.py). `BridgedFileSystemLinker` is the smallest subclass that runs it on 0.5.23, three
bridges and nothing else, each a declared deviation: `finish_layer_wise_loading` pops the batch's completed load and
reports it landed (its loads are synchronous), `offload(transfers, session_id=None)` drops the session id, the
constructor takes and stores `forward_stream`.

SGLang's `dynamic` backend builds `ObservedFileSystemLinker`: the bridged class with every call SGLang makes to it
forwarded unchanged and fed, call and answer, to a `kvcert.spec.linker.LinkerLedger` (INV-LINK-1..7), plus what only
the store's files show: a lookup that reports a page no file holds (INV-LINK-1), and an offload published as a
success whose page files are missing or hold other bytes (INV-LINK-6). Its files live in a temporary directory the
adapter owns (deleted at `close`). The trace's `LinkerFault`s are what a filesystem store meets: a page file deleted
by another process (`drop`: the oldest, now; `load_refuse`: between a lookup and its load; `load_fail`: between a
load and the batch that reads it), a full disk (`offload_fail`: the next offload's middle page is written to
/dev/full), and a page file damaged at rest (`corrupt`: one byte of its K data flipped; `truncate`: cut to half its
length), applied to the middle page of the next started batch just before it is read, since damage no read finds is
never seen. Everything else is `sglang_linker.SGLangLinkerPath`: SGLang's Scheduler, a device-only
UnifiedRadixCache, real requests.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import tempfile
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.kit.kv import free_slots, read_pool
from kvcert.conformance.adapters.sglang import requests as _rq  # SGLang's CPU shims: before any sglang import
from kvcert.conformance.adapters.sglang.linker import SGLangLinkerPath, kv_transfer
from kvcert.conformance.reference.linker import FaultCues
from kvcert.spec.invariants import Violation
from kvcert.spec.linker import LinkerLedger, Offload, check_pinned
from kvcert.spec.types import CacheConfig

__all__ = [
    "FS_FAULTS",
    "BridgedFileSystemLinker",
    "ObservedFileSystemLinker",
    "SGLangFsLinkerPath",
    "factory",
    "factory_corrupt",
    "factory_survivable",
]

from sglang_fs_linker import linker as _fs  # noqa: E402
from sglang_fs_linker.linker import FileSystemLinker  # noqa: E402

FS_FAULTS = ("load_fail", "load_refuse", "offload_fail", "drop", "corrupt", "truncate")
"""The `LinkerFault` kinds this target takes: what a filesystem store honestly meets (module docstring).
`offload_refuse` and `offload_hold` (`kvcert.spec.linker.FAULTS`) are not taken: the package's `offload` always
accepts and completes inside the call."""

NAMESPACE = "kvcert"
"""The package's `namespace` option (it names the model revision in the page directory)."""


class BridgedFileSystemLinker(FileSystemLinker):  # type: ignore[misc]
    """`sglang_fs_linker.linker.FileSystemLinker` bridged to SGLang 0.5.23's `UnifiedCacheLinker` contract: three
    bridges, nothing else (declared deviations, printed under NOT CHECKED)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: Optional[dict[str, Any]] = None,
        forward_stream: Any = None,
    ) -> None:
        super().__init__(server_args, params, components=components, extra_config=extra_config)
        self.forward_stream = forward_stream

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """Its loads are synchronous: the batch landed inside `start_layer_wise_loading`, which recorded it."""
        if self.num_completed_loads():
            self.pop_completed_load()
        return True

    def offload(self, transfers: list[Any], session_id: Optional[str] = None) -> bool:
        return bool(super().offload(transfers))


class ObservedFileSystemLinker(BridgedFileSystemLinker):
    """The bridged linker as SGLang's `dynamic` factory builds it here: every contract method forwards to it
    unchanged, and the call and its answer go to `ledger` (a `LinkerLedger`); faults the trace armed act on the
    store's files at the call they are timed to (`fault`)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: Optional[dict[str, Any]] = None,
        forward_stream: Any = None,
    ) -> None:
        super().__init__(
            server_args, params, components=components, extra_config=extra_config, forward_stream=forward_stream
        )
        self.allocator = params.token_to_kv_pool_allocator
        self.layers = len(self.pool.k_buffer)
        self.ledger = LinkerLedger(int(self.page_size))
        self.cached: Any = lambda: ()
        """The device slots the tree holds now (set by the adapter, which sees the tree)."""
        self.written: OrderedDict[str, None] = OrderedDict()
        """Page keys with a file, oldest write first (the victim of `drop`: the oldest)."""
        self.queued_bytes: dict[int, list[bytes]] = {}
        """Offload id -> its source slots' bytes when it was queued (INV-LINK-5)."""
        self.cues = FaultCues(FS_FAULTS)
        self.reached: Counter[str] = Counter()

    # ------------------------------------------------------------------ the world's side: faults

    def fault(self, kind: str) -> None:
        """`drop` deletes the oldest page file now; every other kind is armed for the next call it is timed to."""
        self.cues.check(kind)
        if kind == "drop":
            key = next((k for k in self.written if self._path(k).is_file()), None)
            if key is not None:
                self._damage(key, "dropped")
        else:
            self.cues.arm(kind)

    def _damage(self, key: str, how: str) -> None:
        """The page file of `key` is deleted (`dropped`, `deleted ...`), cut to half its length (`truncated`) or has
        one byte of its data flipped (`corrupted`), as another process or the disk would do it."""
        path = self._path(key)
        if not path.is_file():
            return
        if how == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        elif how == "corrupted":
            _flip_first_data_byte(path)
        else:
            path.unlink()
            self.written.pop(key, None)
        self.cues.log.append(f"{how} {key[:8]}")
        self.reached[f"page {how}"] += 1

    def _free(self) -> Collection[int]:
        return free_slots(self.allocator, int(self.page_size))

    def _read(self, slots: Sequence[int]) -> list[bytes]:
        return read_pool(self.pool, slots, self.layers)

    def _stored(self, key: str) -> Optional[list[bytes]]:
        """The entries the page file of `key` holds (one per token), or None without a readable file."""
        try:
            values = torch.load(self._path(key), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError):
            return None
        rows = [v.contiguous().view(torch.uint8).reshape(v.shape[0], -1) for v in values]
        return [b"".join(r[t].numpy().tobytes() for r in rows) for t in range(int(self.page_size))]

    def _violation(self, inv: str, message: str) -> None:
        self.ledger.found.append(Violation(inv, message))

    # ------------------------------------------------------------------ loads

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        hits = [int(n) for n in super().lookup(rid, transfers)]
        keys = list(kv_transfer(transfers).keys or ())
        resident = 0
        while resident < len(keys) and self._path(keys[resident]).is_file():
            resident += 1
        over = sorted(n for n in hits if n > resident)
        if over:
            self._violation("INV-LINK-1", f"the linker reports {over} pages restorable for {rid}, and only the "
                            f"first {resident} of them have a page file: a page it does not hold is never a hit")  # fmt: skip
        self.reached["lookup hit" if hits else "lookup miss"] += 1
        self.ledger.lookup(rid, keys, hits)
        return hits

    def load(self, rid: str, transfers: list[Any]) -> bool:
        kv = kv_transfer(transfers)
        keys = list(kv.keys or ())
        self.ledger.load(rid, keys, [int(s) for s in kv.device_indices.tolist()], self._free(), self.cached())
        if keys and self.cues.take("load_refuse"):  # another process deletes a page after the lookup saw it
            self._damage(keys[-1], "deleted before its load")
        queued = bool(super().load(rid, transfers))
        if not queued:
            self.ledger.cancel(rid, True)
        self.reached["load queued" if queued else "load refused"] += 1
        return queued

    def cancel_queued_load(self, rid: str) -> bool:
        cancelled = bool(super().cancel_queued_load(rid))
        self.ledger.cancel(rid, cancelled)
        self.reached["load cancelled"] += cancelled
        return cancelled

    def start_layer_wise_loading(self) -> int:
        free, cached = self._free(), self.cached()
        loads = list(self.pending_loads.values())
        if loads:
            # A page this batch reads, deleted by another process after its load was queued, or damaged at rest:
            # damage that no read finds is never seen, so it is applied to the next page read, just before it is.
            key = loads[0][0][len(loads[0][0]) // 2]
            for kind, how in (
                ("load_fail", "deleted before its batch"),
                ("truncate", "truncated"),
                ("corrupt", "corrupted"),
            ):
                if self.cues.take(kind):
                    self._damage(key, how)
        index = int(super().start_layer_wise_loading())
        self.ledger.start(index, free, cached)
        if loads:
            self.reached["load batch landed"] += 1  # it returned: every page was read and copied
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed = bool(super().finish_layer_wise_loading(counter_index))
        self.ledger.finish(counter_index, landed)
        return landed

    # ------------------------------------------------------------------ offloads

    def offload(self, transfers: list[Any], session_id: Optional[str] = None) -> bool:
        kv = kv_transfer(transfers)
        keys = list(kv.keys or ())
        slots = [int(s) for s in kv.device_indices.tolist()]
        off = self.ledger.offload(keys, slots)
        self.queued_bytes[off.id] = self._read(slots)
        before = len(self.completed_offloads)
        full = len(keys) // 2 if keys and self.cues.take("offload_fail") else None
        with _disk_full_at(full):
            queued = bool(super().offload(transfers, session_id))
        for key in keys:
            if self._path(key).is_file():
                self.written[key] = None
                self.written.move_to_end(key)
        if not queued:  # never, as shipped: the package's offload always accepts
            self.ledger.offloads.remove(off)
            self.queued_bytes.pop(off.id, None)
            return False
        if len(self.completed_offloads) > before:  # published inside the call (it is synchronous)
            success = bool(self.completed_offloads[-1])
            self.ledger.published(off, success)
            self.reached["offload stored" if success else "offload failed"] += 1
            if success:
                self._check_stored(off)
        return queued

    def _check_stored(self, off: Offload) -> None:
        """A success means every page is in its file, holding what its source slots held (the linker's side)."""
        ps, queued = int(self.page_size), self.queued_bytes[off.id]
        for i, key in enumerate(off.keys):
            if self._stored(key) != queued[i * ps : (i + 1) * ps]:
                self._violation("INV-LINK-6", f"offload {off.id} is published as a success, and the file of its "
                                f"page {i} ({key[:8]}) is missing or holds other bytes: a node would be marked "
                                "stored that the store cannot restore")  # fmt: skip
                return

    def pop_completed_offload(self) -> bool:
        off = self.ledger.taken()
        success = bool(super().pop_completed_offload())
        if off is not None:
            self.ledger.found += check_pinned(off, self.queued_bytes.pop(off.id, []), self._read(off.slots))
            if success != off.result:
                self._violation("INV-LINK-6", f"the cache takes offload {off.id}'s result as {success}; the linker "
                                f"published {off.result} for it: results out of queue order")  # fmt: skip
        return success

    # ------------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        super().reset()
        self.ledger.reset()
        self.queued_bytes.clear()


@contextmanager
def _disk_full_at(page: Optional[int]) -> Iterator[None]:
    """While it is open, the package's `page`-th temporary page file of the call is written to /dev/full: its
    bytes go nowhere and the write fails with ENOSPC, as on a full disk (the file itself is created)."""
    if page is None:
        yield
        return
    real = _fs.tempfile
    count = [0]

    class _Tempfile:
        @staticmethod
        def NamedTemporaryFile(*args: Any, **kwargs: Any) -> Any:  # noqa: N802  (the name the package calls)
            count[0] += 1
            if count[0] - 1 != page:
                return real.NamedTemporaryFile(*args, **kwargs)
            fd, name = real.mkstemp(dir=kwargs.get("dir"), suffix=kwargs.get("suffix", ""))
            os.close(fd)
            return _FullFile(name)

    _fs.tempfile = _Tempfile
    try:
        yield
    finally:
        _fs.tempfile = real


class _FullFile:
    """A temporary file on a full disk: named and created, and every write of its bytes fails (/dev/full)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._file = open("/dev/full", "wb")  # noqa: SIM115  (closed by __exit__)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._file, attr)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.close()


def _flip_first_data_byte(path: Path) -> None:
    """Flip the first byte of the first tensor's data record of a `torch.save` file (K of layer 0, token 0): the
    archive stays readable (torch.load checks no CRC), the value changes. A file that is no archive any more (a
    `truncate` before) has its middle byte flipped instead."""
    data = bytearray(path.read_bytes())
    try:
        with zipfile.ZipFile(path) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
        at = info.header_offset + 30 + name_len + extra_len
    except (zipfile.BadZipFile, StopIteration, struct.error):
        at = len(data) // 2
    if at < len(data):
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))


class SGLangFsLinkerPath(SGLangLinkerPath):
    """`sglang_linker.SGLangLinkerPath` with the package's filesystem linker in place of the harness's store."""

    def __init__(self, config: CacheConfig) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvcert-fs-linker-")
        try:
            super().__init__(config)
        except BaseException:
            self._dir.cleanup()
            raise
        self._closed = False

    def _server_args(self) -> dict[str, Any]:
        return super()._server_args() | {
            "unified_cache_external_linker_config": {
                "linker": ObservedFileSystemLinker.__name__,
                "linker_module_path": __name__,
                "linker_extra_config": {"directory": self._dir.name, "namespace": NAMESPACE},
            },
        }

    @property
    def directory(self) -> Path:
        """Where the linker keeps its page files (a subdirectory of the adapter's temporary directory)."""
        return Path(self.linker.directory)

    # ------------------------------------------------------------------ the store's side

    def linker_fault(self, kind: str) -> None:
        self.linker.fault(kind)

    def reached(self) -> dict[str, int]:
        return dict(self.linker.reached)

    def _ledger(self) -> LinkerLedger:
        """The ledger the observed linker feeds (the package keeps none)."""
        return self.linker.ledger  # type: ignore[no-any-return]

    def step(self) -> None:
        """SGLang's iteration (the package's store has no time of its own: it works inside each call)."""
        _rq.SGLangRequestPath.step(self)

    def close(self) -> None:
        """Close the linker and delete its files; the adapter is unusable afterwards."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            super().close()
            self.linker.close()
        finally:
            self._dir.cleanup()


_base = _rq.factory.capabilities  # type: ignore[attr-defined]
_FS_NOTES = (
    "clients leave request ids to SGLang (CLIENT_RULES distinct-ids) and send no LoRA requests, as sglang_linker:factory",
    "--enable-unified-cache-external-linker with --unified-cache-external-linker-backend dynamic: SGLang's "
    "create_unified_cache_linker imports ObservedFileSystemLinker (this module: sglang-fs-linker 0.1.0's "
    "FileSystemLinker, bridged, with forwarding observers) and init_cache_linker wraps it in "
    "UnifiedCacheLinkerWrapper; device only",
    "the store is the package's: one torch.save file per page in a temporary directory the adapter owns (options "
    f"directory and namespace={NAMESPACE!r}); offloads are written inside offload(), loads read inside "
    "start_layer_wise_loading(), lookups read the directory",
    "every call SGLang makes to the linker and every answer is fed to a LinkerLedger (INV-LINK-1..7); the adapter also "
    "checks a lookup against the page files (INV-LINK-1) and a published success against the files' bytes (INV-LINK-6)",
)
_FAULT_NOTES = {
    "drop": "drop (the oldest page file deleted now)",
    "load_refuse": "load_refuse (a page file of the next load deleted between its lookup and the load)",
    "load_fail": "load_fail (a page file of the next started batch deleted between its load and the batch)",
    "offload_fail": "offload_fail (the next offload's middle page written to /dev/full: ENOSPC)",
    "corrupt": "corrupt (one byte of K data flipped in a page file the next started batch reads)",
    "truncate": "truncate (a page file the next started batch reads cut to half its length)",
}
_FS_DEVIATIONS = (
    "tree core: Python (tree_core_backend=python); SGLang's default is the Rust core",
    "bridge: finish_layer_wise_loading (abstract in 0.5.23, absent from the package) pops the package's completed "
    "load and returns True: its loads are synchronous, so a batch that returned from start_layer_wise_loading landed",
    "bridge: offload(transfers, session_id=None) forwards offload(transfers); the session id is dropped",
    "bridge: the constructor takes forward_stream= (the package's does not) and stores it; on CPU it is None",
    "layer-wise loading: the package's layer counter is a no-op (its loads finish inside start_layer_wise_loading) "
    "and the scripted forward waits on no counter",
    "no flush: the request path sends no flush_cache, so reset with work in flight is not run",
)


def _make(name: str, faults: tuple[str, ...]) -> Any:
    def factory(config: CacheConfig) -> SGLangFsLinkerPath:
        return SGLangFsLinkerPath(config)

    factory.__name__ = factory.__qualname__ = name
    which = "" if faults == FS_FAULTS else f", faults {', '.join(faults)}"
    factory.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
        _base,
        name=f"sglang {_rq._env.SGLANG_VERSION} request path, UnifiedRadixCache + sglang-fs-linker 0.1.0 "
        f"(FileSystemLinker, Python tree core{which})",
        write_policies=(),
        linker_faults=faults,
        loras=False,
        client=("distinct-ids",),
        notes=_rq._NOTES + _FS_NOTES + ("linker faults: " + ", ".join(_FAULT_NOTES[k] for k in faults),),
        deviations=_rq._DEVIATIONS + _FS_DEVIATIONS,
    )
    factory.__doc__ = f"SGLang's request path over UnifiedRadixCache with sglang-fs-linker's FileSystemLinker{which}."
    return factory


factory = _make("factory", FS_FAULTS)
"""`kvcert certify kvcert.conformance.adapters.sglang.fs_linker:factory`: every fault kind the target takes."""
factory_survivable = _make("factory_survivable", ("drop", "load_refuse", "offload_fail"))
"""`...:factory_survivable`: the faults that touch no page file a started batch reads (a page lost before its
lookup or its load, a full disk under an offload)."""
factory_corrupt = _make("factory_corrupt", ("corrupt",))
"""`...:factory_corrupt`: a flipped byte in a page file only (the wrong-KV finding, without the exits that
truncate and load_fail find first)."""
