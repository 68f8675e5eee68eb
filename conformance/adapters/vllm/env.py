"""vLLM 0.32's v1 scheduler built on a CPU machine with no model: what the vLLM adapters share.

`scheduler` builds vLLM's own `Scheduler` (or `AsyncScheduler`) over one full-attention KV cache group. The only
part not vLLM's is the model config: `ModelConfig.__post_init__` loads a Hugging Face config and inspects the model
class in a subprocess, so the adapters put in its place a stand-in holding just the fields the scheduler and its
structured-output manager read (`STAND_IN`), declared by every target that uses it.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any, Optional

from kvcert.spec.block_table import BlockTableModel
from kvcert.spec.invariants import Violation
from kvcert.spec.page_table import CachedPage, PageTable

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

__all__ = [
    "STAND_IN",
    "VLLM_VERSION",
    "PoolObserver",
    "RecordingPublisher",
    "block_hasher",
    "cached_hashes",
    "events_agree",
    "group_namespace",
    "kv_cache_config",
    "mapped_blocks",
    "pool_pages",
    "scheduler",
]

VLLM_VERSION = "0.32.0"

STAND_IN = (
    "model config: a stand-in holding the fields vLLM's Scheduler and StructuredOutputManager read (no Hugging Face "
    "config, no tokenizer: skip_tokenizer_init), in place of ModelConfig, whose construction loads a model config "
    "and inspects the model class; so CpuPlatform.check_and_update_config (which would force block_size 128 and "
    "async_scheduling off) does not run; a LoRA config, where one is used, is set on the built VllmConfig, "
    "unchecked against a model; KV events go to a recording publisher registered through "
    "EventPublisherFactory.register_publisher (the config's publisher field, whose Literal names only null and zmq, "
    "set after validation)"
)


def block_hasher(block: int) -> Any:
    """The block hasher vLLM's `EngineCore` gives every request: sha256 (the default `prefix_caching_hash_algo`)
    over `block`-token blocks, chained from `NONE_HASH`."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block, sha256)


