"""SGLang 0.5.23's direct-linker wrapper broken on purpose (tests/test_sglang_linker.py).

Each plant is one bug of a class the seed's linker review names, put into SGLang's own
`UnifiedCacheLinkerWrapper` for the length of one certification of `sglang_linker:factory`: a failed load served
as if it landed, a node marked stored when its offload failed, an offload that does not pin its pages, a hit one
page longer than the store reported, results taken newest first; and a reset that keeps waiting on the offloads
the store forgot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

PLANTS = ("serve-failed-load", "stored-on-failure", "offload-unpinned", "hit-past-lookup", "results-lifo")
RESET_PLANTS = ("reset-keeps-pending",)
"""Plants only a flush reaches (`_linker.flush_mid_offload`), not certified by generation in the tests."""


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    from sglang.srt.mem_cache.unified_cache import unified_cache_linker as ul

    W = ul.UnifiedCacheLinkerWrapper
    if name == "none":
        yield
        return
    if name == "serve-failed-load":  # finish_loads never reports a failed batch: its requests run on torn slots
        real_finish = W.finish_loads

        def finish_loads(self: Any) -> list[str]:
            real_finish(self)
            return []

        with mock.patch.object(W, "finish_loads", finish_loads):
            yield
    elif name == "stored-on-failure":  # a failed offload's node is marked stored anyway
        real_commit = W.commit_completed_offloads

        def commit(self: Any, successes: Any) -> None:
            real_commit(self, [True for _ in successes])

        with mock.patch.object(W, "commit_completed_offloads", commit):
            yield
    elif name == "offload-unpinned":  # the offload's lock is dropped as soon as the store accepts it
        real_offload, real_commit = W._offload_node, W.commit_completed_offloads

        def offload_node(self: Any, node_id: Any, transfers: Any) -> None:
            before = len(self.pending_offloads)
            real_offload(self, node_id, transfers)
            if len(self.pending_offloads) > before:
                pending = self.pending_offloads[-1]
                self.cache.dec_lock_ref(pending.lock_node_id, pending.lock_params)
                self.pending_offloads[-1] = pending._replace(lock_params=None)

        def commit(self: Any, successes: Any) -> None:
            for success in successes:
                pending = self.pending_offloads.pop(0)
                self.cache.tree_core.finish_external_linker_offload(
                    pending.publish_node_ids, pending.lock_node_id, success
                )

        with mock.patch.object(W, "_offload_node", offload_node), mock.patch.object(
            W, "commit_completed_offloads", commit
        ):
            yield
    elif name == "hit-past-lookup":  # the hit is one page longer than the store reported restorable
        real_sync = W._sync_restorable_prefix

        def sync(self: Any, restorable: Any, *, num_pages: int, device_hit_pages: int) -> int:
            got = real_sync(self, restorable, num_pages=num_pages, device_hit_pages=device_hit_pages)
            return got + 1 if 0 < got < num_pages else got

        with mock.patch.object(W, "_sync_restorable_prefix", sync):
            yield
    elif name == "results-lifo":  # results are matched to offloads newest first
        real_commit = W.commit_completed_offloads

        def commit(self: Any, successes: Any) -> None:
            self.pending_offloads.reverse()
            try:
                real_commit(self, successes)
            finally:
                self.pending_offloads.reverse()

        with mock.patch.object(W, "commit_completed_offloads", commit):
            yield
    elif name == "reset-keeps-pending":  # a reset forgets the store's offloads but keeps waiting for their results
        with mock.patch.object(W, "_release_pending_offloads", lambda self: None):
            yield
    else:
        raise ValueError(f"no plant {name!r}; one of {PLANTS + RESET_PLANTS}")
