"""The HostTierBackend adapter over SGLang's UnifiedRadixCache + HiCache (conformance/adapters/sglang_hicache_backend.py).

Protocol conformance, exact host-pool sizing, and SGLang snapshots that pass kvcert's state
invariants after basic host-tier operations. No certification test: the known differences
between SPEC.md §9 and SGLang are listed in conformance/adapters/HICACHE_CALIBRATION.md.
Skipped as a whole when sglang (the `sglang` extra) cannot be imported.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang_hicache_backend import SGLangHiCacheBackend  # noqa: E402
from kvcert.conformance.adapters.sglang_hicache_backend import factory as _factory  # noqa: E402
from kvcert.conformance.backend import Backend, HostTierBackend  # noqa: E402
from kvcert.conformance.driver import run_trace  # noqa: E402
from kvcert.spec.invariants import check_snapshot  # noqa: E402
from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, LoadBack, Match, Poll  # noqa: E402
from kvcert.spec.types import CacheConfig  # noqa: E402

pytestmark = pytest.mark.sglang

_OPEN: list[SGLangHiCacheBackend] = []


def factory(config: CacheConfig) -> SGLangHiCacheBackend:
    """The adapter's factory, remembering each backend so that it is closed after the test."""
    backend = _factory(config)
    _OPEN.append(backend)
    return backend


factory.capabilities = _factory.capabilities  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _close_backends() -> Iterator[None]:
    """Close every cache a test built: an open HiCache left behind changes later tests in the process."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _config(page_size: int, write_policy: str = "write_through", host_pages: int = 24) -> CacheConfig:
    return CacheConfig(
        page_size=page_size,
        capacity=16 * page_size,
        host_capacity=host_pages * page_size,
        write_policy=write_policy,
        load_back_threshold=page_size,
    )


def _insert(b: SGLangHiCacheBackend, tokens: list[int]) -> int:
    """The harness's caller side: alloc, insert, free the duplicates."""
    slots = b.alloc(len(tokens))
    out = b.insert(None, tokens, slots)
    b.free(slots[: out.prefix_len])
    return out.node


def test_protocols_and_capabilities() -> None:
    caps = factory.capabilities  # type: ignore[attr-defined]
    assert caps.page_sizes == (1, 4) and caps.policies == ("lru",) and not caps.strict_input
    assert caps.write_policies
    b = factory(_config(1))
    assert isinstance(b, Backend) and isinstance(b, HostTierBackend)
    device_only = factory(CacheConfig(page_size=4, capacity=64))
    snap = device_only.snapshot()
    assert snap.host_capacity == 0 and snap.write_policy == "" and not check_snapshot(snap)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("host_pages", [1, 17, 24, 40])
def test_host_pool_is_exactly_host_capacity(page_size: int, host_pages: int) -> None:
    b = factory(_config(page_size, host_pages=host_pages))
    snap = b.snapshot()
    assert snap.host_capacity == host_pages * page_size
    assert snap.host_free_slots == tuple(range(host_pages * page_size))
    assert b.h.cache.load_back_threshold == page_size


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_round_trip_snapshots_pass_invariants(page_size: int, write_policy: str) -> None:
    b = factory(_config(page_size, write_policy))
    tokens = list(range(1, 3 * page_size + 1))
    node = _insert(b, tokens)
    assert not check_snapshot(b.snapshot())
    if write_policy == "write_through_selective":  # backed up on the second hit
        assert not b.snapshot().pending
        assert _insert(b, tokens) == node
    if write_policy != "write_back":
        (copy,) = b.snapshot().pending
        assert copy.kind == "write" and node in copy.nodes and not copy.finished
        assert not check_snapshot(b.snapshot())
        b.complete(copy.id)
        assert b.snapshot().pending[0].finished
        assert b.poll() == 1 and not b.snapshot().pending
    assert b.evict(len(tokens)) == len(tokens)
    snap = b.snapshot()
    assert not check_snapshot(snap)
    view = snap.by_id()[node]
    assert view.slots is None and view.host_slots is not None  # demoted, not dropped

    m = b.match_prefix(None, tokens)
    assert (m.length, m.host_length, m.host_node) == (0, len(tokens), node)
    assert b.load_back(node) == len(tokens)
    snap = b.snapshot()
    assert not check_snapshot(snap)
    (copy,) = snap.pending
    assert copy.kind == "load" and snap.by_id()[node].host_lock_ref == 1
    b.complete(copy.id)
    assert b.poll() == 1
    assert b.match_prefix(None, tokens).length == len(tokens)
    assert b.evict(len(tokens)) == len(tokens)
    assert b.evict_host(len(tokens)) == len(tokens)
    snap = b.snapshot()
    assert not check_snapshot(snap)
    assert len(snap.nodes) == 1 and len(snap.free_slots) == snap.capacity
    assert len(snap.host_free_slots) == snap.host_capacity


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_through_trace_conforms(page_size: int) -> None:
    """A write-through trace that avoids the known differences passes the whole harness (and quiesces)."""
    ps = page_size
    key = [7] * (2 * ps)
    ops = [
        Insert(None, tuple(key)),
        Complete(0),
        Poll(),
        Evict(2 * ps),
        Match(None, tuple(key)),
        LoadBack(4),
        Complete(1),
        Poll(),
        Insert(None, tuple(key + [8] * ps)),
        Evict(16 * ps),
        EvictHost(24 * ps),
    ]
    config = _config(ps)
    run_trace(factory(config), config, factory.capabilities, ops)  # type: ignore[attr-defined]
