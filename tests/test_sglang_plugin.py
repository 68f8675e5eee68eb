"""kvcert's cache as SGLang 0.5.23's `--radix-cache-backend kvcert` (kvcert.integrations.sglang).

SGLang's plugin loader registers it from kvcert's entry point; SGLang's own `create_tree_cache` builds it; an
option it does not implement stops the server at startup naming the option; SGLang's scheduler runs its
requests through it (tests/test_sglang_requests.py's scenario runs on it too); and defects planted in it are
caught by certifying it through SGLang's request path (`sglang.plugin`), so the certificate can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _sglang import require_sglang

require_sglang()

from test_sglang_requests import Model  # noqa: E402

from kvcert.conformance.adapters.sglang import plugin as sglang_kvcert  # noqa: E402
from kvcert.integrations import sglang as plugin  # noqa: E402
from kvcert.integrations.sglang import cache as backend  # noqa: E402
from kvcert.integrations.sglang.options import (  # noqa: E402
    HIGH_PRIORITY_ENV,
    RETAIN_PARAM,
    RETENTION_ENV,
    UnsupportedOption,
)
from kvcert.spec import contracts  # noqa: E402
from kvcert.spec.types import CacheConfig  # noqa: E402

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[1]

REGISTERS = """
from kvcert.conformance.adapters.sglang import env as env
env.install_shims()
with env.quiet_imports():
    from sglang.srt.mem_cache import registry
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group
assert "kvcert" not in registry.registered_radix_cache_backends()
load_plugins()
print(sorted(registry.registered_radix_cache_backends()))
import os
os.environ["SGLANG_PLUGINS"] = "someone-else"
print(sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP)))
"""


def test_sglang_plugin_loader_registers_the_backend() -> None:
    """In a fresh process that imports SGLang's registry, `load_plugins()` (what SGLang's scheduler process runs
    first) finds kvcert's entry point and registers `kvcert`; `SGLANG_PLUGINS` naming another plugin leaves it out."""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    out = subprocess.run(
        [sys.executable, "-c", REGISTERS], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    registered, filtered = out.stdout.strip().splitlines()[-2:]
    assert "'kvcert'" in registered and filtered == "[]", out.stdout


