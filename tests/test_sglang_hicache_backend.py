"""The HostTierBackend adapter over SGLang's UnifiedRadixCache + HiCache (conformance/adapters/sglang/hicache_backend.py).

Protocol conformance, exact host-pool sizing, and SGLang snapshots that pass kvcert's state
invariants after basic host-tier operations, for both tree cores (Python, Rust) and both host
layouts (layer_first, page_first_direct); KV bytes survive a load-back in either layout; and the
Rust-core backend answers and snapshots exactly like the Python-core one over random traces
(spec-independent: the two adapters are compared with each other, not with SPEC.md). No
certification test: see docs/calibration/hicache.md for the certify runs.
Skipped as a whole when sglang (the `sglang` extra) cannot be imported.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _sglang import require_sglang

require_sglang()

import torch  # noqa: E402

from kvcert.conformance.adapters.sglang import hicache_backend as adapter  # noqa: E402
from kvcert.conformance.adapters.sglang.hicache_backend import SGLangHiCacheBackend  # noqa: E402
from kvcert.conformance.backend import Backend, HostTierBackend  # noqa: E402
from kvcert.conformance.harness.driver import run_trace  # noqa: E402
from kvcert.spec.invariants import check_snapshot  # noqa: E402
from kvcert.spec.ops import Complete, Evict, EvictHost, Insert, LoadBack, Match, Poll  # noqa: E402
from kvcert.spec.types import CacheConfig, PoolExhausted, Snapshot  # noqa: E402

pytestmark = pytest.mark.sglang

_OPEN: list[SGLangHiCacheBackend] = []


FACTORIES = {
    ("python", "layer_first"): adapter.factory,
    ("rust", "layer_first"): adapter.factory_rust,
    ("python", "page_first_direct"): adapter.factory_page_first,
    ("rust", "page_first_direct"): adapter.factory_rust_page_first,
}
CORE_LAYOUTS = [pytest.param(core, layout, id=f"{core}-{layout}") for core, layout in FACTORIES]
CORES = [pytest.param("python", "layer_first", id="python"), pytest.param("rust", "layer_first", id="rust")]


def tracked(core: str = "python", layout: str = "layer_first") -> Callable[[CacheConfig], SGLangHiCacheBackend]:
    """The adapter's factory for (core, layout), remembering each backend so that it is closed after the test."""
    inner = FACTORIES[core, layout]

    def make(config: CacheConfig) -> SGLangHiCacheBackend:
        backend = inner(config)
        _OPEN.append(backend)
        return backend

    make.capabilities = inner.capabilities  # type: ignore[attr-defined]
    return make


factory = tracked()


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


@pytest.mark.parametrize(("core", "layout"), CORE_LAYOUTS)
def test_protocols_and_capabilities(core: str, layout: str) -> None:
    make = tracked(core, layout)
    caps = make.capabilities  # type: ignore[attr-defined]
    assert caps.page_sizes == (1, 4) and caps.policies == ("lru", "slru", "tlru") and not caps.strict_input
    assert caps.write_policies and f"{core} tree core, {layout}" in caps.name
    b = make(_config(1))
    assert isinstance(b, Backend) and isinstance(b, HostTierBackend)
    assert b.h.is_rust == (core == "rust") and b.h.host_pool.layout == layout
    device_only = make(CacheConfig(page_size=4, capacity=64))
    snap = device_only.snapshot()
    assert snap.host_capacity == 0 and snap.write_policy == "" and not check_snapshot(snap)


def test_factories_are_module_level_targets() -> None:
    """`kvcert certify ...sglang_hicache_backend:<name>` finds each factory, with its capabilities."""
    from kvcert.conformance.certification.certify import load_factory

    for name in ("factory", "factory_rust", "factory_page_first", "factory_rust_page_first"):
        loaded = load_factory(f"kvcert.conformance.adapters.sglang.hicache_backend:{name}")
        assert loaded is getattr(adapter, name) and loaded.__name__ == name
    with pytest.raises(ValueError):
        adapter.make_factory("cython")


