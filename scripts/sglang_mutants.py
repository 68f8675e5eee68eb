# Over 600 lines: a catalogue of SGLang source mutants, one short patch each, read as one list.
"""Source mutants of SGLang 0.5.23's `RadixCache`: how much of a real engine's bug space `kvcert certify` kills.

Each mutant is one or more exact edits of the installed `sglang/srt/mem_cache/radix_cache.py` (each `find` must
occur once: a new SGLang breaks the table loudly). The mutated file is loaded in place of the module by an import
hook (`sitecustomize` on PYTHONPATH, in a temporary folder; the installed file is never touched), and the SGLang
RadixCache adapter is certified over it in a fresh process, one mutant at a time. `SURVIVES` names the mutants that
are expected to pass and why (equivalent, or on a path the adapter never drives): a survivor not listed there is
a gap in the suite.

    KVCERT_SGLANG=1 .venv/bin/python scripts/sglang_mutants.py                  # all, 60 examples, page sizes 1 and 4
    KVCERT_SGLANG=1 .venv/bin/python scripts/sglang_mutants.py --default-budget # certify's default budget (slow)
    KVCERT_SGLANG=1 .venv/bin/python scripts/sglang_mutants.py m09_split_drops_priority ...
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent.parent
TARGET = "kvcert.conformance.adapters.sglang.radix:factory"
MODULE = "sglang.srt.mem_cache.radix_cache"

SURVIVES: dict[str, str] = {
    "m07_match_no_touch_start": "equivalent: only the root's stamp is lost, and the root is never an eviction candidate",
    "m35_insert_no_clone": "equivalent: every value reaching _insert_helper is already a private tensor",
    "m43_lt_flipped": "equivalent: __lt__ only breaks exact rank ties, which the spec leaves free",
    "m48_inc_lock_delta_sign": "unreachable: IncLockRefResult.delta has no reader in 0.5.23 (the adapter discards it)",
    "m49_reset_keeps_leaves": "unreachable: reset() runs only in __init__ through the adapter (no flush op)",
    "m60_dec_lock_reordered": "equivalent: the same logic in another order (a control)",
}
"""Mutants expected to pass, and why."""

HOOK = (
    f"""import importlib.abc, importlib.machinery, os, sys
class _Loader(importlib.abc.Loader):
    def __init__(self, path): self.path = path
    def create_module(self, spec): return None
    def exec_module(self, module):
        module.__file__ = self.path
        exec(compile(open(self.path, encoding="utf-8").read(), self.path, "exec"), module.__dict__)
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != {MODULE!r} or not os.environ.get("KVCERT_SG_MUTANT"):
            return None
        return importlib.machinery.ModuleSpec(name, _Loader(os.environ["KVCERT_SG_MUTANT"]), origin=os.environ["KVCERT_SG_MUTANT"])
