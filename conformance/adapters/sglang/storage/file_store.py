"""The harness's view of SGLang's own `file` L3 backend: spec records in, HiCacheFile's page files out.

The `file` storage target runs SGLang's ``HiCacheFile`` unpatched: SGLang writes and reads its page
files itself. The harness still needs to publish a peer's pages into the same directory, damage a
page there, and read back what SGLang stored (INV-STORE-1). :class:`SGLangFileStore` is that view:
a ``kvcert.spec.storage.StorageBackend`` whose keys are the spec's page keys and whose values are
spec records, kept as the files HiCacheFile names and writes (the raw page bytes, no header).

A spec key is translated to SGLang's through the (namespace, token path) the driver learned for it
(:meth:`learn`). A page published before SGLang was handed its path waits as a record and becomes a
file when the path is learned, which happens before SGLang can ask for it. ``corrupt`` flips a byte
of the page file itself, as bit rot would: HiCacheFile keeps no checksum, so that is the fault it
cannot see (findings.md, F-L3-1).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

from kvcert.spec import storage as l3

__all__ = ["EnginePageStore", "SGLangFileStore"]


class EnginePageStore:
    """Spec keys and records over the store a live SGLang backend keeps in a format of its own (its files, its
    objects): the translation both ways, pages published before their path was learned, and damage. A subclass says
    how the engine names a page (`_name`), reads, writes and removes it (`_read`, `_write`, `_remove`), and how a page
    payload is laid out in it (`to_object`, `to_payload`: as is here)."""

    WHAT = "page"
    """What the engine stores a page as, for messages."""

    def __init__(self, page_size: int, model_id: str, keys_of: Any) -> None:
        self.page_size = page_size
        self.digest = l3.canonical_digest(page_size, model_id)
        self._keys_of = keys_of
        """SGLang's page keys of a (namespace, tokens): the chain its tree stores as hash values."""
        self.sglang_key: dict[str, str] = {}
        """Spec key -> SGLang's key, for every page of a path learned."""
        self.spec_key: dict[str, str] = {}
        """The engine's name of a learned page (see `_learned`) -> its spec key."""
        self.waiting: dict[str, bytes] = {}
        """Records published for pages whose path SGLang was not handed yet."""
        self.waiting_blobs: dict[str, bytes] = {}
        """The bytes each waiting page will hold in the engine's store (its payload as stored, or that as damaged
        meanwhile)."""
        self.damaged: dict[str, tuple[bytes, bytes]] = {}
        """Spec key -> (the stored bytes once corrupted, the damaged record the harness's own stores hold): one fault,
        in the engine's format and as a record; read as the record while the store still holds those bytes."""

    # ------------------------------------------------------------------ the engine's store (subclasses)

    def _learned(self, spec_key: str, sglang_key: str) -> str:
        """The engine's name of a learned page, the key of `spec_key` (a subclass's own naming)."""
        raise NotImplementedError

    def _name(self, spec_key: str) -> Optional[str]:
        raise NotImplementedError

    def _read(self, name: str) -> Optional[bytes]:
        raise NotImplementedError

    def _write(self, name: str, blob: bytes) -> None:
        raise NotImplementedError

    def _remove(self, name: str) -> bool:
        """Remove the stored page `name`; whether there was one."""
        raise NotImplementedError

    def _exists(self, name: str) -> bool:
        return self._read(name) is not None

    def to_object(self, payload: bytes) -> bytes:
        return payload

    def to_payload(self, blob: bytes) -> Optional[bytes]:
        return blob

    # ------------------------------------------------------------------ translation

    def learn(self, namespace: Optional[str], tokens: Sequence[int]) -> None:
        """Name every whole page of `tokens` both ways; a waiting record of one becomes its stored page."""
        toks = tuple(int(t) for t in tokens)
        spec = l3.page_keys(namespace, toks, self.page_size, self.digest)
        for sk, gk in zip(spec, self._keys_of(namespace, toks, self.page_size)):
            if sk in self.sglang_key:
                continue
            self.sglang_key[sk] = gk
            self.spec_key[self._learned(sk, gk)] = sk
            if self.waiting.pop(sk, None) is not None:
                self._put(sk, self.waiting_blobs.pop(sk))

    def _put(self, key: str, blob: bytes) -> bool:
        """A peer engine's write of page `key` in the engine's format."""
        name = self._name(key)
        if name is None:
            return False
        self._write(name, blob)
        return True

    @staticmethod
    def _flip(blob: bytes, offset: Optional[int]) -> bytes:
        """`blob` with every bit of one byte flipped (the middle one by default), as FaultyStorage damages a page."""
        i = len(blob) // 2 if offset is None else offset % len(blob)
        return blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1 :]

    def _record(self, key: str, blob: bytes) -> bytes:
        """Stored bytes as the harness's stores hold the page: its record, or the record as damaged."""
        damaged = self.damaged.get(key)
        if damaged is not None and damaged[0] == blob:
            return damaged[1]
        payload = self.to_payload(blob)
        return l3.encode_page(key, blob if payload is None else payload)

    # ------------------------------------------------------------------ StorageBackend

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            name = self._name(key)
            if key not in self.waiting and (name is None or not self._exists(name)):
                return i
        return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for key in keys:
            if key in self.waiting:
                out.append(self.waiting[key])
                continue
            name = self._name(key)
            blob = None if name is None else self._read(name)
            out.append(None if blob is None else self._record(key, blob))
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        """A peer engine's writes: each record's payload as the engine would have stored it."""
        if len(keys) != len(values):
            raise l3.StorageError(f"batch_set got {len(keys)} keys and {len(values)} values")
        done = []
        for key, value in zip(keys, values):
            payload = l3.decode_page(key, bytes(value))
            if payload is None:  # only a harness call fault writes a record that does not decode: none is declared
                raise l3.StorageError(f"a record that does not decode cannot become a {self.WHAT}: {key[:16]}…")
            self.damaged.pop(key, None)
            if key in self.sglang_key:
                done.append(self._put(key, self.to_object(payload)))
            else:
                self.waiting[key], self.waiting_blobs[key] = bytes(value), self.to_object(payload)
                done.append(True)
        return done

    def delete(self, key: str) -> bool:
        self.damaged.pop(key, None)
        if self.waiting.pop(key, None) is not None:
            del self.waiting_blobs[key]
            return True
        name = self._name(key)
        return name is not None and self._remove(name)

    def corrupt(self, key: str, offset: Optional[int] = None) -> bool:
        """Flip every bit of one byte of the stored page (the middle one by default): bit rot in the store. The
        harness's own stores damage the page's record alike; `contents` reads the page as that record."""
        if key in self.waiting:
            self.waiting_blobs[key] = self._flip(self.waiting_blobs[key], offset)
            self.waiting[key] = self._flip(self.waiting[key], offset)
            self.damaged[key] = (self.waiting_blobs[key], self.waiting[key])
            return True
        name = self._name(key)
        blob = None if name is None else self._read(name)
        if not blob:
            return False
        assert name is not None
        damaged = self._flip(blob, offset)
        self._write(name, damaged)
        self.damaged[key] = (damaged, self._flip(self._record(key, blob), offset))
        return True


