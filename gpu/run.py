"""`Run`: token ids or slot ids as int64 bytes, counted and cut in items, never in bytes.

Keys, edges and slot runs are little-endian int64 bytes underneath (the layout of `array("q")`
and of an int64 tensor): comparing an edge is one memcmp, a split two slices, a match's slots
one join. As bare `bytes`, though, `len()` counts bytes where the tree counts tokens, and a
`len(key)` next to a `len(key) >> 3` is the size-unit bug class. A `Run` puts the unit in the
type: `len(run)`, indices, slices, `head` / `tail` / `cut`, `startswith` and `common` all count
items (tokens or slots), and no method loops over items in Python. The bytes are reachable only
as `.raw`, spelled out where C works on them: a child selector, a join, the allocator's `*_raw`
calls, and the walk's memcmp loop (whose local offsets are bytes, `at_b`, converted on return).

A run is an immutable value over `bytes`; node edges and slots and the tree's internal
interfaces are runs. A run is one Python object (~150 ns to make), so values that only pass
between C and the caller — a lent or freed slot run, a match's joined slots on their way into a
tensor — stay bytes (`slot_raw`, `tensor_of`), and hot callers pass a key's token count along
instead of asking `len()` again.

The conversions of what the APIs take (`key_run`, `slot_run`, `slot_raw`, `ints_run`) raise or
flag bad input before anything changes, as the protocol requires.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Iterable, Sequence
from typing import Optional, Union, overload

import torch

from kvcert.gpu.alloc import to_bytes
from kvcert.spec.types import InvalidToken, check_tokens

TokenKey = Union[bytes, bytearray, memoryview, array, torch.Tensor, Sequence[int]]
"""What the fast API takes as a key: int64 bytes, an `array("q")`, a 1-D integer tensor, or ints."""

SlotRun = Union[torch.Tensor, array, bytes, bytearray, Sequence[int]]
"""What the fast API takes as slots: a 1-D integer tensor (what `alloc_tensor` returns), an `array("q")`, bytes."""


class Run:
    """A run of int64 items (token ids or slot ids); every length, index and offset counts items."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        """The items as little-endian int64 bytes (8 an item): for C-level work only."""

    def __len__(self) -> int:
        return len(self.raw) >> 3

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Run: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[int, Run]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("a Run slices with step 1 only")
            return Run(self.raw[start << 3 : max(start, stop) << 3])
        return int(memoryview(self.raw).cast("q")[i])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and self.raw == other.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"Run({self.to_tuple()!r})"

    def head(self, n: int) -> Run:
        """The first `n` items."""
        return Run(self.raw[: n << 3])

    def tail(self, n: int) -> Run:
        """All but the first `n` items (the run itself for none: runs are immutable)."""
        return Run(self.raw[n << 3 :]) if n else self

    def cut(self, lo: int, hi: int) -> Run:
        """Items `lo` to `hi`."""
        return Run(self.raw[lo << 3 : hi << 3])

    def page(self, at: int, page_size: int) -> bytes:
        """The bytes of the page starting at item `at`: a child's selector (a dict key, never measured)."""
        return self.raw[at << 3 : (at + page_size) << 3]

    def startswith(self, prefix: Run, at: int = 0) -> bool:
        """`prefix` occurs at item `at` (one memcmp)."""
        return self.raw.startswith(prefix.raw, at << 3)

    def common(self, edge: Run, at: int, end: int, page_size: int) -> int:
        """Items of the longest whole-page common prefix of `edge` and `self[at:end]`, given that one page matches.

        Bisects over pages with `startswith` (a memcmp each): O(|edge| log pages), no per-item loop.
        """
        pb = page_size << 3
        raw, at_b = self.raw, at << 3
        view = memoryview(edge.raw)
        lo, hi = 1, min(len(view), (end - at) << 3) // pb  # lo pages match; hi pages might
        if raw.startswith(view[: hi * pb], at_b):
            return hi * page_size
        while hi - lo > 1:  # lo pages match, hi pages do not
            mid = (lo + hi) // 2
            if raw.startswith(view[: mid * pb], at_b):
                lo = mid
            else:
                hi = mid
        return lo * page_size

    @staticmethod
    def join(runs: Iterable[Run]) -> Run:
        """The runs end to end."""
        return Run(b"".join([r.raw for r in runs]))

    @staticmethod
    def of_ints(values: Sequence[int]) -> Run:
        """Ints known to fit int64 (checked slot or token ids)."""
        return Run(array("q", values).tobytes())

    def to_tuple(self) -> tuple[int, ...]:
        return tuple(array("q", self.raw))

    def tensor(self) -> torch.Tensor:
        """The items as a CPU int64 tensor that owns its memory (a copy)."""
        return tensor_of(self.raw)


EMPTY = Run(b"")
"""The empty run (the root's key and slots)."""

_INT_ARRAY = frozenset("bBhHiIlLqQ")
_INT_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


