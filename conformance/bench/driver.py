"""What `kvcert bench meta` drives: the trace's `Request`, and `Driver`, one implementation's calls for one request
step, which `meta`'s kvcert drivers and `sglang`'s SGLang drivers subclass (with `Hit`, its answer with a host
tier). Apart from `meta` so that `sglang`, which `meta` imports when SGLang is installed, need not import `meta`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

HOST_RATIO = 2
"""Host pool = HOST_RATIO x device pool (SGLang's `hicache_ratio` default)."""


@dataclass(frozen=True)
class Request:
    namespace: Optional[str]
    tokens: tuple[int, ...]
    """The whole key: the session's context so far plus this turn."""


class Hit(NamedTuple):
    """A match with a host tier: where the device hit ends, and the host hit after it."""

    node: Any
    host_length: int
    host_node: Any
    length: int = 0
    """Device tokens hit."""


class Driver:
    """One implementation's calls for one request step; subclasses bind them to a real API."""

    name = ""

    def key(self, req: Request) -> Any:
        """The request's token ids in the form this API takes, built once per request, outside the timers.

        A scheduler holds each request's token ids already (SGLang keeps them as an `array("q")`,
        `Req.full_untruncated_fill_ids`, and wraps it in a `RadixKey` per call); converting the
        trace's tuples is the harness's work, not the cache's.
        """
        return req.tokens

    def tick(self, now: int) -> None:
        """The logical clock of the next call (untimed): LRU ranks by call order in every implementation,
        so their eviction choices, and with them every answer, are the same."""

    def match(self, req: Request, key: Any) -> tuple[Any, int]:
        """(the node to lock, device tokens hit)."""
        raise NotImplementedError

    def lock(self, node: Any) -> Any:
        raise NotImplementedError

    def unlock(self, lock: Any) -> None:
        raise NotImplementedError

    def free_count(self) -> int:
        raise NotImplementedError

    def evict(self, n: int) -> None:
        raise NotImplementedError

    def insert(self, req: Request, key: Any) -> bool:
        """Allocate the key's slots, insert, free the duplicates; False when the pool is short."""
        raise NotImplementedError

    # -- with a host tier (replay_host)
    def match_host(self, req: Request, key: Any) -> Hit:
        raise NotImplementedError

    def load_back(self, hit: Hit) -> Any:
        """Load the host part of `hit` back, land the copy, consume its ack; the node to lock."""
        raise NotImplementedError

    def backup(self) -> None:
        """The scheduler's step: issued write copies land, their acks are consumed."""
        raise NotImplementedError

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """Entered once around the whole replay (per-process state an engine keeps in globals)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
