"""The storage tier: page keys, KV content, page records, and the harness backends.

The key and record formats are re-derived here from docs/storage.md with hashlib alone,
so a change to spec/storage.py that changes bytes on disk fails a test. Backends are
compared with each other on generated op sequences, and every injected fault is checked
to give a miss, never other bytes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import pytest
from _contracts import check_contract, contracted
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcert.conformance.harness.storage import CALL_FAULTS, Fault, FaultyStorage, FileStorage, MemoryStorage
from kvcert.spec import storage
from kvcert.spec.storage import (
    KV_PARTS,
    KV_WIDTH,
    RECORD_OVERHEAD,
    StorageBackend,
    StorageError,
    compat_digest,
    decode_page,
    encode_page,
    page_keys,
    page_payload,
    prefix_digests,
    token_entries,
    token_kv,
)
from kvcert.spec.types import BadInput

FAST = settings(max_examples=200, deadline=None)
DIGEST = compat_digest(4, "layer_first", "bfloat16", "llama-3-8b")

namespaces = st.one_of(st.none(), st.text(max_size=4))
small_tokens = st.lists(st.integers(0, 5), max_size=24)
any_tokens = st.lists(st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1)), max_size=24)

# --------------------------------------------------------------------------- the docstring contracts

CONTRACTED = contracted(storage)

_records = st.builds(encode_page, st.text(max_size=6), st.binary(max_size=24))
STRATEGIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "compat_digest": st.fixed_dictionaries(
        {
            "page_size": st.one_of(st.integers(-2, 64), st.integers(2**63, 2**64 + 2)),
            "layout": st.text(max_size=6),
            "dtype": st.text(max_size=6),
            "model_id": st.text(max_size=6),
        }
    ),
    "page_keys": st.fixed_dictionaries(
        {"namespace": namespaces, "tokens": any_tokens, "page_size": st.integers(0, 6), "digest": st.text(max_size=6)}
    ),
    "prefix_digests": st.fixed_dictionaries({"namespace": namespaces, "tokens": any_tokens}),
    "token_entries": st.fixed_dictionaries(
        {"namespace": namespaces, "tokens": any_tokens, "layers": st.integers(0, 4)}
    ),
    "token_kv": st.fixed_dictionaries(
        {
            "prefix_digest": st.binary(max_size=16),
            "layer": st.one_of(st.integers(-1, 80), st.just(2**32)),
            "which": st.sampled_from([*KV_PARTS, "x"]),
        }
    ),
    "page_payload": st.fixed_dictionaries(
        {
            "namespace": namespaces,
            "tokens": st.lists(st.integers(0, 5), min_size=6, max_size=24),
            "page_index": st.integers(-1, 2),
            "page_size": st.integers(0, 3),
            "layers": st.integers(0, 3),
        }
    ),
    "stored_pages": st.fixed_dictionaries(
        {
            "namespace": namespaces,
            "tokens": st.lists(st.integers(0, 5), max_size=12),
            "page_size": st.integers(0, 3),
            "layers": st.integers(0, 2),
            "digest": st.text(max_size=6),
        }
    ),
    "encode_page": st.fixed_dictionaries({"key": st.text(max_size=8), "payload": st.binary(max_size=40)}),
    "decode_page": st.fixed_dictionaries(
        {"key": st.text(max_size=6), "blob": st.one_of(st.none(), st.binary(max_size=60), _records)}
    ),
}


def test_every_contracted_function_has_a_strategy() -> None:
    assert set(CONTRACTED) == set(STRATEGIES)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_docstring_contracts(name: str) -> None:
    check_contract(storage, CONTRACTED[name], STRATEGIES[name], examples=200)


# --------------------------------------------------------------------------- page keys


def _text(s: str) -> bytes:
    raw = s.encode()
    return len(raw).to_bytes(8, "little") + raw


def test_key_scheme_is_the_documented_bytes() -> None:
    """docs/storage.md, reimplemented: another implementation must get the same keys."""
    digest = hashlib.sha256(
        b"kvcert-compat-v1\x00" + (16).to_bytes(8, "little") + _text("page_first") + _text("fp8") + _text("m")
    ).hexdigest()
    assert compat_digest(16, "page_first", "fp8", "m") == digest

    tokens = [7, 2**32 - 1, 0, 9, 9, 9, 1]
    for namespace, encoded in ((None, b"\x00"), ("lora-1", b"\x01" + _text("lora-1"))):
        prior = hashlib.sha256(b"kvcert-page-key-v1\x00" + encoded + _text(digest)).digest()
        want = []
        for start in (0, 3):
            page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + 3])
            prior = hashlib.sha256(prior + page).digest()
            want.append(prior.hex())
        assert page_keys(namespace, tokens, 3, digest) == tuple(want)


def test_content_and_record_are_the_documented_bytes() -> None:
    prior = hashlib.blake2b(b"kvcert-kv-v1\x00" + b"\x01" + _text("ns"), digest_size=16).digest()
    digests = []
    for t in (5, 6):
        prior = hashlib.blake2b(prior + t.to_bytes(4, "little"), digest_size=16).digest()
        digests.append(prior)
    assert prefix_digests("ns", [5, 6]) == tuple(digests)

    def kv(d: bytes, layer: int, which: bytes) -> bytes:
        return hashlib.blake2b(d + layer.to_bytes(4, "little") + which, digest_size=8).digest()

    order = [(w, layer, d) for w in (b"k", b"v") for layer in range(3) for d in digests]
    assert page_payload("ns", [5, 6, 1], 0, 2, 3) == b"".join(kv(d, layer, w) for w, layer, d in order)
    entry = [(w, layer) for w in (b"k", b"v") for layer in range(3)]  # a slot's entry: the same cells, token outermost
    assert token_entries("ns", [5, 6], 3) == tuple(b"".join(kv(d, layer, w) for w, layer in entry) for d in digests)
    assert token_entries("ns", [5, 6], 3)[1] == b"".join(token_kv(digests[1], layer, w.decode()) for w, layer in entry)

    body = b"KVCP" + b"\x01" + (3).to_bytes(4, "little") + b"abc" + (2).to_bytes(8, "little") + b"xy"
    assert encode_page("abc", b"xy") == body + hashlib.blake2b(body, digest_size=16).digest()


def test_golden_values() -> None:
    """The test vectors of docs/storage.md: any change here breaks every page already stored."""
    d = compat_digest(16, "layer_first", "bfloat16", "llama-3-8b")
    assert d == "0af672081b2c0bd9aef31d7b37383ce456f3a6bb736fd4729960f3304143b10d"
    assert page_keys(None, [1, 2, 3, 4], 2, d) == (
        "8feade62d3317262ecdf1268b4ec7e9d7b40ea185ebdd0bd5b2dc6c443355cbe",
        "9b73eabc9fb8c44058b5c188b2f53cfd2dbe7894a5c3ff245108111efecb8e68",
    )
    assert (
        page_keys("lora-7", [1, 2, 3, 4], 2, d)[1] == "b24c81319e961d1664bf250700d411203a2ea0370099e1276e85dd94cb9ec12f"
    )
    assert (
        page_payload("lora-7", [1, 2, 3, 4], 1, 2, 1).hex()
        == "91a7f62189be9506c96ca4c8d5dd3045aec41a16551df250a9f3cd8dcc954218"
    )
    assert (
        encode_page("ab", b"xy").hex() == "4b564350010200000061620200000000000000787906cfc11f791fab255b9918174d14abf1"
    )


_SUBPROCESS = """
from kvcert.spec.storage import compat_digest, page_keys, page_payload
d = compat_digest(4, "layer_first", "bfloat16", "llama-3-8b")
print(d)
print(page_keys("salt", list(range(40)), 4, d))
print(page_keys(None, [3] * 17, 4, d))
print(page_payload("salt", list(range(40)), 2, 4, 2).hex())
"""


def test_keys_are_the_same_in_another_process() -> None:
    """Python's hash() would differ per process (PYTHONHASHSEED); these must not."""
    here = "\n".join(
        [
            DIGEST,
            str(page_keys("salt", list(range(40)), 4, DIGEST)),
            str(page_keys(None, [3] * 17, 4, DIGEST)),
            page_payload("salt", list(range(40)), 2, 4, 2).hex(),
        ]
    )
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONWARNINGS": "ignore"}
        run = subprocess.run([sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, env=env, check=True)
        assert run.stdout.strip() == here


def test_namespaces_separate_keys_and_content() -> None:
    tokens = [1, 2, 3, 4]
    spaces: list[Optional[str]] = [None, "", "a", "a\x00", "\x00", "ab"]
    assert len({page_keys(ns, tokens, 2, DIGEST) for ns in spaces}) == len(spaces)
    assert len({prefix_digests(ns, tokens) for ns in spaces}) == len(spaces)
    assert len({page_payload(ns, tokens, 1, 2, 1) for ns in spaces}) == len(spaces)
    # Fields are length-prefixed: moving a character between namespace and digest is a new key.
    assert page_keys("ab", tokens, 2, "c") != page_keys("a", tokens, 2, "bc")


def test_every_compatibility_field_changes_the_keys() -> None:
    base = ("layer_first", "bfloat16", "m")
    digests = {
        compat_digest(4, *base),
        compat_digest(8, *base),
        compat_digest(4, "page_first", "bfloat16", "m"),
        compat_digest(4, "layer_first", "fp8_e4m3", "m"),
        compat_digest(4, "layer_first", "bfloat16", "m2"),
        compat_digest(4, "layer_firstb", "float16", "m"),  # the same characters, split differently
    }
    assert len(digests) == 6
    assert len({page_keys(None, [1] * 8, 4, d) for d in digests}) == 6


@FAST
@given(namespaces, small_tokens, st.integers(1, 5))
def test_keys_chain_and_ignore_the_partial_page(namespace: Optional[str], tokens: list[int], ps: int) -> None:
    keys = page_keys(namespace, tokens, ps, DIGEST)
    assert len(keys) == len(tokens) // ps
    assert keys == page_keys(namespace, tokens[: len(keys) * ps], ps, DIGEST)
    for i in range(len(keys) + 1):
        assert page_keys(namespace, tokens[: i * ps], ps, DIGEST) == keys[:i]


@FAST
@given(namespaces, small_tokens, small_tokens, st.integers(1, 4))
def test_a_key_names_its_whole_prefix(namespace: Optional[str], a: list[int], b: list[int], ps: int) -> None:
    """Equal keys at page i if and only if the first i + 1 pages are equal."""
    ka, kb = page_keys(namespace, a, ps, DIGEST), page_keys(namespace, b, ps, DIGEST)
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[: (i + 1) * ps] == b[: (i + 1) * ps])
    assert len(set(ka) & set(kb)) == sum(x == y for x, y in zip(ka, kb))


