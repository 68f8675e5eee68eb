"""Smoke tests of the CPU driver of SGLang's UnifiedRadixCache + HiCache (conformance/adapters/sglang/hicache.py).

One round trip per (core, page size, write policy): insert, a held write ack released by
the harness, eviction that demotes to host, a host hit, a load-back whose KV is byte-equal
to what was written, host eviction, and SGLang's own sanity_check after every step. Then the
Rust core's snapshot reader (interface reads plus ledgers) held to the Python core's node
objects, and the Rust core to the Python core, over random lockstep traces.
Skipped as a whole when sglang (the `sglang` extra) cannot be imported.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from _sglang import require_sglang

require_sglang()

import torch  # noqa: E402

from kvcert.conformance.adapters.sglang.hicache import HiCacheConfig, SGLangHiCache  # noqa: E402

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


# ---------------------------------------------------------------------- reading the Rust core
# The Rust core has no node objects: the driver reads it through the tree-core interface
# (`_snapshot_interface`) and keeps host_lock_ref and the nodes of in-flight loads in ledgers. These
# tests hold that reader to the Python core's node objects, and the Rust core to the Python core.

FIELDS = ("parent", "namespace", "key", "device", "host", "lock_ref", "host_lock_ref", "backed_up")


def _by_path(nodes: dict[int, dict[str, Any]]) -> tuple[dict[Any, Any], dict[int, Any]]:
    """Nodes keyed by (namespace, root path) instead of id (ids differ between the cores), and id -> path."""
    path: dict[int, Any] = {}

    def of(nid: int) -> Any:
        if nid not in path:
            v = nodes[nid]
            path[nid] = (None, ()) if v["parent"] is None else (v["namespace"], of(v["parent"])[1] + v["key"])
        return path[nid]

    canon = {
        of(nid): {f: v[f] for f in FIELDS if f != "parent"} | {"parent": of(v["parent"]) if v["parent"] else None}
        for nid, v in nodes.items()
    }
    return canon, path


def _random_op(rnd: random.Random, ps: int, paths: list[Any], copies: list[Any], locks: int) -> tuple[Any, ...]:
    ns = rnd.choice([None, None, "a"])
    tokens = [rnd.randint(1, 3) for _ in range(rnd.randint(1, 4) * ps)]
    n, r, pick = rnd.randint(1, 4) * ps, rnd.random(), rnd.random()
    todo = [c[0] for c in copies if not c[3]]
    if r < 0.3:
        return ("insert", ns, tokens)
    if r < 0.45:
        return ("match", ns, tokens)
    if r < 0.55:
        return ("evict", n)
    if r < 0.62:
        return ("evict_host", n)
    if r < 0.7 and paths:
        return ("lock", paths[int(pick * len(paths))])
    if r < 0.76 and locks:
        return ("unlock", int(pick * locks))
    if r < 0.84 and paths:
        return ("load_back", paths[int(pick * len(paths))])
    if r < 0.95 and todo:
        return ("complete", todo[int(pick * len(todo))])
    return ("poll",)


def _apply(
    h: SGLangHiCache, op: tuple[Any, ...], nodes: dict[int, dict[str, Any]], ids: dict[Any, int], locks: list[int]
) -> Any:
    """Run one op on a driver; results name nodes by id (the caller maps them to paths)."""
    kind = op[0]
    if kind == "insert":
        short = len(op[2]) - h.device_free()
        if short > 0:
            h.evict(short)
        if h.device_free() < len(op[2]):
            return "no room"
        return h.insert(op[1], op[2], h.alloc(len(op[2])))
    if kind == "match":
        return tuple(h.match_prefix(op[1], op[2]))
    if kind == "evict":
        return h.evict(op[1])
    if kind == "evict_host":
        return h.evict_host(op[1])
    if kind == "lock":
        locks.append(h.inc_lock_ref(ids[op[1]]))
        return None
    if kind == "unlock":
        h.dec_lock_ref(locks.pop(op[1]))
        return None
    if kind == "load_back":
        host_len, cur = 0, ids[op[1]]
        while nodes[cur]["parent"] is not None and nodes[cur]["device"] is None:
            host_len += len(nodes[cur]["key"])
            cur = nodes[cur]["parent"]
        return h.init_load_back(ids[op[1]], host_len, last_device=cur)
    if kind == "complete":
        h.complete(op[1], poll=False)
        return None
    h.poll()
    return None


def _drivers(core: str, ps: int, policy: str, layout: str = "layer_first", pages: int = 8) -> SGLangHiCache:
    h = SGLangHiCache(HiCacheConfig(page_size=ps, device_pages=pages, core=core, layout=layout, write_policy=policy))
    h.cache.load_back_threshold = ps
    return h


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_rust_core_matches_python_core_and_interface_reader_matches_node_objects(page_size: int, policy: str) -> None:
    """Lockstep random traces: after every step the Python core read through the interface (what the
    Rust core offers, ledgers included) equals its node objects, the Rust core (page_first_direct) equals
    the Python core (layer_first) node by node, pool by pool and copy by copy, and both pass sanity_check.
    Under write_back, the load ledger equals the Python core's own load_back_pending_id pins."""
    for seed in range(3):
        rnd = random.Random(seed)
        py, rs = _drivers("python", page_size, policy), _drivers("rust", page_size, policy, "page_first_direct")
        locks: dict[str, list[int]] = {"python": [], "rust": []}
        try:
            for step in range(50):
                sp, sr = py.snapshot(), rs.snapshot()
                direct, path_p = _by_path(sp["nodes"])
                assert _by_path(py._snapshot_interface())[0] == direct, (seed, step)
                theirs, path_r = _by_path(sr["nodes"])
                assert theirs == direct, (seed, step)
                for key in ("device_free", "host_free", "evictable_size", "protected_size", "pending_ops"):
                    assert sp[key] == sr[key], (seed, step, key)
                copies_p = [(i, k, [path_p[n] for n in ns], f) for i, k, ns, f in sp["copies"]]
                assert copies_p == [(i, k, [path_r[n] for n in ns], f) for i, k, ns, f in sr["copies"]], (seed, step)
                if policy == "write_back":
                    core = py.cache.tree_core
                    pinned = {n for n in sp["nodes"] if core.node_by_id(n).load_back_pending_id is not None}
                    assert pinned == {n for _, k, ns, _ in sp["copies"] if k == "load" for n in ns}, (seed, step)
                py.sanity_check()
                rs.sanity_check()
                paths = sorted((p for p in direct if p[1]), key=lambda p: (p[0] or "", p[1]))
                op = _random_op(rnd, page_size, paths, sp["copies"], len(locks["python"]))
                ids = {"python": {p: n for n, p in path_p.items()}, "rust": {p: n for n, p in path_r.items()}}
                got = {}
                for name, h, snap in (("python", py, sp), ("rust", rs, sr)):
                    out = _apply(h, op, snap["nodes"], ids[name], locks[name])
                    after = _by_path(h.nodes())[1]
                    if op[0] == "insert" and isinstance(out, tuple):
                        out = (out[0], after[out[1]])
                    elif op[0] == "match":
                        out = (*out[:2], after[out[2]], after[out[3]])
                    elif op[0] == "load_back":
                        out = (out[0], after[out[1]])
                    got[name] = out
                assert got["python"] == got["rust"], (seed, step, op, got)
        finally:
            py.close()
            rs.close()


