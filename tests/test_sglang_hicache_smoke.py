"""Smoke tests of the CPU driver of SGLang's UnifiedRadixCache + HiCache (conformance/adapters/sglang_hicache.py).

One round trip per (core, page size, write policy): insert, a held write ack released by
the harness, eviction that demotes to host, a host hit, a load-back whose KV is byte-equal
to what was written, host eviction, and SGLang's own sanity_check after every step.
Skipped as a whole when sglang (the `sglang` extra) cannot be imported.
"""

from __future__ import annotations

import pytest
from _sglang import require_sglang

require_sglang()

import torch  # noqa: E402

from kvcert.conformance.adapters.sglang_hicache import HiCacheConfig, SGLangHiCache  # noqa: E402

pytestmark = pytest.mark.sglang

CASES = [
    pytest.param(core, ps, layout, policy, id=f"{core}-p{ps}-{layout}-{policy}")
    for core in ("python", "rust")
    for ps, layout, policy in (
        (1, "layer_first", "write_through"),
        (4, "page_first_direct", "write_through"),
        (4, "layer_first", "write_through_selective"),
        (1, "layer_first", "write_back"),
    )
]


@pytest.mark.parametrize(("core", "page_size", "layout", "policy"), CASES)
def test_round_trip(core: str, page_size: int, layout: str, policy: str) -> None:
    h = SGLangHiCache(
        HiCacheConfig(page_size=page_size, device_pages=32 // page_size, core=core, layout=layout, write_policy=policy)
    )
    try:
        tokens = list(range(1, 13))
        slots = h.alloc(12)
        h.write_kv(slots, seed=7)
        written = h.read_device_kv(slots)
        _, node = h.insert(None, tokens, slots)
        if policy == "write_through_selective":  # backed up on the second hit (threshold 2)
            assert h.pending() == []
            assert h.insert(None, tokens, h.alloc(12))[0] == 12  # duplicates are freed by the cache
        if policy != "write_back":
            (op,) = h.pending()
            view = h.snapshot()["nodes"][node]
            assert view["in_flight"] == "write" and view["lock_ref"] == 1  # locked until the ack
            h.poll()
            assert h.pending() == [op]  # held: SGLang's poll sees an unfinished event
            h.complete(op)
            assert h.pending() == []
            view = h.snapshot()["nodes"][node]
            assert view["backed_up"] and view["lock_ref"] == 0 and view["in_flight"] is None
            assert torch.equal(h.read_host_kv(view["host"]), written)
        h.sanity_check()

        assert h.evict(12) == 12
        host_demoted = h.host_free()
        if policy == "write_back":
            assert h.forced  # eviction waited on its own backup
        view = h.snapshot()["nodes"][node]
        assert view["device"] is None and view["backed_up"]  # demoted, not dropped
        h.sanity_check()

        m = h.match_prefix(None, tokens)
        assert (m.device_len, m.host_hit_len, m.last_host_node) == (0, 12, node)
        loaded, anchor = h.init_load_back(m.last_host_node, m.host_hit_len)
        assert (loaded, anchor) == (12, node)
        (op,) = h.pending()
        assert h.snapshot()["nodes"][node]["in_flight"] == "load"
        h.sanity_check()
        h.complete(op)
        m = h.match_prefix(None, tokens)
        assert m.device_len == 12
        assert torch.equal(h.read_device_kv(h.device_slots(m.last_device_node)), written)
        h.sanity_check()

        assert h.evict(12) == 12  # the host copy is kept: demote again, no new write
        assert h.evict_host(12) == 12
        assert h.host_free() == host_demoted + 12
        assert list(h.snapshot()["nodes"]) == [h.snapshot()["root"]]
        h.sanity_check()
    finally:
        h.close()


def test_ids_are_per_driver_and_acks_fifo() -> None:
    """Node ids restart per driver; a later released ack waits behind an earlier held one."""
    a, b = SGLangHiCache(HiCacheConfig()), SGLangHiCache(HiCacheConfig())
    try:
        assert a.insert(None, [1, 2], a.alloc(2)) == b.insert(None, [1, 2], b.alloc(2))
        a.insert(None, [3, 4], a.alloc(2))
        first, second = a.pending()
        a.complete(second)
        assert a.pending() == [first, second]  # _count_ready_acks stops at the first unready ack
        a.complete(first)
        assert a.pending() == []
        a.sanity_check()
    finally:
        a.close()
        b.close()
