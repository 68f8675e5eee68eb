"""Storage backends for the harness: in memory, on disk, and one that fails on cue.

All three implement `kvcert.spec.storage.StorageBackend`. `MemoryStorage` and
`FileStorage` are correct, plain stores (the second also exercises real I/O);
`FaultyStorage` wraps either and injects the failures a real L3 store has — an I/O
error, a partial or torn write, a corrupt or vanished page — only when the harness says
so. Nothing here is random or timed: the same calls and the same `arm` / `corrupt` /
`drop` calls give the same run, bit for bit, so a fault is an op in a replayable trace.

Backends store values verbatim; checking them is `decode_page`'s job. Under every
fault here that must still hold: a page reads back as its payload or as a miss, never
as other bytes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from kvcert.spec import storage as l3
from kvcert.spec.ops import Publish, StorageFault
from kvcert.spec.storage import MemoryStorage, StorageError
from kvcert.spec.storage import check_batch as _check_batch
from kvcert.spec.types import BadInput, CacheConfig


class FileStorage:
    """One file per key under `root`, each replaced atomically.

    A value is written to a temporary file in `root` and renamed over the page's file
    (`os.replace`), so a reader sees the old record or the new one, never half of one.
    There is no fsync: this is atomic visibility, not crash durability (a page torn by a
    crash fails its checksum, which is a miss). A file's name is the key's UTF-8 bytes in
    hex, so any key of up to MAX_KEY_BYTES maps to a safe, distinct, reversible name.
    """

    MAX_KEY_BYTES = 120  # 240 hex digits + suffix stays under the usual 255-byte name limit
    SUFFIX = ".page"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        raw = key.encode("utf-8")
        if len(raw) > self.MAX_KEY_BYTES:
            raise BadInput(f"storage key of {len(raw)} bytes; FileStorage takes at most {self.MAX_KEY_BYTES}")
        return self.root / (raw.hex() + self.SUFFIX)

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not self._path(key).is_file():
                return i
        return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for key in keys:
            try:
                out.append(self._path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise StorageError(f"reading {key!r}: {e}") from e
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        _check_batch(keys, values)
        paths = [self._path(key) for key in keys]  # a bad key fails the call before any write
        return [self._write(path, value) for path, value in zip(paths, values)]

    def _write(self, path: Path, value: bytes) -> bool:
        tmp: Optional[str] = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
            return True
        except OSError:
            return False
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)  # already gone after a successful replace

    def delete(self, key: str) -> bool:
        """Remove `key`'s file; whether there was one."""
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def contents(self) -> dict[str, bytes]:
        """Every stored page by key (temporary files are not pages)."""
        return {
            bytes.fromhex(p.name[: -len(self.SUFFIX)]).decode("utf-8"): p.read_bytes()
            for p in sorted(self.root.glob("*" + self.SUFFIX))
        }


LocalStorage = Union[MemoryStorage, FileStorage]
"""Backends FaultyStorage can wrap: it needs `delete` to make a page vanish."""

CALL_FAULTS = ("error", "partial_write", "torn_write")
"""Faults `FaultyStorage.arm` queues for a later call.

- `error`: the next `batch_get` or `batch_set` raises `StorageError` and changes nothing.
- `partial_write`: the next `batch_set` stores pages before `at` and reports the rest
  False, unwritten — an honest partial failure.
- `torn_write`: the next `batch_set` stores page `at` cut to half its length and reports
  it True — a lying one, which only the checksum catches.
"""


@dataclass(frozen=True)
class Fault:
    """One fault as injected: its kind and the keys it touched (none if it hit no page)."""

    kind: str
    keys: tuple[str, ...]