class SGLangFileStore(EnginePageStore):
    """Spec keys and records over a live HiCacheFile's directory and file names (the raw page bytes, no header)."""

    WHAT = "page file"

    def __init__(self, backend: Any, page_size: int, model_id: str, keys_of: Any) -> None:
        super().__init__(page_size, model_id, keys_of)
        self.backend = backend
        """The engine's HiCacheFile: its directory and its own file naming (``_get_suffixed_key``)."""

    def _learned(self, spec_key: str, sglang_key: str) -> str:
        return sglang_key

    def _name(self, spec_key: str) -> Optional[str]:
        gk = self.sglang_key.get(spec_key)
        if gk is None:
            return None
        return os.path.join(self.backend.file_path, f"{self.backend._get_suffixed_key(gk)}.bin")

    def _read(self, name: str) -> Optional[bytes]:
        if not os.path.exists(name):
            return None
        with open(name, "rb") as f:
            return f.read()

    def _exists(self, name: str) -> bool:
        return os.path.exists(name)

    def _write(self, name: str, blob: bytes) -> None:
        """The page's raw bytes under HiCacheFile's name, replaced atomically."""
        tmp = f"{name}.kvcert-tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, name)

    def _remove(self, name: str) -> bool:
        if not os.path.exists(name):
            return False
        os.unlink(name)
        return True

    def contents(self) -> dict[str, bytes]:
        """Every page stored, as spec records: HiCacheFile's files of learned pages, and waiting records."""
        out = dict(self.waiting)
        suffix = self.backend._get_suffixed_key("")
        for name in os.listdir(self.backend.file_path):
            if not name.endswith(".bin"):
                continue
            stem = name[: -len(".bin")]
            gk = stem[: -len(suffix)] if suffix and stem.endswith(suffix) else stem
            sk = self.spec_key.get(gk)
            if sk is None:
                out[f"unlearned:{stem}"] = b""  # a file no path the driver handed SGLang names: never the spec's
                continue
            with open(os.path.join(self.backend.file_path, name), "rb") as f:
                out[sk] = self._record(sk, f.read())
        return out
