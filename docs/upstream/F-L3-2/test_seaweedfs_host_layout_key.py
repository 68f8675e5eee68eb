"""SeaweedFSStore names an object by model, rank and page hash only, not by the host layout that wrote it: a cache
with another --hicache-mem-layout on the same bucket loads the objects in its own byte order, as a full hit.

The cache controller moves seaweedfs pages zero-copy (batch_set_v1 / batch_get_v1 in
python/sglang/srt/mem_cache/storage/seaweedfs/seaweedfs_store.py): an object is the host pool's page buffers
(MHATokenToKVPoolHost.get_page_buffer_meta) back to back, in the layout's order. layer_first writes K0 V0 K1 V1 ...
(one buffer per layer and K/V), page_first_direct writes K then V with (layer, token) inside, page_first (the default)
K then V with (token, layer) inside. The objects have the same size, _get_into checks only the size, and the key
(key_scope: model, TP/PP/CP rank) is the same. A server restarted with another layout, or a peer running one (e.g.
--hicache-io-backend direct, which turns page_first into page_first_direct), finds every page and serves wrong KV.

Needs boto3 and moto (with its server extra): the test starts moto's S3 server on 127.0.0.1 and stops it at the end.

Run: python -m pytest -q test_seaweedfs_host_layout_key.py  (fails on SGLang 0.5.23; passes with fix.patch)
"""

import unittest
import uuid

import torch
from moto.server import ThreadedMotoServer
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE_SIZE = 4
NUM_PAGES = 3
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 4 * PAGE_SIZE


def _host_pool(layout):
    """A CPU host pool over CPU stand-ins for the device KV buffers."""

    def layers():
        return tuple(
            torch.zeros(DEVICE_TOKENS + PAGE_SIZE, HEADS, HEAD_DIM)
            for _ in range(LAYERS)
        )

    def ptrs(buffers):
        return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)

    k, v = layers(), layers()
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=ptrs(k),
            v_data_ptrs=ptrs(v),
            layout=KVBufferLayout.NHD,
        ),
        page_size=PAGE_SIZE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE_SIZE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )


def _kv(pool, page):
    """The page's KV in one order for every layout: (K|V, layer, token, head, dim)."""
    start = page * PAGE_SIZE
    if pool.layout == "layer_first":
        return pool.kv_buffer[:, :, start : start + PAGE_SIZE]
    if pool.layout == "page_first":
        return pool.kv_buffer[:, start : start + PAGE_SIZE].transpose(1, 2)
    if pool.layout == "page_first_direct":
        return pool.kv_buffer[:, page]
    raise ValueError(pool.layout)


class TestSeaweedFSHostLayout(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        cls.server.start()
        host, port = cls.server.get_host_and_port()
        cls.endpoint = f"http://{host}:{port}"

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def setUp(self):
        # Writer and reader share one bucket, as two servers would.
        self.extra_config = {
            "endpoint": self.endpoint,
            "bucket": f"sgl-{uuid.uuid4().hex[:10]}",
            "access_key": "testing",
            "secret_key": "testing",
        }

    def _store(self, layout):
        """SeaweedFSStore as the cache controller attaches it, over a `layout` pool."""
        pool = _host_pool(layout)
        config = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=layout == "page_first",
            model_name="Qwen/Qwen3-0.6B",
            extra_config=dict(self.extra_config),
        )
        store = StorageBackendFactory.create_backend("seaweedfs", config, pool)
        store.register_mem_pool_host(pool)
        self.addCleanup(store._executor.shutdown)
        return store, pool

    def _write_then_read(self, writer_layout, reader_layout):
        """A writer backs pages up; a fresh reader prefetches them."""
        writer, written = self._store(writer_layout)
        generator = torch.Generator().manual_seed(0)
        for page in range(NUM_PAGES):
            kv = _kv(written, page)
            kv.copy_(torch.randn(kv.shape, generator=generator))
        keys = [uuid.uuid4().hex for _ in range(NUM_PAGES)]
        host_indices = torch.arange(NUM_PAGES * PAGE_SIZE, dtype=torch.int64)
        self.assertEqual(writer.batch_set_v1(keys, host_indices), [True] * NUM_PAGES)

        reader, read = self._store(reader_layout)
        hits = reader.batch_exists(keys)
        if not hits:  # the controller prefetches nothing
            return written, read, 0, []
        loaded = reader.batch_get_v1(keys[:hits], host_indices[: hits * PAGE_SIZE])
        return written, read, hits, loaded

    def _assert_never_served_wrong_kv(self, writer, reader):
        written, read, hits, loaded = self._write_then_read(writer, reader)
        for page, ok in enumerate(loaded):
            if ok:
                self.assertTrue(
                    torch.equal(_kv(read, page), _kv(written, page)),
                    f"a {reader} cache read the {writer} cache's page {page} "
                    f"as a hit ({hits} of {NUM_PAGES} pages found): wrong KV",
                )

    def test_same_layout_reader_is_served_the_writers_kv(self):
        for layout in ("layer_first", "page_first", "page_first_direct"):
            written, read, hits, loaded = self._write_then_read(layout, layout)
            self.assertEqual(hits, NUM_PAGES, layout)
            self.assertEqual(loaded, [True] * NUM_PAGES, layout)
            for page in range(NUM_PAGES):
                self.assertTrue(torch.equal(_kv(read, page), _kv(written, page)))

    def test_page_first_direct_reader_of_layer_first_objects(self):
        self._assert_never_served_wrong_kv("layer_first", "page_first_direct")

    def test_layer_first_reader_of_page_first_direct_objects(self):
        self._assert_never_served_wrong_kv("page_first_direct", "layer_first")

    def test_page_first_direct_reader_of_page_first_objects(self):
        # The default layout, and what --hicache-io-backend direct turns it into.
        self._assert_never_served_wrong_kv("page_first", "page_first_direct")


if __name__ == "__main__":
    unittest.main()