sys.meta_path.insert(0, _Finder())
"""
)

MUTANTS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "m01_page_aligned_ceil",
        "RadixKey.page_aligned rounds the length up instead of down (partial page kept)",
        [
            (
                "aligned_len = len(self) // page_size * page_size",
                "aligned_len = (len(self) + page_size - 1) // page_size * page_size",
            )
        ],
    ),
    (
        "m02_match_no_page_round",
        "RadixKey.match_at returns the raw token match, not rounded down to page_size",
        [
            (
                "        if page_size == 1:\n            return matched_tokens\n        return (matched_tokens // page_size) * page_size",
                "        if page_size == 1:\n            return matched_tokens\n        return matched_tokens",
            )
        ],
    ),
    (
        "m03_match_gallop_off_by_one",
        "RadixKey.match_at binary search reports hi (one token past the divergence)",
        [("                matched_tokens = lo\n", "                matched_tokens = hi\n")],
    ),
    (
        "m04_match_split_appends_tail",
        "_match_prefix_helper appends the split child's (tail) value instead of the new head node's",
        [("                value.append(new_node.value)", "                value.append(child.value)")],
    ),
    (
        "m05_match_split_on_full",
        "_match_prefix_helper splits when prefix_len <= len(child.key) (splits even on a full node match)",
        [
            (
                "            if prefix_len < len(child.key):\n                new_node = self._split_node(child.key, child, prefix_len)\n                value.append(new_node.value)",
                "            if prefix_len <= len(child.key):\n                new_node = self._split_node(child.key, child, prefix_len)\n                value.append(new_node.value)",
            )
        ],
    ),
    (
        "m06_match_no_touch_child",
        "_match_prefix_helper does not refresh child.last_access_time on the matched path",
        [("            child.last_access_time = access_time\n", "")],
    ),
    (
        "m07_match_no_touch_start",
        "_match_prefix_helper does not refresh the start (root) node's last_access_time",
        [
            (
                "        access_time = time.monotonic()\n        node.last_access_time = access_time\n\n        child_key = key.child_key(self.page_size)\n\n        value = []",
                "        access_time = time.monotonic()\n\n        child_key = key.child_key(self.page_size)\n\n        value = []",
            )
        ],
    ),
    (
        "m08_split_drops_hit_count",
        "_split_node does not copy hit_count to the new head node",
        [("        new_node.hit_count = child.hit_count\n", "")],
    ),
    (
        "m09_split_drops_priority",
        "_split_node's new head node gets default priority 0, not the child's",
        [("        new_node = TreeNode(priority=child.priority)", "        new_node = TreeNode()")],
    ),
    (
        "m10_split_value_order",
        "_split_node slices child.value before new_node.value (head gets the tail's slots)",
        [
            (
                "        new_node.value = child.value[:split_len].clone()\n        child.parent = new_node\n        child.key = child.key[split_len:]\n        child.value = child.value[split_len:].clone()\n",
                "        child.parent = new_node\n        child.key = child.key[split_len:]\n        child.value = child.value[split_len:].clone()\n        new_node.value = child.value[:split_len].clone()\n",
            )
        ],
    ),
    (
        "m11_split_wrong_child_key",
        "_split_node files the child under the head's child_key instead of the tail's",
        [
            (
                "        new_node.children = {key[split_len:].child_key(self.page_size): child}",
                "        new_node.children = {key.child_key(self.page_size): child}",
            )
        ],
    ),
    (
        "m12_split_parent_not_relinked",
        "_split_node never re-points the parent's children entry at the new node",
        [("        new_node.parent.children[key.child_key(self.page_size)] = new_node\n", "")],
    ),
    (
        "m13_split_lock_zero",
        "_split_node's new head node starts with lock_ref 0 instead of child's",
        [("        new_node.lock_ref = child.lock_ref", "        new_node.lock_ref = 0")],
    ),
    (
        "m14_inc_lock_le1",
        "inc_lock_ref moves size evictable->protected when lock_ref <= 1 (double count on 2nd lock)",
        [
            (
                "            if node.lock_ref == 0:\n                self.evictable_size_ -= len(node.key)",
                "            if node.lock_ref <= 1:\n                self.evictable_size_ -= len(node.key)",
            )
        ],
    ),
    (
        "m15_inc_lock_stops_early",
        "inc_lock_ref stops one node early (never locks the top-level node under root)",
        [
            (
                "        delta = 0\n        while node != self.root_node:\n            if node.lock_ref == 0:",
                "        delta = 0\n        while node.parent != self.root_node and node != self.root_node:\n            if node.lock_ref == 0:",
            )
        ],
    ),
    (
        "m16_dec_lock_no_evictable",
        "dec_lock_ref forgets to add the node's size back to evictable_size_",
        [
            (
                "            if node.lock_ref == 1:\n                self.evictable_size_ += len(node.key)\n",
                "            if node.lock_ref == 1:\n",
            )
        ],
    ),
    (
        "m17_dec_lock_no_leaf_update",
        "dec_lock_ref does not call _update_leaf_status (unlocked leaves never become evictable)",
        [
            (
                "            node.lock_ref -= 1\n            self._update_leaf_status(node)\n",
                "            node.lock_ref -= 1\n",
            )
        ],
    ),
    (
        "m18_inc_lock_no_leaf_update",
        "inc_lock_ref does not call _update_leaf_status (locked leaf stays an eviction candidate)",
        [
            (
                "            node.lock_ref += 1\n            self._update_leaf_status(node)\n",
                "            node.lock_ref += 1\n",
            )
        ],
    ),
    (
        "m19_dec_lock_wrong_threshold",
        "dec_lock_ref tests lock_ref == 0 (after-decrement logic placed before the decrement)",
        [
            (
                "            if node.lock_ref == 1:\n                self.evictable_size_ += len(node.key)",
                "            if node.lock_ref == 0:\n                self.evictable_size_ += len(node.key)",
            )
        ],
    ),
    (
        "m20_dec_lock_stops_late",
        "dec_lock_ref also decrements the root (loop runs one node too far)",
        [
            (
                '            if node.parent is None:\n                assert node is self.root_node, (\n                    "This request holds the node from another tree"\n                )\n            node = node.parent\n        return DecLockRefResult(delta=delta)',
                '            if node.parent is None:\n                assert node is self.root_node, (\n                    "This request holds the node from another tree"\n                )\n            node = node.parent\n        if node is self.root_node:\n            node.lock_ref -= 1\n        return DecLockRefResult(delta=delta)',
            )
        ],
    ),
    (
        "m21_evict_no_free",
        "evict never returns the victim's slots to the allocator (leak)",
        [("            self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)\n", "")],
    ),
    (
        "m22_evict_counts_nodes",
        "evict counts nodes instead of tokens (num_evicted += 1)",
        [("            num_evicted += len(x.value)\n", "            num_evicted += 1\n")],
    ),
    (
        "m23_evict_no_parent_push",
        "evict never pushes a parent that became a leaf into the heap",
        [
            (
                "            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:\n                new_priority = self.eviction_strategy.get_priority(x.parent)\n                heapq.heappush(eviction_heap, (new_priority, x.parent))\n",
                "",
            )
        ],
    ),
    (
        "m24_evict_pushes_locked_parent",
        "evict pushes a childless parent even when it is locked",
        [
            (
                "            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:",
                "            if len(x.parent.children) == 0 and x.parent is not self.root_node:",
            )
        ],
    ),
    (
        "m25_evict_le",
        "evict loop uses <= (evicts one node more once the target is met)",
        [
            (
                "        while num_evicted < num_tokens and len(eviction_heap):",
                "        while num_evicted <= num_tokens and len(eviction_heap):",
            )
        ],
    ),
    (
        "m26_evict_parent_child_prio",
        "evict pushes the parent with the evicted child's priority, not the parent's",
        [
            (
                "                new_priority = self.eviction_strategy.get_priority(x.parent)",
                "                new_priority = self.eviction_strategy.get_priority(x)",
            )
        ],
    ),
    (
        "m27_delete_leaf_no_size",
        "_delete_leaf does not subtract the leaf from evictable_size_",
        [
            (
                "        self.evictable_size_ -= len(node.key)\n        if node in self.evictable_leaves:",
                "        if node in self.evictable_leaves:",
            )
        ],
    ),
    (
        "m28_delete_leaf_no_parent_status",
        "_delete_leaf does not re-check the parent's leaf status (parent never enters evictable_leaves)",
        [
            (
                "            self.evictable_leaves.remove(node)\n        self._update_leaf_status(node.parent)\n",
                "            self.evictable_leaves.remove(node)\n",
            )
        ],
    ),
    (
        "m29_insert_prefix_full_node",
        "_insert_helper adds the whole node length to prefix_len even when it splits",
        [
            (
                "            prefix_len = node.key.match(key, page_size=self.page_size)\n            total_prefix_length += prefix_len\n",
                "            prefix_len = node.key.match(key, page_size=self.page_size)\n            total_prefix_length += len(node.key)\n",
            )
        ],
    ),
    (
        "m30_insert_no_hit_on_path",
        "_insert_helper does not bump hit_count on already-cached nodes it walks",
        [("            if total_prefix_length > inserted_len:\n                self._inc_hit_count(node)\n", "")],
    ),
    (
        "m31_insert_parent_leaf_status",
        "_insert_helper does not update the parent's leaf status when it gains a child",
        [
            (
                "            self.evictable_size_ += len(key)\n            self._update_leaf_status(node)\n",
                "            self.evictable_size_ += len(key)\n",
            )
        ],
    ),
    (
        "m32_insert_priority_overwrite",
        "_insert_helper overwrites the walked node's priority instead of taking the max",
        [
            (
                "            else:\n                node.priority = max(node.priority, priority)\n",
                "            else:\n                node.priority = priority\n",
            )
        ],
    ),
    (
        "m33_insert_leaf_default_priority",
        "_insert_helper creates the new leaf with default priority",
        [
            (
                "            new_node = TreeNode(priority=priority)\n            new_node.parent = node",
                "            new_node = TreeNode()\n            new_node.parent = node",
            )
        ],
    ),
    (
        "m34_insert_no_value_trunc",
        "insert does not truncate value to the page-aligned key length",
        [
            (
                "        if value is not None:\n            value = value[: len(key)]\n",
                "        if value is not None:\n            pass\n",
            )
        ],
    ),
    (
        "m35_insert_no_clone",
        "_insert_helper stores value without clone() (aliases the caller's tensor)",
        [("            new_node.value = value.clone()\n", "            new_node.value = value\n")],
    ),
    (
        "m36_slice_drops_extra_key",
        "RadixKey.__getitem__ (non-bigram) drops extra_key on slices (namespace lost after page_aligned / split)",
        [
            (
                "        return RadixKey(\n            self.token_ids[start:stop],\n            self.extra_key,\n            cache_salt=self.cache_salt,\n        )",
                "        return RadixKey(\n            self.token_ids[start:stop],\n            None,\n            cache_salt=self.cache_salt,\n        )",
            ),
            (
                "        if self.extra_key != other.extra_key:\n            raise",
                "        if False:\n            raise",
            ),
        ],
    ),
    (
        "m37_child_key_ignores_ns",
        "RadixKey.child_key_at ignores extra_key (children of different namespaces collide)",
        [
            ("        return plain if self.extra_key is None else (self.extra_key, plain)", "        return plain"),
            (
                "        if self.extra_key != other.extra_key:\n            raise",
                "        if False:\n            raise",
            ),
        ],
    ),
    (
        "m38_match_ns_only_top",
        "match_prefix drops the namespace for the lookup (insert keeps it)",
        [
            (
                "        key = key.page_aligned(self.page_size)\n\n        if len(key) == 0:\n            return self._empty_match_result\n",
                "        key = key.page_aligned(self.page_size)\n        key = RadixKey(key.token_ids, None, limit=key.limit)\n\n        if len(key) == 0:\n            return self._empty_match_result\n",
            ),
            (
                "        if self.extra_key != other.extra_key:\n            raise",
                "        if False:\n            raise",
            ),
        ],
    ),
    (
        "m39_path_indices_no_reverse",
        "path_device_indices forgets values.reverse() (slots of multi-node paths out of order)",
        [("        values.reverse()\n        return torch.cat(values)", "        return torch.cat(values)")],
    ),
    (
        "m40_leaf_status_lock_gt1",
        "_update_leaf_status treats lock_ref == 1 as unlocked (lock_ref > 1)",
        [("        if node.evicted or node.lock_ref > 0:", "        if node.evicted or node.lock_ref > 1:")],
    ),
    (
        "m41_leaf_status_ignores_children",
        "_update_leaf_status ignores children (inner nodes become eviction candidates)",
        [
            (
                "        for child in node.children.values():\n            if not child.evicted:",
                "        for child in ():\n            if not child.evicted:",
            )
        ],
    ),
    (
        "m42_match_no_page_align",
        "match_prefix does not page-align the lookup key",
        [
            (
                "        key = key.page_aligned(self.page_size)\n\n        if len(key) == 0:\n            return self._empty_match_result\n",
                "\n        if len(key) == 0:\n            return self._empty_match_result\n",
            )
        ],
    ),
    (
        "m43_lt_flipped",
        "TreeNode.__lt__ compares with > (tie-breaks in the eviction heap reversed)",
        [
            (
                "        return self.last_access_time < other.last_access_time",
                "        return self.last_access_time > other.last_access_time",
            )
        ],
    ),
    (
        "m44_ckpt_no_dup_free",
        "_insert_cache (checkpoint) never frees the duplicate slots the insert exposed (leak)",
        [
            (
                "        self.token_to_kv_pool_allocator.free_segment(\n            kv_indices[req.kv.cache_protected_len : result.prefix_len],\n            start_pos=req.kv.cache_protected_len,\n        )\n",
                "",
            )
        ],
    ),
    (
        "m45_ckpt_no_row_write",
        "checkpoint does not repoint the request's row at the tree's slots",
        [
            (
                "        self.req_to_token_pool.write(\n            (req.kv.req_pool_idx, slice(req.kv.cache_protected_len, len(new_indices))),\n            new_indices[req.kv.cache_protected_len :],\n        )\n",
                "",
            )
        ],
    ),
    (
        "m46_ckpt_protected_not_updated",
        "checkpoint does not advance req.kv.cache_protected_len",
        [
            (
                "        req.kv.cache_protected_len = len(new_indices)\n\n        self.unlock(req.lock)",
                "\n        self.unlock(req.lock)",
            )
        ],
    ),
    (
        "m47_ckpt_lock_old_node",
        "checkpoint re-locks the request's old last_node instead of the new one",
        [("        req.lock = self.lock(new_last_node)\n", "        req.lock = self.lock(req.last_node)\n")],
    ),
    (
        "m48_inc_lock_delta_sign",
        "inc_lock_ref reports delta with the wrong sign (unreachable: adapter discards the result)",
        [("                delta -= len(node.key)\n", "                delta += len(node.key)\n")],
    ),
    (
        "m49_reset_keeps_leaves",
        "reset() does not clear evictable_leaves (reset only runs in __init__ through the adapter)",
        [("        self.evictable_leaves.clear()\n", "")],
    ),
    (
        "m50_prompt_split_priority",
        "_insert_cache's prompt-boundary re-insert uses priority-1 (split_prompt path)",
        [
            (
                "                        priority=min(priority + 1, torch.iinfo(torch.int64).max),",
                "                        priority=priority - 1,",
            )
        ],
    ),
    (
        "m51_ckpt_dup_free_off_by_page",
        "_insert_cache frees duplicates starting one page late (leaks one page of duplicates)",
        [
            (
                "            kv_indices[req.kv.cache_protected_len : result.prefix_len],\n            start_pos=req.kv.cache_protected_len,",
                "            kv_indices[req.kv.cache_protected_len + self.page_size : result.prefix_len],\n            start_pos=req.kv.cache_protected_len + self.page_size,",
            )
        ],
    ),
    (
        "m52_evict_free_wrong_slots",
        "evict frees the parent's slots prefix instead of the victim's when the parent is not root",
        [
            (
                "            self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)\n",
                "            self.token_to_kv_pool_allocator.free_segment(x.value if x.parent is self.root_node or len(x.parent.value) < len(x.value) else x.parent.value[: len(x.value)], start_pos=0)\n",
            )
        ],
    ),
    (
        "m53_insert_split_no_prio_bump",
        "_insert_helper does not raise a split head node's priority to the inserter's",
        [
            (
                "                new_node = self._split_node(node.key, node, prefix_len)\n                new_node.priority = max(new_node.priority, priority)\n",
                "                new_node = self._split_node(node.key, node, prefix_len)\n",
            )
        ],
    ),
    (
        "m54_insert_leaf_no_hit",
        "_insert_helper creates new leaves with hit_count 0 (initial hit not counted)",
        [
            (
                "            if total_prefix_length + len(key) > inserted_len:\n                self._inc_hit_count(new_node)\n",
                "",
            )
        ],
    ),
    (
        "m55_insert_no_touch_path",
        "_insert_helper does not refresh last_access_time on nodes it walks",
        [
            (
                "            node = node.children[child_key]\n            node.last_access_time = access_time\n",
                "            node = node.children[child_key]\n",
            )
        ],
    ),
    (
        "m57_split_inherits_creation",
        "_split_node's head node inherits child's creation_time (FIFO age) instead of now",
        [
            (
                "        new_node.hit_count = child.hit_count\n",
                "        new_node.hit_count = child.hit_count\n        new_node.creation_time = child.creation_time\n",
            )
        ],
    ),
    (
        "m60_dec_lock_reordered",
        "dec_lock_ref decrements first, then tests lock_ref == 0 (refactor; expected equivalent)",
        [
            (
                "            if node.lock_ref == 1:\n                self.evictable_size_ += len(node.key)\n                self.protected_size_ -= len(node.key)\n                delta += len(node.key)\n            node.lock_ref -= 1\n",
                "            node.lock_ref -= 1\n            if node.lock_ref == 0:\n                self.evictable_size_ += len(node.key)\n                self.protected_size_ -= len(node.key)\n                delta += len(node.key)\n",
            )
        ],
    ),
    (
        "m56_insert_hit_ignores_inserted_len",
        "_insert_helper counts hits on already-inserted nodes (drops the inserted_len gate)",
        [
            (
                "            if total_prefix_length > inserted_len:\n                self._inc_hit_count(node)\n",
                "            if True:\n                self._inc_hit_count(node)\n",
            )
        ],
    ),
    (
        "m58_insert_cache_inserted_len_not_advanced",
        "_insert_cache never advances req.kv.cache_inserted_len",
        [("        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, key_len)\n", "")],
    ),
]


def _original() -> str:
    import importlib.util

    sys.path.insert(0, str(ROOT))
    from kvcert.conformance.adapters.sglang.env import import_sglang

    import_sglang()
    spec = importlib.util.find_spec(MODULE)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_text()


def build(original: str, edits: list[tuple[str, str]], name: str) -> str:
    out = original
    for find, repl in edits:
        if out.count(find) != 1:
            raise SystemExit(f"{name}: an edit occurs {out.count(find)} times in {MODULE}")
        out = out.replace(find, repl)
    return out


def main(
    names: list[str] = typer.Argument(None),
    default_budget: bool = typer.Option(False, help="certify's default budget: every page size and policy"),
    examples: int = 60,
    out: Path = Path("kvcert-failures/sglang-mutants"),
) -> None:
    chosen = [m for m in MUTANTS if not names or m[0] in names]
    if names and len(chosen) != len(set(names)):
        raise typer.BadParameter(f"unknown mutant among {names}")
    original = _original()
    args = [] if default_budget else ["--examples", str(examples), "--page-size", "1", "--page-size", "4"]
    gaps, killed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(HOOK)
        for name, _doc, edits in chosen:
            path = Path(tmp) / f"{name}.py"
            path.write_text(build(original, edits, name))
            cert = Path(tmp) / f"{name}.json"
            env = dict(os.environ, PYTHONPATH=tmp, KVCERT_SG_MUTANT=str(path), KVCERT_SGLANG="1")
            cmd = [str(ROOT / "kvcert"), "certify", TARGET, *args, "--out", str(out / name), "--json", str(cert)]
            t0 = time.monotonic()
            subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            secs = time.monotonic() - t0
            cells = json.loads(cert.read_text())["cells"]
            failed = [c for c in cells if not c["passed"]]
            if failed:
                killed += 1
                rules = sorted({r for c in failed for r in re.findall(r"INV-[A-Z]+-\d+", c["failure"] or "")})
                first = failed[0]
                verdict = f"killed   {len(failed)}/{len(cells)} cells, first ps{first['page_size']}/{first['policy']} "
                verdict += f"after {first['examples']} examples: {' '.join(rules)}"
            elif name in SURVIVES:
                verdict = f"survives {SURVIVES[name]}"
            else:
                verdict = "SURVIVES: a gap in the suite"
                gaps.append(name)
            print(f"{name:44s} {verdict}  ({secs:.0f} s)", flush=True)
    print(
        f"killed {killed}/{len(chosen)}; expected survivors {sum(m[0] in SURVIVES for m in chosen)}; gaps {len(gaps)}"
    )
    if gaps:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
