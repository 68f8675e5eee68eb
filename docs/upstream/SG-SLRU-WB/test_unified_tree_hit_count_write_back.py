"""Under --hicache-write-policy write_back the unified tree counts no hits, so SLRU (and LFU) rank every node as never
hit.

UnifiedTreeCore._inc_hit_count_and_check returns before `node.hit_count += 1` under write-back, and
_should_backup_after_insert returns before it counts a new leaf's first hit. SLRUStrategy ranks
(hit_count >= protected_threshold, last_access_time): no node reaches the protected segment, and a prefix reused many
times is evicted before one-off prompts that came after it, exactly what --radix-eviction-policy slru is set to
prevent. Under write-through (and with HiCache off) hits are counted.

Run: python -m pytest -q test_unified_tree_hit_count_write_back.py  (fails on SGLang 0.5.23; passes with fix.patch)
"""

import unittest
from types import SimpleNamespace

from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore


def _core(write_back):
    core = UnifiedTreeCore.__new__(UnifiedTreeCore)
    core.is_write_back = write_back
    core.enable_hicache = True
    core.enable_external_cache_linker = False
    core.write_through_threshold = 2
    return core


def _node():
    return SimpleNamespace(evicted=False, hit_count=0, backuped=False, key=[1, 2, 3, 4])


class TestUnifiedTreeHitCountWriteBack(unittest.TestCase):
    def test_hits_are_counted_under_write_back(self):
        for write_back in (False, True):
            core, node = _core(write_back), _node()
            core._inc_hit_count_and_check(node)
            core._inc_hit_count_and_check(node)
            self.assertEqual(node.hit_count, 2, f"write_back={write_back}")

    def test_write_back_never_fires_a_backup_on_a_hit(self):
        core, node = _core(True), _node()
        self.assertFalse(core._inc_hit_count_and_check(node))
        self.assertFalse(core._inc_hit_count_and_check(node))

    def test_a_new_leaf_counts_its_first_hit_under_write_back(self):
        core, node = _core(True), _node()
        state = SimpleNamespace(
            is_new_leaf=True,
            total_prefix_length=0,
            target_node=node,
            params=SimpleNamespace(inserted_len=0),
        )
        self.assertFalse(core._should_backup_after_insert(state))
        self.assertEqual(node.hit_count, 1)


if __name__ == "__main__":
    unittest.main()