_string_at = getattr(ctypes, "_string_at", ctypes.string_at)
"""`ctypes.string_at` without its Python wrapper's frame (the hot path copies a slot tensor's memory with it)."""
_I64 = torch.int64


def _tensor_raw(t: torch.Tensor) -> bytes:
    """A 1-D integer tensor's values as int64 bytes: one memcpy of a contiguous CPU int64 tensor's memory."""
    if t.dtype is not _I64 or not t.is_cpu or not t.is_contiguous():
        t = t.to(device="cpu", dtype=_I64).contiguous()
    n = t.numel()
    return _string_at(t.data_ptr(), 8 * n) if n else b""


def tensor_of(raw: Union[bytes, bytearray]) -> torch.Tensor:
    """int64 bytes as a CPU tensor that owns its memory (a `bytearray`'s, handed over; bytes are copied)."""
    if not raw:
        return torch.empty(0, dtype=_I64)
    return torch.frombuffer(raw if isinstance(raw, bytearray) else bytearray(raw), dtype=_I64)


def _int64(values: Sequence[int]) -> bytes:
    try:
        return array("q", values).tobytes()
    except OverflowError:
        raise InvalidToken("this cache stores token ids as int64: ids must be below 2**63") from None


def ints_run(values: Sequence[int]) -> Run:
    """Token ids the protocol checked (non-negative ints) as a run; `InvalidToken` past int64."""
    return Run(_int64(values))


def key_run(key: object) -> Run:
    """A fast-API key as a run; `InvalidToken` for anything but non-negative integer ids."""
    if type(key) is array and key.typecode == "q":  # what a scheduler holds (SGLang's requests do)
        raw = key.tobytes()
        if not raw[7::8].isascii():  # the top byte of every little-endian int64: its high bit is the sign
            raise InvalidToken("token ids must be non-negative")
        return Run(raw)
    if isinstance(key, bytes):
        raw = key
    elif isinstance(key, array):
        if key.typecode not in _INT_ARRAY:
            raise InvalidToken(f"token ids must be integers, got an array of {key.typecode!r}")
        raw = key.tobytes() if key.typecode == "q" else _int64(key)
    elif isinstance(key, torch.Tensor):
        if key.dtype not in _INT_DTYPES or key.dim() != 1:
            raise InvalidToken(f"token ids must be a 1-D integer tensor, got {key.dtype} of shape {tuple(key.shape)}")
        raw = _tensor_raw(key)
    elif isinstance(key, (bytearray, memoryview)):
        raw = bytes(key)
    elif isinstance(key, Sequence) and not isinstance(key, str):
        raw = _int64(check_tokens(key))
    else:
        raise InvalidToken(f"not a key: {type(key).__name__}")
    if len(raw) % 8:
        raise InvalidToken(f"a key of int64 bytes has a multiple of 8 bytes, got {len(raw)}")
    if not raw[7::8].isascii():  # the top byte of every little-endian int64: its high bit is the sign
        raise InvalidToken("token ids must be non-negative")
    return Run(raw)


def slot_raw(slots: object) -> tuple[int, Optional[bytes]]:
    """(how many slots, their int64 bytes); the bytes None when `slots` is not a run of slot ids.

    Bytes, not a `Run`: what a caller frees goes straight to the allocator (`PageAllocator.give_back_checked`).
    """
    if type(slots) is torch.Tensor and slots.dtype is _I64 and slots.is_cpu and slots.dim() == 1:
        if slots.is_contiguous():  # what `alloc_tensor` hands out, and its slices: one memcpy
            n = slots.numel()
            return n, _string_at(slots.data_ptr(), 8 * n) if n else b""
    if isinstance(slots, torch.Tensor):
        if slots.dtype not in _INT_DTYPES or slots.dim() != 1:
            return slots.numel(), None
        return slots.numel(), _tensor_raw(slots)
    if isinstance(slots, array):
        if slots.typecode == "q":
            return len(slots), slots.tobytes()
        return len(slots), to_bytes(slots) if slots.typecode in _INT_ARRAY else None
    if isinstance(slots, (bytes, bytearray, memoryview)):
        raw = bytes(slots)
        return len(raw) >> 3, raw if len(raw) % 8 == 0 else None
    if isinstance(slots, Sequence) and not isinstance(slots, str):
        return len(slots), to_bytes(slots)
    return 0, None


def slot_run(slots: object) -> tuple[int, Optional[Run]]:
    """(how many slots, the run); the run None when `slots` is not a run of slot ids."""
    n, raw = slot_raw(slots)
    return n, None if raw is None else Run(raw)


def slots_of(slots: Sequence[object]) -> Optional[Run]:
    """Protocol slot ids as a run; None unless every item is an int that fits int64 (`alloc.to_bytes`)."""
    raw = to_bytes(slots)
    return None if raw is None else Run(raw)
