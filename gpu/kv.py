"""KV pools as torch tensors in real engine layouts, and the byte mapping of the spec's synthetic KV.

A token's KV entry (`kvcert.spec.storage.token_entries`) is K of every layer, then V of every
layer, KV_WIDTH (8) bytes each. A pool stores one (token, layer, K|V) cell as `heads x head_dim`
elements of `dtype`: `width` bytes. The default geometry (1 head of 2 float32) is exactly 8
bytes, so an entry fills a slot; a wider geometry keeps the entry in the first 8 bytes of each
cell and zeros after them (real engines' cells are wider; the content function does not care).

Every copy works on a `uint8` view of the pool, so bytes move bit for bit whatever the dtype
(no NaN canonicalisation, no float conversions).

For the CUDA engine a pool is also a matrix of *cells* (`cells`: uint8 [rows, width], one row per
(token, layer, K|V), contiguous in memory); `plan_copy` turns a copy into runs of rows contiguous in
the host pool (one DMA each) plus one device gather/scatter, grouped per layer for load-back.

Layouts (SGLang's names):
- `layer_first`: one tensor [2, layers, slots, heads, head_dim]; `k_buffer(l)` and `v_buffer(l)`
  are the per-layer [slots, heads, head_dim] views an attention kernel reads.
- `page_first`: one tensor [pages, layers, 2, page_size, heads, head_dim]: a page of every layer
  is one contiguous block (what a page-granular storage or RDMA transfer wants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, cast

import numpy as np
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

    @cached_property
    def width(self) -> int:
        """Bytes of one (token, layer, K|V) cell (asked on every read and write: worked out once)."""
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
    planned: bool = True
    """Its slots map to rows of one cell matrix (`cells`, `cell_rows`), so a planned engine can plan its copies; an
    engine's pool of per-layer tensors (no such matrix) is copied through `gather` / `scatter` instead."""
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
        self.cells = self.u8.view(-1, geometry.width)
        """uint8 [rows, width]: every (token, layer, K|V) cell of the pool, a row each (`cell_rows` maps slots)."""
        self.entry = np.dtype((np.void, 2 * geometry.layers * KV_WIDTH))
        """One slot's entry as one numpy item: a read's result becomes a bytes object per slot in one `tolist`."""
        self.host_view: Optional[np.ndarray] = self.u8.numpy() if self.u8.device.type == "cpu" else None
        """The same memory as a numpy array, for a pool in CPU memory: a read indexes it for a fraction of a
        torch call's fixed cost (what a conformance run, reading every slot every step, pays for)."""

    # -- layout-specific
    def _allocate(self, pin: bool) -> torch.Tensor:
        raise NotImplementedError

    def _bytes_view(self) -> torch.Tensor:
        raise NotImplementedError

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """uint8 [n, 2, layers, width] of the slots in `idx`."""
        raise NotImplementedError

    def gather_host(self, view: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """`gather` on `host_view`: uint8 [n, 2, layers, KV_WIDTH] of the slots in `idx`."""
        raise NotImplementedError

    def scatter(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        """Write uint8 [n, 2, layers, width] into the slots in `idx`."""
        raise NotImplementedError

    def run_view(self, start: int, n: int) -> Optional[torch.Tensor]:
        """A [2, layers, n, width] view of `n` consecutive slots, if the layout has one."""
        return None

    def cell_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 [n, 2, layers]: the row of `cells` holding each slot's (K|V, layer) cell (`slots`: int64 [n], CPU)."""
        raise NotImplementedError

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
        if self.host_view is not None:
            data = np.ascontiguousarray(self.gather_host(self.host_view, np.asarray(slots, dtype=np.int64)))
        else:
            data = self.gather(self.index(slots))[..., :KV_WIDTH].contiguous().cpu().numpy()
        return cast(list[bytes], data.reshape(len(slots), -1).view(self.entry).reshape(len(slots)).tolist())

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

    def gather_host(self, view: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return view[:, :, idx, :KV_WIDTH].transpose(2, 0, 1, 3)

    def scatter(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        self.u8.index_copy_(2, idx, data.permute(1, 2, 0, 3).contiguous())

    def run_view(self, start: int, n: int) -> Optional[torch.Tensor]:
        return self.u8[:, :, start : start + n]

    def cell_rows(self, slots: torch.Tensor) -> torch.Tensor:
        # row of (kv, layer, slot) in [2, layers, capacity]: (kv * layers + layer) * capacity + slot
        base = torch.arange(2 * self.geometry.layers, dtype=torch.long).view(2, -1) * self.capacity
        return base.unsqueeze(0) + slots.view(-1, 1, 1)


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

    def gather_host(self, view: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return view[idx // self.page_size, :, :, idx % self.page_size, :KV_WIDTH].transpose(0, 2, 1, 3)

    def scatter(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        self.u8[idx // self.page_size, :, :, idx % self.page_size] = data.permute(0, 2, 1, 3)

    def cell_rows(self, slots: torch.Tensor) -> torch.Tensor:
        # row of (page, layer, kv, offset) in [pages, layers, 2, page_size]
        ps, layers = self.page_size, self.geometry.layers
        kv = torch.arange(2, dtype=torch.long).view(2, 1) * ps
        layer = torch.arange(layers, dtype=torch.long).view(1, layers) * (2 * ps)
        start = (slots // ps) * (layers * 2 * ps) + slots % ps
        return (kv + layer).unsqueeze(0) + start.view(-1, 1, 1)


def make_pool(
    layout: str, capacity: int, page_size: int, geometry: KVGeometry, device: torch.device, pin: bool = False
) -> KVPool:
    if layout == "layer_first":
        return LayerFirstPool(capacity, page_size, geometry, device, pin)
    if layout == "page_first":
        return PageFirstPool(capacity, page_size, geometry, device, pin)
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


# ---------------------------------------------------------------------- copy plans (the CUDA engine's path)

PLAN_STRATEGIES = ("auto", "dma", "staged")
MIN_RUN_BYTES = 64 * 1024
"""`auto` moves host runs of at least this many bytes (on average) as one DMA each, smaller ones staged."""
DIRECT_MAX_RUNS = 32
"""A group whose runs are contiguous in both pools moves without staging when it has at most this many."""


@dataclass
class PlanGroup:
    """The cells of one copy that one event covers: one layer (load-back by layer) or every layer.

    `host_rows` / `dev_rows` pair the cells, sorted by host row, so that the host pool's contiguous runs
    are consecutive: run `i` is positions `starts[i] : starts[i] + lengths[i]`.
    """

    layer: Optional[int]
    """The layer whose cells this group moves; None: every layer."""
    host_rows: torch.Tensor
    dev_rows: torch.Tensor
    starts: list[int]
    lengths: list[int]
    direct: bool
    """Every run is contiguous in the device pool too (and there are at most DIRECT_MAX_RUNS)."""

    def host_runs(self) -> list[tuple[int, int, int]]:
        """(host_row, dev_row, rows) of each run (the dev row is meaningful only when `direct`)."""
        if not self.starts:
            return []
        at = torch.tensor(self.starts, dtype=torch.long)
        return list(zip(self.host_rows[at].tolist(), self.dev_rows[at].tolist(), self.lengths))


@dataclass
class CopyPlan:
    """How one copy between a device pool and a host pool moves, whatever the engine that runs it.

    `dma`: per group, runs contiguous in both pools are single copies (at most DIRECT_MAX_RUNS);
    otherwise one device gather (D2H) or scatter (H2D) through a contiguous device staging buffer,
    and one DMA per host run between that buffer and the host pool. `staged`: one device gather /
    scatter, one DMA between the device buffer and a pinned host staging buffer, and one CPU
    scatter / gather between that buffer and the host pool (for runs too short to DMA one by one).
    """

    direction: str
    """"d2h" (device pool to host pool) or "h2d"."""
    strategy: str
    """"dma" or "staged" (what `auto` chose)."""
    groups: list[PlanGroup]
    width: int
    """Bytes of one cell (row)."""

    @property
    def rows(self) -> int:
        return sum(len(g.host_rows) for g in self.groups)

    @property
    def nbytes(self) -> int:
        return self.rows * self.width

    @property
    def runs(self) -> int:
        return sum(len(g.starts) for g in self.groups)


def slot_tensor(slots: object) -> torch.Tensor:
    """Slot ids as an int64 CPU tensor: from a sequence of ints, an int64 tensor, or int64 bytes / `array("q")`."""
    if isinstance(slots, torch.Tensor):
        return slots.to(device="cpu", dtype=torch.long).view(-1)
    if isinstance(slots, (bytes, bytearray, memoryview)):
        raw = bytes(slots)
        return torch.frombuffer(bytearray(raw), dtype=torch.long) if raw else torch.zeros(0, dtype=torch.long)
    return torch.tensor(list(slots), dtype=torch.long)  # type: ignore[call-overload]


def _group(layer: Optional[int], host_rows: torch.Tensor, dev_rows: torch.Tensor) -> PlanGroup:
    order = torch.argsort(host_rows, stable=True)
    h, d = host_rows[order], dev_rows[order]
    m = len(h)
    if m == 0:
        return PlanGroup(layer, h, d, [], [], True)
    breaks = h[1:] != h[:-1] + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(breaks).view(-1) + 1])
    ends = torch.cat([starts[1:], torch.tensor([m], dtype=torch.long)])
    # a run is contiguous on the device side too when no step inside it breaks there
    inner = (~breaks) & (d[1:] != d[:-1] + 1)
    seen = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(inner.long(), 0)])
    direct = len(starts) <= DIRECT_MAX_RUNS and bool(((seen[ends - 1] - seen[starts]) == 0).all())
    return PlanGroup(layer, h, d, starts.tolist(), (ends - starts).tolist(), direct)


def plan_copy(
    host: KVPool,
    host_slots: object,
    dev: KVPool,
    dev_slots: object,
    direction: str,
    *,
    by_layer: bool = False,
    strategy: str = "auto",
    min_run_bytes: int = MIN_RUN_BYTES,
) -> CopyPlan:
    """Plan moving the cells of `dev_slots` to `host_slots` ("d2h") or back ("h2d"), pair by pair.

    Every (slot, layer, K|V) cell becomes a (host row, device row) pair; pairs are sorted by host
    row and merged into runs contiguous in the host pool, so a run is one DMA however the slots
    were scattered. `by_layer` splits the plan into one group per layer (an event each: a forward
    pass can start layer `l` once its group landed).
    """
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction must be d2h or h2d, got {direction!r}")
    if strategy not in PLAN_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {PLAN_STRATEGIES}")
    hs, ds = slot_tensor(host_slots), slot_tensor(dev_slots)
    if len(hs) != len(ds):
        raise ValueError(f"{len(hs)} host slots but {len(ds)} device slots")
    if host.geometry != dev.geometry:
        raise ValueError("pools of different geometries")
    h, d = host.cell_rows(hs), dev.cell_rows(ds)
    if by_layer:
        groups = [_group(layer, h[:, :, layer].reshape(-1), d[:, :, layer].reshape(-1)) for layer in range(h.shape[2])]
    else:
        groups = [_group(None, h.reshape(-1), d.reshape(-1))]
    width = host.geometry.width
    if strategy == "auto":
        runs = sum(len(g.starts) for g in groups)
        rows = sum(len(g.host_rows) for g in groups)
        strategy = "dma" if runs == 0 or rows * width >= min_run_bytes * runs else "staged"
    return CopyPlan(direction, strategy, groups, width)
