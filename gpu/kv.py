"""KV pools as torch tensors in real engine layouts, and the byte mapping of the spec's synthetic KV.

A token's KV entry (`kvcert.spec.storage.token_entries`) is K of every layer, then V of every
layer, KV_WIDTH (8) bytes each. A pool stores one (token, layer, K|V) cell as `heads x head_dim`
elements of `dtype`: `width` bytes. The default geometry (1 head of 2 float32) is exactly 8
bytes, so an entry fills a slot; a wider geometry keeps the entry in the first 8 bytes of each
cell and zeros after them (real engines' cells are wider; the content function does not care).

Every copy works on a `uint8` view of the pool, so bytes move bit for bit whatever the dtype
(no NaN canonicalisation, no float conversions).

Layouts (SGLang's names):
- `layer_first`: one tensor [2, layers, slots, heads, head_dim]; `k_buffer(l)` and `v_buffer(l)`
  are the per-layer [slots, heads, head_dim] views an attention kernel reads.
- `page_first`: one tensor [pages, layers, 2, page_size, heads, head_dim]: a page of every layer
  is one contiguous block (what a page-granular storage or RDMA transfer wants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from kvcert.spec.storage import KV_WIDTH

LAYOUTS = ("layer_first", "page_first")


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one token's KV: `layers` x (K, V) x `heads` x `head_dim` elements of `dtype`."""

    layers: int = 2
    heads: int = 1
    head_dim: int = 2
    dtype: torch.dtype = torch.float32

    @property
    def width(self) -> int:
        """Bytes of one (token, layer, K|V) cell."""
        return self.heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def check(self) -> None:
        if self.layers < 1 or self.heads < 1 or self.head_dim < 1:
            raise ValueError(f"geometry needs layers, heads, head_dim >= 1, got {self}")
        if self.width < KV_WIDTH:
            raise ValueError(f"a KV cell of {self.width} bytes cannot hold a {KV_WIDTH}-byte entry part")


