"""`kvcert.gpu.storage.StorageTier`, called directly: store copies, page records, prefetch, its ends."""

from __future__ import annotations

from kvcert.conformance.harness import scheduler
from kvcert.conformance.harness.storage import MemoryStorage
from kvcert.gpu.cache import GpuCache
from kvcert.gpu.node import Node
from kvcert.gpu.storage import StorageTier
from kvcert.spec import storage as l3
from kvcert.spec.types import CacheConfig

TOKENS = (1, 2, 3, 4, 5, 6)


def cache_of(store: MemoryStorage, host: int = 16, **kw: object) -> tuple[GpuCache, StorageTier]:
    config = CacheConfig(
        **{"page_size": 2, "capacity": 16, "host_capacity": host, "prefetch_policy": "best_effort", **kw}  # type: ignore[arg-type]
    )
    cache = GpuCache(config)
    cache.attach_storage(store)
    return cache, cache.stores


def put(cache: GpuCache, tokens: tuple[int, ...]) -> Node:
    """The caller's side of an insert, the model's KV written (`conformance.harness.scheduler`)."""
    out = scheduler.insert_request(
        cache, None, tokens, write=lambda slots: cache.write_kv(slots, l3.token_entries(None, tokens, cache.kv_layers))
    )
    return cache.nodes[out.node]


def settle(cache: GpuCache) -> None:
    scheduler.settle(cache)


def test_a_write_ack_stores_every_page_verified_by_its_payload() -> None:
    store = MemoryStorage()
    cache, stores = cache_of(store)
    node = put(cache, TOKENS)
    (write,) = cache.copies.values()
    cache.complete(write.id)
    cache.poll()  # the write's ack issues the store copy, host-locking the node until its own ack
    (copy,) = cache.copies.values()
    assert copy.kind == "store" and node.host_lock_ref == 1 and not store.contents()
    cache.complete(copy.id)
    keys = l3.page_keys(None, TOKENS, 2, stores.digest)
    assert sorted(store.contents()) == sorted(keys)
    for page, key in enumerate(keys):
        assert l3.decode_page(key, store.contents()[key]) == l3.page_payload(None, TOKENS, page, 2, cache.kv_layers)
    cache.poll()
    assert node.host_lock_ref == 0


def test_pages_come_shallowest_first() -> None:
    cache, stores = cache_of(MemoryStorage())
    top = put(cache, TOKENS[:2])
    leaf = put(cache, TOKENS)
    settle(cache)
    keys, values = stores.pages_of([leaf, top])
    assert keys == list(l3.page_keys(None, TOKENS, 2, stores.digest)) and len(values) == 3


def test_a_prefetch_reserves_what_fits_fetches_verified_pages_and_hangs_them() -> None:
    store = MemoryStorage()
    writer, _ = cache_of(store)
    put(writer, TOKENS)
    settle(writer)
    reader, stores = cache_of(store, host=4)  # room for two of the three stored pages (D9)
    assert stores.prefetch(reader.root, None, TOKENS) == 4
    (p,) = stores.prefetches.values()
    assert len(p.keys) == 2 and p.span_pages == 3 and reader.alloc_host is not None and reader.alloc_host.available == 0
    stores.fetch(p.id)
    stores.fetch(p.id)
    assert stores.check(p.id) == 4 and not stores.prefetches
    m = reader.match_prefix(None, TOKENS)
    assert (m.length, m.host_length) == (0, 4)
    view = reader.snapshot().by_id()[m.host_node]
    assert view.host_slots is not None
    want = list(l3.token_entries(None, TOKENS[:4], reader.kv_layers))
    assert reader.read_host_kv(view.host_slots) == want


def test_a_corrupt_page_fails_the_prefetch_and_an_abort_frees_its_room() -> None:
    store = MemoryStorage()
    writer, _ = cache_of(store)
    put(writer, TOKENS)
    settle(writer)
    first = l3.page_keys(None, TOKENS, 2, writer.stores.digest)[0]
    store.batch_set([first], [b"junk"])
    reader, stores = cache_of(store)
    assert stores.prefetch(reader.root, None, TOKENS) == 6
    (p,) = stores.prefetches.values()
    stores.fetch(p.id)
    assert p.failed and p.fetched == 0  # never wrong KV
    stores.end(p, 0)
    assert reader.alloc_host is not None and reader.alloc_host.available == 16 and len(reader.nodes) == 1


def test_an_anchor_without_a_backup_asks_storage_nothing() -> None:
    store = MemoryStorage()
    writer, _ = cache_of(store)
    put(writer, TOKENS)
    settle(writer)
    reader, stores = cache_of(store, write_policy="write_back")
    anchor = put(reader, TOKENS[:2])  # write-back: no backup until eviction
    assert anchor.host_slots is None and stores.prefetch(anchor, None, TOKENS) == 0  # D18
