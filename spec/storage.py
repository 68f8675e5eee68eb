"""The storage tier (L3): page keys, KV content and page records, as pure functions.

Three things every storage backend and every cache that uses one must agree on:

- **page keys** — a chained hash of the token prefix, seeded by the namespace and a
  compatibility digest, so equal prefixes meet under equal keys in every process and on
  every rank, and nothing else does;
- **KV content** — the bytes a page must hold are a pure function of (namespace, token
  prefix, layer, K or V), so every page read back from any tier can be verified without
  keeping a copy;
- **page records** — what is stored under a key: the payload framed with its key and a
  checksum, so a missing, truncated, corrupt or misplaced record decodes to a miss, never
  to wrong KV.

`StorageBackend` is the batch API a backend implements (SGLang's `HiCacheStorage` shape); `MemoryStorage` is the
simplest correct one, a dict, for the harness and for an adapter whose engine shares a store with its peers.
The exact byte encodings are in docs/storage.md. Hashes come from `hashlib` only, never
`hash()`, whose value changes from one process to the next. Token ids are unsigned 32-bit
(vocabulary indices); namespaces are `None` or any valid Unicode string.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Optional, Protocol, runtime_checkable

from kvcert.spec.types import BadInput, KVCertError

TOKEN_LIMIT = 2**32
"""Token ids lie in [0, TOKEN_LIMIT): each is hashed as 4 little-endian bytes."""

KV_WIDTH = 8
"""Bytes of one (token, layer, K or V) entry of the content function."""

RECORD_MAGIC = b"KVCP"
RECORD_VERSION = 1
CHECKSUM_WIDTH = 16
_HEAD = struct.Struct("<4sBI")  # magic, version, key length
_LENGTH = struct.Struct("<Q")  # payload length
RECORD_OVERHEAD = _HEAD.size + _LENGTH.size + CHECKSUM_WIDTH
"""Bytes a record adds to its key and payload."""

KV_PARTS = ("k", "v")
"""`which` values of `token_kv`: the key and the value tensor."""

FETCH_BATCH_PAGES = 128
"""SGLang's storage batch (``STORAGE_BATCH_SIZE``): a prefetch's progress reaches the engine per batch of this many
pages, at a batch's first miss, or at its last page (SPEC.md §6.1 ``FETCH``)."""

PREFETCH_ADMIT_FRACTION = 0.5
"""SGLang's prefetch admission limit: a prefetch is declined while the running prefetches' requested spans reach
this fraction of the host pool (``prefetch_capacity_limit``, SPEC.md §6.1 ``THROTTLE``)."""


class StorageError(KVCertError):
    """A storage call failed as a whole (I/O, network, a dead peer).

    The caller treats every page of the batch as missing. The backend may have written
    some of a failed `batch_set` — records are self-checking, so that is safe.
    """


# --------------------------------------------------------------------------- encodings


def _text(s: str) -> bytes:
    """Length-prefixed UTF-8, so a run of fields splits back into fields one way only."""
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _namespace(namespace: Optional[str]) -> bytes:
    """`None` is one byte 0; a string is byte 1 then its text, so None != "" != any string."""
    return b"\x00" if namespace is None else b"\x01" + _text(namespace)


def _tokens(tokens: Sequence[int]) -> bytes:
    for t in tokens:
        if not 0 <= t < TOKEN_LIMIT:
            raise ValueError(f"token ids must lie in [0, 2**32), got {t}")
    return struct.pack(f"<{len(tokens)}I", *tokens)


# --------------------------------------------------------------------------- page keys


def compat_digest(page_size: int, layout: str, dtype: str, model_id: str) -> str:
    """Hex digest of what makes two caches' pages interchangeable.

    Two caches may share stored pages only if their digests are equal: it seeds every
    page key, so a page written under another page size, layout, dtype or model is
    simply never found.

    pre: 1 <= page_size < 2**64
    post: len(__return__) == 64
    post: all(c in "0123456789abcdef" for c in __return__)
    """
    if not 1 <= page_size < 2**64:
        raise ValueError(f"page_size must lie in [1, 2**64), got {page_size}")
    h = hashlib.sha256(b"kvcert-compat-v1\x00")
    h.update(struct.pack("<Q", page_size) + _text(layout) + _text(dtype) + _text(model_id))
    return h.hexdigest()


