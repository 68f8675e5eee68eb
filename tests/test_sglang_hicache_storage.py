"""SGLang's L3 storage path (HiCache + storage, 0.5.23), stepped by the harness.

Three layers: SGLang's own `file` backend end to end (a producer writes pages, a fresh cache
prefetches them; what its missing integrity check does with a damaged page); the bridge to the
harness's store (keys, records, one storage call per step); and whole traces through the
conformance harness on both tree cores. Skipped as a whole without the `sglang` extra.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _sglang import drop_mid_prefetch, require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang.hicache import HiCacheConfig, SGLangHiCache  # noqa: E402
from kvcert.conformance.adapters.sglang.hicache_backend import (  # noqa: E402
    SGLangHiCacheBackend,
    factory_rust_storage,
    factory_storage,
)
from kvcert.conformance.adapters.sglang.storage.stepped import (  # noqa: E402
    BridgeStorage,
    canonical_kv,
    sglang_page_keys,
)
from kvcert.conformance.certification.certify import certify  # noqa: E402
from kvcert.conformance.harness.driver import run_trace  # noqa: E402
from kvcert.conformance.harness.storage import FaultyStorage, MemoryStorage  # noqa: E402
from kvcert.spec import storage as l3  # noqa: E402
from kvcert.spec.ops import op_from_json  # noqa: E402
from kvcert.spec.types import CacheConfig, UnknownPrefetch  # noqa: E402

pytestmark = pytest.mark.sglang


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality: synthetic KV is arbitrary bit patterns, NaNs included, which torch.equal calls unequal."""
    return a.shape == b.shape and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(torch.uint8).numpy()
    )


# --------------------------------------------------------------------------- SGLang's `file` backend

TOKENS = [5, 6, 7, 8, 9, 10]
P = 2


def _file_driver(root: Path) -> SGLangHiCache:
    return SGLangHiCache(
        HiCacheConfig(
            page_size=P, device_pages=8, write_policy="write_through", stepped_storage=True, storage_dir=str(root)
        )
    )


def _produce(root: Path) -> torch.Tensor:
    """A producer writes TOKENS' pages through write_backup_storage -> HiCacheFile; returns their device KV."""
    h = _file_driver(root)
    try:
        slots = h.alloc(len(TOKENS))
        h.write_kv(slots, seed=3)
        kv = h.read_device_kv(slots)
        h.insert(None, TOKENS, slots)
        h.complete(h.pending()[0])  # the D2H write's ack issues the store (one StorageOperation for the node)
        assert h.l3 is not None
        stores = h.l3.pending_stores()
        assert len(stores) == 1 and not stores[0][2]
        with h._in_sglang():
            h.l3.complete_store(next(iter(h.l3.stores)))
        h.poll()  # the backup ack releases the node's host lock
        assert h.l3.pending_stores() == []
        return kv
    finally:
        h.close()


def _consume(root: Path, stored: int = len(TOKENS)) -> tuple[int, Optional[torch.Tensor]]:
    """A fresh cache prefetches TOKENS from the root (`stored` of them found); returns (tokens added, their host KV)."""
    h = _file_driver(root)
    try:
        assert h.l3 is not None
        root_id = int(h.cache.root_node_handle())
        with h._in_sglang():
            requested = h.l3.prefetch(root_id, None, [], TOKENS, None)
            assert requested == stored
            pid = next(iter(h.l3.prefetches))
            while h.l3.fetch(pid):  # HiCacheFile reads one page per harness fetch, in one batch_get
                pass
            added = h.l3.check(pid)
        assert added is not None
        nodes = [v for v in h.nodes().values() if v["parent"] is not None]
        if not added:
            return 0, None
        (node,) = nodes
        assert node["device"] is None and node["key"] == tuple(TOKENS[:added])
        return added, h.read_host_kv(node["host"])
    finally:
        h.close()


def test_file_backend_round_trip(tmp_path: Path) -> None:
    """Producer -> HiCacheFile -> a fresh consumer: every page comes back, byte-equal to the producer's device KV."""
    kv = _produce(tmp_path)
    assert len(list(tmp_path.glob("*.bin"))) == len(TOKENS) // P
    added, host = _consume(tmp_path)
    assert added == len(TOKENS)
    assert host is not None and _same(host, kv)


