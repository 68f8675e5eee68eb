"""SGLang's device KV pool as a `kvcert.gpu` pool: the tree's host copies move SGLang's own K and V buffers.

`MHATokenToKVPool` keeps K and V per layer as `[slots, heads, head_dim]` tensors (`k_buffer[l]`, `v_buffer[l]`).
`EnginePool` is a `kvcert.gpu.kv.KVPool` over those tensors, without a buffer of its own: a gather reads each
layer's rows as bytes, a scatter writes them back, so backups and load-backs move SGLang's bytes bit for bit.
Its layers are separate tensors, not one matrix of cells, so a planned copy engine (CUDA's) moves them through
a staging buffer (`PlannedCopyEngine`'s pooled path) rather than by a plan over cell rows.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from kvcert.gpu.kv import KVGeometry, KVPool

__all__ = ["EnginePool", "geometry_of"]


def geometry_of(pool: Any) -> KVGeometry:
    """The `KVGeometry` of an SGLang MHA pool: its layers, heads, head dim and dtype."""
    k = pool.k_buffer[0]
    return KVGeometry(layers=len(pool.k_buffer), heads=int(k.shape[1]), head_dim=int(k.shape[2]), dtype=k.dtype)


class EnginePool(KVPool):
    """`kvcert.gpu`'s pool interface over SGLang's per-layer K and V tensors (layer-first, owned by SGLang)."""

    layout = "engine"
    planned = False

    def __init__(self, pool: Any, capacity: int, page_size: int) -> None:
        self.geometry = geometry_of(pool)
        self.geometry.check()
        self.capacity, self.page_size = capacity, page_size
        self.device = pool.k_buffer[0].device
        self.pin = False
        self.k, self.v = list(pool.k_buffer), list(pool.v_buffer)
        self.entry = np.dtype((np.void, 2 * self.geometry.layers * 8))
        self.host_view: Optional[np.ndarray] = None

    def _rows(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(buf.shape[0], -1).view(torch.uint8)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        kv = [torch.stack([self._rows(b).index_select(0, idx) for b in side]) for side in (self.k, self.v)]
        return torch.stack(kv).permute(2, 0, 1, 3)  # [n, 2, layers, width]

    def scatter(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        for s, side in enumerate((self.k, self.v)):
            for layer, buf in enumerate(side):
                self._rows(buf).index_copy_(0, idx, data[:, s, layer].contiguous())

    def cell_rows(self, slots: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("SGLang's per-layer buffers are not one matrix of cells (`planned` is False)")
