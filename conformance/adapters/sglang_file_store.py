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

__all__ = ["SGLangFileStore"]


class SGLangFileStore:
    """Spec keys and records over a live HiCacheFile's directory and file names."""

    def __init__(self, backend: Any, page_size: int, model_id: str, keys_of: Any) -> None:
        self.backend = backend
        """The engine's HiCacheFile: its directory and its own file naming (``_get_suffixed_key``)."""
        self.page_size = page_size
        self.digest = l3.canonical_digest(page_size, model_id)
        self._keys_of = keys_of
        """SGLang's page keys of a (namespace, tokens): the chain its tree stores as hash values."""
        self.sglang_key: dict[str, str] = {}
        """Spec key -> SGLang's key, for every page of a path learned."""
        self.spec_key: dict[str, str] = {}
        self.waiting: dict[str, bytes] = {}
        """Records published for pages whose path SGLang was not handed yet."""
        self.waiting_files: dict[str, bytes] = {}
        """The bytes each waiting page's file will hold (its payload, or the payload as damaged meanwhile)."""
        self.damaged: dict[str, tuple[bytes, bytes]] = {}
        """Spec key -> (the page file's bytes once corrupted, the damaged record the harness's own stores hold):
        one fault, as a file and as a record; read as the record while the file still holds those bytes."""

    # ------------------------------------------------------------------ translation

    def learn(self, namespace: Optional[str], tokens: Sequence[int]) -> None:
        """Name every whole page of `tokens` both ways; a waiting record of one becomes its file."""
        toks = tuple(int(t) for t in tokens)
        spec = l3.page_keys(namespace, toks, self.page_size, self.digest)
        for sk, gk in zip(spec, self._keys_of(namespace, toks, self.page_size)):
            if sk in self.sglang_key:
                continue
            self.sglang_key[sk], self.spec_key[gk] = gk, sk
            if self.waiting.pop(sk, None) is not None:
                self._write_file(sk, self.waiting_files.pop(sk))

    def _path(self, spec_key: str) -> Optional[str]:
        gk = self.sglang_key.get(spec_key)
        if gk is None:
            return None
        return os.path.join(self.backend.file_path, f"{self.backend._get_suffixed_key(gk)}.bin")

    def _write_file(self, key: str, blob: bytes) -> bool:
        """A peer engine's write: the page's raw bytes under HiCacheFile's name, replaced atomically."""
        path = self._path(key)
        if path is None:
            return False
        tmp = f"{path}.kvcert-tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        return True

    @staticmethod
    def _flip(blob: bytes, offset: Optional[int]) -> bytes:
        """`blob` with every bit of one byte flipped (the middle one by default), as FaultyStorage damages a page."""
        i = len(blob) // 2 if offset is None else offset % len(blob)
        return blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1 :]

    # ------------------------------------------------------------------ StorageBackend

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            path = self._path(key)
            if key not in self.waiting and (path is None or not os.path.exists(path)):
                return i
        return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for key in keys:
            if key in self.waiting:
                out.append(self.waiting[key])
                continue
            path = self._path(key)
            if path is None or not os.path.exists(path):
                out.append(None)
                continue
            with open(path, "rb") as f:
                out.append(self._record(key, f.read()))
        return out

    def _record(self, key: str, blob: bytes) -> bytes:
        """The page file's bytes as the harness's stores hold the page: its record, or the record as damaged."""
        damaged = self.damaged.get(key)
        return damaged[1] if damaged is not None and damaged[0] == blob else l3.encode_page(key, blob)

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise l3.StorageError(f"batch_set got {len(keys)} keys and {len(values)} values")
        done = []
        for key, value in zip(keys, values):
            payload = l3.decode_page(key, bytes(value))
            if payload is None:  # only a harness call fault writes a record that does not decode: none is declared
                raise l3.StorageError(f"a record that does not decode cannot become a page file: {key[:16]}…")
            self.damaged.pop(key, None)
            if key in self.sglang_key:
                done.append(self._write_file(key, payload))
            else:
                self.waiting[key], self.waiting_files[key] = bytes(value), payload
                done.append(True)
        return done

    def delete(self, key: str) -> bool:
        self.damaged.pop(key, None)
        if self.waiting.pop(key, None) is not None:
            del self.waiting_files[key]
            return True
        path = self._path(key)
        if path is None or not os.path.exists(path):
            return False
        os.unlink(path)
        return True

    def corrupt(self, key: str, offset: Optional[int] = None) -> bool:
        """Flip every bit of one byte of the page itself (the middle one by default): bit rot in the file. The
        harness's own stores damage the page's record alike; :meth:`contents` reads the file as that record."""
        if key in self.waiting:
            blob = self.waiting_files[key]
            self.waiting_files[key] = self._flip(blob, offset)
            self.waiting[key] = self._flip(self.waiting[key], offset)
            self.damaged[key] = (self.waiting_files[key], self.waiting[key])
            return True
        path = self._path(key)
        if path is None or not os.path.exists(path):
            return False
        with open(path, "rb") as f:
            blob = f.read()
        if not blob:
            return False
        damaged = self._flip(blob, offset)
        with open(path, "wb") as f:
            f.write(damaged)
        self.damaged[key] = (damaged, self._flip(self._record(key, blob), offset))
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
