"""A session turn that ends above one of the session's own frontier leaves counts the session twice on that prefix.

With --enable-session-radix-cache, each tree component keeps a session's frontier leaves ("the deepest registered
node per cached path") and adds one session_ref to every node a frontier covers. A finished request registers the
node its insert ended on (UnifiedRadixCache.checkpoint_into_tree -> UnifiedSessionRefTracker.register_session_ref ->
TreeComponent.register_session_leaf). register_session_leaf looks for the session's frontier only above the new node
(_nearest_session_ancestor), so when a turn ends above a frontier (a retry of an earlier turn that stops earlier, a
one-token probe of the history) the ancestor becomes a second frontier on the same path, and the path above it gains
a second session_ref from the one session. The same two turns in the other order leave one frontier and one ref.

Effect: FullComponent evicts by (session_ref > 0, session_ref, LRU), so the prefix ranks as held by two sessions. With
HiCache, once the deeper KV has moved to the host the prefix is a device leaf, and prefixes of other sessions that it
ties with are evicted before it, out of LRU order. Nothing leaks: closing the session drops both frontiers.

Run: python -m pytest -q test_session_turn_above_frontier.py  (fails on SGLang 0.5.23; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace

import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

FULL = ComponentType.FULL
POOL_SIZE = 64


class TestSessionTurnAboveFrontier(unittest.TestCase):
    def setUp(self):
        kv_pool = MHATokenToKVPool(
            size=POOL_SIZE,
            page_size=1,
            dtype=torch.float32,
            head_num=1,
            head_dim=1,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        self.allocator = TokenToKVPoolAllocator(
            POOL_SIZE, dtype=torch.float32, device="cpu", kvcache=kv_pool, need_sort=False
        )
        self.req_to_token_pool = ReqToTokenPool(size=8, max_context_len=32, device="cpu", enable_memory_saver=False)
        self.cache = UnifiedRadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=1,
                tree_components=(FULL,),
                enable_session_radix_cache=True,
            )
        )
        (self.full,) = self.cache.tree_core.components
        self.next_row = 0

    def _finish_turn(self, session_id, prompt, output):
        """One finished request of the session, cached as release_kv_cache does: checkpoint() inserts its KV and
        registers the session at the node the insert ended on. Returns that node."""
        generation = self.cache.ensure_session_generation(session_id)
        kv_len = len(prompt) + len(output) - 1  # the last sampled token has no KV yet
        row, self.next_row = self.next_row, self.next_row + 1
        self.req_to_token_pool.write((row, slice(0, kv_len)), self.allocator.alloc(kv_len))
        req = SimpleNamespace(
            rid=f"{session_id}-{row}",
            origin_input_ids=list(prompt),
            output_ids=list(output),
            full_untruncated_fill_ids=(list(prompt) + list(output))[:kv_len],
            kv=SimpleNamespace(req_pool_idx=row, cache_protected_len=0, cache_inserted_len=0),
            finished=lambda: True,
            finished_reason=FINISH_LENGTH(length=len(output)),
            priority=None,
            session_id=session_id,
            session=None,
            session_generation=generation,
            kv_rotation_base=None,
            extra_key=None,
            cache_salt=None,
            lock=None,
            last_node=None,
        )
        self.cache.checkpoint(req, up_to=kv_len)
        self.cache.unlock(req.lock)
        return self.cache.tree_core.node_by_id(req.last_node)

    def _refs(self, *nodes):
        return [node.component_data[FULL].session_ref for node in nodes]

    def test_turn_ending_above_the_frontier_counts_the_session_once(self):
        # Turn 1: prompt [1..4], reply [5..9]; the tree holds prompt -> [5, 6, 7, 8], the session's frontier.
        first = self._finish_turn("a", [1, 2, 3, 4], [5, 6, 7, 8, 9])
        prompt_node = first.parent
        self.assertEqual(self._refs(prompt_node, first), [1, 1])

        # Turn 2 retries the prompt and stops after two tokens: its insert ends at [5], above the frontier.
        retry = self._finish_turn("a", [1, 2, 3, 4], [5, 6])
        self.assertIs(first.parent, retry)
        self.assertIs(retry.parent, prompt_node)

        self.assertEqual(self._refs(prompt_node)[0], 1, "one session, counted twice on its prompt")
        self.assertEqual(self._refs(retry, first), [1, 1])
        self.assertEqual(self.full._session_leaves["a"], {first})

        self.cache.release_radix_session("a")
        self.assertEqual(self._refs(prompt_node, retry, first), [0, 0, 0])

    def test_the_same_turns_in_the_other_order_count_once(self):
        # Passes on 0.5.23 too: the frontier advances from the short turn to the long one.
        retry = self._finish_turn("a", [1, 2, 3, 4], [5, 6])
        first = self._finish_turn("a", [1, 2, 3, 4], [5, 6, 7, 8, 9])
        self.assertIs(first.parent, retry)
        self.assertEqual(self._refs(retry.parent, retry, first), [1, 1, 1])
        self.assertEqual(self.full._session_leaves["a"], {first})


if __name__ == "__main__":
    unittest.main()
