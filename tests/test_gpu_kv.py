"""kvcert.gpu's tensors: layouts, byte mapping of the spec's KV entries, copies, allocators, engines."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch

from kvcert.gpu.alloc import PageAllocator
from kvcert.gpu.copy_engine import CopyJob, DeferredCopyEngine, ThreadedCopyEngine
from kvcert.gpu.kv import LAYOUTS, KVGeometry, contiguous_runs, make_pool
from kvcert.spec import storage as l3

CPU = torch.device("cpu")
GEOMETRIES = [
    KVGeometry(layers=2),  # the default: one float32 head of width 2 = 8 bytes, exactly an entry part
    KVGeometry(layers=3, heads=2, head_dim=4, dtype=torch.bfloat16),  # 16 bytes: 8 of entry, 8 of zeros
    KVGeometry(layers=1, heads=1, head_dim=8, dtype=torch.uint8),
]
TOKENS = (5, 6, 7, 8, 9, 10, 11, 12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"L{g.layers}h{g.heads}d{g.head_dim}{g.dtype}")
def test_entries_round_trip_and_copy_between_layouts(layout: str, geometry: KVGeometry) -> None:
    entries = l3.token_entries("ns", TOKENS, geometry.layers)
    dev = make_pool(layout, 16, 4, geometry, CPU)
    host = make_pool("page_first" if layout == "layer_first" else "layer_first", 16, 4, geometry, CPU)
    slots = [8, 9, 10, 11, 0, 1, 2, 3]
    dev.write_entries(slots, entries)
    assert dev.read_entries(slots) == list(entries)
    host.copy_from(dev, slots, [4, 5, 6, 7, 12, 13, 14, 15])  # two runs: slice copies
    assert host.read_entries([4, 5, 6, 7, 12, 13, 14, 15]) == list(entries)
    dev.copy_from(host, [15, 4, 13, 6], [3, 2, 1, 0])  # scattered: gather/scatter
    assert dev.read_entries([0, 1, 2, 3]) == [entries[7], entries[0], entries[5], entries[2]][::-1]
    # storage payloads are the host bytes transposed (K/V, layer, token)
    assert host.read_page_payload([12, 13, 14, 15]) == l3.page_payload("ns", TOKENS, 1, 4, geometry.layers)
    host.write_page_payload([0, 1, 2, 3], l3.page_payload("ns", TOKENS, 0, 4, geometry.layers))
    assert host.read_entries([0, 1, 2, 3]) == list(entries[:4])
    # past the 8 entry bytes, every cell is zero
    assert int(dev.u8[..., l3.KV_WIDTH :].abs().sum()) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"L{g.layers}h{g.heads}d{g.head_dim}{g.dtype}")
def test_a_cpu_pool_reads_through_numpy_what_the_torch_path_reads(layout: str, geometry: KVGeometry) -> None:
    """A CPU pool reads through `host_view`; a CUDA pool cannot and takes the torch gather. Both, on the same
    memory, in any slot order, with repeats and one slot alone."""
    pool = make_pool(layout, 16, 4, geometry, CPU)
    entries = l3.token_entries("ns", TOKENS + TOKENS, geometry.layers)
    pool.write_entries(list(range(16)), entries)
    assert pool.host_view is not None
    reads = [[13, 2, 2, 7, 0, 15], [5], list(range(16))[::-1]]
    through_numpy = [pool.read_entries(r) for r in reads]
    pool.host_view = None  # the CUDA path
    assert [pool.read_entries(r) for r in reads] == through_numpy == [[entries[i] for i in r] for r in reads]


def test_layer_first_exposes_per_layer_kernel_buffers() -> None:
    pool = make_pool("layer_first", 8, 1, KVGeometry(layers=2, heads=2, head_dim=4), CPU)
    assert pool.k_buffer(1).shape == (8, 2, 4) and pool.v_buffer(0).dtype == torch.float32  # type: ignore[attr-defined]


def test_runs_merge_when_both_sides_are_contiguous() -> None:
    assert contiguous_runs([0, 1, 2, 8, 9], [4, 5, 6, 7, 8]) == [(0, 4, 3), (8, 7, 2)]
    assert contiguous_runs([], []) == []


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(20))
def test_free_slots_are_the_slots_in_state_free(page_size: int, seed: int) -> None:
    """`free_slots` (set operations over pages) against each slot's own state, through lends, takes, and partial
    give-backs, adoptions and releases that leave pages mixed."""
    rng = random.Random(seed)
    a = PageAllocator(8 * page_size, page_size)
    lent: list[int] = []
    held: list[int] = []
    for _ in range(40):
        move = rng.randrange(5)
        if move == 0 and a.available:
            lent += a.lend(page_size * rng.randint(1, a.available // page_size))
        elif move == 1 and a.available:
            held += a.take(page_size * rng.randint(1, a.available // page_size))
        elif move in (2, 3) and lent:
            part = rng.sample(lent, rng.randint(1, len(lent)))
            lent = [x for x in lent if x not in part]
            if move == 2:
                a.give_back(part)
            else:
                a.adopt(part)
                held += part
        elif move == 4 and held:
            part = rng.sample(held, rng.randint(1, len(held)))
            held = [x for x in held if x not in part]
            a.release(part)
        assert a.free_slots() == tuple(x for x in range(a.capacity) if a.is_free(x))
        assert set(a.free_slots()).isdisjoint(lent + held) and len(a.free_slots()) + len(lent) + len(held) == a.capacity


def test_allocator_hands_out_aligned_pages_and_tracks_owners() -> None:
    a = PageAllocator(16, 4)
    got = a.lend(8)
    assert all(got[i] % 4 == 0 and got[i : i + 4] == tuple(range(got[i], got[i] + 4)) for i in (0, 4))
    assert a.are_lent(got) and not a.are_lent(got + got[:1]) and not a.are_lent((99,))
    a.adopt(got[:4])
    assert not a.are_lent(got[:4])
    a.give_back(got[4:6])  # half a page: not allocatable until the rest comes back
    assert a.available == 8
    a.give_back(got[6:])
    assert a.available == 12
    a.release(got[:4])
    assert a.available == 16 and a.free_slots() == tuple(range(16))


@pytest.mark.parametrize("engine_cls", [DeferredCopyEngine, ThreadedCopyEngine])
def test_engines_land_bytes_only_through_finish_and_retry_failures(engine_cls: type) -> None:
    g = KVGeometry(layers=2)
    dev, host = make_pool("layer_first", 8, 1, g, CPU), make_pool("layer_first", 8, 1, g, CPU)
    entries = l3.token_entries(None, (1, 2), 2)
    dev.write_entries([3, 4], entries)
    engine = engine_cls()
    try:
        ticket = engine.submit(CopyJob(dev, (3, 4), host, (0, 1)))
        engine.arm_failure()
        assert engine.finish(ticket) is False  # failed: the cache keeps it pending, the engine retries it
        assert engine.finish(ticket) is True
        assert host.read_entries([0, 1]) == list(entries)
        store = engine.submit(None)
        assert engine.finish(store) is True
    finally:
        engine.close()


def test_threaded_engine_soak() -> None:
    """Many copies through the worker thread, joined without timeouts: every byte lands where it should."""
    g = KVGeometry(layers=2)
    dev, host = make_pool("layer_first", 64, 1, g, CPU), make_pool("page_first", 64, 4, g, CPU)
    engine = ThreadedCopyEngine()
    try:
        for round_ in range(50):
            entries = l3.token_entries(None, (round_,) * 8, 2)
            src = tuple((round_ * 8 + i) % 64 for i in range(8))
            dst = tuple((round_ * 24 + i * 3) % 64 for i in range(8))
            dev.write_entries(src, entries)
            ticket = engine.submit(CopyJob(dev, src, host, dst))
            assert engine.finish(ticket)
            assert host.read_entries(dst) == list(entries)
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_moves_bytes_both_ways() -> None:  # pragma: no cover - no GPU in CI
    from kvcert.gpu.copy_engine import CudaCopyEngine

    g = KVGeometry(layers=2)
    dev = make_pool("layer_first", 64, 4, g, torch.device("cuda"))
    host = make_pool("layer_first", 64, 4, g, CPU, pin=True)
    entries = l3.token_entries(None, tuple(range(8)), 2)
    engine = CudaCopyEngine()
    dev.write_entries(list(range(8, 16)), entries)
    down = engine.submit(CopyJob(dev, tuple(range(8, 16)), host, (0, 1, 2, 3, 40, 41, 42, 43)))
    assert engine.finish(down) and host.read_entries([0, 1, 2, 3, 40, 41, 42, 43]) == list(entries)
    up = engine.submit(CopyJob(host, (43, 0, 41, 2), dev, (20, 21, 22, 23)))
    assert engine.finish(up) and dev.read_entries([20, 21, 22, 23]) == [entries[i] for i in (7, 0, 5, 2)]


def test_gpu_package_shares_no_code_with_the_model_or_the_suite() -> None:
    for path in (Path(__file__).parent.parent / "gpu").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("kvcert.refimpl", "kvcert.conformance")), f"{path.name} imports {name}"
                root = name.split(".")[0]
                assert root in {"kvcert", "torch", "numpy", "__future__"} or root in _stdlib(), (
                    f"{path.name} imports {name}"
                )


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names)