class FaultyStorage:
    """A backend that fails exactly when and where the harness says.

    `arm` queues call faults (CALL_FAULTS); each call takes the earliest armed fault
    that applies to it, so arming is a deterministic script, not a probability.
    `corrupt` and `drop` damage a stored page at once, as bit rot or an eviction inside
    the store would. `batch_exists` never fails: a store that cannot answer it is a miss.
    `log` lists every fault injected, in order.
    """

    def __init__(self, inner: LocalStorage) -> None:
        self.inner = inner
        self.log: list[Fault] = []
        self._armed: list[tuple[str, Optional[int]]] = []
        self.lookups = 0
        """`batch_exists` calls so far: a prefetch declined for admission (THROTTLE) makes none, one whose host
        room then failed makes one, and the snapshots cannot tell the two apart."""

    def arm(self, kind: str, count: int = 1, at: Optional[int] = None) -> None:
        """Queue `count` faults of `kind`; `at` is the page a write fault hits.

        `at` defaults to the middle of the batch and is clamped into it, so a write
        fault always hits a page of a non-empty batch.
        """
        if kind not in CALL_FAULTS:
            raise BadInput(f"unknown fault {kind!r}; call faults are {CALL_FAULTS}")
        if count < 0 or (at is not None and at < 0):
            raise BadInput(f"count and at must be >= 0, got {count}, {at}")
        self._armed.extend([(kind, at)] * count)

    @property
    def armed(self) -> tuple[tuple[str, Optional[int]], ...]:
        """Faults queued and not yet triggered, earliest first."""
        return tuple(self._armed)

    def _take(self, kinds: Sequence[str]) -> Optional[tuple[str, Optional[int]]]:
        for i, (kind, _) in enumerate(self._armed):
            if kind in kinds:
                return self._armed.pop(i)
        return None

    def batch_exists(self, keys: Sequence[str]) -> int:
        self.lookups += 1
        return self.inner.batch_exists(keys)

    def batch_get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        if self._take(("error",)) is not None:
            self.log.append(Fault("error", tuple(keys)))
            raise StorageError("injected: batch_get failed")
        return self.inner.batch_get(keys)

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        _check_batch(keys, values)
        fault = self._take(CALL_FAULTS)
        if fault is None:
            return self.inner.batch_set(keys, values)
        kind, at = fault
        if kind == "error":
            self.log.append(Fault(kind, tuple(keys)))
            raise StorageError("injected: batch_set failed")
        if not keys:
            self.log.append(Fault(kind, ()))
            return []
        hit = min(len(keys) // 2 if at is None else at, len(keys) - 1)
        if kind == "partial_write":
            self.log.append(Fault(kind, tuple(keys[hit:])))
            return self.inner.batch_set(keys[:hit], values[:hit]) + [False] * (len(keys) - hit)
        torn = list(values)
        torn[hit] = torn[hit][: len(torn[hit]) // 2]
        self.log.append(Fault(kind, (keys[hit],)))
        return self.inner.batch_set(keys, torn)

    def corrupt(self, key: str, offset: Optional[int] = None) -> bool:
        """Flip every bit of one byte of `key`'s stored value (the middle one by default).

        Returns whether there was a non-empty value to damage. A store that keeps pages in a format of its own
        (an engine's files) damages its own bytes, through its `corrupt`.
        """
        own = getattr(self.inner, "corrupt", None)
        if callable(own):
            hit = bool(own(key, offset))
            if hit:
                self.log.append(Fault("corrupt", (key,)))
            return hit
        blob = self.inner.batch_get([key])[0]
        if not blob:
            return False
        i = len(blob) // 2 if offset is None else offset % len(blob)
        self.inner.batch_set([key], [blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1 :]])
        self.log.append(Fault("corrupt", (key,)))
        return True

    def drop(self, key: str) -> bool:
        """Make `key` vanish from the store; whether it was there."""
        if not self.inner.delete(key):
            return False
        self.log.append(Fault("drop", (key,)))
        return True


# ---------------------------------------------------------------------- storage-side trace events


def publish(stores: Sequence[FaultyStorage], op: Publish, config: CacheConfig) -> None:
    """Write `op.tokens`' canonical pages into every store, as a peer engine would."""
    tokens = tuple(t for t in op.tokens if isinstance(t, int) and not isinstance(t, bool) and t >= 0)
    digest = l3.canonical_digest(config.page_size, config.model_id)
    pairs = l3.stored_pages(op.namespace, tokens, config.page_size, config.kv_layers, digest)
    for store in stores:
        store.inner.batch_set([k for k, _ in pairs], [v for _, v in pairs])


def page_order(store: FaultyStorage) -> list[str]:
    """The keys `store` holds, in the order a page fault's `at` counts them."""
    return sorted(store.inner.contents())


def damage(stores: Sequence[FaultyStorage], op: StorageFault) -> None:
    """Damage every store alike; a page fault picks the `at`-th of the last store's (the oracle's) keys."""
    if op.kind in ("corrupt", "drop"):
        keys = page_order(stores[-1])
        if not keys:
            return
        key = keys[op.at % len(keys)]
        for store in stores:
            store.corrupt(key) if op.kind == "corrupt" else store.drop(key)
        return
    for store in stores:
        store.arm(op.kind, at=op.at)