def _context(**overrides: Any) -> Any:
    """The `TreeCacheBuildContext` SGLang's `build_kv_cache` passes a factory, over a real allocator and params."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    page_size = overrides.pop("page_size", 1)
    pools = sglang_kvcert.KvcertPools(CacheConfig(capacity=16 * page_size, page_size=page_size))
    if overrides.pop("mla", False):  # an MLA pool: one latent buffer a layer, no k_buffer
        latent = types.SimpleNamespace(kv_buffer=[torch.zeros(17, 1, 4)])
        pools.allocator.get_kvcache = lambda: latent  # type: ignore[method-assign]
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=pools.allocator,
        page_size=page_size,
        dynamo_kv_event_format=overrides.pop("dynamo", False),
        eviction_policy=overrides.pop("policy", "lru"),
        eviction_policy_config=overrides.pop("policy_config", None),
        is_eagle=overrides.pop("is_eagle", False),
        enable_kv_cache_events=overrides.pop("events", False),
        enable_session_radix_cache=overrides.pop("sessions", False),
    )
    args = types.SimpleNamespace(**overrides.pop("args", {}))
    return sglang_kvcert.tree_context(params, args, **overrides)


UNSUPPORTED = [
    ({"is_hybrid_swa": True}, "sliding-window"),
    ({"is_hybrid_ssm": True}, "Mamba"),
    ({"is_dsa": True}, "DSA"),
    ({"disable_radix_cache": True}, "--disable-radix-cache"),
    ({"args": {"hicache_host_memory_mode": "buffer_only"}}, "--hicache-host-memory-mode buffer_only"),
    ({"args": {"hicache_storage_backend": "file"}}, "--hicache-storage-backend"),
    ({"args": {"enable_unified_cache_external_linker": True}}, "--enable-unified-cache-external-linker"),
    ({"args": {"enable_lmcache": True}}, "--enable-lmcache"),
    ({"args": {"disaggregation_decode_retraction_backup": "host_pool"}}, "--disaggregation-decode-retraction-backup"),
    ({"args": {"speculative_algorithm": "EAGLE"}}, "--speculative-algorithm"),
    ({"is_eagle": True}, "--speculative-algorithm"),
    ({"args": {"dcp_size": 2}}, "--dcp-size"),
    ({"args": {"pp_size": 2}}, "--pp-size"),
    ({"args": {"schedule_policy": "dfs-weight"}}, "--schedule-policy dfs-weight"),
    ({"policy": "filo"}, "--radix-eviction-policy filo"),
    ({"policy": "tlru"}, "--radix-eviction-policy tlru"),
    ({"policy": "slru", "policy_config": {"threshold": 4}}, "--radix-eviction-policy-config"),
    (
        {
            "enable_hierarchical_cache": True,
            "args": {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True},
        },
        "--disaggregation-mode decode",
    ),
    ({"enable_hierarchical_cache": True, "mla": True}, "MLA"),
]


@pytest.mark.parametrize(("overrides", "named"), UNSUPPORTED, ids=[n for _, n in UNSUPPORTED])
def test_an_unsupported_option_stops_the_server_at_startup(overrides: dict[str, Any], named: str) -> None:
    """The factory SGLang calls while the scheduler builds its tree cache refuses, naming the option."""
    with pytest.raises(UnsupportedOption, match=named.replace("-", r"\-")):
        plugin.factory(_context(**overrides))


def test_the_high_priority_threshold_is_read_at_startup(monkeypatch: Any) -> None:
    monkeypatch.setenv(HIGH_PRIORITY_ENV, "2")
    cache = plugin.factory(_context())
    assert isinstance(cache, backend.KvcertRadixCache) and cache.cache.high_threshold == 2
    monkeypatch.setenv(HIGH_PRIORITY_ENV, "high")
    with pytest.raises(UnsupportedOption, match=HIGH_PRIORITY_ENV):
        plugin.factory(_context())


def test_the_host_tier_is_sized_as_sglang_sizes_its_host_pool() -> None:
    """--enable-hierarchical-cache: `--hicache-ratio` of the device pool plus SGLang's padding page, or
    `--hicache-size` GB of this model's KV; the tree's device pool is SGLang's own buffers."""
    ratio = plugin.factory(_context(enable_hierarchical_cache=True, args={"hicache_ratio": 2.5}))
    assert ratio.cache.host_capacity == (int(16 * 2.5) // 1 + 1) * 1 == 41
    assert ratio.cache.kv.k[0] is ratio.token_to_kv_pool_allocator.get_kvcache().k_buffer[0]
    per_token = 2 * 2 * 1 * 2 * 4  # K and V, 2 layers, 1 head of 2 float32 (the suite's pool)
    sized = plugin.factory(_context(enable_hierarchical_cache=True, args={"hicache_size": 1e-6}))
    assert sized.cache.host_capacity == int(1e-6 * 1e9 // per_token) + 1
    assert plugin.factory(_context()).cache.host is None


def test_what_sglangs_other_callers_read_is_there(monkeypatch: Any) -> None:
    """--enable-metrics with the host tier reads the host pool's size and room (MetricsReporter._log_hicache_stats
    asserted "Host pool not found" and the scheduler exited); the storage-clear endpoint calls
    clear_storage_backend (AttributeError in the scheduler before). Without a host tier there is no host pool, as
    with SGLang's own caches."""
    cache = plugin.factory(_context(enable_hierarchical_cache=True, args={"hicache_ratio": 2.0}))
    host = cache.token_to_kv_pool_host
    assert host is not None and host.logical_size == cache.cache.host_capacity == 33
    assert host.available_size() == 33
    assert cache.clear_storage_backend() is False
    assert plugin.factory(_context()).token_to_kv_pool_host is None


def test_low_priority_values_first_flips_what_the_tree_protects(monkeypatch: Any) -> None:
    """SGLang schedules smaller values first under --schedule-low-priority-values-first: the backend then holds
    values at or below the threshold high, so it protects the requests SGLang's scheduler favours."""
    monkeypatch.setenv(HIGH_PRIORITY_ENV, "1")
    default = plugin.factory(_context())
    flipped = plugin.factory(_context(args={"schedule_low_priority_values_first": True}))
    assert default._priority(5) == 5 and default.cache.high_threshold == 1
    assert flipped._priority(5) == -5 and flipped.cache.high_threshold == -1
    high = flipped.cache.high_threshold
    assert flipped._priority(0) >= high and flipped._priority(1) >= high and flipped._priority(2) < high


def test_namespaces_keep_extra_key_and_cache_salt_apart() -> None:
    """SG-LORA's class: no extra_key may spell another request's (extra_key, cache_salt)."""
    keys = [(None, None), ("a", None), (None, "a"), ("a", "b"), ('["a", "b"]', None), ("a\0b", None)]
    spelled = {backend.namespace_of(*k) for k in keys}
    assert len(spelled) == len(keys) and backend.namespace_of(None, None) is None


# ---------------------------------------------------------------------------------------------- KV events

EVENT_KEYS = [
    ((1, 2, 3, 4), None, None),
    ((1, 2, 5, 6), None, None),  # splits [1 2 3 4]: the new pages chain from [1 2]
    ((1, 2, 3, 4, 7, 8), None, None),
    ((1, 2, 3, 4), "adapter", None),  # an extra key: its own subtree
    ((1, 2, 3, 4, 5, 6), None, "salt"),  # a cache salt seeds the chain
    ((1, 2, 9, 9), "adapter", "salt"),
]


@pytest.mark.parametrize("dynamo", [False, True], ids=["sglang-format", "dynamo-format"])
def test_kv_events_name_blocks_as_sglangs_own_radix_cache_does(dynamo: bool) -> None:
    """The same inserts into SGLang's `RadixCache` and into the backend, both with --kv-events-config: the same
    BlockStored events (hashes, parents, tokens, batching) in the same order; evicting everything removes the same
    blocks. A router that follows either sees the same blocks, so it routes to the backend as to SGLang."""
    from array import array

    from sglang.srt.disaggregation.kv_events import AllBlocksCleared
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    from kvcert.conformance.adapters.sglang.radix import cpu_pools

    ours = plugin.factory(_context(events=True, page_size=2, dynamo=dynamo))
    _, allocator = cpu_pools(CacheConfig(page_size=2, capacity=64))
    theirs = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=2,
            enable_kv_cache_events=True,
            dynamo_kv_event_format=dynamo,
        )
    )
    assert ours.take_events() == theirs.take_events() == [AllBlocksCleared()]  # a restarted worker has nothing
    for tokens, extra, salt in EVENT_KEYS:
        key = RadixKey(array("q", tokens), extra_key=extra, cache_salt=salt)
        theirs.insert(InsertParams(key=key, value=allocator.alloc(len(tokens))))
        mine = ours.token_to_kv_pool_allocator.alloc(len(tokens)).to(backend.torch.int64)
        ours.cache.insert_fast(backend.namespace_of(extra, salt), list(tokens), mine)
        stored_theirs, stored_ours = theirs.take_events(), ours.take_events()
        assert stored_ours == stored_theirs and stored_ours, (tokens, extra, salt)
    theirs.evict(backend.EvictParams(num_tokens=64))
    ours.evict(backend.EvictParams(num_tokens=64))
    removed_theirs, removed_ours = theirs.take_events(), ours.take_events()
    assert sorted(h for e in removed_ours for h in e.block_hashes) == sorted(
        h for e in removed_theirs for h in e.block_hashes
    )
    assert len(removed_ours) >= 1 and ours.total_size() == 0
    ours.reset()
    assert [type(e).__name__ for e in ours.take_events()] == ["AllBlocksCleared"]


