"""Smoke run of the ref-aware SGLang fork's caches on CPU, with real SGLang 0.5.10 pools.

    .venv-refaware/bin/python scripts/refaware_smoke.py

Part 1 drives `RefAwareRadixCache` (device only): two inserts, a prefix match, refs
(register/update/release), lock/unlock and eviction under the default and a widened scope.
Part 2 builds `RefAwareHiRadixCache` with a host tier (one-rank gloo group, unpinned host
pool, `direct` io with `layer_first`, write_through) and runs a backup -> evict -> load-back
round trip, checking the KV bytes. Each step prints what the cache reports; the script exits
non-zero if a step fails. Not a test of kvcert; groundwork for a `refaware` adapter.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings
from types import SimpleNamespace
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from kvcert.conformance.adapters.refaware.env import import_refaware, install_host_cpu_shims  # noqa: E402

RA = import_refaware()

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

SLOTS, LAYERS, HEADS, DIM, DTYPE = 64, 2, 2, 4, torch.float32


def server_args(**extra: Any) -> ServerArgs:
    """The real ServerArgs, as the fork's scheduler hands it to the caches (priority tiers on)."""
    return ServerArgs(
        model_path="dummy",
        device="cpu",
        enable_ref_aware_kv_buffer=True,
        enable_priority_scheduling=True,
        high_priority_threshold=1,
        **extra,
    )


def pools() -> tuple[MHATokenToKVPool, TokenToKVPoolAllocator, ReqToTokenPool]:
    kv = MHATokenToKVPool(
        SLOTS, 1, DTYPE, HEADS, DIM, LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False
    )
    alloc = TokenToKVPoolAllocator(SLOTS, DTYPE, "cpu", kv, need_sort=False)
    req_pool = ReqToTokenPool(4, SLOTS, "cpu", False)
    return kv, alloc, req_pool


def tiers(cache: Any) -> str:
    return (
        f"evictable={cache.evictable_size_} protected={cache.protected_size_} "
        f"unused={cache.unused_evictable_size_} low={cache.low_ref_evictable_size_} "
        f"high={cache.high_ref_evictable_size_} free_slots={cache.token_to_kv_pool_allocator.available_size()}"
    )


def tree(cache: Any) -> str:
    out: list[str] = []

    def walk(node: Any, depth: int) -> None:
        for child in node.children.values():
            where = "dev" if not child.evicted else "---"
            where += "+host" if getattr(child, "backuped", False) else ""
            out.append(
                f"{'  ' * depth}- {child.key.token_ids} [{where}] lock={child.lock_ref} "
                f"high_ref={child.high_ref} low_ref={child.low_ref} rids={sorted(child.tracked_rids)}"
            )
            walk(child, depth + 1)

    walk(cache.root_node, 2)
    return "\n".join(out) or "    (empty)"


def show(label: str, cache: Any) -> None:
    print(f"  {label}: {tiers(cache)}")
    print(tree(cache))


def insert(cache: Any, alloc: TokenToKVPoolAllocator, tokens: list[int]) -> int:
    """Insert like cache_finished_req does: fresh slots for the whole key, free the duplicated prefix."""
    value = alloc.alloc(len(tokens))
    assert value is not None, "device pool exhausted"
    result = cache.insert(InsertParams(key=RadixKey(tokens), value=value))
    if result.prefix_len:
        alloc.free(value[: result.prefix_len])  # RadixCache.insert leaves the duplicate slots to the caller
    print(f"  insert {tokens} -> prefix_len={result.prefix_len} last_node={result.last_node}")
    return result.prefix_len


def part1() -> None:
    print("== part 1: RefAwareRadixCache (device only)")
    _, alloc, req_pool = pools()
    cache = RA.RefAwareRadixCache(
        CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=1),
        server_args=server_args(),
    )
    print(
        f"  constructed {type(cache).__name__}, policy={cache.eviction_policy}, threshold={cache.high_priority_threshold}"
    )
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 10, 11, 12]
    insert(cache, alloc, a)
    insert(cache, alloc, b)
    show("after two inserts", cache)

    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 9, 10])))
    print(f"  match [1,2,3,4,9,10] -> {len(m.device_indices)} tokens, slots {m.device_indices.tolist()}")
    show("after match (splits [9..12] at 2)", cache)
    deep = m.last_device_node

    hp = SimpleNamespace(rid="hp", priority=5, last_node=deep)
    lp = SimpleNamespace(
        rid="lp", priority=0, last_node=cache.match_prefix(MatchPrefixParams(RadixKey(a))).last_device_node
    )
    cache.register_ref(hp)
    cache.register_ref(lp)
    print(f"  register_ref hp (priority 5) and lp (priority 0): {sorted(cache.rid_to_ref_info)}")
    show("after register_ref", cache)

    r = cache.inc_lock_ref(deep)
    print(f"  inc_lock_ref(deep) -> delta={r.delta}")
    n = cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted
    print(f"  evict(100), default scope (allow_low, not high), deep locked -> evicted {n}")
    show("after evict", cache)
    r = cache.dec_lock_ref(deep)
    print(f"  dec_lock_ref(deep) -> delta={r.delta}")
    show("after unlock", cache)

    print(f"  update_ref('hp', 0) -> {cache.update_ref('hp', 0)}")
    print(f"  update_ref('hp', 7) -> {cache.update_ref('hp', 7)}")
    n = cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted
    print(f"  evict(100), default scope -> evicted {n} (high tier kept)")
    show("after evict", cache)
    with cache.scoped_evict(allow_low=True, allow_high=True):
        n = cache.evict(EvictParams(num_tokens=2)).num_tokens_evicted
    print(f"  evict(2) in scoped_evict(allow_high=True) -> evicted {n}")
    show("after scoped evict", cache)
    print(f"  release_ref('hp') -> {cache.release_ref('hp')}")
    print(f"  release_ref('hp') again -> {cache.release_ref('hp')}")
    n = cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted
    print(f"  evict(100) -> evicted {n}")
    show("at end", cache)
    assert cache.evictable_size_ == 0 and alloc.available_size() == SLOTS, "slots leaked"
    print("  part 1 OK")