def _page_files(root: Path) -> list[Path]:
    """The page files in chain order (SGLang's key of page i, plus HiCacheFile's suffix)."""
    files = {p.name.split("_")[0]: p for p in root.glob("*.bin")}
    return [files[k] for k in sglang_page_keys(None, TOKENS, P)]


@pytest.mark.parametrize("damage", ["drop", "torn", "corrupt"])
def test_file_backend_under_storage_faults(tmp_path: Path, damage: str) -> None:
    """The harness's page faults applied to HiCacheFile's files: a miss is safe, a corrupt page is served.

    drop ends the prefetch before the damaged page (batch_exists stops there). torn (half the file)
    makes HiCacheFile's short read raise inside the batch's one batch_get, so the whole batch is
    lost, the good page before it too (SPEC.md §6.1 FETCH).
    corrupt (one byte flipped, same length) is read back as KV: HiCacheFile keeps no checksum
    (findings.md, F-L3-1), so the consumer's host KV differs from what the producer wrote.
    """
    kv = _produce(tmp_path)
    page = _page_files(tmp_path)[1]
    blob = page.read_bytes()
    if damage == "drop":
        page.unlink()
    elif damage == "torn":
        page.write_bytes(blob[: len(blob) // 2])
    else:
        page.write_bytes(blob[:5] + bytes([blob[5] ^ 0xFF]) + blob[6:])
    added, host = _consume(tmp_path, stored=P if damage == "drop" else len(TOKENS))
    if damage == "drop":
        assert added == P  # batch_exists stops at the missing page: only page 0 is requested
    elif damage == "torn":
        assert added == 0  # page 1's read raises: SGLang counts no page of that batch
    else:
        assert added == len(TOKENS)
        assert host is not None and not _same(host, kv)  # wrong KV, served as a hit
        assert _same(host[:, :, :P], kv[:, :, :P]) and _same(host[:, :, 2 * P :], kv[:, :, 2 * P :])
    if damage == "drop":
        assert host is not None and _same(host, kv[:, :, :added])


# --------------------------------------------------------------------------- the bridge


def test_bridge_translates_sglang_keys_to_the_spec_keys() -> None:
    bridge = BridgeStorage(page_size=2, layers=2, model_id="m")
    bridge.learn("ns", [1, 2, 3, 4, 5])
    spec = l3.page_keys("ns", [1, 2, 3, 4], 2, l3.canonical_digest(2, "m"))
    assert [bridge.spec_key(k) for k in sglang_page_keys("ns", [1, 2, 3, 4], 2)] == list(spec)
    assert bridge.spec_key(sglang_page_keys(None, [1, 2], 2)[0]) is None  # another namespace: never learned


def _storage_backend(
    policy: str = "best_effort", ps: int = 1
) -> tuple[SGLangHiCacheBackend, FaultyStorage, CacheConfig]:
    config = CacheConfig(
        page_size=ps, capacity=6 * ps, host_capacity=6 * ps, write_policy="write_through", prefetch_policy=policy
    )
    backend = factory_storage(config)
    store = FaultyStorage(MemoryStorage())
    backend.attach_storage(store)
    return backend, store, config


def test_store_copy_writes_the_spec_records() -> None:
    """write ack -> one store copy -> complete: one batch_set holding exactly the spec's records of the node."""
    backend, store, config = _storage_backend()
    try:
        slots = backend.alloc(3)
        backend.set_clock(1)
        backend.write_kv(slots, l3.token_entries("lora-a", [4, 5, 6], config.kv_layers))  # the forward pass
        node = backend.insert("lora-a", [4, 5, 6], slots).node
        (write,) = backend.snapshot().pending
        backend.complete(write.id)
        assert backend.poll() == 1
        (copy,) = backend.snapshot().pending
        assert copy.kind == "store" and copy.nodes == (node,) and not copy.finished
        assert store.inner.contents() == {}  # storage sees the pages only when the store copy completes
        backend.complete(copy.id)
        digest = l3.canonical_digest(1, config.model_id)
        assert store.inner.contents() == dict(l3.stored_pages("lora-a", [4, 5, 6], 1, config.kv_layers, digest))
        assert backend.h.l3 is not None and backend.h.l3.bridge is not None
        assert backend.h.l3.bridge.calls == [("batch_set", 3)]
        assert [v.host_lock_ref for v in backend.snapshot().nodes if v.id == node] == [1]  # until the ack
        assert backend.poll() == 1
        assert [v.host_lock_ref for v in backend.snapshot().nodes if v.id == node] == [0]
    finally:
        backend.close()


def _publish(store: FaultyStorage, config: CacheConfig, ns: Any, tokens: list[int]) -> None:
    digest = l3.canonical_digest(config.page_size, config.model_id)
    pairs = l3.stored_pages(ns, tokens, config.page_size, config.kv_layers, digest)
    store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])