def test_a_host_pool_builds_whatever_memory_the_machine_has_free(monkeypatch: Any) -> None:
    """SGLang's host pool checks the machine's free RAM less a 10 GiB reserve; a cell's pool is kilobytes, so the
    adapter books it against a fixed budget (SGLang's own host_memory_budget_scope, a declared deviation): a machine
    with next to nothing free still builds it, and SGLang's check itself still refuses outside that scope."""
    from sglang.srt.mem_cache.pool_host import base as host_base

    from kvcert.conformance.adapters.sglang.hicache import HOST_BUDGET_DEVIATION

    monkeypatch.setattr(host_base, "available_host_memory_bytes", lambda **kw: 1 << 20)  # 1 MiB free
    assert host_base.host_memory_budget_bytes(1024) < 0  # what the check would read without the budget
    b = tracked()(_config(1, host_pages=17))
    assert b.snapshot().host_capacity == 17
    assert HOST_BUDGET_DEVIATION in adapter.factory.capabilities.deviations


@pytest.mark.parametrize(("core", "layout"), CORE_LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("host_pages", [1, 17, 40])
def test_host_pool_is_exactly_host_capacity(page_size: int, host_pages: int, core: str, layout: str) -> None:
    b = tracked(core, layout)(_config(page_size, host_pages=host_pages))
    snap = b.snapshot()
    assert snap.host_capacity == host_pages * page_size
    assert snap.host_free_slots == tuple(range(host_pages * page_size))
    assert b.h.cache.load_back_threshold == page_size


@pytest.mark.parametrize(("core", "layout"), CORE_LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_round_trip_snapshots_pass_invariants(page_size: int, write_policy: str, core: str, layout: str) -> None:
    b = tracked(core, layout)(_config(page_size, write_policy))
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


@pytest.mark.parametrize(("core", "layout"), CORE_LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_write_through_trace_conforms(page_size: int, core: str, layout: str) -> None:
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
    make = tracked(core, layout)
    run_trace(make(config), config, make.capabilities, ops)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("core", "layout"), CORE_LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_bytes_survive_backup_and_load_back(page_size: int, core: str, layout: str) -> None:
    """The host copy holds the device bytes, and a load-back restores them, in either host layout."""
    b = tracked(core, layout)(_config(page_size))
    tokens = list(range(1, 3 * page_size + 1))
    slots = b.alloc(len(tokens))
    b.h.write_kv(slots, seed=3)
    written = b.h.read_device_kv(slots)
    node = b.insert(None, tokens, slots).node
    (copy,) = b.snapshot().pending
    b.complete(copy.id)
    assert b.poll() == 1
    host_slots = b.snapshot().by_id()[node].host_slots
    assert host_slots is not None and torch.equal(b.h.read_host_kv(host_slots), written)
    assert b.evict(len(tokens)) == len(tokens)
    for buf in (*b.h.kv_pool.k_buffer, *b.h.kv_pool.v_buffer):
        buf.zero_()  # the device copy is gone: only the load-back can bring the bytes back
    assert b.match_prefix(None, tokens).host_node == node
    assert b.load_back(node) == len(tokens)
    (copy,) = b.snapshot().pending
    b.complete(copy.id)
    assert b.poll() == 1
    m = b.match_prefix(None, tokens)
    assert m.length == len(tokens)
    assert torch.equal(b.h.read_device_kv(m.slots), written)
    assert not check_snapshot(b.snapshot())


# ---------------------------------------------------------------------- Rust core vs Python core, lockstep


def _canon(snap: Snapshot) -> dict[str, Any]:
    """A snapshot with node ids replaced by the node's (namespace, root path): ids differ between the cores."""
    path = {n.id: snap.path_of(n.id) for n in snap.nodes}
    return {
        "nodes": {
            path[n.id]: (n.key, n.slots, n.lock_ref, n.host_slots, n.host_lock_ref, path.get(n.parent))
            for n in snap.nodes
        },
        "pools": (snap.free_slots, snap.host_free_slots, snap.evictable_size, snap.protected_size),
        "pending": [(c.id, c.kind, tuple(path[n] for n in c.nodes), c.finished) for c in snap.pending],
    }


def _lockstep(seed: int, page_size: int, write_policy: str, steps: int) -> None:
    """One random trace through the Python-core and the Rust-core backends: same answers, same snapshots."""
    rnd = random.Random(seed)
    config = CacheConfig(
        page_size=page_size,
        capacity=8 * page_size,
        host_capacity=12 * page_size,
        write_policy=write_policy,
        load_back_threshold=page_size,
    )
    py, rs = tracked("python")(config), tracked("rust", "page_first_direct")(config)
    locks: list[Any] = []  # (namespace, path) of each lock taken, on both
    for step in range(steps):
        sp, sr = py.snapshot(), rs.snapshot()
        cp = _canon(sp)
        assert cp == _canon(sr), f"step {step}: the cores' snapshots differ"
        assert not check_snapshot(sr)
        ids = {b: {snap.path_of(n.id): n.id for n in snap.nodes} for b, snap in ((py, sp), (rs, sr))}
        paths = sorted((p for p in cp["nodes"] if p[1]), key=lambda p: (p[0] or "", p[1]))
        host_only = [p for p in paths if cp["nodes"][p][1] is None]
        todo = [c.id for c in sp.pending if not c.finished]
        ns = rnd.choice([None, None, "a"])
        tokens = tuple(rnd.randint(1, 3) for _ in range(rnd.randint(1, 4) * page_size))
        n = rnd.randint(1, 4) * page_size
        r, pick = rnd.random(), rnd.random()
        op = (
            "insert"
            if r < 0.3
            else "match"
            if r < 0.45
            else "evict"
            if r < 0.55
            else "evict_host"
            if r < 0.62
            else "lock"
            if r < 0.7 and paths
            else "unlock"
            if r < 0.76 and locks
            else "load_back"
            if r < 0.84 and host_only
            else "complete"
            if r < 0.95 and todo
            else "poll"
        )
        out: dict[str, Any] = {}
        for name, b in (("python", py), ("rust", rs)):
            if op == "insert":
                try:
                    slots = b.alloc(len(tokens))
                except PoolExhausted:
                    out[name] = ("exhausted", b.evict(len(tokens)))
                    continue
                res = b.insert(ns, tokens, slots)
                b.free(slots[: res.prefix_len])
                out[name] = (res.prefix_len, b.snapshot().path_of(res.node))
            elif op == "match":
                m = b.match_prefix(ns, tokens)
                snap = b.snapshot()
                out[name] = (m.length, m.slots, snap.path_of(m.node), m.host_length, snap.path_of(m.host_node))
            elif op == "evict":
                out[name] = b.evict(n)
            elif op == "evict_host":
                out[name] = b.evict_host(n)
            elif op == "lock":
                b.inc_lock_ref(ids[b][paths[int(pick * len(paths))]])
            elif op == "unlock":
                b.dec_lock_ref(ids[b][locks[int(pick * len(locks))]])
            elif op == "load_back":
                out[name] = b.load_back(ids[b][host_only[int(pick * len(host_only))]])
            elif op == "complete":
                b.complete(todo[int(pick * len(todo))])
            else:
                out[name] = b.poll()
        if op == "lock":
            locks.append(paths[int(pick * len(paths))])
        elif op == "unlock":
            locks.pop(int(pick * len(locks)))
        assert out.get("python") == out.get("rust"), f"step {step} ({op}): the cores answer differently: {out}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_rust_core_answers_and_snapshots_like_python_core(page_size: int, write_policy: str) -> None:
    """Spec-independent differential check of the Rust-core adapter (its interface-read snapshots, the
    host-lock ledger) against the Python-core adapter, which reads SGLang's node objects directly."""
    for seed in range(2):
        _lockstep(seed, page_size, write_policy, steps=40)
        while _OPEN:
            _OPEN.pop().close()
