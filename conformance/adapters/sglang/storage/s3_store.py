"""SGLang's `seaweedfs` L3 backend (S3 through boto3) on moto's S3 server, and the harness's view of its objects.

The `seaweedfs` storage target runs SGLang's ``SeaweedFSStore`` unpatched against a real S3 server on
loopback (moto's, :class:`LoopbackS3`): SGLang's own boto3 client puts, heads and gets its page objects
over HTTP. What the adapter changes, and why:

* the backend: the driver builds SGLang's `file` backend at init (its config names no other);
  :func:`attach_seaweedfs` replaces it with ``seaweedfs`` built by SGLang's own ``StorageBackendFactory``
  from the controller's storage config plus an endpoint, and selects the zero-copy page functions, as
  ``attach_storage_backend`` does for that name (`cache_controller.py:614-667`);
* its thread pool (16 workers) runs each task on the caller's thread, in submission order
  (:class:`InlineExecutor`): a run is a function of its trace, and a page read can wait for the harness's
  ``fetch`` on the io thread (:func:`gate_reads`), as the `file` target's reads do.

:class:`SGLangS3Store` is the harness's ``StorageBackend`` over the live bucket: spec keys and records in,
SGLang's object names (``_object_key``) and object bytes out. An object is a page's host buffers back to
back (``get_page_buffer_meta``, `pool_host/mha.py:817-877`): K then V of each layer for ``layer_first``,
K of every layer then V for ``page_first_direct``, whose order is the spec payload's. No header, no
checksum: ``corrupt`` flips a byte of the object, which SGLang cannot see (findings.md, F-L3-1).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Optional

from kvcert.conformance.adapters.sglang.storage.file_store import EnginePageStore
from kvcert.conformance.adapters.sglang.storage.stepped import _CURRENT
from kvcert.spec import storage as l3

__all__ = [
    "S3_LAYOUTS",
    "InlineExecutor",
    "LoopbackS3",
    "SGLangS3Store",
    "attach_seaweedfs",
    "gate_reads",
    "object_order",
    "shared_server",
]

S3_LAYOUTS = ("layer_first", "page_first_direct")
"""Host layouts the CPU driver builds whose zero-copy pages SeaweedFSStore stores (`page_first` needs a GPU kernel)."""
CREDENTIALS = {"access_key": "kvcert", "secret_key": "kvcert"}
"""Explicit keys: without them boto3 walks the AWS credential chain, which may ask a metadata address off loopback."""

for _name in ("werkzeug", "sglang.srt.mem_cache.storage.seaweedfs.seaweedfs_store"):
    # moto's server logs every request; SGLang warns of every refused or short object: outcomes the harness reports.
    logging.getLogger(_name).setLevel(logging.CRITICAL)


# --------------------------------------------------------------------------- the server


class LoopbackS3:
    """moto's threaded S3 server on 127.0.0.1 at a free port, started and stopped by kvcert.

    ``refuse`` makes it answer chosen requests with S3's 403 AccessDenied (what a bucket policy denying
    them returns; botocore does not retry it): ``(method, object key) -> bool``, None to serve all.
    moto keeps its buckets process-wide, so every server of a process serves the same objects.
    """

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.refuse: Optional[Callable[[str, str], bool]] = None
        self.refused: list[tuple[str, str]] = []
        """(method, object key) of every request refused, in order."""
        wsgi = self._server._server
        assert wsgi is not None
        app = wsgi.app

        def guarded(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            method = str(environ.get("REQUEST_METHOD", ""))
            key = str(environ.get("PATH_INFO", "")).lstrip("/").partition("/")[2]
            if self.refuse is not None and key and self.refuse(method, key):
                self.refused.append((method, key))
                body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                start_response(
                    "403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
                )
                return [body]
            try:
                return app(environ, start_response)  # type: ignore[no-any-return]
            finally:
                if method not in ("GET", "HEAD"):
                    MUTATIONS[0] += 1

        wsgi.app = guarded
        self.stopped = False
        SERVED.add(self.endpoint)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._server.stop()


MUTATIONS = [0]
"""Requests that may have changed an object, through any LoopbackS3 of this process (moto's buckets are
process-wide): while it stands still, a bucket listing stands still."""
SERVED: set[str] = set()
"""Endpoints of this process's LoopbackS3 servers: only their listings can be reused."""