@pytest.mark.parametrize("ps", [1, 4])
def test_prefetch_reads_one_page_per_fetch_and_publishes_its_batch(ps: int) -> None:
    """One batch_exists at prefetch and one batch_get of SGLang's whole batch (128 pages as shipped), which reads one
    page per harness fetch; SGLang sees the progress when the batch ends; the host KV is the content function's."""
    backend, store, config = _storage_backend("wait_complete", ps)
    tokens = list(range(1, 3 * ps + 1))
    try:
        _publish(store, config, None, tokens)
        root = backend.snapshot().root
        assert backend.prefetch(root, None, tokens) == 3 * ps
        bridge = backend.h.l3.bridge  # type: ignore[union-attr]
        assert bridge is not None and bridge.calls == [("batch_exists", 3), ("batch_get", 3)] and bridge.reads == 0
        for k in range(3):
            assert [(p.requested, p.fetched, p.failed) for p in backend.snapshot().prefetches] == [(3 * ps, 0, False)]
            assert backend.check_prefetch(0) is None  # wait_complete: still running
            backend.fetch(0)
            assert bridge.reads == k + 1
        with pytest.raises(UnknownPrefetch):
            backend.fetch(0)
        assert [(p.requested, p.fetched, p.failed) for p in backend.snapshot().prefetches] == [(3 * ps, 3 * ps, False)]
        assert bridge.calls == [("batch_exists", 3), ("batch_get", 3)]
        assert backend.check_prefetch(0) == 3 * ps
        (node,) = [v for v in backend.snapshot().nodes if v.parent is not None]
        assert node.slots is None and node.key == tuple(tokens)
        assert node.host_slots is not None
        assert _same(backend.h.read_host_kv(node.host_slots), canonical_kv(None, tokens, config.kv_layers))
    finally:
        backend.close()


@pytest.mark.parametrize("fault", ["error", "corrupt", "drop"])
def test_a_bad_page_fails_the_prefetch_and_is_never_kept(fault: str) -> None:
    """Under any fault the page is a miss: the prefetch fails there. A miss keeps the pages before it; a read that
    raises loses its whole batch, as SGLang's _page_transfer counts no page of a batch whose batch_get raised."""
    backend, store, config = _storage_backend("wait_complete")
    tokens = [7, 8, 9]
    try:
        _publish(store, config, None, tokens)
        assert backend.prefetch(backend.snapshot().root, None, tokens) == 3
        backend.fetch(0)
        key = l3.page_keys(None, tokens, 1, l3.canonical_digest(1, config.model_id))[1]
        if fault == "error":
            store.arm("error")
        else:
            assert store.corrupt(key) if fault == "corrupt" else store.drop(key)
        backend.fetch(0)
        kept = 0 if fault == "error" else 1
        assert [(p.requested, p.fetched, p.failed) for p in backend.snapshot().prefetches] == [(3, kept, True)]
        with pytest.raises(UnknownPrefetch):
            backend.fetch(0)
        assert backend.check_prefetch(0) == kept
        snap = backend.snapshot()
        assert [v.key for v in snap.nodes if v.parent is not None] == ([(7,)] if kept else [])
        assert len(snap.host_free_slots) == 6 - kept  # the rest of the reservation came back at once
    finally:
        backend.close()


def test_abort_keeps_nothing() -> None:
    backend, store, config = _storage_backend("wait_complete")
    try:
        _publish(store, config, None, [1, 2])
        assert backend.prefetch(backend.snapshot().root, None, [1, 2]) == 2
        backend.fetch(0)
        backend.fetch(0)
        backend.abort_prefetch(0)
        snap = backend.snapshot()
        assert snap.prefetches == () and len(snap.nodes) == 1 and len(snap.host_free_slots) == 6
    finally:
        backend.close()