def test_interface_reads_do_not_perturb_the_rust_core() -> None:
    """The reads the Rust snapshot makes (match_full_device_prefix, collect_path_info, ...) change nothing:
    a Rust driver read after every step answers and ends exactly like one that is read only at the end."""
    rnd = random.Random(7)
    seen, blind = _drivers("rust", 1, "write_through_selective"), _drivers("rust", 1, "write_through_selective")
    locks: dict[str, list[int]] = {"seen": [], "blind": []}
    try:
        for _ in range(80):
            snap = seen.snapshot()
            paths = sorted((p for p in _by_path(snap["nodes"])[0] if p[1]), key=lambda p: (p[0] or "", p[1]))
            ids = {p: n for n, p in _by_path(snap["nodes"])[1].items()}  # the same on both: ids are per driver
            op = _random_op(rnd, 1, paths, snap["copies"], len(locks["seen"]))
            a = _apply(seen, op, snap["nodes"], ids, locks["seen"])
            b = _apply(blind, op, snap["nodes"], ids, locks["blind"])
            assert a == b, op
        final = seen.snapshot()
        assert blind.snapshot() == final
    finally:
        seen.close()
        blind.close()


@pytest.mark.parametrize("core", ["python", "rust"])
def test_host_lock_and_load_copy_follow_splits(core: str) -> None:
    """A load-back host-locks its anchor only (D5); splitting the anchor while the load is in flight gives
    the new prefix node the lock too, and the load copy covers every fragment. The Python core's node
    objects say so directly; the Rust core's ledgers must say the same."""
    h = _drivers(core, 1, "write_through", pages=16)
    try:
        h.insert(None, [1, 2, 3, 4], h.alloc(4))
        h.insert(None, list(range(1, 9)), h.alloc(8))
        for op in h.pending():
            h.complete(op)
        assert h.evict(8) == 8  # both nodes demoted to host
        m = h.match_prefix(None, list(range(1, 9)))
        assert h.init_load_back(m.last_host_node, m.host_hit_len)[0] == 8

        def state() -> tuple[dict[Any, int], list[Any]]:
            snap = h.snapshot()
            paths = _by_path(snap["nodes"])[1]
            locks = {paths[n][1]: v["host_lock_ref"] for n, v in snap["nodes"].items() if v["parent"] is not None}
            return locks, [(k, sorted(paths[n][1] for n in ns)) for _, k, ns, _ in snap["copies"]]

        p4, p8 = (1, 2, 3, 4), tuple(range(1, 9))
        assert state() == ({p4: 0, p8: 1}, [("load", [p4, p8])])
        h.match_prefix(None, [1, 2, 3, 4, 5, 6])  # split the anchor: (5, 6) | (7, 8)
        h.match_prefix(None, [1, 2, 3, 4, 5])  # split the new prefix: (5,) | (6,)
        p5, p6 = (1, 2, 3, 4, 5), (1, 2, 3, 4, 5, 6)
        assert state() == ({p4: 0, p5: 1, p6: 1, p8: 1}, [("load", [p4, p5, p6, p8])])
        if core == "python":
            assert {k: v["host_lock_ref"] for k, v in _by_path(h._snapshot_python())[0].items() if k[1]} == {
                (None, p): r for p, r in state()[0].items()
            }
        h.sanity_check()
        (op,) = h.pending()
        h.complete(op)
        assert state() == ({p4: 0, p5: 0, p6: 0, p8: 0}, [])
        h.sanity_check()
    finally:
        h.close()
