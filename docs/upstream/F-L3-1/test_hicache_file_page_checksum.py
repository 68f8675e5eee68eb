"""HiCacheFile, the `file` L3 backend, serves a damaged page file as KV and never rewrites it.

HiCacheFile.set (python/sglang/srt/mem_cache/hicache_storage.py) writes a page's raw bytes and nothing else, and
HiCacheFile.get checks only that the file holds as many bytes as the page. A page file with one byte flipped (bit rot,
a bad disk or copy) or another page's file under its name is loaded as the page's KV: every prompt whose prefix hashes
to that page is served wrong KV, silently, across restarts. HiCacheFile.set skips a key whose file exists ("already
exists. Skipped"), so the engine storing the page again leaves the damage in place.

Run: python -m pytest -q test_hicache_file_page_checksum.py  (fails on SGLang 0.5.23; passes with fix.patch)
"""

import os
import shutil
import tempfile
import unittest
from unittest import mock

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig


def _config():
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="Qwen/Qwen3-0.6B",
    )


def _page(seed):
    """A flat KV page as the host pool hands it to the backend (bf16)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4096, generator=generator).to(torch.bfloat16)


class TestHiCacheFilePageIntegrity(unittest.TestCase):
    def setUp(self):
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        # HiCacheFile reads its directory from this env var first.
        env = mock.patch.dict(
            os.environ, {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": directory.name}
        )
        env.start()
        self.addCleanup(env.stop)
        self.store = HiCacheFile(_config())
        self.pages = {"page-0": _page(0), "page-1": _page(1)}
        for key, page in self.pages.items():
            self.assertTrue(self.store.set(key, page))

    def _path(self, key):
        name = self.store._get_suffixed_key(key) + ".bin"
        return os.path.join(self.store.file_path, name)

    def _flip_one_byte(self, key, offset=100):
        with open(self._path(key), "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x01]))

    def _get(self, key):
        return self.store.get(key, torch.empty_like(self.pages[key]))

    def test_intact_page_is_served(self):
        page = self._get("page-0")
        self.assertIsNotNone(page)
        self.assertTrue(torch.equal(page, self.pages["page-0"]))

    def test_page_with_a_flipped_byte_is_a_miss(self):
        self._flip_one_byte("page-0")
        served = self._get("page-0") is not None
        self.assertFalse(served, "a page file with one byte flipped was served as KV")

    def test_another_pages_file_is_a_miss(self):
        shutil.copyfile(self._path("page-1"), self._path("page-0"))
        served = self._get("page-0") is not None
        self.assertFalse(served, "page-1's file was served as page-0's KV")

    def test_storing_a_damaged_page_again_rewrites_it(self):
        self._flip_one_byte("page-0")
        self.assertTrue(self.store.set("page-0", self.pages["page-0"]))
        page = self._get("page-0")
        self.assertIsNotNone(page)
        self.assertTrue(
            torch.equal(page, self.pages["page-0"]),
            "set skipped the damaged page file: the damage stays",
        )


if __name__ == "__main__":
    unittest.main()
