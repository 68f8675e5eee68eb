"""Race windows (conformance/harness/windows.py): each is recognised on a step that enters it, and not on one that
does not; a certification counts them per cell and says which it never entered."""

from __future__ import annotations

from pathlib import Path

from kvcert.conformance.certification.certify import certify
from kvcert.conformance.certification.scope import scope_gaps
from kvcert.conformance.harness.driver import Harness
from kvcert.refimpl import RefCache
from kvcert.refimpl import factory as ref_factory
from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, LoadBack, Lock, Match, Op, Poll, Start
from kvcert.spec.types import CacheConfig

CAPS = ref_factory.capabilities  # type: ignore[attr-defined]
HOST = CacheConfig(capacity=24, page_size=4, host_capacity=96, write_policy="write_through", load_back_threshold=4)


def windows_of(config: CacheConfig, ops: list[Op]) -> list[list[str]]:
    h = Harness(RefCache(config), config, CAPS)
    h.count_windows = True
    out = []
    try:
        for op in ops:
            h.step(op)
            out.append(h.windows)
    finally:
        h.close()
    return out


K = tuple([1] * 4 + [2] * 4)


def test_a_split_under_an_unacked_write_and_a_host_eviction_around_it() -> None:
    got = windows_of(HOST, [Insert(None, K), Match(None, K[:4]), EvictHost(4)])
    assert got[0] == [] and "split-under-write" in got[1]


def test_no_window_once_the_write_has_landed() -> None:
    got = windows_of(HOST, [Insert(None, K), Complete(0), Poll(), Match(None, K[:4])])
    assert got[3] == []


def test_a_lock_before_a_loads_ack_and_a_split_under_it() -> None:
    ops: list[Op] = [Insert(None, K), Complete(0), Poll(), Evict(24), Match(None, K), LoadBack(4)]
    got = windows_of(HOST, [*ops, Match(None, K), Lock(6)])  # the request matches again and locks what loads
    assert "lock-before-load-ack" in got[7]
    assert windows_of(HOST, [*ops, Lock(4)])[6] == []  # its first match ended at the root: nothing loading there
    split = windows_of(HOST, ops[:6] + [Match(None, K[:4])])
    assert "split-under-load" in split[6]


def test_a_lock_on_a_host_only_node() -> None:
    got = windows_of(HOST, [Insert(None, K), Complete(0), Poll(), Evict(24), Lock(0)])  # its node left the device
    assert "lock-host-only" in got[4]
    assert "lock-host-only" not in windows_of(HOST, [Insert(None, K), Lock(0)])[1]  # on the device


def test_an_insert_over_a_host_only_node() -> None:
    got = windows_of(HOST, [Insert(None, K), Complete(0), Poll(), Evict(24), Insert(None, K)])
    assert "insert-over-host" in got[4] and got[3] == []


def test_a_split_of_a_running_requests_locked_path() -> None:
    config = CacheConfig(capacity=64, page_size=4)
    got = windows_of(config, [Insert(None, K), Start(None, K), Insert(None, K[:4] + (3, 3, 3, 3))])
    assert got[2] == ["split-locked"]


def test_a_certificate_reports_windows_per_cell_and_names_those_never_entered(tmp_path: Path) -> None:
    cert = certify(
        "kvcert.refimpl:factory",
        examples=8,
        steps=30,
        page_sizes=[4],
        policies=["lru"],
        out_dir=tmp_path,
        prefetch_policies=["timeout"],
    )
    assert cert.passed
    host = [c for c in cert.cells if c.write_policy]
    assert any(k.startswith("window:") for c in host for k in c.ops)
    gaps = scope_gaps(CAPS, cert.cells)
    for w in ("split-under-write", "split-under-load", "split-locked", "lock-before-load-ack"):
        entered = any(c.ops.get(f"window:{w}") for c in cert.cells)
        assert entered != any(g.startswith(f"race window {w} ") for g in gaps)
    # A device-only run cannot enter a host window, and is not told it missed one.
    device = scope_gaps(CAPS, [c for c in cert.cells if not c.write_policy])
    assert not any("split-under-write" in g for g in device)
    host_only = scope_gaps(CAPS, [c for c in cert.cells if c.write_policy and "+" not in c.write_policy])
    assert not any("split-under-store" in g or "write-back-host-full" in g for g in host_only)