def kv_cache_config(block: int, blocks: int, window: int = 0) -> Any:
    """One full-attention group of `blocks` blocks of `block` tokens (block 0 is vLLM's null block); with `window`,
    a hybrid model's: a sliding-window group of that many tokens beside it, both drawing on the one pool."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    groups = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block, num_kv_heads=1, head_size=64, dtype=torch.float32))]
    if window:
        swa = SlidingWindowSpec(block, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=window)
        groups.append(KVCacheGroupSpec(["layer.1"], swa))
    return KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def group_namespace(namespace: Optional[str], group: int) -> Optional[str]:
    """The namespace KV cache group `group`'s KV is computed under: the request's for group 0, the group folded in
    for the others (their layers are other layers, so their bytes differ)."""
    return namespace if group == 0 else f"{namespace!r}\x01group\x01{group}"


def scheduler(
    block: int,
    blocks: int,
    *,
    max_model_len: int,
    batch: int,
    max_num_seqs: int = 8,
    async_scheduling: bool = False,
    max_loras: int = 0,
    window: int = 0,
    policy: str = "fcfs",
    kv_transfer: Optional[dict[str, Any]] = None,
) -> Any:
    """vLLM's `Scheduler` (`AsyncScheduler` with `async_scheduling`) with prefix caching and KV events on, chunked
    prefill with a budget of `batch` tokens a step, and with `max_loras` a LoRA config that admits that many
    adapters into one batch. With `kv_transfer` (`KVTransferConfig`'s fields) the scheduler builds its KV connector's
    scheduler side through `KVConnectorFactory`, as the engine does."""
    warnings.filterwarnings("ignore")
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.config.kv_events import KVEventsConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.config.lora import LoRAConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    sched = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batch,
        async_scheduling=async_scheduling,
        policy=policy,
    )
    cache = CacheConfig(block_size=block, enable_prefix_caching=True)
    cache.num_gpu_blocks = blocks
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    _register_publisher()
    object.__setattr__(events, "publisher", "kvcert")  # RecordingPublisher: the field's Literal names only null and zmq
    transfer = KVTransferConfig(**kv_transfer) if kv_transfer is not None else None
    vc = VllmConfig(scheduler_config=sched, cache_config=cache, kv_events_config=events, kv_transfer_config=transfer)
    model = SimpleNamespace(  # STAND_IN: what the scheduler and its structured-output manager read
        uses_mrope=False,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        runner_type="generate",
        is_diffusion=False,
        supports_multimodal_inputs=False,
        return_sampling_mask=False,
        multimodal_config=None,
        skip_tokenizer_init=True,
        is_multimodal_model=False,
        hf_config=None,
        tokenizer=None,
    )
    object.__setattr__(vc, "model_config", model)
    if max_loras:  # set after construction: VllmConfig checks a LoRA config against the (absent) model config
        object.__setattr__(vc, "lora_config", LoRAConfig(max_loras=max_loras))
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vc, kv_cache_config(block, blocks, window), StructuredOutputManager(vc), block_size=block)


def mapped_blocks(pool: Any) -> list[tuple[bytes, Any]]:
    """Every (hash with group id, block) in a `BlockPool`'s hash map: one hash may map to several blocks."""
    out: list[tuple[bytes, Any]] = []
    for key, entry in pool.cached_block_hash_to_block._cache.items():
        out += [(bytes(key), b) for b in (entry.values() if isinstance(entry, dict) else (entry,))]
    return out


def pool_pages(
    pool: Any,
    page_size: int,
    capacity: int,
    contents: dict[bytes, tuple[Optional[str], tuple[int, ...]]],
    held: Iterable[Sequence[Any]],
) -> PageTable:
    """A `BlockPool` read as the page-level core's `PageTable` (SPEC.md §13): every block in its hash map is a cached
    page (its keys and tokens those its hash was made from, `contents`; its holders its `ref_cnt`), the free queue's
    blocks without a hash are free and those with one evictable, and the blocks the requests hold (`held`, one list
    per request) outside the map are lent, each once. Block 0, the null block, is outside the capacity."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    queue = pool.free_block_queue.get_all_free_blocks()
    queued = {b.block_id for b in queue}
    mapped = [b for _, b in mapped_blocks(pool)]
    in_map = {b.block_id for b in mapped}

    def slots(block: int) -> range:
        return range(block * page_size, (block + 1) * page_size)

    pages = []
    for b in mapped:
        ns, tokens = contents.get(bytes(get_block_hash(b.block_hash)), (None, ()))
        ns = group_namespace(ns, get_group_id(b.block_hash))
        pages.append(CachedPage(b.block_id, ns, tokens, tuple(slots(b.block_id)), b.ref_cnt))
    # A block outside the map held by two requests is one owner's slots: vLLM shares a block only through the map,
    # unless a connector's evict_blocks took a shared block's hash (INV-POOL-1 compares its reference count).
    lent_blocks = dict.fromkeys(b.block_id for blocks in held for b in blocks if not b.is_null and b.block_id not in in_map)
    lent = [x for b in lent_blocks for x in slots(b)]
    return PageTable(
        page_size=page_size,
        capacity=capacity,
        slot_limit=len(pool.blocks) * page_size,
        pages=tuple(pages),
        free_slots=tuple(x for b in queue if b.block_hash is None for x in slots(b.block_id)),
        lent_slots=tuple(lent),
        evictable_size=page_size * len(in_map & queued),
        protected_size=page_size * len(in_map - queued),
    )


class RecordingPublisher:
    """The KV event publisher the scheduler is built with (registered as "kvcert" through vLLM's
    `EventPublisherFactory.register_publisher`): it keeps every batch the scheduler publishes, in order."""

    def __init__(self, data_parallel_rank: int = 0, **config: Any) -> None:
        self.batches: list[Any] = []

    def publish(self, events: Any) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self) -> Any:
        return None

    def take(self) -> list[Any]:
        """Every event published since the last call, in order."""
        out = [e for batch in self.batches for e in batch.events]
        self.batches = []
        return out


def _register_publisher() -> None:
    from vllm.distributed.kv_events import EventPublisherFactory

    if "kvcert" not in EventPublisherFactory._registry:
        EventPublisherFactory.register_publisher("kvcert", RecordingPublisher)


def apply_events(cached: Counter[Any], events: Iterable[Any]) -> Counter[Any]:
    """The cached hashes (one count per block) after `events` (BlockStored, BlockRemoved, AllBlocksCleared)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    have = Counter(cached)
    for ev in events:
        if isinstance(ev, BlockStored):
            have.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            have.subtract(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            have.clear()
    return +have


def cached_hashes(pool: Any) -> Counter[Any]:
    """A pool's cached hashes as its events name them (`maybe_convert_block_hash`), one count per block."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    return Counter(maybe_convert_block_hash(get_block_hash(key)) for key, _ in mapped_blocks(pool))


def events_agree(before: Counter[Any], events: Sequence[Any], now: Counter[Any]) -> list[Violation]:
    """INV-EVENT-1: the events, applied to the cached hashes before them, give the cached hashes now."""
    have = apply_events(before, events)
    if have == now:
        return []
    return [Violation("INV-EVENT-1", f"after its KV events the cache holds {sum(have.values())} block hashes "
                      f"({sum((have - now).values())} no longer in the pool); the pool holds {sum(now.values())} "
                      f"({sum((now - have).values())} never announced)")]  # fmt: skip


class PoolObserver:
    """Sees every call vLLM's managers make on a `BlockPool` and compares it with the `vllm-0.32` profile's pool
    (`BlockTableModel`): the blocks handed out and found, then the free queue, the hash table and every reference
    count (INV-POOL-1), and that a request's blocks are freed last block first (INV-POOL-2). Each call is forwarded
    unchanged: the wrappers sit on the instances and change nothing vLLM computes."""

    def __init__(self, pool: Any, managers: Sequence[Any]) -> None:
        self.pool, self.model = pool, BlockTableModel(len(pool.blocks))
        self.found: list[Violation] = []
        self.counts: Counter[str] = Counter()
        """What the calls reached: "evicted" (cached blocks taken for reuse), "uncached" (hashes evict_blocks took)."""
        self.freeing: Optional[list[int]] = None
        for name in ("get_new_blocks", "get_cached_block", "touch", "cache_full_blocks", "free_blocks",
                     "evict_blocks", "reset_prefix_cache"):  # fmt: skip
            setattr(pool, name, getattr(self, "_" + name)(getattr(pool, name)))
        for m in managers:
            m.free = self._manager_free(m, m.free)

    def _get_new_blocks(self, real: Any) -> Any:
        def call(num_blocks: int) -> Any:
            got = real(num_blocks)
            want, evicted = self.model.take(num_blocks)
            self.counts["evicted"] += len(evicted)
            if [b.block_id for b in got] != want:
                self.found.append(Violation("INV-POOL-1", f"get_new_blocks({num_blocks}) handed out "
                                            f"{[b.block_id for b in got]}; the free queue's head was {want}"))  # fmt: skip
            return got

        return call

    def _get_cached_block(self, real: Any) -> Any:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        def call(block_hash: Any, kv_cache_group_ids: Any) -> Any:
            got = real(block_hash, kv_cache_group_ids)
            want = [self.model.lookup(bytes(make_block_hash_with_group_id(block_hash, g))) for g in kv_cache_group_ids]
            found = [b.block_id for b in got] if got else None
            if found != (None if None in want else want):
                self.found.append(Violation("INV-POOL-1", f"a lookup found blocks {found}; the first blocks cached "
                                            f"under that hash, per group, are {want}"))  # fmt: skip
            return got

        return call

    def _touch(self, real: Any) -> Any:
        def call(blocks: Any) -> Any:
            blocks = list(blocks)
            self.model.touch([b.block_id for b in blocks])
            return real(blocks)

        return call

    def _cache_full_blocks(self, real: Any) -> Any:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        def call(
            request: Any,
            blocks: Any,
            num_cached_blocks: int,
            num_full_blocks: int,
            block_size: int,
            kv_cache_group_id: int,
            block_mask: Optional[list[bool]] = None,
        ) -> Any:
            new = blocks[num_cached_blocks:num_full_blocks]
            mask = block_mask if block_mask is not None else [True] * len(new)
            hashes = request.block_hashes[num_cached_blocks:num_full_blocks]
            taken = [(b.block_id, bytes(make_block_hash_with_group_id(h, kv_cache_group_id)))
                     for b, h, keep in zip(new, hashes, mask) if keep and not b.is_null]  # fmt: skip
            self.model.cache([b for b, _ in taken], [h for _, h in taken])
            return real(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask)

        return call

    def _free_blocks(self, real: Any) -> Any:
        def call(ordered_blocks: Any) -> Any:
            blocks = list(ordered_blocks)
            ids = [b.block_id for b in blocks]
            if self.freeing is not None and ids != self.freeing[::-1]:
                self.found.append(Violation("INV-POOL-2", f"a request's blocks {self.freeing} were freed in the "
                                            f"order {ids}; vLLM frees the last block first"))  # fmt: skip
            self.freeing = None
            self.model.free(ids)
            return real(blocks)

        return call

    def _manager_free(self, manager: Any, real: Any) -> Any:
        def call(request_id: str) -> Any:
            self.freeing = [b.block_id for b in manager.req_to_blocks.get(request_id, ())]
            try:
                return real(request_id)
            finally:
                self.freeing = None

        return call

    def _evict_blocks(self, real: Any) -> Any:
        def call(block_ids: Any) -> Any:
            self.counts["uncached"] += len(self.model.uncache(sorted(block_ids)))
            return real(block_ids)

        return call

    def _reset_prefix_cache(self, real: Any) -> Any:
        def call() -> Any:
            done = real()
            held = sum(map(bool, self.model.ref[1:]))
            if done != self.model.reset():
                self.found.append(Violation("INV-POOL-1", f"reset_prefix_cache returned {done}; with {held} blocks "
                                            f"held the model says {not done}"))  # fmt: skip
            return done

        return call

    def take(self) -> list[Violation]:
        """What broke since the last call, then the pool's state against the model's."""
        out, self.found = self.found, []
        queue = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        if queue != self.model.queue:
            out.append(Violation("INV-POOL-1", f"the free queue is {queue}; the model's is {self.model.queue}"))
        refs = [b.ref_cnt for b in self.pool.blocks[1:]]
        if refs != self.model.ref[1:]:
            out.append(Violation("INV-POOL-1", f"reference counts {refs}; the model's {self.model.ref[1:]}"))
        table: dict[bytes, list[int]] = {}
        for key, block in mapped_blocks(self.pool):
            table.setdefault(key, []).append(block.block_id)
        if table != self.model.table:
            out.append(Violation("INV-POOL-1", "the hash table holds blocks "
                                 f"{sorted(map(sorted, table.values()))}; the model's {sorted(map(sorted, self.model.table.values()))}"))  # fmt: skip
        return out[:4]
