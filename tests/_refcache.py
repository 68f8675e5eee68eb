"""Helpers the reference model's tests share: the caller's side of an insert, and an idle copy engine."""

from __future__ import annotations

from kvcert.refimpl import RefCache


def put(cache: RefCache, tokens: list[int]) -> int:
    """Allocate, insert, free the duplicates (SGLang's caller contract); the node the key ends at."""
    slots = cache.alloc(len(tokens))
    out = cache.insert(None, tokens, slots)
    cache.free(slots[: out.prefix_len])
    return out.node


def settle(cache: RefCache) -> None:
    """Finish every copy and consume every ack, until none is left (a write ack may issue store copies)."""
    while cache.copies:
        for copy in list(cache.copies):
            if not copy.finished:
                cache.complete(copy.id)
        cache.poll()