def test_kv_events_replay_to_what_the_backend_holds_through_the_request_path(monkeypatch: Any, tmp_path: Path) -> None:
    """`sglang.plugin` replays the backend's KV events after every op (INV-EVENT-1): a removal left unannounced
    leaves a router routing to blocks the worker no longer has, and fails certification."""
    from kvcert.conformance.certification.certify import certify
    from kvcert.integrations.sglang.events import EventWatch

    monkeypatch.setattr(EventWatch, "removed", lambda watch, node, tier: None)
    cert = certify(
        "kvcert.conformance.adapters.sglang.plugin:factory", examples=20, steps=30, page_sizes=[1],
        policies=["lru"], write_policies=[], out_dir=tmp_path,
    )  # fmt: skip
    assert not cert.passed and "INV-EVENT-1" in str(cert.cells[0].failure)


# ---------------------------------------------------------------------------------------------- planted defects


def _leaks_duplicates(original: Callable[..., None]) -> Callable[..., None]:
    """Checkpoint without giving the duplicates back to SGLang's allocator: their slots are nobody's."""

    def insert_row(cache: Any, req: Any, *args: Any) -> None:
        allocator = cache.token_to_kv_pool_allocator
        allocator.free_segment = lambda *_, **__: None
        try:
            original(cache, req, *args)
        finally:
            del allocator.free_segment

    return insert_row