# --------------------------------------------------------------------------- through the harness

TRACE = [
    {"op": "Publish", "namespace": None, "tokens": [1, 2, 3]},
    {"op": "Match", "namespace": None, "tokens": [1, 2, 3]},
    {"op": "Prefetch", "handle": 1},
    {"op": "Fetch", "prefetch": 0},
    {"op": "StorageFault", "kind": "partial_write", "at": 1},
    {"op": "Fetch", "prefetch": 0},
    {"op": "CheckPrefetch", "prefetch": 0},
    {"op": "Insert", "namespace": "lora-a", "tokens": [4, 5, 6]},
    {"op": "Complete", "copy": 0},
    {"op": "Poll"},
    {"op": "Complete", "copy": 1},
    {"op": "Poll"},
    {"op": "Match", "namespace": "lora-a", "tokens": [4, 5, 6]},
]
"""Valid under SPEC.md §10 as it stands: a prefetch from the root, a store copy of one node under a partial write."""


@pytest.mark.parametrize("factory", [factory_storage, factory_rust_storage], ids=["python", "rust"])
def test_a_storage_trace_conforms_on_both_cores(factory: Any) -> None:
    config = CacheConfig(
        page_size=1, capacity=6, host_capacity=6, write_policy="write_through", prefetch_policy="best_effort"
    )
    backend = factory(config)
    try:
        h = run_trace(backend, config, factory.capabilities, [op_from_json(o) for o in TRACE])
        spec = h.storages[1].inner.contents()
        assert len(spec) == 3 + 1  # the published pages, and the partial write's first page of [4, 5, 6]
        assert h.storages[0].inner.contents() == spec
    finally:
        backend.close()


def test_same_trace_same_run() -> None:
    """The stepped threads leave nothing to timing: a replay gives the same answers, snapshots and store bytes."""

    def run() -> tuple[list[Any], dict[str, bytes]]:
        config = CacheConfig(
            page_size=1, capacity=6, host_capacity=6, write_policy="write_through", prefetch_policy="wait_complete"
        )
        backend = factory_storage(config)
        seen: list[Any] = []
        try:
            h = run_trace(
                backend,
                config,
                factory_storage.capabilities,
                [op_from_json(o) for o in TRACE],
                hook=lambda i, op, got: seen.append((i, repr(got), backend.snapshot())),
            )
            return seen, h.storages[0].inner.contents()
        finally:
            backend.close()

    assert run() == run()


@pytest.mark.parametrize("name", ["factory_storage", "factory_rust_storage"])
def test_storage_cells_are_certified(name: str, tmp_path: Path) -> None:
    """SGLang's L3 path (stepped threads, bridge store) passes every storage cell at P = 1 and 4.

    SPEC.md §10 took calibration decisions D7-D16 (docs/calibration/hicache.md); a short run for CI,
    the longer one's figures are in docs/sglang.md.
    """
    cert = certify(
        f"kvcert.conformance.adapters.sglang.hicache_backend:{name}",
        examples=25,
        steps=30,
        seed=0,
        page_sizes=[1, 4],
        device_cells=False,
        host_cells=False,
        out_dir=tmp_path,
    )
    failures = [f"P={c.page_size} {c.write_policy}: {c.failure}" for c in cert.cells if not c.passed]
    assert not failures, "\n".join(failures)
    wps = ("write_through", "write_through_selective", "write_back")
    pfs = ("best_effort", "wait_complete", "timeout")
    assert {(c.page_size, c.write_policy) for c in cert.cells} == {
        (p, f"{w}+{f}") for p in (1, 4) for w in wps for f in pfs
    }
    assert all(c.steps > 0 for c in cert.cells)


D16 = Path(__file__).parent / "traces" / "d16-prefetch-end-is-an-access.json"


