"""The spec's KV bytes in SGLang's pools (SPEC.md §9.12): one geometry, two conversions.

An entry of `kvcert.spec.storage.token_entries` is one token's KV: K of every layer, then V of
every layer, `KV_WIDTH` (8) bytes each. SGLang's pools hold K and V per layer as
`[slots, heads, dim]` tensors; with one float32 head of width 2 (`HEAD_NUM`, `HEAD_DIM`), one
(token, layer, K|V) element is exactly those 8 bytes, so an entry is a `[2, layers, 1, 1, 2]`
view of the pool and back, bit for bit (only copies touch the values, never arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcert.spec import storage as l3

__all__ = ["HEAD_DIM", "HEAD_NUM", "KV_DTYPE", "entries_of", "free_slots", "read_pool", "tensor_of", "write_pool"]

KV_DTYPE = torch.float32
HEAD_NUM, HEAD_DIM = 1, l3.KV_WIDTH // 4
"""Device/host KV geometry under which one (token, layer, K|V) entry is exactly `token_kv`'s 8 bytes."""


def tensor_of(entries: Sequence[bytes], layers: int) -> torch.Tensor:
    """[2, layers, len(entries), HEAD_NUM, HEAD_DIM] float32 holding `entries` (one per token)."""
    width = 2 * layers * l3.KV_WIDTH
    if any(len(e) != width for e in entries):
        raise ValueError(f"an entry of {layers} layers is {width} bytes")
    flat = torch.frombuffer(bytearray(b"".join(entries)), dtype=KV_DTYPE) if entries else torch.empty(0)
    return flat.view(len(entries), 2, layers, HEAD_NUM, HEAD_DIM).permute(1, 2, 0, 3, 4).contiguous()


def entries_of(kv: torch.Tensor) -> list[bytes]:
    """The entries of a [2, layers, n, HEAD_NUM, HEAD_DIM] tensor, one per token (inverse of `tensor_of`)."""
    n = kv.shape[2]
    raw = kv.detach().permute(2, 0, 1, 3, 4).contiguous().view(torch.uint8).numpy().tobytes()
    width = len(raw) // n if n else 0
    return [raw[i * width : (i + 1) * width] for i in range(n)]


def write_pool(pool: Any, slots: Sequence[int], entries: Sequence[bytes], layers: int) -> None:
    """The forward pass into an MHA device pool: each entry into the K and V buffers of every layer at its slot."""
    kv = tensor_of(entries, layers)
    idx = torch.tensor(list(slots), dtype=torch.int64)
    for layer in range(layers):
        pool.k_buffer[layer][idx] = kv[0, layer]
        pool.v_buffer[layer][idx] = kv[1, layer]


def read_pool(pool: Any, slots: Sequence[int], layers: int) -> list[bytes]:
    """The entries an MHA device pool holds at `slots` (inverse of `write_pool`)."""
    idx = torch.tensor(list(slots), dtype=torch.int64)
    k = torch.stack([pool.k_buffer[layer][idx] for layer in range(layers)])
    v = torch.stack([pool.v_buffer[layer][idx] for layer in range(layers)])
    return entries_of(torch.stack([k, v]))


def free_slots(allocator: Any, page_size: int) -> set[int]:
    """The device slots a (paged or token) SGLang allocator holds free: every slot of each free page."""
    return {int(p) * page_size + i for p in allocator.get_all_free_pages().tolist() for i in range(page_size)}