def test_same_page_after_different_prefixes() -> None:
    page = [9, 9]
    assert page_keys(None, [1, 1, *page], 2, DIGEST)[1] != page_keys(None, [2, 2, *page], 2, DIGEST)[1]
    assert page_keys(None, [1, 2, 3, 4], 1, DIGEST) != page_keys(None, [1, 2, 3, 4], 2, DIGEST)[:4]


def test_bad_arguments_raise() -> None:
    for tokens in ([-1], [2**32]):
        with pytest.raises(ValueError):
            page_keys(None, tokens, 1, DIGEST)
        with pytest.raises(ValueError):
            prefix_digests(None, tokens)
    with pytest.raises(ValueError):
        page_keys(None, [1], 0, DIGEST)
    with pytest.raises(ValueError):
        compat_digest(0, "a", "b", "c")
    with pytest.raises(ValueError):
        token_kv(b"", 0, "q")
    with pytest.raises(ValueError):
        page_payload(None, [1, 2, 3], 1, 2, 1)  # page 1 of size 2 needs 4 tokens


# --------------------------------------------------------------------------- KV content


def test_content_depends_on_namespace_layer_part_and_prefix() -> None:
    d = prefix_digests("ns", [1, 2, 3])
    entries = {token_kv(x, layer, w) for x in d for layer in range(4) for w in KV_PARTS}
    assert len(entries) == 3 * 4 * 2
    assert prefix_digests("ns", [1, 2, 3])[2] != prefix_digests("ns", [0, 2, 3])[2]  # an earlier token
    assert prefix_digests("ns", [1, 2, 3])[2] != prefix_digests("other", [1, 2, 3])[2]
    assert page_payload("ns", [1, 2, 3, 4], 1, 2, 2) != page_payload("ns", [0, 2, 3, 4], 1, 2, 2)
    assert page_payload("ns", [1, 2, 3, 4], 1, 2, 2) != page_payload(None, [1, 2, 3, 4], 1, 2, 2)
    assert (
        page_payload("ns", [1, 2, 3, 4], 1, 2, 2)[: 2 * KV_WIDTH * 2]
        == page_payload("ns", [1, 2, 3, 4], 1, 2, 3)[: 2 * KV_WIDTH * 2]
    )


