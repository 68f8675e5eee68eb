"""The suite sees through the adapter: real SGLang, patched with a known bug class, fails certification.

Each case monkeypatches one method of SGLang's own `RadixCache` (restored after the
test) the way a regression in an engine fork would change it, and certifies the
unmodified adapter over it. A pass here would mean the adapter hides bugs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang.env import import_sglang  # noqa: E402

SG = import_sglang()

from kvcert.conformance.certification.certify import certify  # noqa: E402

pytestmark = pytest.mark.sglang
RC = SG.radix_cache.RadixCache


def split_drops_lock(orig: Callable[..., Any]) -> Callable[..., Any]:
    def patched(self: Any, key: Any, child: Any, split_len: int) -> Any:
        node = orig(self, key, child, split_len)
        node.lock_ref = 0
        return node

    return patched


def lock_skips_self(orig: Callable[..., Any]) -> Callable[..., Any]:
    def patched(self: Any, node: Any, *args: Any) -> Any:
        return orig(self, node.parent if node is not self.root_node else node, *args)

    return patched


def evict_never_stops(orig: Callable[..., Any]) -> Callable[..., Any]:
    def patched(self: Any, params: Any) -> Any:
        return orig(self, SG.EvictParams(num_tokens=10**9))

    return patched


def insert_ignores_namespace(orig: Callable[..., Any]) -> Callable[..., Any]:
    def patched(self: Any, params: Any) -> Any:
        params.key.extra_key = None
        return orig(self, params)

    return patched


def checkpoint_frees_protected(orig: Callable[..., Any]) -> Callable[..., Any]:
    """A running request's checkpoint forgets its protected prefix: the duplicate free starts at 0 and takes
    the slots the tree already held for it."""

    def patched(self: Any, req: Any, *, up_to: int) -> Any:
        req.kv.cache_protected_len = 0
        return orig(self, req, up_to=up_to)

    return patched


def checkpoint_keeps_old_lock(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The lock is taken on the new node but never dropped from the old one."""

    def patched(self: Any, req: Any, *, up_to: int) -> Any:
        self.unlock = lambda lock: None
        try:
            return orig(self, req, up_to=up_to)
        finally:
            del self.unlock

    return patched


def checkpoint_frees_partial_page(orig: Callable[..., Any]) -> Callable[..., Any]:
    """After the insert, the partial last page (still the request's, still in its row) is freed too."""

    def patched(self: Any, req: Any, *, up_to: int) -> Any:
        out = orig(self, req, up_to=up_to)
        tail = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, req.kv.cache_protected_len : up_to]
        if len(tail):
            self.token_to_kv_pool_allocator.free(tail.to(dtype=__import__("torch").int64))
        return out

    return patched