def start_gloo() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="kvcert-gloo-"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def part2() -> None:
    print("== part 2: RefAwareHiRadixCache (device + host tier)")
    start_gloo()
    install_host_cpu_shims()
    args = server_args(
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        hicache_write_policy="write_through",
    )
    kv, alloc, req_pool = pools()
    cache = RA.RefAwareHiRadixCache(
        CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=1),
        server_args=args,
    )
    host = cache.token_to_kv_pool_host
    print(
        f"  constructed {type(cache).__name__}: host pool {type(host).__name__} size={host.size} "
        f"pin_memory={host.pin_memory} layout={host.layout} io={cache.cache_controller.io_backend} "
        f"write_policy={cache.cache_controller.write_policy} tp_world_size={cache.tp_world_size}"
    )
    tokens = list(range(100, 116))  # 16 tokens: above load_back_threshold (10)
    value = alloc.alloc(len(tokens))
    for layer in range(LAYERS):  # KV bytes: a function of (layer, slot) so a load-back can be checked
        kv.k_buffer[layer][value] = torch.arange(len(tokens), dtype=DTYPE).view(-1, 1, 1) + 1000 * layer + 1
        kv.v_buffer[layer][value] = -(torch.arange(len(tokens), dtype=DTYPE).view(-1, 1, 1) + 1000 * layer + 1)
    want_k = [kv.k_buffer[layer][value].clone() for layer in range(LAYERS)]
    want_v = [kv.v_buffer[layer][value].clone() for layer in range(LAYERS)]
    result = cache.insert(InsertParams(key=RadixKey(tokens), value=value))
    print(f"  insert 16 tokens -> prefix_len={result.prefix_len} last_node id={getattr(result.last_node, 'id', None)}")
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node
    cache.register_ref(SimpleNamespace(rid="hp", priority=5, last_node=node))
    print(
        f"  register_ref hp -> node high_ref={node.high_ref}; ongoing write-through: {sorted(cache.ongoing_write_through)}"
    )
    cache.writing_check()
    print(f"  writing_check -> backuped={node.backuped} ongoing={sorted(cache.ongoing_write_through)}")
    show("after backup", cache)

    n = cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted
    print(f"  evict(100) default scope -> evicted {n} (node is high tier)")
    with cache.scoped_evict(allow_low=True, allow_high=True):
        n = cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted
    print(
        f"  evict(100) in scoped_evict(allow_high=True) -> evicted {n}; node evicted={node.evicted} backuped={node.backuped}"
    )
    show("after device eviction", cache)

    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    print(f"  match -> device hit {len(m.device_indices)}, host hit {m.host_hit_length}")
    loaded, last = cache.init_load_back(
        InitLoadBackParams(last_host_node=m.last_host_node, host_hit_length=m.host_hit_length, mem_quota=None)
    )
    print(f"  init_load_back -> {len(loaded)} tokens to slots {loaded.tolist()[:4]}... (queued, node locked)")
    producer = cache.ready_to_load_host_cache()  # the scheduler's cue: run the queued H2D copies
    print(f"  ready_to_load_host_cache -> producer {producer}; ongoing load-back: {sorted(cache.ongoing_load_back)}")
    cache.loading_check()  # acks the load and drops load_back's lock on the node
    print(f"  loading_check -> ongoing load-back: {sorted(cache.ongoing_load_back)}, node lock={last.lock_ref}")
    ok = all(
        torch.equal(kv.k_buffer[layer][loaded], want_k[layer])
        and torch.equal(kv.v_buffer[layer][loaded], want_v[layer])
        for layer in range(LAYERS)
    )
    print(f"  KV bytes after load-back equal to those inserted: {ok}")
    show("after load-back", cache)
    assert ok, "KV bytes differ after load-back"

    with cache.scoped_evict(allow_low=True, allow_high=True):
        cache.evict(EvictParams(num_tokens=100))
    print(f"  release_ref('hp') -> {cache.release_ref('hp')}")
    freed = cache.evict_host(100)
    print(f"  evict_host(100) -> freed {freed} host slots")
    show("at end", cache)
    print("  part 2 OK")


def main() -> int:
    print(f"sglang {RA.version} (ref-aware fork overlay), torch {torch.__version__}")
    failed = False
    for part in (part1, part2):
        try:
            part()
        except Exception:
            failed = True
            print(f"  {part.__name__} FAILED:")
            traceback.print_exc(file=sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
