"""Helpers the reference model's tests share: the caller's side of an insert, and an idle copy engine."""

from __future__ import annotations

from kvcert.conformance.harness import scheduler
from kvcert.refimpl import RefCache


def put(cache: RefCache, tokens: list[int]) -> int:
    """Allocate, insert, free the duplicates (SGLang's caller contract); the node the key ends at."""
    return scheduler.insert_request(cache, None, tuple(tokens)).node


def settle(cache: RefCache) -> None:
    """Finish every copy and consume every ack, until none is left (a write ack may issue store copies)."""
    scheduler.settle(cache)
