"""The two caches a step runs on: `Side`, one of them (the backend, or the oracle beside it) with what its caller does
differently there; `StepNotes`, what the backend side leaves for the checks; `KVModel`, the model's KV content the
backend side writes into its caller's fresh slots. The op table that runs on a side is `scheduler`'s; a running
request's calls are `running`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.conformance.harness.ledger import Ledger
from kvcert.spec import storage as l3
from kvcert.spec.decisions import Chooser
from kvcert.spec.invariants import Violation
from kvcert.spec.types import CacheConfig, Snapshot


class KVModel:
    """The model's KV content (SPEC.md §9.12), memoised: every step re-reads the whole tree."""

    def __init__(self, kv_layers: int) -> None:
        self.kv_layers = kv_layers
        self._memo: dict[tuple[Any, tuple[Any, ...]], Optional[tuple[bytes, ...]]] = {}

    def entries(self, namespace: Any, tokens: tuple[Any, ...]) -> tuple[bytes, ...]:
        """`token_entries` of a path."""
        got = self.content(namespace, tokens)
        return got if got is not None else l3.token_entries(namespace, tokens, self.kv_layers)

    def content(self, namespace: Any, tokens: tuple[Any, ...]) -> Optional[tuple[bytes, ...]]:
        """`token_entries` of a path the content function is defined on (`has_content`), else None."""
        key = (namespace, tokens)
        try:
            got = self._memo.get(key, self)
        except TypeError:  # unhashable: a namespace or token the content function is not defined on
            return None
        if got is self:
            if len(self._memo) > 4096:
                self._memo.clear()
            ok = has_content(namespace, tokens)
            got = self._memo[key] = l3.token_entries(namespace, tokens, self.kv_layers) if ok else None
        return got  # type: ignore[return-value]


def has_content(namespace: Any, tokens: Any) -> bool:
    """Whether the content function is defined on this path: valid token ids and a namespace."""
    return (namespace is None or isinstance(namespace, str)) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < l3.TOKEN_LIMIT for t in tokens
    )


@dataclass
class StepNotes:
    """What the backend side of a step leaves for the checks."""

    made_kv: Optional[tuple[bytes, ...]] = None
    """The entries a retraction's backup was made from."""
    planned: Optional[Snapshot] = None
    """The backend's state when it made an admission plan (after the running requests' allocations)."""
    violations: list[Violation] = field(default_factory=list)
    """Broken rules the caller saw mid-op (restored KV read back, a running request's row)."""
    inserted: Optional[tuple[Any, tuple[Any, ...]]] = None
    """(namespace, key) a running request's checkpoint inserted: its insert's contract is checked on it."""


@dataclass
class Side:
    """One of the two caches a step runs on, and what the caller does differently on it."""

    cache: Any
    column: int
    """Which id of each ledger pair names this cache's objects: 0 the backend, 1 the oracle."""
    ledger: Ledger
    config: CacheConfig
    kv: Optional[KVModel] = None
    """The model's KV, written into the caller's fresh slots: the backend side of a kv_reads backend only."""
    notes: Optional[StepNotes] = None
    """Where the backend side records what the checks need; None on the oracle side."""
    admitted: Optional[list[bool]] = None
    """Per admission that fit, whether the backend could then allocate the planned slots (backend side)."""
    choose: Optional[Chooser] = None
    """The oracle's eviction tie-break, steered to the backend's choice (oracle side)."""
    native_checkpoint: bool = False
    """The backend runs a running request's checkpoint itself (`Capabilities.checkpoints`; backend side only)."""
    gated: bool = False
    """The oracle composes the checkpoint of a backend that runs its own, so it skips, as that engine does, the
    hits a request's earlier checkpoints counted (oracle side only; SPEC.md §4.8)."""
    unaligned: bool = False
    """The backend page-aligns insert keys itself (`Capabilities.aligns_keys`): the backend gets a key that
    ends mid-page whole, the oracle its page-aligned head; the caller keeps the tail's slots (SPEC.md §4.2)."""

    def node(self, k: Any) -> int:
        return self.ledger.handles.id(k, self.column)

    def content(self, namespace: Any, tokens: tuple[Any, ...]) -> Optional[tuple[bytes, ...]]:
        """The model's entries for a path, where this side plays the model and the path has content."""
        if self.kv is None or not has_content(namespace, tokens):
            return None
        return self.kv.entries(namespace, tuple(tokens))

    def write_kv(self, slots: tuple[int, ...], namespace: Any, tokens: tuple[Any, ...], start: int = 0) -> None:
        """Play the model: fill the caller's fresh slots with the content of `tokens[start:]` (valid ones only)."""
        entries = self.content(namespace, tokens) if slots else None
        if entries is None:
            return
        entries = entries[start : start + len(slots)]
        self.cache.write_kv(slots[: len(entries)], entries)
