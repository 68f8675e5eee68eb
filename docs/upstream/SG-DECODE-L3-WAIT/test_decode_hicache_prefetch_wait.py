"""The decode transfer queue closes a request's L3 prefetch admission wait when it takes the prefetched tokens.

Under the default `timeout` prefetch policy, UnifiedRadixCache.check_prefetch_progress opens an entry in
`_storage_prefetch_wait` when a prefetch is still running at its first poll. The prefill scheduler closes it at
admission (PrefillAdder -> finish_storage_prefetch_admission). The PD decode path takes the prefetched tokens in
DecodeHiCacheTransferMixin._try_hicache_queue_load_back with pop_prefetch_loaded_tokens only, so on a decode server
every request whose prefix was prefetched from L3 leaves its wait entry (and its budget) behind for the life of the
server.

Run: python -m pytest -q test_decode_hicache_prefetch_wait.py  (fails on SGLang 0.5.23; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

from sglang.srt.disaggregation.decode_hicache_mixin import DecodeHiCacheTransferMixin


class _StopAfterPrefetch(Exception):
    """Raised where the rematch that follows the prefetch step begins: this test stops there."""


class TestDecodeHiCachePrefetchWait(unittest.TestCase):
    @patch(
        "sglang.srt.disaggregation.decode_hicache_mixin._req_radix_key",
        side_effect=_StopAfterPrefetch,
    )
    def test_taking_prefetched_tokens_closes_the_admission_wait(self, _rematch):
        handle = object()
        tree_cache = MagicMock()
        tree_cache.check_prefetch_progress.return_value = True
        tree_cache.pop_prefetch_loaded_tokens.return_value = 16
        queue = DecodeHiCacheTransferMixin.__new__(DecodeHiCacheTransferMixin)
        queue.tree_cache = tree_cache
        dr = SimpleNamespace(
            req=SimpleNamespace(cache_request_handle=handle, origin_input_ids=[]),
            prefix_match=SimpleNamespace(l3_storage_hit_length=16, decode_prefix_len=32),
        )

        with self.assertRaises(_StopAfterPrefetch):
            queue._try_hicache_queue_load_back(dr)

        tree_cache.pop_prefetch_loaded_tokens.assert_called_once_with(handle)
        tree_cache.finish_storage_prefetch_admission.assert_called_once_with(
            handle, fulfilled_tokens=16, reason=None
        )


if __name__ == "__main__":
    unittest.main()