def _index(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(slots), dtype=torch.long, device=device)


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge (src[i], dst[i]) pairs into runs (src_start, dst_start, length) that are contiguous on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class KVPool:
    """A pool of `capacity` token slots; subclasses fix the layout."""

    layout: str = ""
    MAX_RUNS = 8
    """Copies with at most this many contiguous runs are done as slice copies, else gather/scatter."""

    def __init__(
        self, capacity: int, page_size: int, geometry: KVGeometry, device: torch.device, pin: bool = False
    ) -> None:
        geometry.check()
        self.capacity, self.page_size, self.geometry, self.device = capacity, page_size, geometry, device
        self.pin = pin
        self.buffer = self._allocate(pin)
        self.u8 = self._bytes_view()

    # -- layout-specific
    def _allocate(self, pin: bool) -> torch.Tensor:
        raise NotImplementedError

    def _bytes_view(self) -> torch.Tensor:
        raise NotImplementedError

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """uint8 [n, 2, layers, width] of the slots in `idx`."""
        raise NotImplementedError

    def scatter(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        """Write uint8 [n, 2, layers, width] into the slots in `idx`."""
        raise NotImplementedError

    def run_view(self, start: int, n: int) -> Optional[torch.Tensor]:
        """A [2, layers, n, width] view of `n` consecutive slots, if the layout has one."""
        return None

    # -- shared
    def index(self, slots: Sequence[int]) -> torch.Tensor:
        return _index(slots, self.device)

    def copy_from(
        self, src: KVPool, src_slots: Sequence[int], dst_slots: Sequence[int], non_blocking: bool = False
    ) -> None:
        """Move the bytes of `src_slots` of `src` into `dst_slots` of this pool.

        Few contiguous runs (the common case: pages allocated together) go as slice copies, one
        per run; scattered slots go as one index_select gather and one index_copy_ scatter.
        """
        if not src_slots:
            return
        runs = contiguous_runs(src_slots, dst_slots)
        if len(runs) <= self.MAX_RUNS:
            views = [(src.run_view(s, n), self.run_view(d, n)) for s, d, n in runs]
            if all(a is not None and b is not None for a, b in views):
                for a, b in views:
                    assert a is not None and b is not None
                    b.copy_(a, non_blocking=non_blocking)
                return
        data = src.gather(src.index(src_slots))
        self.scatter(self.index(dst_slots), data.to(self.device, non_blocking=non_blocking))

    def write_entries(self, slots: Sequence[int], entries: Sequence[bytes]) -> None:
        """Store each entry (K of every layer, then V, 8 bytes each) in its slot; the rest of each cell is zero."""
        g = self.geometry
        size = 2 * g.layers * KV_WIDTH
        if len(slots) != len(entries) or any(len(e) != size for e in entries):
            raise ValueError(f"need one {size}-byte entry per slot")
        if not slots:
            return
        raw = torch.frombuffer(bytearray(b"".join(entries)), dtype=torch.uint8).view(len(slots), 2, g.layers, KV_WIDTH)
        data = torch.zeros((len(slots), 2, g.layers, g.width), dtype=torch.uint8)
        data[..., :KV_WIDTH] = raw
        self.scatter(self.index(slots), data.to(self.device))

    def read_entries(self, slots: Sequence[int]) -> list[bytes]:
        """The entry each slot holds (the first 8 bytes of each of its cells)."""
        if not slots:
            return []
        data = self.gather(self.index(slots))[..., :KV_WIDTH].contiguous().cpu()
        flat = data.numpy().tobytes()
        size = 2 * self.geometry.layers * KV_WIDTH
        return [flat[i * size : (i + 1) * size] for i in range(len(slots))]

    def read_page_payload(self, slots: Sequence[int]) -> bytes:
        """A page's canonical storage payload: K then V, then layer, then token (`page_payload`'s order)."""
        data = self.gather(self.index(slots))[..., :KV_WIDTH]  # [P, 2, L, 8]
        return data.permute(1, 2, 0, 3).contiguous().cpu().numpy().tobytes()

    def write_page_payload(self, slots: Sequence[int], payload: bytes) -> None:
        """Inverse of `read_page_payload`: a fetched page lands in its reserved slots."""
        g = self.geometry
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(2, g.layers, len(slots), KV_WIDTH)
        data = torch.zeros((len(slots), 2, g.layers, g.width), dtype=torch.uint8)
        data[..., :KV_WIDTH] = raw.permute(2, 0, 1, 3)
        self.scatter(self.index(slots), data.to(self.device))


class LayerFirstPool(KVPool):
    """[2, layers, slots, heads, head_dim]: per-layer K and V buffers, as an attention kernel reads them."""

    layout = "layer_first"

    def _allocate(self, pin: bool) -> torch.Tensor:
        g = self.geometry
        shape = (2, g.layers, self.capacity, g.heads, g.head_dim)
        return torch.zeros(shape, dtype=g.dtype, device=self.device, pin_memory=pin)

    def _bytes_view(self) -> torch.Tensor:
        g = self.geometry
        return self.buffer.view(torch.uint8).view(2, g.layers, self.capacity, g.width)

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        return self.u8.index_select(2, idx).permute(2, 0, 1, 3)

    def scatter(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        self.u8.index_copy_(2, idx, data.permute(1, 2, 0, 3).contiguous())

    def run_view(self, start: int, n: int) -> Optional[torch.Tensor]:
        return self.u8[:, :, start : start + n]


class PageFirstPool(KVPool):
    """[pages, layers, 2, page_size, heads, head_dim]: a page of every layer is one contiguous block."""

    layout = "page_first"

    def _allocate(self, pin: bool) -> torch.Tensor:
        g = self.geometry
        pages = self.capacity // self.page_size
        shape = (pages, g.layers, 2, self.page_size, g.heads, g.head_dim)
        return torch.zeros(shape, dtype=g.dtype, device=self.device, pin_memory=pin)

    def _bytes_view(self) -> torch.Tensor:
        g = self.geometry
        return self.buffer.view(torch.uint8).view(self.capacity // self.page_size, g.layers, 2, self.page_size, g.width)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        # Advanced indices on dims 0 and 3 (separated by slices) put the index dim first: [n, L, 2, width].
        return self.u8[idx // self.page_size, :, :, idx % self.page_size].permute(0, 2, 1, 3)

    def scatter(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        self.u8[idx // self.page_size, :, :, idx % self.page_size] = data.permute(0, 2, 1, 3)


def make_pool(
    layout: str, capacity: int, page_size: int, geometry: KVGeometry, device: torch.device, pin: bool = False
) -> KVPool:
    if layout == "layer_first":
        return LayerFirstPool(capacity, page_size, geometry, device, pin)
    if layout == "page_first":
        return PageFirstPool(capacity, page_size, geometry, device, pin)
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