_SHARED: list[LoopbackS3] = []
_SHARED_LOCK = threading.Lock()


def shared_server() -> LoopbackS3:
    """The process's own server, started on first use and stopped at exit: every backend without an endpoint."""
    with _SHARED_LOCK:
        if not _SHARED:
            _SHARED.append(LoopbackS3())
            atexit.register(_SHARED[0].stop)
        return _SHARED[0]


_PREFIXES = itertools.count()


# --------------------------------------------------------------------------- attaching SGLang's backend


class InlineExecutor:
    """SeaweedFSStore's ThreadPoolExecutor, one task at a time on the caller's thread, in submission order."""

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        out: Future[Any] = Future()
        try:
            out.set_result(fn(*args, **kwargs))
        except BaseException as err:  # the caller's f.result() raises it, as with a pool
            out.set_exception(err)
        return out

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def gate_reads(backend: Any) -> None:
    """Each page SeaweedFSStore reads into the host pool (``_get_into``) waits for the harness's next fetch; past a
    miss SGLang uses nothing, so the rest of the batch is read free; after the prefetch ended a read is a miss that
    sends no request. When a page is read changes, not what or how."""
    read = backend._get_into

    def get_into(key: str, buffers: list[tuple[int, int]]) -> bool:
        transfer = getattr(_CURRENT, "transfer", None)
        if transfer is None or transfer.missed:
            return bool(read(key, buffers))
        if not transfer.gate():
            return False
        ok = bool(read(key, buffers))
        transfer.missed = not ok
        return ok

    backend._get_into = get_into


def attach_seaweedfs(cc: Any, endpoint: str, prefix: str) -> Any:
    """Replace HybridCacheController `cc`'s storage backend with SGLang's SeaweedFSStore on `endpoint`, objects under
    `prefix`; returns it. The lines of ``attach_storage_backend`` that depend on the backend's name, no others."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = dict(cc.storage_config.extra_config or {}) | {"endpoint": endpoint, "prefix": prefix} | CREDENTIALS
    config = dataclasses.replace(cc.storage_config, extra_config=extra)
    backend = StorageBackendFactory.create_backend("seaweedfs", config, cc.storage_host_pool)
    backend.register_mem_pool_host(cc.storage_host_pool)
    backend.on_host_pools_registered()
    backend._executor.shutdown(wait=True)
    backend._executor = InlineExecutor()
    gate_reads(backend)
    cc.storage_config, cc.storage_backend, cc.storage_backend_type = config, backend, "seaweedfs"
    cc.page_get_func, cc.page_set_func = cc._page_get_zero_copy, cc._page_set_zero_copy
    return backend


def new_prefix() -> str:
    """A prefix no other backend of any process uses: each backend's objects are its own."""
    return f"kvcert-{os.getpid()}-{next(_PREFIXES)}"


# --------------------------------------------------------------------------- object bytes


def object_order(layout: str, layers: int, page_size: int) -> list[int]:
    """For each KV entry of a page object, in object order, its index in the spec payload ((K|V, layer, token))."""
    if layout == "page_first_direct":  # one K buffer (layer, token), one V buffer: the payload's order
        return list(range(2 * layers * page_size))
    if layout == "layer_first":  # per layer: its K buffer (token), its V buffer
        return [
            (w * layers + layer) * page_size + t for layer in range(layers) for w in range(2) for t in range(page_size)
        ]
    raise ValueError(f"layout must be one of {S3_LAYOUTS}")