def checkpoint_keeps_stale_row(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The request's row is not repointed at the tree's slots: it still reads the duplicates the checkpoint freed
    (their bytes are right until someone else takes them, so only the row's slots show it)."""

    def patched(self: Any, req: Any, *, up_to: int) -> Any:
        pool = self.req_to_token_pool
        row = pool.req_to_token[req.kv.req_pool_idx].clone()
        write = pool.write
        pool.write = lambda *args, **kw: None
        try:
            return orig(self, req, up_to=up_to)
        finally:
            pool.write = write
            pool.req_to_token[req.kv.req_pool_idx] = row

    return patched


def _assert_caught(cert: Any, name: str, expected: str) -> None:
    """The patched engine failed a cell, broke the expected rule, and the saved trace replays."""
    failing = [c for c in cert.cells if not c.passed]
    assert failing, f"SGLang with {name} was certified"
    assert expected in (failing[0].failure or ""), failing[0].failure
    assert failing[0].reproduced


CASES: dict[str, tuple[list[str], Callable[[Callable[..., Any]], Callable[..., Any]], int, str]] = {
    "split_drops_lock": (["_split_node"], split_drops_lock, 1, "INV-LOCK"),
    "lock_skips_self": (["inc_lock_ref", "dec_lock_ref"], lock_skips_self, 1, "INV-LOCK-2"),
    "evict_never_stops": (["evict"], evict_never_stops, 4, "INV-EVICT-2"),
    "insert_ignores_namespace": (["insert"], insert_ignores_namespace, 1, "INV-"),
    # a running request's checkpoint (SPEC.md §4.8), SGLang's own `RadixCache.checkpoint`
    "checkpoint_frees_protected": (["checkpoint"], checkpoint_frees_protected, 1, "INV-"),
    "checkpoint_keeps_old_lock": (["checkpoint"], checkpoint_keeps_old_lock, 1, "INV-LOCK"),
    "checkpoint_frees_partial_page": (["checkpoint"], checkpoint_frees_partial_page, 4, "INV-"),
    "checkpoint_keeps_stale_row": (["checkpoint"], checkpoint_keeps_stale_row, 1, "INV-REQ-2"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_patched_sglang_is_not_certified(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    methods, mutate, page_size, expected = CASES[name]
    for method in methods:
        monkeypatch.setattr(RC, method, mutate(getattr(RC, method)))
    cert = certify(
        "kvcert.conformance.adapters.sglang.radix:factory",
        examples=200,
        steps=30,
        page_sizes=[page_size],
        policies=["lru"],
        out_dir=tmp_path,
    )
    _assert_caught(cert, name, expected)


def split_drops_priority(orig: Callable[..., Any]) -> Callable[..., Any]:
    """A split's new prefix node starts at priority 0 instead of copying the child's (SPEC.md §4.7)."""

    def patched(self: Any, key: Any, child: Any, split_len: int) -> Any:
        node = orig(self, key, child, split_len)
        node.priority = 0
        return node

    return patched


def split_drops_hit_count(orig: Callable[..., Any]) -> Callable[..., Any]:
    """A split's new prefix node starts with no hits instead of copying the child's count."""

    def patched(self: Any, key: Any, child: Any, split_len: int) -> Any:
        node = orig(self, key, child, split_len)
        node.hit_count = 0
        return node

    return patched


@pytest.mark.parametrize(
    "mutate, policy", [(split_drops_priority, "priority"), (split_drops_hit_count, "lfu")], ids=["priority", "hits"]
)
def test_split_metadata_is_compared_under_the_profile(
    mutate: Callable[..., Any], policy: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Metadata a split loses shows in eviction order only when the prefix node, later a leaf, ties another leaf on
    everything else (the default budget never built it for priority); the adapter reports SGLang's own metadata, and
    under the profile that pins RANK it is compared at the split (INV-META-1). The core leaves metadata to the
    backend: the same run certifies."""
    monkeypatch.setattr(RC, "_split_node", mutate(RC._split_node))
    kw: dict[str, Any] = dict(examples=60, steps=30, page_sizes=[1], policies=[policy], out_dir=tmp_path)
    cert = certify("kvcert.conformance.adapters.sglang.radix:factory", **kw)
    _assert_caught(cert, "split metadata", "INV-META-1")
    assert certify("kvcert.conformance.adapters.sglang.radix:factory", profile="core", **kw).passed


# --------------------------------------------------------------------------- HiCache: KV bytes (SPEC.md §9.12)

from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402


def backup_reversed(orig: Callable[..., Any]) -> Callable[..., Any]:
    """A device->host copy that writes a batch's tokens into the host slots in reverse order."""

    def patched(self: Any, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any) -> Any:
        return orig(self, device_pool, host_indices.flip(0), device_indices, io_backend)

    return patched


def load_reversed(orig: Callable[..., Any]) -> Callable[..., Any]:
    """A host->device load that lands a batch's tokens in the device slots in reverse order."""

    def patched(self: Any, device_pool: Any, host_indices: Any, device_indices: Any, *args: Any, **kw: Any) -> Any:
        return orig(self, device_pool, host_indices, device_indices.flip(0), *args, **kw)

    return patched


HICACHE_CASES: dict[str, tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]], int, str]] = {
    "backup_reversed": ("backup_from_device_all_layer", backup_reversed, 1, "INV-KV-2"),
    # a page: >= 4 tokens a load; a retraction's restore is a load too, read back by INV-KV-3
    "load_reversed": ("load_to_device_per_layer", load_reversed, 4, "INV-KV-"),
}


@pytest.mark.parametrize("name", sorted(HICACHE_CASES))
def test_patched_hicache_copies_are_caught_by_the_bytes(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Copies that move the right slots' worth of KV to the wrong places: the tree and every count stay
    right, so only reading the bytes back (kv_reads) sees it."""
    method, mutate, page_size, expected = HICACHE_CASES[name]
    monkeypatch.setattr(MHATokenToKVPoolHost, method, mutate(getattr(MHATokenToKVPoolHost, method)))
    cert = certify(
        "kvcert.conformance.adapters.sglang.hicache_backend:factory",
        examples=100,
        steps=30,
        page_sizes=[page_size],
        write_policies=["write_through"],
        device_cells=False,
        out_dir=tmp_path,
    )
    _assert_caught(cert, name, expected)


def touch_keeps_old_stamp(orig: Callable[..., Any]) -> Callable[..., Any]:
    """An insert's walk no longer refreshes the recency of the nodes it passes: the tree core keeps their old stamp."""

    def patched(self: Any, node: Any) -> None:
        stamp = node.last_access_time
        orig(self, node)
        if node is not self.root_node:
            node.last_access_time = stamp

    return patched


def test_hicache_python_core_metadata_is_compared_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The Python tree core stamps recency from a counter of its own, so INV-META-1 compares only the order its
    stamps give the nodes with the spec's (SPEC.md §4.7). A walk that forgets to refresh them is seen under the
    profile that pins RANK; the core leaves recency to the backend, and the same run certifies."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    monkeypatch.setattr(UnifiedTreeCore, "_touch_node", touch_keeps_old_stamp(UnifiedTreeCore._touch_node))
    kw: dict[str, Any] = dict(examples=40, steps=30, page_sizes=[1], device_cells=True, out_dir=tmp_path)
    target = "kvcert.conformance.adapters.sglang.hicache_backend:factory"
    cert = certify(target, write_policies=[], **kw)
    _assert_caught(cert, "touch keeps old stamp", "INV-META-1")
    assert certify(target, write_policies=[], profile="core", **kw).passed


def insert_cache_forgets_what_it_inserted(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Every checkpoint counts the request's hits again: the request record's `cache_inserted_len` is lost."""

    def patched(self: Any, req: Any, token_ids: Any, **kw: Any) -> Any:
        req.kv.cache_inserted_len = 0
        return orig(self, req, token_ids, **kw)

    return patched


def insert_cache_never_splits_the_prompt(orig: Callable[..., Any]) -> Callable[..., Any]:
    """A checkpoint no longer re-inserts the prompt at its boundary (`split_prompt` dropped)."""

    def patched(self: Any, req: Any, token_ids: Any, **kw: Any) -> Any:
        return orig(self, req, token_ids, **{**kw, "split_prompt": False})

    return patched


@pytest.mark.parametrize(
    "mutate, policy, expected",
    [
        (insert_cache_forgets_what_it_inserted, "lfu", "INV-META-1"),
        (insert_cache_never_splits_the_prompt, "lru", "INV-"),
    ],
    ids=["hits-counted-twice", "prompt-not-split"],
)
def test_the_checkpoint_runs_sglangs_prompt_split_and_hit_gate(
    mutate: Callable[..., Any], policy: str, expected: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The adapter's request record lives across its checkpoints and its prompt is the `Start`'s tokens (§4.8), so
    SGLang's `cache_inserted_len` gate and its prompt re-insert run, and a checkpoint that loses either fails."""
    monkeypatch.setattr(RC, "_insert_cache", mutate(RC._insert_cache))
    cert = certify(
        "kvcert.conformance.adapters.sglang.radix:factory",
        examples=60,
        steps=30,
        page_sizes=[1],
        policies=[policy],
        out_dir=tmp_path,
    )
    _assert_caught(cert, "checkpoint", expected)