def page_keys(namespace: Optional[str], tokens: Sequence[int], page_size: int, digest: str) -> tuple[str, ...]:
    """One storage key per whole page of `tokens`, each naming the whole prefix up to it.

    key_i = sha256(key_{i-1} || page i's tokens), chained from a root that hashes the
    namespace and `digest`; a trailing partial page gets no key. Because each key covers
    its whole prefix, the same page after different prefixes gets different keys, and
    the keys of a prefix are a prefix of the keys.

    pre: page_size >= 1
    pre: all(0 <= t < TOKEN_LIMIT for t in tokens)
    post: len(__return__) == len(tokens) // page_size
    post: len(set(__return__)) == len(__return__)
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    prior = hashlib.sha256(b"kvcert-page-key-v1\x00" + _namespace(namespace) + _text(digest)).digest()
    keys: list[str] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = hashlib.sha256(prior + _tokens(tokens[start : start + page_size])).digest()
        keys.append(prior.hex())
    return tuple(keys)


# --------------------------------------------------------------------------- KV content


def prefix_digests(namespace: Optional[str], tokens: Sequence[int]) -> tuple[bytes, ...]:
    """A 16-byte digest per position naming (namespace, tokens[: i + 1]).

    d_i = blake2b-128(d_{i-1} || token_i), from a root that hashes the namespace: the
    content of position i depends on every token before it, as real KV does.

    pre: all(0 <= t < TOKEN_LIMIT for t in tokens)
    post: len(__return__) == len(tokens)
    post: all(len(d) == 16 for d in __return__)
    """
    prior = hashlib.blake2b(b"kvcert-kv-v1\x00" + _namespace(namespace), digest_size=16).digest()
    out: list[bytes] = []
    for t in tokens:
        prior = hashlib.blake2b(prior + _tokens((t,)), digest_size=16).digest()
        out.append(prior)
    return tuple(out)


def token_kv(prefix_digest: bytes, layer: int, which: str) -> bytes:
    """The KV_WIDTH bytes of K or V at one layer for the token `prefix_digest` names.

    The namespace is already inside `prefix_digest` (see `prefix_digests`).

    pre: 0 <= layer < 2**32
    pre: which in KV_PARTS
    post: len(__return__) == KV_WIDTH
    """
    if which not in KV_PARTS:
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    return hashlib.blake2b(prefix_digest + _kv_part(layer, which), digest_size=KV_WIDTH).digest()


def _kv_part(layer: int, which: str) -> bytes:
    """What `token_kv` hashes after the prefix digest to name one (layer, K|V) cell."""
    return struct.pack("<I", layer) + which.encode()


def token_entries(namespace: Optional[str], tokens: Sequence[int], layers: int) -> tuple[bytes, ...]:
    """What one device or host slot holds for each token: K of every layer, then V of every layer.

    A cache that exposes its KV bytes (`Capabilities.kv_reads`) is written and checked with
    these; `page_payload` holds the same entries transposed (token innermost).

    pre: layers >= 1
    pre: all(0 <= t < TOKEN_LIMIT for t in tokens)
    post: len(__return__) == len(tokens)
    post: all(len(e) == 2 * layers * KV_WIDTH for e in __return__)
    """
    # `token_kv(d, layer, w)` for each part, its `_kv_part` packed once per call, not once per token
    parts = [_kv_part(layer, w) for w in KV_PARTS for layer in range(layers)]
    blake = hashlib.blake2b
    return tuple(
        b"".join([blake(d + part, digest_size=KV_WIDTH).digest() for part in parts])
        for d in prefix_digests(namespace, tokens)
    )


def page_payload(
    namespace: Optional[str], tokens: Sequence[int], page_index: int, page_size: int, layers: int
) -> bytes:
    """The canonical payload of page `page_index` of `tokens` (tokens past it are ignored).

    Entries are ordered K then V, then layer, then token — the order of SGLang's
    layer-first host buffer, shape (2, layers, tokens) — each `token_kv` of KV_WIDTH bytes.

    pre: page_size >= 1 and layers >= 1 and page_index >= 0
    pre: (page_index + 1) * page_size <= len(tokens)
    pre: all(0 <= t < TOKEN_LIMIT for t in tokens)
    post: len(__return__) == 2 * layers * page_size * KV_WIDTH
    """
    start, end = page_index * page_size, (page_index + 1) * page_size
    if page_size < 1 or layers < 1 or page_index < 0 or end > len(tokens):
        raise ValueError(f"no page {page_index} of size {page_size} in {len(tokens)} tokens ({layers} layers)")
    digests = prefix_digests(namespace, tokens[:end])[start:end]
    return b"".join(token_kv(d, layer, w) for w in KV_PARTS for layer in range(layers) for d in digests)


def stored_pages(
    namespace: Optional[str], tokens: Sequence[int], page_size: int, layers: int, digest: str
) -> tuple[tuple[str, bytes], ...]:
    """(key, record) of every whole page of `tokens`: what any conforming cache stores for them.

    pre: page_size >= 1 and layers >= 1
    pre: all(0 <= t < TOKEN_LIMIT for t in tokens)
    post: len(__return__) == len(tokens) // page_size
    """
    keys = page_keys(namespace, tokens, page_size, digest)
    return tuple(
        (key, encode_page(key, page_payload(namespace, tokens, i, page_size, layers))) for i, key in enumerate(keys)
    )


CANONICAL_LAYOUT = "kvcert/1"
"""Layout name of canonical payloads (`page_payload`) in the compatibility digest."""
CANONICAL_DTYPE = "synthetic"


def canonical_digest(page_size: int, model_id: str) -> str:
    """The digest of a cache that stores canonical payloads: refimpl, gpu and the harness agree on it."""
    return compat_digest(page_size, CANONICAL_LAYOUT, CANONICAL_DTYPE, model_id)


# --------------------------------------------------------------------------- page records


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=CHECKSUM_WIDTH).digest()


def _record_head(raw_key: bytes) -> bytes:
    return _HEAD.pack(RECORD_MAGIC, RECORD_VERSION, len(raw_key)) + raw_key


def encode_page(key: str, payload: bytes) -> bytes:
    """The record stored under `key`: header, key, payload, checksum of all before it.

    The key is inside the record so a page stored or returned under the wrong key is
    rejected, not served.

    post: len(__return__) == RECORD_OVERHEAD + len(key.encode()) + len(payload)
    post: decode_page(key, __return__) == payload
    """
    body = _record_head(key.encode("utf-8")) + _LENGTH.pack(len(payload)) + payload
    return body + _checksum(body)


def decode_page(key: str, blob: Optional[bytes]) -> Optional[bytes]:
    """The payload of a record for `key`, or None for anything else: a miss.

    None when `blob` is missing, truncated or extended, has another magic, version or
    key, a length that does not match, or a bad checksum. Never raises: whatever a
    backend returns, the worst outcome is a miss.

    post: __return__ is None or encode_page(key, __return__) == blob
    """
    if not isinstance(blob, bytes):
        return None
    try:
        head = _record_head(key.encode("utf-8"))
    except (UnicodeEncodeError, struct.error):
        return None
    start = len(head) + _LENGTH.size
    if len(blob) < start + CHECKSUM_WIDTH or not blob.startswith(head):
        return None
    payload = blob[start : start + int.from_bytes(blob[len(head) : start], "little")]
    # Accept exactly the canonical record of `payload`: length, checksum and the end of
    # the blob are all verified by this one comparison.
    return payload if encode_page(key, payload) == blob else None


# --------------------------------------------------------------------------- the backend protocol


@runtime_checkable
class StorageBackend(Protocol):
    """An L3 store of page records by key: SGLang's `HiCacheStorage` batch API.

    Values are opaque bytes to the backend (records from `encode_page`); only the cache
    decodes them, so a backend cannot serve wrong KV without the cache noticing. Any
    call may raise `StorageError`.
    """

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, are stored: the usable prefix of a chain.

        A hint only: a page that exists may still decode to a miss.
        """
        ...

    def batch_get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """The stored value of each key, None where there is none."""
        ...

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        """Store each value under its key; whether each one was stored."""
        ...


def check_batch(keys: Sequence[str], values: Sequence[bytes]) -> None:
    """A `batch_set` takes one value per key: a typed error, before anything is stored."""
    if len(keys) != len(values):
        raise BadInput(f"batch_set got {len(keys)} keys and {len(values)} values")


class MemoryStorage:
    """A dict from key to value: the simplest correct backend (`StorageBackend`)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if key not in self._data:
                return i
        return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        return [self._data.get(key) for key in keys]

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        check_batch(keys, values)
        for key, value in zip(keys, values):
            self._data[key] = bytes(value)
        return [True] * len(keys)

    def delete(self, key: str) -> bool:
        """Remove `key`; whether it was stored. (Harness-side, like `contents`.)"""
        return self._data.pop(key, None) is not None

    def contents(self) -> dict[str, bytes]:
        """Everything stored, for tests and fault injection; not part of the protocol."""
        return dict(self._data)