@pytest.mark.parametrize("factory", [factory_storage, factory_rust_storage], ids=["python", "rust"])
def test_d16_ending_a_prefetch_is_an_access(factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration D16: SGLang stamps the anchor and the walked nodes when a prefetch ends (`insert_host` ->
    `_touch_node`). Its trace passes on SGLang and on the model; a model that touches nothing fails it."""
    from kvcert.conformance.harness.driver import ConformanceFailure
    from kvcert.refimpl import cache as refcache
    from kvcert.spec.ops import Trace

    trace = Trace.from_json(D16.read_text())
    run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))
    run_trace(refcache.RefCache(trace.config), trace.config, refcache.RefCache.capabilities, list(trace.ops))
    plain = refcache.RefCache._end_prefetch
    monkeypatch.setattr(refcache.RefCache, "_end_prefetch", lambda self, p, keep, touch=False: plain(self, p, keep))
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))
    # The Python core reports its stamps, so the untouched anchor's rank shows at once (INV-META-1); the Rust
    # core's only shows when the copies it orders differ.
    assert {"INV-COPY-1", "INV-HOST-11", "INV-META-1"} & {v.inv for v in failure.value.violations}


D17 = Path(__file__).parent / "traces" / "d17-retraction-reclaims-its-size.json"


@pytest.mark.parametrize("factory", [factory_storage, factory_rust_storage], ids=["python", "rust"])
def test_d17_a_retraction_backup_reclaims_its_whole_size(factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration D17: SGLang's `HostPoolGroup.alloc(reclaim=...)` host-evicts the backup's whole size when it
    does not fit. The trace passes on SGLang and on the model; a model that reclaims the shortfall fails it."""
    from kvcert.conformance.harness.driver import ConformanceFailure
    from kvcert.refimpl import cache as refcache
    from kvcert.spec.ops import Trace

    trace = Trace.from_json(D17.read_text())
    run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))
    run_trace(refcache.RefCache(trace.config), trace.config, refcache.RefCache.capabilities, list(trace.ops))
    plain = refcache.RefCache._host_alloc
    monkeypatch.setattr(refcache.RefCache, "_host_alloc", lambda self, n, reclaim_all=False: plain(self, n))
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))
    assert "INV-TREE-4" in {v.inv for v in failure.value.violations}


D18 = Path(__file__).parent / "traces" / "d18-prefetch-gate-at-prefetch-time.json"


@pytest.mark.parametrize("factory", [factory_storage, factory_rust_storage], ids=["python", "rust"])
def test_d18_the_prefetch_gate_holds_when_the_prefetch_is_made(factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration D18: a deferred prefetch whose anchor lost its backup since its match asks storage nothing
    (SGLang's scheduler gates on `is_backuped` when it prefetches). A model that prefetches anyway fails."""
    from kvcert.conformance.harness.driver import ConformanceFailure
    from kvcert.refimpl import cache as refcache
    from kvcert.spec.ops import Trace

    trace = Trace.from_json(D18.read_text())
    run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))
    run_trace(refcache.RefCache(trace.config), trace.config, refcache.RefCache.capabilities, list(trace.ops))

    def ungated(self: Any, node_id: int, namespace: Any, tokens: Any) -> int:
        anchor = self._live(node_id)
        kept, anchor.host_slots = anchor.host_slots, anchor.host_slots or ()  # looks backed up to the gate
        try:
            return gated(self, node_id, namespace, tokens)
        finally:
            anchor.host_slots = kept

    gated = refcache.RefCache.prefetch
    monkeypatch.setattr(refcache.RefCache, "prefetch", ungated)
    with pytest.raises(ConformanceFailure) as failure:
        run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))
    assert "INV-PF-2" in {v.inv for v in failure.value.violations}


FROM_STORAGE = Path(__file__).parent / "traces" / "rust-core-key-of-a-node-from-storage.json"


@pytest.mark.parametrize("factory", [factory_storage, factory_rust_storage], ids=["python", "rust"])
def test_the_tokens_of_a_node_that_came_from_storage_are_known(factory: Any) -> None:
    """Found by the ten-times `factory_rust_storage` run (an adapter bug, not SGLang's): prefetched pages,
    loaded back, host copy reclaimed by the next prefetch (write_back), then split by a match. No Insert
    names that node's tokens; the Rust-core reader (which sees spans, not tokens) learns them from the
    path it saw the node's lower half on. Before, its snapshot raised and ended the run."""
    from kvcert.spec.ops import Trace

    trace = Trace.from_json(FROM_STORAGE.read_text())
    run_trace(factory(trace.config), trace.config, factory.capabilities, list(trace.ops))