class SGLangS3Store(EnginePageStore):
    """Spec keys and records over a live SeaweedFSStore's bucket and object names."""

    WHAT = "page object"

    def __init__(self, backend: Any, page_size: int, layers: int, model_id: str, layout: str, keys_of: Any) -> None:
        super().__init__(page_size, model_id, keys_of)
        self.backend = backend
        """The engine's SeaweedFSStore: its client, bucket and object naming (``_object_key``)."""
        self.s3, self.bucket = backend._s3, backend.config.bucket
        self.order = object_order(layout, layers, page_size)
        self.size = len(self.order) * l3.KV_WIDTH
        self._listed: Optional[tuple[int, dict[str, str]]] = None
        """(MUTATIONS when listed, the listing), for a server of this process."""
        self._ours = backend.config.endpoint in SERVED
        self._seen: dict[str, tuple[str, bytes]] = {}
        """Object name -> (its ETag, its bytes) when last read: INV-STORE-1 reads the bucket after every step, and a
        listing's ETags (MD5 of the body) say which objects changed since."""

    # ------------------------------------------------------------------ the bucket

    def _learned(self, spec_key: str, sglang_key: str) -> str:
        return str(self.backend._object_key(sglang_key))

    def _name(self, spec_key: str) -> Optional[str]:
        gk = self.sglang_key.get(spec_key)
        return None if gk is None else str(self.backend._object_key(gk))

    def to_object(self, payload: bytes) -> bytes:
        w = l3.KV_WIDTH
        return b"".join(payload[i * w : (i + 1) * w] for i in self.order)

    def to_payload(self, blob: bytes) -> Optional[bytes]:
        """The spec payload an object holds, None if it is not a page's size (SGLang reads that as a miss)."""
        if len(blob) != self.size:
            return None
        w, out = l3.KV_WIDTH, [b""] * len(self.order)
        for j, i in enumerate(self.order):
            out[i] = blob[j * w : (j + 1) * w]
        return b"".join(out)

    def _write(self, name: str, blob: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=name, Body=blob)

    def _read(self, name: str) -> Optional[bytes]:
        try:
            return bytes(self.s3.get_object(Bucket=self.bucket, Key=name)["Body"].read())
        except self.s3.exceptions.NoSuchKey:
            return None

    def _exists(self, name: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=name)
        except self.s3.exceptions.ClientError as err:
            if str(err.response["Error"]["Code"]) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def _remove(self, name: str) -> bool:
        if not self._exists(name):
            return False
        self.s3.delete_object(Bucket=self.bucket, Key=name)
        return True

    def truncate(self, key: str) -> bool:
        """Keep the first half of the object (a torn upload, a short copy): SGLang's size check makes it a miss."""
        name = self._name(key)
        blob = None if name is None else self._read(name)
        if not blob:
            return False
        self.s3.put_object(Bucket=self.bucket, Key=name, Body=blob[: len(blob) // 2])
        return True

    def listing(self) -> dict[str, str]:
        """Every object under the backend's prefix: name -> ETag. Listed again only when our server was asked to change
        something since (INV-STORE-1 reads the bucket after every step; most steps send it nothing)."""
        if self._ours and self._listed is not None and self._listed[0] == MUTATIONS[0]:
            return dict(self._listed[1])
        at = MUTATIONS[0]
        prefix = f"{self.backend.key_prefix}/" if self.backend.key_prefix else ""
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        listed = {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}
        self._listed = (at, listed)
        return dict(listed)

    def names(self) -> list[str]:
        return sorted(self.listing())

    def contents(self) -> dict[str, bytes]:
        """Every page stored, as spec records: the objects of learned pages, and waiting records. One listing, and a
        read of each object whose ETag changed since it was last read."""
        out = dict(self.waiting)
        listed = self.listing()
        self._seen = {name: seen for name, seen in self._seen.items() if name in listed}
        for name, etag in sorted(listed.items()):
            sk = self.spec_key.get(name)
            if sk is None:
                out[f"unlearned:{name}"] = b""  # an object no path the driver handed SGLang names: never the spec's
                continue
            seen = self._seen.get(name)
            if seen is None or seen[0] != etag:
                blob = self._read(name)
                if blob is None:  # deleted since the listing
                    continue
                seen = self._seen[name] = (etag, blob)
            out[sk] = self._record(sk, seen[1])
        return out