def _keeps_the_old_lock(original: Callable[..., None]) -> Callable[..., None]:
    def insert_row(cache: Any, req: Any, *args: Any) -> None:
        req.lock = None  # the request's lock on its old node is dropped without a release
        original(cache, req, *args)

    return insert_row


def _forgets_the_close(cache: Any, session_id: str) -> int:
    """Releases the path but keeps the session's epoch: a turn still running registers it again."""
    if session_id in cache.cache.sessions:
        cache.cache.release_ref(session_id)
    return 0


def _never_releases(cache: Any, session_id: str) -> int:
    cache._epochs.pop(session_id, None)
    return 0


PLANTS = {
    "checkpoint leaks the duplicates": ("_insert_row", _leaks_duplicates(backend.KvcertRadixCache._insert_row), "factory", 4),
    "checkpoint keeps the old lock": ("_insert_row", _keeps_the_old_lock(backend.KvcertRadixCache._insert_row), "factory", 1),
    "closing a session releases nothing": ("release_radix_session", _never_releases, "factory_sessions", 1),
    "a turn after its session's close holds it again": ("release_radix_session", _forgets_the_close, "factory_sessions", 4),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_defect_fails_certification(plant: str, monkeypatch: Any, tmp_path: Path) -> None:
    from kvcert.conformance.certification.certify import certify
    method, replacement, name, page_size = PLANTS[plant]
    monkeypatch.setattr(backend.KvcertRadixCache, method, replacement)
    target = f"kvcert.conformance.adapters.sglang.plugin:{name}"
    cert = certify(
        target, examples=30, steps=30, page_sizes=[page_size], policies=["lru"], write_policies=[], out_dir=tmp_path
    )
    assert not cert.passed, f"{plant}: certified"


def test_retention_is_refused_where_it_cannot_hold(monkeypatch: Any) -> None:
    """KVCERT_RETENTION=1 needs radix-native sessions (it holds a session's path) and one tensor-parallel rank (its
    deadlines are wall time); an unknown value is refused too. Off, the hint changes nothing."""
    assert not plugin.factory(_context(sessions=True)).options.retention
    monkeypatch.setenv(RETENTION_ENV, "1")
    assert plugin.factory(_context(sessions=True)).options.retention
    with pytest.raises(UnsupportedOption, match="--enable-session-radix-cache"):
        plugin.factory(_context())
    with pytest.raises(UnsupportedOption, match="--tp-size"):
        plugin.factory(_context(sessions=True, args={"tp_size": 2}))
    monkeypatch.setenv(RETENTION_ENV, "yes")
    with pytest.raises(UnsupportedOption, match=RETENTION_ENV):
        plugin.factory(_context(sessions=True))


@pytest.mark.parametrize(
    ("params", "micros"),
    [(None, None), ({}, None), ({RETAIN_PARAM: 2.5}, 2_500_000), ({RETAIN_PARAM: 3}, 3_000_000),
     ({RETAIN_PARAM: -1}, None), ({RETAIN_PARAM: 0}, None), ({RETAIN_PARAM: "3"}, None), ({RETAIN_PARAM: True}, None),
     ({RETAIN_PARAM: float("nan")}, None), ({RETAIN_PARAM: float("inf")}, None)],
)  # fmt: skip
def test_a_retention_hint_is_read_from_custom_params_and_a_bad_one_retains_nothing(params: Any, micros: Any) -> None:
    req = types.SimpleNamespace(rid="r1", sampling_params=types.SimpleNamespace(custom_params=params))
    assert backend.retain_hint(req) == micros


def _ignores_hints(req: Any) -> None:
    return None


def _outlives_its_hint(req: Any) -> Any:
    got = RETAIN_HINT(req)
    return None if got is None else got * 10


RETAIN_HINT = backend.retain_hint


@pytest.mark.parametrize("plant", [_ignores_hints, _outlives_its_hint], ids=["hint ignored", "retained 10x the hint"])
def test_a_retention_the_hint_did_not_ask_for_fails_under_inv_rp_6(plant: Any, monkeypatch: Any, tmp_path: Path) -> None:
    from kvcert.conformance.certification.certify import certify

    monkeypatch.setattr(backend, "retain_hint", plant)
    target = "kvcert.conformance.adapters.sglang.plugin:factory_retention"
    cert = certify(target, examples=30, steps=30, page_sizes=[1], policies=["lru"], write_policies=[], out_dir=tmp_path)
    assert not cert.passed
    assert "INV-RP-6" in (cert.cells[0].failure or ""), cert.cells[0].failure


def test_a_retention_held_for_a_waiting_turn_as_a_new_pause_fails_under_inv_rp_6(
    monkeypatch: Any, tmp_path: Path
) -> None:
    """A backend that, as a turn arrives, retains its session for a fresh pause instead of holding the live retention
    for the waiting turn (`retain_waiting`) keeps KV no hint asked for: INV-RP-6 sees it."""
    from kvcert.conformance.certification.certify import certify

    real = backend.KvcertRadixCache.ensure_session_generation

    def renews(self: Any, session_id: Any) -> int:
        epoch = real(self, session_id)
        if session_id in self.cache.sessions:
            self.cache.retain(session_id, 10_000_000)  # ten seconds from the arrival, whatever the hint said
        return epoch

    monkeypatch.setattr(backend.KvcertRadixCache, "ensure_session_generation", renews)
    target = "kvcert.conformance.adapters.sglang.plugin:factory_retention"
    cert = certify(target, examples=30, steps=30, page_sizes=[1], policies=["lru"], write_policies=[], out_dir=tmp_path)
    assert not cert.passed
    assert "INV-RP-6" in (cert.cells[0].failure or ""), cert.cells[0].failure


def test_retention_hints_reach_the_tree_and_certify(tmp_path: Path) -> None:
    """The unplanted backend passes with hints on, and the run sent hints, saw sessions retained and saw one held for
    a turn that arrived within its retention and waited (`retain_waiting`, from `ensure_session_generation`)."""
    from kvcert.conformance.certification.certify import certify

    target = "kvcert.conformance.adapters.sglang.plugin:factory_retention"
    cert = certify(target, examples=30, steps=30, page_sizes=[1], policies=["lru"], write_policies=[], out_dir=tmp_path)
    assert cert.passed, cert.cells[0].failure
    ops = cert.cells[0].ops
    assert ops.get("retain:sent", 0) > 0 and ops.get("retain:held", 0) > 0 and ops.get("retain:waiting", 0) > 0, ops


def test_slots_evicted_go_back_to_sglangs_allocator() -> None:
    """The tree holds SGLang's slot ids; what it evicts SGLang can allocate again, and a slot the tree holds is
    refused as a request's (SlotNotOwned), changing nothing."""
    from kvcert.spec.types import SlotNotOwned

    ctx = _context()
    cache = plugin.factory(ctx)
    allocator = ctx.params.token_to_kv_pool_allocator
    slots = allocator.alloc(8)
    free = allocator.available_size()
    out = cache.cache.insert_fast(None, list(range(8)), slots.to(backend.torch.int64))
    before = cache.cache.snapshot()
    with pytest.raises(SlotNotOwned):
        cache.cache.insert_fast(None, [9, 9], slots[:2].to(backend.torch.int64))
    assert cache.cache.snapshot() == before
    assert cache.evictable_size() == 8 and cache.path_device_indices(out.node).tolist() == slots.tolist()
    assert cache.evict(backend.EvictParams(num_tokens=8)).num_tokens_evicted == 8
    assert allocator.available_size() == free + 8 and cache.total_size() == 0


def _cached(target: Any) -> set[tuple[int, ...]]:
    """The token path of every node in the target's tree."""
    return {path for _, path in contracts.node_paths(target.snapshot()).values()}


def _run(target: Any, limit: int = 40) -> None:
    for _ in range(limit):
        target.step()
        if all(v.state in ("finished", "aborted") for v in target.requests()):
            return
    raise AssertionError(target.requests())


@pytest.mark.parametrize(("sessions", "policy"), [(False, "lru"), (True, "lru"), (False, "priority")])
def test_a_high_priority_prefix_outlives_pressure_that_lru_alone_would_evict_it_under(sessions: bool, policy: str) -> None:
    """Through SGLang's scheduler: an older prefix of a priority-2 request survives the pressure of a new prompt,
    which evicts a newer priority-0 request's prefix instead: held by a high-priority session (§11's tiers: unused
    before high), or ranked by the `priority` policy (the request's priority reaches the insert). Under plain LRU
    without sessions the older prefix goes: the priority, not the order of arrival, decides."""
    config = CacheConfig(page_size=1, capacity=32, policy=policy, high_priority_threshold=1)
    make = sglang_kvcert.factory_sessions if sessions else sglang_kvcert.factory
    target = make(config)
    target.attach_model(Model(config.kv_layers))
    old, new = (1, 2, 3, 1, 2, 3, 1, 2), (3, 3, 2, 2, 1, 1, 0, 0)
    target.submit("old", "vip", None, list(old), 2, 2)
    _run(target)
    target.submit("new", None, None, list(new), 0, 2)
    _run(target)
    assert {old, new} <= _cached(target)
    target.submit("big", None, None, [0, 1, 2, 3, 0] * 4, 0, 2)
    _run(target)
    cached = _cached(target)
    if sessions or policy == "priority":
        assert old in cached and new not in cached, "the low-priority prefix goes first"
    else:
        assert old not in cached, "LRU evicts the older prefix"
    if sessions:
        (view,) = target.snapshot().sessions
        assert view.id == "vip" and view.high



def test_a_load_back_that_moves_no_bytes_is_caught(monkeypatch: Any) -> None:
    """The host tier moves SGLang's own buffers: a copy into them that writes nothing leaves a loaded-back prefix
    with stale bytes, which the request-path scenario's KV reads catch (generated walks rarely reach a load-back
    on a request path: the directed scenario does)."""
    import test_sglang_requests as scenarios

    from kvcert.integrations.sglang.kv import EnginePool

    monkeypatch.setattr(EnginePool, "scatter", lambda pool, idx, data: None)
    with pytest.raises(AssertionError, match="KV"):
        scenarios.test_scenario("sglang.plugin:factory", 4, scenarios.HOST, "write_back")


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_the_cuda_engines_pooled_path_moves_sglangs_bytes(write_policy: str, monkeypatch: Any) -> None:
    """On a GPU the host tier's copies go through kvcert's CUDA copy engine; SGLang's per-layer buffers are no cell
    matrix, so the engine moves them by its pooled path (device gather or scatter, one staging buffer, a backup's
    host scatter after the copy's event). `planned` runs that path synchronously on the CPU: the request-path
    scenario reads every byte backed up and loaded back through it."""
    import test_sglang_requests as scenarios

    from kvcert.gpu.copy_engine import PlannedCopyEngine
    from kvcert.integrations.sglang.kv import EnginePool
    from kvcert.integrations.sglang.options import COPY_ENGINE_ENV

    monkeypatch.setenv(COPY_ENGINE_ENV, "planned")
    directions: list[str] = []
    pooled = PlannedCopyEngine._pooled

    def seen(engine: PlannedCopyEngine, ticket: Any, job: Any) -> None:
        directions.append("d2h" if isinstance(job.src, EnginePool) else "h2d")
        pooled(engine, ticket, job)

    monkeypatch.setattr(PlannedCopyEngine, "_pooled", seen)
    scenarios.test_scenario("sglang.plugin:factory", 4, scenarios.HOST, write_policy)
    assert {"d2h", "h2d"} <= set(directions), directions


@pytest.mark.parametrize(("engine", "why"), [("warp", "not one of"), ("cuda", "needs SGLang's KV on a CUDA device")])
def test_a_copy_engine_that_cannot_run_is_refused_at_startup(engine: str, why: str, monkeypatch: Any) -> None:
    from kvcert.integrations.sglang.options import COPY_ENGINE_ENV

    monkeypatch.setenv(COPY_ENGINE_ENV, engine)
    with pytest.raises(UnsupportedOption, match=f"{COPY_ENGINE_ENV}.*{why}"):
        plugin.factory(_context(enable_hierarchical_cache=True))
