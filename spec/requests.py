"""Requests as an engine's scheduler sees them (SPEC.md §12): what a request-path target reports, and the model.

A request-path target is an engine driven through its own scheduler code: the suite submits requests, steps the
scheduler, closes sessions and changes their priority, and the engine decides everything else — admission,
chunking, eviction, retraction, what it caches and registers. The suite plays only the model: for every token
the engine computes it supplies the KV bytes (`kvcert.spec.storage.token_entries`, the same content function as
everywhere) and, at the end of a forward, the next token (`output_token`). So it can check every byte the engine
keeps, and knows each turn's tokens without asking the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvcert.spec.types import Namespace, Tokens

REQUEST_STATES = ("waiting", "running", "finished", "aborted")
"""Where a request stands: queued (holds no KV of its own), running (admitted: holds its row), finished (its
result was processed: it holds nothing), aborted (dropped before finishing: it holds nothing)."""

OUTPUT_VOCAB = 4
"""Output tokens are 0..OUTPUT_VOCAB-1: the same small alphabet as the suite's prompts, so turns share prefixes."""


def output_token(namespace: Namespace, tokens: Tokens) -> int:
    """The token the model samples after `tokens`: a pure function of the sequence, so every run, engine and
    replay decodes the same output."""
    return (sum(tokens) * 7 + len(tokens) * 3 + (len(namespace) if namespace else 0)) % OUTPUT_VOCAB


LORA_MARK = "\x01lora\x01"
"""Separates a namespace from the adapter folded into it (`kv_namespace`); no namespace the suite sends contains it."""


def kv_namespace(namespace: Namespace, lora: Optional[tuple[str, str]]) -> Namespace:
    """The namespace a request's KV is computed under: its own, with its LoRA adapter (name, path) folded in. An
    adapter's weights change every token's KV, so the base model's pages and an adapter's never serve each other
    (the suite's content function then gives them other bytes); None without an adapter."""
    if lora is None:
        return namespace
    return f"{namespace!r}{LORA_MARK}{lora[0]}{LORA_MARK}{lora[1]}"


@dataclass(frozen=True)
class RequestView:
    """One request the engine knows, read off the engine's own request object."""

    id: str
    session: Optional[str]
    """The session (multi-turn conversation) it is a turn of; None for a one-shot request."""
    namespace: Namespace
    """The namespace its KV is computed under (`kv_namespace`: its own, with its LoRA adapter folded in)."""
    tokens: Tokens
    """Its prompt, then what it has decoded so far."""
    prompt: int
    """How many of `tokens` are the prompt."""
    state: str
    """One of REQUEST_STATES."""
    priority: int
    """Its priority as the engine holds it now."""
    computed: int = 0
    """Tokens whose KV is in the engine's memory for it (the engine's committed length)."""
    row: tuple[int, ...] = ()
    """The device slots its row maps for `tokens[:computed]`: the tree's for its cached prefix, then its own."""
    own: tuple[int, ...] = ()
    """Device slots it holds itself, outside the tree (its uncached KV and any spare slots of a last page):
    the snapshot's `lent_slots`."""
    held: tuple[int, ...] = ()
    """Device slots it holds in further KV cache groups (a hybrid model's sliding window): pages it holds, counted
    among their holders (INV-PAGE-2), though its row is its first group's."""
    max_output: Optional[int] = None
    """The most output tokens the engine will decode for it, as the engine set that on the request's arrival (SGLang
    clips a request's output to what its pool can hold); None where the engine keeps what the client asked. Rules that
    weigh a request's size (INV-DEC-6) judge the engine's request, not the client's."""