@FAST
@given(namespaces, small_tokens, st.integers(1, 4), st.integers(1, 3), st.data())
def test_page_payload_is_the_page_of_token_kv(
    namespace: Optional[str], tokens: list[int], ps: int, layers: int, data: st.DataObject
) -> None:
    assume(len(tokens) >= ps)
    i = data.draw(st.integers(0, len(tokens) // ps - 1))
    d = prefix_digests(namespace, tokens)
    want = b"".join(
        token_kv(d[p], layer, w) for w in KV_PARTS for layer in range(layers) for p in range(i * ps, (i + 1) * ps)
    )
    assert page_payload(namespace, tokens, i, ps, layers) == want
    # Tokens after the page do not change it; its own prefix is all it depends on.
    assert page_payload(namespace, tokens[: (i + 1) * ps], i, ps, layers) == want


# --------------------------------------------------------------------------- page records


@FAST
@given(st.text(max_size=70), st.binary(max_size=200))
def test_record_round_trip(key: str, payload: bytes) -> None:
    blob = encode_page(key, payload)
    assert len(blob) == RECORD_OVERHEAD + len(key.encode()) + len(payload)
    assert decode_page(key, blob) == payload


@FAST
@given(st.text(max_size=8), st.binary(max_size=64), st.data())
def test_damaged_records_are_misses(key: str, payload: bytes, data: st.DataObject) -> None:
    blob = encode_page(key, payload)
    cut = data.draw(st.integers(0, len(blob) - 1), label="truncate to")
    assert decode_page(key, blob[:cut]) is None
    at = data.draw(st.integers(0, len(blob) - 1), label="flip at")
    mask = data.draw(st.integers(1, 255), label="xor")
    assert decode_page(key, blob[:at] + bytes([blob[at] ^ mask]) + blob[at + 1 :]) is None
    assert decode_page(key, blob + data.draw(st.binary(min_size=1, max_size=4), label="tail")) is None
    other = data.draw(st.text(max_size=8), label="other key")
    assume(other != key)
    assert decode_page(other, blob) is None


@FAST
@given(st.text(max_size=8), st.binary(max_size=120))
def test_garbage_is_a_miss_or_exactly_a_record(key: str, blob: bytes) -> None:
    out = decode_page(key, blob)
    assert out is None or encode_page(key, out) == blob


def test_decode_never_raises() -> None:
    record = encode_page("k", b"payload")
    assert decode_page("k", None) is None
    assert decode_page("k", b"") is None
    not_bytes: list[Any] = [bytearray(record), memoryview(record), "not bytes", 7]  # only bytes are records
    assert [decode_page("k", blob) for blob in not_bytes] == [None] * 4
    assert decode_page("\ud800", record) is None  # a key that is not valid Unicode
    assert record[10:18] == (7).to_bytes(8, "little")  # the payload length field
    for length in (0, 6, 8, 2**63, 2**64 - 1):
        assert decode_page("k", record[:10] + length.to_bytes(8, "little") + record[18:]) is None
    assert decode_page("k", record) == b"payload"


# --------------------------------------------------------------------------- the backends


@pytest.fixture(params=["memory", "file", "faulty"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "memory":
        return MemoryStorage()
    if request.param == "file":
        return FileStorage(tmp_path / "store")
    return FaultyStorage(MemoryStorage())


def test_backends_satisfy_the_protocol(backend: Any) -> None:
    assert isinstance(backend, StorageBackend)


def test_batch_exists_counts_the_stored_prefix_only(backend: Any) -> None:
    assert backend.batch_set(["a", "c"], [b"1", b"3"]) == [True, True]
    assert backend.batch_exists([]) == 0
    assert backend.batch_exists(["a"]) == 1
    assert backend.batch_exists(["a", "b", "c"]) == 1
    assert backend.batch_exists(["b", "a", "c"]) == 0
    assert backend.batch_exists(["a", "c", "a"]) == 3
    assert backend.batch_get(["c", "b", "a"]) == [b"3", None, b"1"]


def test_batch_set_rejects_mismatched_lengths(backend: Any) -> None:
    with pytest.raises(BadInput):
        backend.batch_set(["a", "b"], [b"1"])
    assert backend.batch_exists(["a"]) == 0


_keys = st.sampled_from(["", "a", "b", "0" * 64, "../x", "é/ü", "a.page"])
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.lists(st.tuples(_keys, st.binary(max_size=6)), max_size=4)),
        st.tuples(st.just("get"), st.lists(_keys, max_size=4)),
        st.tuples(st.just("exists"), st.lists(_keys, max_size=4)),
        st.tuples(st.just("delete"), _keys),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_file_storage_behaves_like_memory_storage(ops: list[tuple[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mem, disk = MemoryStorage(), FileStorage(Path(tmp))
        for op, arg in ops:
            if op == "set":
                keys, values = [k for k, _ in arg], [v for _, v in arg]
                assert mem.batch_set(keys, values) == disk.batch_set(keys, values)
            elif op == "get":
                assert mem.batch_get(arg) == disk.batch_get(arg)
            elif op == "exists":
                assert mem.batch_exists(arg) == disk.batch_exists(arg)
            else:
                assert mem.delete(arg) == disk.delete(arg)
            assert mem.contents() == disk.contents()
        assert sorted(os.listdir(tmp)) == sorted(p.name for p in Path(tmp).glob("*.page"))  # no temp files left


def test_file_storage_names_stay_inside_the_root(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "store")
    store.batch_set(["../escape", "/abs", "a/b"], [b"1", b"2", b"3"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    assert store.contents() == {"../escape": b"1", "/abs": b"2", "a/b": b"3"}
    with pytest.raises(BadInput):
        store.batch_set(["ok", "x" * 121], [b"1", b"2"])
    assert store.batch_exists(["ok"]) == 0  # the bad key failed the call before any write


def test_file_storage_failed_replace_keeps_the_old_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStorage(tmp_path)
    old = encode_page("k", b"old")
    store.batch_set(["k"], [old])

    def refuse(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    assert store.batch_set(["k", "new"], [encode_page("k", b"new"), b"x"]) == [False, False]
    monkeypatch.undo()
    assert store.contents() == {"k": old}
    assert [p.name for p in tmp_path.iterdir()] == [bytes.hex(b"k") + ".page"]


def test_file_storage_read_error_is_a_storage_error(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    (tmp_path / (b"k".hex() + ".page")).mkdir()  # reading a directory fails with an OSError
    with pytest.raises(StorageError):
        store.batch_get(["k"])


# --------------------------------------------------------------------------- injected faults


def _pages(namespace: Optional[str], tokens: list[int]) -> tuple[list[str], list[bytes], list[bytes]]:
    """Keys, payloads and records of the whole pages of `tokens` (page size 2, 2 layers)."""
    keys = list(page_keys(namespace, tokens, 2, DIGEST))
    payloads = [page_payload(namespace, tokens, i, 2, 2) for i in range(len(keys))]
    return keys, payloads, [encode_page(k, p) for k, p in zip(keys, payloads)]


def _decoded(store: Any, keys: list[str]) -> list[Optional[bytes]]:
    return [decode_page(k, b) for k, b in zip(keys, store.batch_get(keys))]


def test_error_fault_raises_and_changes_nothing() -> None:
    store = FaultyStorage(MemoryStorage())
    keys, _, records = _pages("ns", list(range(8)))
    store.batch_set(keys[:2], records[:2])
    before = store.inner.contents()
    store.arm("error", count=2)
    assert store.batch_exists(keys) == 2  # exists never takes a fault
    with pytest.raises(StorageError):
        store.batch_set(keys[::-1], [b"other"] * len(keys))  # new pages and overwrites alike
    assert store.inner.contents() == before
    with pytest.raises(StorageError):
        store.batch_get(keys)
    assert store.inner.contents() == before
    assert store.armed == ()
    assert store.batch_get(keys[:1]) == records[:1]
    assert store.log == [Fault("error", tuple(keys[::-1])), Fault("error", tuple(keys))]


def test_partial_write_reports_honestly() -> None:
    store = FaultyStorage(MemoryStorage())
    keys, _, records = _pages(None, list(range(8)))
    store.arm("partial_write", at=1)
    assert store.batch_set(keys, records) == [True, False, False, False]
    assert store.batch_exists(keys) == 1
    assert set(store.inner.contents()) == {keys[0]}
    assert store.log == [Fault("partial_write", tuple(keys[1:]))]
    store.arm("partial_write")  # at defaults to the middle
    assert store.batch_set(keys, records) == [True, True, False, False]


def test_torn_write_lies_and_the_checksum_catches_it() -> None:
    store = FaultyStorage(MemoryStorage())
    keys, payloads, records = _pages(None, list(range(8)))
    store.arm("torn_write", at=99)  # clamped to the last page
    assert store.batch_set(keys, records) == [True] * 4
    assert store.batch_exists(keys) == 4  # present, so only decoding finds the damage
    assert _decoded(store, keys) == [*payloads[:3], None]
    assert store.log == [Fault("torn_write", (keys[3],))]


def test_corrupt_and_drop_damage_one_stored_page() -> None:
    store = FaultyStorage(MemoryStorage())
    keys, payloads, records = _pages("ns", list(range(8)))
    store.batch_set(keys, records)
    assert store.corrupt(keys[1]) and store.drop(keys[2])
    assert not store.corrupt("missing") and not store.drop(keys[2])
    assert store.batch_exists(keys) == 2
    assert _decoded(store, keys) == [payloads[0], None, None, payloads[3]]
    assert store.log == [Fault("corrupt", (keys[1],)), Fault("drop", (keys[2],))]


def test_each_call_takes_the_earliest_fault_that_applies() -> None:
    store = FaultyStorage(MemoryStorage())
    store.arm("partial_write", at=0)
    store.arm("error")
    with pytest.raises(StorageError):
        store.batch_get(["a"])  # a read skips the write fault
    assert store.armed == (("partial_write", 0),)
    assert store.batch_set(["a"], [b"1"]) == [False]
    assert store.batch_set(["a"], [b"1"]) == [True]
    with pytest.raises(BadInput):
        store.arm("corrupt")  # corrupt and drop act at once; they are not armed


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_faults_never_yield_wrong_kv(data: st.DataObject) -> None:
    """Under any fault script, each page decodes to its payload or to a miss; pages that
    were reported stored and not damaged since decode to their payload."""
    with tempfile.TemporaryDirectory() as tmp:
        inner = data.draw(st.sampled_from([MemoryStorage(), FileStorage(Path(tmp))]), label="inner")
        store = FaultyStorage(inner)
        truth: dict[str, bytes] = {}
        intact: set[str] = set()
        for _ in range(data.draw(st.integers(1, 10), label="steps")):
            step = data.draw(st.sampled_from(["write", "read", "arm", "corrupt", "drop"]), label="step")
            if step == "arm":
                store.arm(data.draw(st.sampled_from(CALL_FAULTS)), at=data.draw(st.none() | st.integers(0, 4)))
            elif step in ("corrupt", "drop") and truth:
                key = data.draw(st.sampled_from(sorted(truth)))
                if step == "corrupt":
                    store.corrupt(key, data.draw(st.none() | st.integers(0, 500)))
                else:
                    store.drop(key)
                intact.discard(key)
            elif step == "write":
                tokens = data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=8))
                keys, payloads, records = _pages(data.draw(st.sampled_from([None, "x"])), tokens)
                truth.update(zip(keys, payloads))
                n = len(store.log)
                try:
                    ok = store.batch_set(keys, records)
                except StorageError:
                    continue
                torn = {k for f in store.log[n:] if f.kind == "torn_write" for k in f.keys}
                intact |= {k for k, stored in zip(keys, ok) if stored and k not in torn}
                intact -= torn
            elif step == "read":
                try:
                    store.batch_get(sorted(truth))
                except StorageError:
                    pass
        keys = sorted(truth)
        for key, got in zip(keys, _decoded(store.inner, keys)):
            assert got is None or got == truth[key], f"{key}: wrong KV"
            assert key not in intact or got == truth[key], f"{key}: reported stored, not damaged, yet a miss"