RECLAIM_CASCADE = Path(__file__).parent / "traces" / "core-reclaim-cascade.json"


@pytest.mark.parametrize("profile", ["core", "sglang-0.5.23"])
@pytest.mark.parametrize("factory", [factory_storage, factory_rust_storage], ids=["python", "rust"])
def test_a_reclaim_cascade_is_seated_under_the_core(factory: Any, profile: str) -> None:
    """Found by the ten-times `factory_rust_storage` run under the core (a harness error, not SGLang's): a
    write-back eviction of five nodes with the host full, three of them settled duplicates. SGLang reclaims all
    three duplicates for the first backups, so each is backed up and stored again when it is evicted. The
    profile's oracle does the same; the core's search tried 24 orders of all five host victims, never one that
    reclaims the right duplicate first, and failed INV-COPY-1. The core now tries each order of the dropped
    backups first."""
    from dataclasses import replace

    from kvcert.spec.ops import Trace

    trace = Trace.from_json(RECLAIM_CASCADE.read_text())
    caps = replace(factory.capabilities, profile=profile)
    run_trace(factory(trace.config), trace.config, caps, list(trace.ops))


def test_admission_declines_while_running_spans_reach_half_the_host_pool() -> None:
    """SGLang's prefetch_capacity_limit, as shipped: with a four-page request running on an eight-slot host pool, the
    next prefetch is declined before any storage call, as the model (sglang-0.5.23 THROTTLE) says; once it ends, the
    same prefetch is admitted. The same trace with the limit lifted fails: the rule is what the harness sees."""
    from test_profiles import THROTTLE_TRACE  # the profile test's trace: SGLang declines its last prefetch

    from kvcert.spec.ops import AbortPrefetch, Match, Prefetch

    config, declined = THROTTLE_TRACE
    ops = [*declined, AbortPrefetch(0), Match(None, (5, 6)), Prefetch(7)]
    h = run_trace(factory_storage(config), config, factory_storage.capabilities, ops, quiesce=False, close=False)
    try:
        cache = h.backend.h.cache  # type: ignore[attr-defined]
        stats = cache._prefetch_outcome_stats
        assert stats["declined_rate_limited"] == 1 and stats["issued"] == 2
        assert [p.requested for p in h.backend.snapshot().prefetches] == [2]
    finally:
        h.close()

    lifted = factory_storage(config)
    lifted.h.cc.prefetch_capacity_limit = 1 << 62  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="INV-PF-2"):
        run_trace(lifted, config, factory_storage.capabilities, ops)


def test_sglangs_own_file_backend_is_a_storage_target() -> None:
    """`factory_storage_file` runs HiCacheFile unpatched: a peer's pages, the engine's own stores, a dropped page
    file and a fetch across the batch all match the model; the harness's call faults are not declared (HiCacheFile
    does its own I/O), and a corrupt page file is F-L3-1 (its traces are replayed in test_known_findings)."""
    from kvcert.conformance.adapters.sglang.hicache_backend import factory_storage_file
    from kvcert.conformance.certification.scope import scope_gaps

    caps = factory_storage_file.capabilities  # type: ignore[attr-defined]
    assert caps.storage_faults == ("corrupt", "drop")
    assert any("storage faults error, partial_write, torn_write" in g for g in scope_gaps(caps, []))
    config = CacheConfig(capacity=8, host_capacity=8, write_policy="write_through", prefetch_policy="wait_complete")
    ops, keys = drop_mid_prefetch(config)
    h = run_trace(factory_storage_file(config), config, caps, ops, quiesce=False, close=False)
    try:
        backend = h.backend
        assert backend.files is not None and backend.h.l3.bridge is None  # type: ignore[attr-defined]
        names = sorted(n for n in os.listdir(backend.h.cc.storage_backend.file_path) if n.endswith(".bin"))  # type: ignore[attr-defined]
        assert len(names) == 2 + 2, "the engine's two pages and the peer's two left"
        assert [v.key for v in backend.snapshot().nodes if v.slots is None and v.parent is not None] == [(1, 2)]
    finally:
        h.close()
