"""SGLang's `seaweedfs` HiCache L3 backend (S3 through boto3), unpatched, against moto's S3 server on loopback.

One server for the module, started here on 127.0.0.1 and stopped after (a second, for the stopped-server case).
Three layers: pages end to end (a writer stores through SGLang, a fresh cache prefetches them, with either host
layout, across layouts, and with damaged objects and refused requests); the harness's traces over the bucket; and a
planted bug the harness must catch. Skipped as a whole without the `sglang` extra or the S3 pins (requirements/s3.txt).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any, Optional

import pytest
from _sglang import drop_mid_prefetch, require_sglang, required

require_sglang()
if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
    if required():
        pytest.fail("KVCERT_SGLANG=1 but moto/boto3 are missing: scripts/install_sglang.sh (requirements/s3.txt)")
    pytest.skip("moto/boto3 not installed: scripts/install_sglang.sh (requirements/s3.txt)", allow_module_level=True)

from kvcert.conformance.adapters.sglang.hicache_backend import (  # noqa: E402
    SGLangHiCacheBackend,
    factory_page_first_storage_seaweedfs,
    factory_storage_seaweedfs,
    make_factory,
)
from kvcert.conformance.adapters.sglang.storage.s3_store import LoopbackS3, SGLangS3Store, object_order  # noqa: E402
from kvcert.conformance.certification.scope import scope_gaps  # noqa: E402
from kvcert.conformance.harness.driver import ConformanceFailure, run_trace  # noqa: E402
from kvcert.conformance.harness.storage import FaultyStorage, MemoryStorage  # noqa: E402
from kvcert.spec import storage as l3  # noqa: E402
from kvcert.spec.types import CacheConfig, UnknownPrefetch  # noqa: E402

pytestmark = pytest.mark.sglang

P = 2
TOKENS = (5, 6, 7, 8, 9, 10)
NS = "lora-a"
LAYOUTS = ("layer_first", "page_first_direct")


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackS3]:
    s = LoopbackS3()
    assert s.endpoint.startswith("http://127.0.0.1:")
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def serve_all(server: LoopbackS3) -> Iterator[None]:
    server.refuse = None
    yield
    server.refuse = None


_prefixes = iter(range(1 << 30))


def _backend(server: LoopbackS3, layout: str, prefix: Optional[str] = None, endpoint: Optional[str] = None) -> Any:
    """A storage cache on `server` whose objects live under `prefix` (shared by a writer and its readers)."""
    config = CacheConfig(
        page_size=P, capacity=8 * P, host_capacity=8 * P, write_policy="write_through", prefetch_policy="wait_complete"
    )
    b = SGLangHiCacheBackend(
        config, layout=layout, store="seaweedfs", endpoint=endpoint or server.endpoint, prefix=prefix
    )
    b.attach_storage(FaultyStorage(MemoryStorage()))
    return b


def _write(b: Any, tokens: tuple[int, ...] = TOKENS) -> None:
    """The forward pass, insert, the host write and the store copy SGLang issues after it: one batch_set_v1."""
    slots = b.alloc(len(tokens))
    b.write_kv(slots, l3.token_entries(NS, tokens, b.config.kv_layers))
    b.insert(NS, tokens, slots)
    (write,) = b.snapshot().pending
    b.complete(write.id)
    b.poll()
    (store,) = b.snapshot().pending
    assert store.kind == "store"
    b.complete(store.id)
    b.poll()


def _read(b: Any, tokens: tuple[int, ...] = TOKENS) -> tuple[int, list[bytes]]:
    """A prefetch of `tokens` from the root, every page fetched: (tokens added to the tree, their host KV)."""
    root = b.snapshot().root
    b.prefetch(root, NS, tokens)
    running = b.snapshot().prefetches
    if not running:
        return 0, []
    pid = running[0].id
    while True:
        try:
            b.fetch(pid)
        except UnknownPrefetch:
            break
    added = b.check_prefetch(pid)
    assert added is not None
    nodes = [v for v in b.snapshot().nodes if v.parent == root and v.host_slots]
    if not added:
        assert not nodes
        return 0, []
    (node,) = nodes
    assert node.key == tokens[:added] and node.slots is None
    return added, b.read_host_kv(node.host_slots)


def _want(tokens: tuple[int, ...] = TOKENS) -> list[bytes]:
    return list(l3.token_entries(NS, tokens, 2))


def _pair(server: LoopbackS3, writer: str, reader: str) -> tuple[Any, Any]:
    prefix = f"test-{next(_prefixes)}-{writer}-{reader}"
    return _backend(server, writer, prefix), _backend(server, reader, prefix)


# --------------------------------------------------------------------------- the target


def test_the_targets_declare_what_reaches_sglangs_own_io() -> None:
    for factory in (factory_storage_seaweedfs, factory_page_first_storage_seaweedfs):
        caps = factory.capabilities  # type: ignore[attr-defined]
        assert caps.storage_faults == ("corrupt", "drop")
        assert "seaweedfs" in caps.name and caps.prefetch_policies
        assert any("storage faults error, partial_write, torn_write" in g for g in scope_gaps(caps, []))
        assert any("moto's S3 server stands in for SeaweedFS" in d for d in caps.deviations)
    assert factory_page_first_storage_seaweedfs.__name__ == "factory_page_first_storage_seaweedfs"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglang_stores_the_spec_pages_and_reads_them_back(server: LoopbackS3, layout: str) -> None:
    """Writer -> S3 -> a fresh reader with the same layout: the bucket holds the spec's records (INV-STORE-1's view),
    and the reader's host KV is the spec's, every page."""
    writer, reader = _pair(server, layout, layout)
    try:
        _write(writer)
        digest = l3.canonical_digest(P, writer.config.model_id)
        assert writer.objects.contents() == dict(l3.stored_pages(NS, TOKENS, P, 2, digest))
        assert len(writer.objects.names()) == len(TOKENS) // P
        assert _read(reader) == (len(TOKENS), _want())
    finally:
        writer.close()
        reader.close()


def test_object_order_is_sglangs_page_buffers() -> None:
    """layer_first: K then V of each layer; page_first_direct: every layer's K, then V (the spec payload's order)."""
    assert object_order("layer_first", 2, 1) == [0, 2, 1, 3]
    assert object_order("page_first_direct", 2, 1) == [0, 1, 2, 3]
    assert object_order("layer_first", 2, 2) == [0, 1, 4, 5, 2, 3, 6, 7]


# --------------------------------------------------------------------------- a finding: another host layout


@pytest.mark.parametrize(("writer_layout", "reader_layout"), [LAYOUTS, LAYOUTS[::-1]])
def test_a_reader_with_another_host_layout_is_served_wrong_kv(
    server: LoopbackS3, writer_layout: str, reader_layout: str
) -> None:
    """FINDING: SeaweedFSStore names an object by model, rank and page hash, not by host layout, and an object is the
    host pool's buffers in that layout's order (layer_first: K0 V0 K1 V1…; page_first_direct: K0 K1… V0 V1…), of the
    same size. A cache restarted (or a peer run) with the other --hicache-mem-layout on the same bucket finds every
    page, passes the size check and loads the bytes in the wrong order: wrong KV, served as a hit."""
    writer, reader = _pair(server, writer_layout, reader_layout)
    try:
        _write(writer)
        added, kv = _read(reader)
        assert added == len(TOKENS)  # a hit, every page
        assert kv != _want()  # wrong KV
        assert kv == _misread(writer_layout, reader_layout)  # exactly the writer's objects loaded in the reader's order
    finally:
        writer.close()
        reader.close()


def _misread(writer_layout: str, reader_layout: str) -> list[bytes]:
    """The token entries a `reader_layout` cache holds after loading the objects a `writer_layout` cache stored."""
    w, layers = l3.KV_WIDTH, 2
    written, read = object_order(writer_layout, layers, P), object_order(reader_layout, layers, P)
    out = []
    for page in range(len(TOKENS) // P):
        payload = l3.page_payload(NS, TOKENS, page, P, layers)
        obj = [payload[i * w : (i + 1) * w] for i in written]
        held = [b""] * len(read)  # (K|V, layer, token) as the reader's pool holds it
        for j, i in enumerate(read):
            held[i] = obj[j]
        out += [
            b"".join(held[(x * layers + layer) * P + t] for x in range(2) for layer in range(layers)) for t in range(P)
        ]
    return out


# --------------------------------------------------------------------------- damaged objects, refused requests


@pytest.mark.parametrize("damage", ["drop", "truncate", "corrupt"])
def test_damaged_objects(server: LoopbackS3, damage: str) -> None:
    """drop: batch_exists stops before page 1, page 0 is read. truncate: the size check fails page 1's read, the
    zero-copy count keeps page 0. corrupt (one byte, same size): read as KV, no checksum (the F-L3-1 class)."""
    writer, reader = _pair(server, "layer_first", "layer_first")
    try:
        _write(writer)
        view: SGLangS3Store = writer.objects
        key = l3.page_keys(NS, TOKENS, P, view.digest)[1]
        assert {"drop": view.delete, "truncate": view.truncate, "corrupt": view.corrupt}[damage](key)
        added, kv = _read(reader)
        if damage == "corrupt":
            assert added == len(TOKENS) and kv != _want()  # wrong KV, served as a hit
            assert kv[:P] == _want()[:P] and kv[2 * P :] == _want()[2 * P :]
        else:
            assert (added, kv) == (P, _want()[:P])
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("refused", ["every PUT", "page 1's PUT", "page 1's GET"])
def test_the_server_refusing_requests(server: LoopbackS3, refused: str) -> None:
    """403 AccessDenied (a bucket policy's answer; not retried) on writes or reads: a failed or partial store leaves
    only whole pages, a refused read is a miss, and a reader gets the pages before it, never wrong KV."""
    writer, reader = _pair(server, "page_first_direct", "page_first_direct")
    try:
        names = [writer.s3_backend._object_key(k) for k in _sglang_keys(writer)]
        if refused == "every PUT":
            server.refuse = lambda method, key: method == "PUT"
        elif refused == "page 1's PUT":
            server.refuse = lambda method, key: method == "PUT" and key == names[1]
        _write(writer)
        stored = writer.objects.names()
        if refused == "page 1's GET":
            server.refuse = lambda method, key: method == "GET" and key == names[1]
        added, kv = _read(reader)
        assert server.refused
        if refused == "every PUT":
            assert stored == [] and added == 0
        elif refused == "page 1's PUT":  # batch_set_v1 puts every page; page 1's alone is missing
            assert stored == sorted([names[0], names[2]]) and (added, kv) == (P, _want()[:P])
        else:
            assert len(stored) == 3 and (added, kv) == (P, _want()[:P])
    finally:
        server.refuse = None
        writer.close()
        reader.close()


def _sglang_keys(b: Any) -> list[str]:
    from kvcert.conformance.adapters.sglang.storage.stepped import sglang_page_keys

    return sglang_page_keys(NS, TOKENS, P)


def test_a_stopped_server(server: LoopbackS3) -> None:
    """The S3 server goes away (connection refused, after botocore's retries): a store copy writes nothing and a
    prefetch finds nothing; both end, and the caches stay consistent."""
    own = LoopbackS3()
    writer = _backend(server, "layer_first", f"stopped-{next(_prefixes)}", endpoint=own.endpoint)
    reader = _backend(server, "layer_first", writer.s3_prefix, endpoint=own.endpoint)
    try:
        own.stop()
        _write(writer)
        assert _read(reader) == (0, [])
    finally:
        writer.close()
        reader.close()
    assert _read_again(server, writer.s3_prefix) == (0, [])


def _read_again(server: LoopbackS3, prefix: str) -> tuple[int, list[bytes]]:
    """The same prefix through the live server (moto's objects are process-wide): nothing was stored."""
    b = _backend(server, "layer_first", prefix)
    try:
        return _read(b)
    finally:
        b.close()


# --------------------------------------------------------------------------- the harness over the bucket


def _trace_ops(config: CacheConfig) -> tuple[list[Any], list[str]]:
    return drop_mid_prefetch(config)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_harness_trace_over_the_bucket(server: LoopbackS3, layout: str) -> None:
    """A peer's pages, the engine's own stores, a dropped object and a fetch across the batch match the model, with
    every KV byte and the bucket (INV-STORE-1) checked after every step."""
    factory = make_factory("python", layout, storage=True, store="seaweedfs", endpoint=server.endpoint)
    config = CacheConfig(capacity=8, host_capacity=8, write_policy="write_through", prefetch_policy="wait_complete")
    ops, _ = _trace_ops(config)
    h = run_trace(factory(config), config, factory.capabilities, ops, quiesce=False, close=False)
    try:
        backend = h.backend
        assert backend.objects is not None and backend.h.l3.bridge is None  # type: ignore[attr-defined]
        assert len(backend.objects.names()) == 2 + 2, "the engine's two pages and the peer's two left"  # type: ignore[attr-defined]
        assert [v.key for v in backend.snapshot().nodes if v.slots is None and v.parent is not None] == [(1, 2)]
    finally:
        h.close()


def test_a_planted_bug_is_caught(server: LoopbackS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SeaweedFSStore that puts a page's buffers in reverse order (V before K) is caught at its store copy."""
    from sglang.srt.mem_cache.storage.seaweedfs.seaweedfs_store import SeaweedFSStore

    put = SeaweedFSStore._put_from
    monkeypatch.setattr(SeaweedFSStore, "_put_from", lambda self, key, buffers: put(self, key, buffers[::-1]))
    factory = make_factory("python", "page_first_direct", storage=True, store="seaweedfs", endpoint=server.endpoint)
    config = CacheConfig(capacity=8, host_capacity=8, write_policy="write_through", prefetch_policy="wait_complete")
    ops, _ = _trace_ops(config)
    with pytest.raises(ConformanceFailure, match="INV-STORE-1"):
        run_trace(factory(config), config, factory.capabilities, ops[:5])
