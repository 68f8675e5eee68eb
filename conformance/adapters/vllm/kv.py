"""vLLM 0.32.0's prefix cache as a key-partitioning probe: its `KVCacheManager` (`probe`), and its v1 `Scheduler`
(`probe_scheduler`, the request path).

Runs in `.venv-vllm` (scripts/install_vllm.sh): `.venv-vllm/bin/kvcert partition
kvcert.conformance.adapters.vllm.kv:probe` (or `:probe_scheduler`). `probe` serves a request as vLLM's scheduler
serves a prefill:
`get_computed_blocks`, `allocate_slots` for the uncached rest (which caches its full blocks), the step's
computed tokens recorded (`_update_after_schedule`'s part), then `free`. Each request is a real `Request`
carrying the block hasher vLLM's engine gives it (sha256, `EngineCore`), with its keys as vLLM takes them:
a `LoRARequest`, `cache_salt`, and one `MultiModalFeatureSpec` per image. One full-attention group of
16-token blocks, 64 blocks.

`probe_scheduler` hands the same `Request` to vLLM's own `Scheduler`: `add_request`, then `schedule` and
`update_from_output` with a model-runner output the harness writes (one sampled token per scheduled request), until
the request finishes (`max_tokens=1`) and the scheduler frees it. The hit is what the scheduler reported to the
model runner (`NewRequestData.num_computed_tokens`), the pages its `block_ids`. Declared deviation: the scheduler's
`ModelConfig` is a stand-in holding the fields the scheduler reads (no HF config, no tokenizer:
`skip_tokenizer_init`), so nothing of vLLM's model loading runs; it takes no multimodal inputs, so images are NOT
CHECKED through the scheduler.

What the adapter chooses, not vLLM: a LoRA's integer id (vLLM requires one; each (name, path) gets its own,
in the order first seen, and vLLM does not hash it); the image's modality ("image") and its data (None: the
hasher reads the identifier and the placeholder only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcert.conformance.adapters.vllm import env as _env
from kvcert.conformance.backend import Keys, Served

__all__ = ["VLLMProbe", "VLLMSchedulerProbe", "probe", "probe_scheduler"]

BLOCK = 16
BLOCKS = 64
BATCH = 4096
"""The scheduler's token budget per step (`max_num_batched_tokens`): a prompt takes len // BATCH + 1 steps."""


class VLLMProbe:
    """vLLM's `KVCacheManager`, one fresh per case; requests served through it as its scheduler serves them."""

    page = BLOCK

    def __init__(self) -> None:
        self._hasher = _env.block_hasher(BLOCK)
        self._lora_ids: dict[tuple[str, str], int] = {}
        self._n = 0
        self.fresh()

    def fresh(self) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        self.mgr = KVCacheManager(
            _env.kv_cache_config(BLOCK, BLOCKS),
            max_model_len=4096,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )

    def _request(self, tokens: Sequence[int], keys: Keys) -> Any:
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._n += 1
        lora = None
        if keys.lora is not None:
            lora_id = self._lora_ids.setdefault(keys.lora, len(self._lora_ids) + 1)
            lora = LoRARequest(keys.lora[0], lora_id, keys.lora[1])
        images = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=im.identifier,
                mm_position=PlaceholderRange(im.offset, im.length),
            )
            for im in keys.images
        ]
        return Request(
            f"r{self._n}",
            list(tokens),
            SamplingParams(max_tokens=1),
            None,
            mm_features=images or None,
            lora_request=lora,
            cache_salt=keys.salt,
            block_hasher=self._hasher,
        )

    def serve(self, tokens: Sequence[int], keys: Keys) -> Served:
        req = self._request(tokens, keys)
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        if self.mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            raise RuntimeError(f"vLLM's pool of {BLOCKS} blocks cannot hold a {req.num_tokens}-token prompt")
        req.num_computed_tokens = req.num_tokens
        pages = tuple(int(b) for b in self.mgr.get_block_ids(req.request_id)[0])
        self.mgr.free(req)
        return Served(int(hit), pages)


class VLLMSchedulerProbe(VLLMProbe):
    """The same requests through vLLM's v1 `Scheduler` (one fresh per case). Images are NOT CHECKED here: the stand-in
    model takes no multimodal inputs, so the scheduler's encoder path never runs."""

    kinds = frozenset({"lora", "salt"})

    def fresh(self) -> None:
        self.sched = _env.scheduler(BLOCK, BLOCKS, max_model_len=4096, batch=BATCH)

    def serve(self, tokens: Sequence[int], keys: Keys) -> Served:
        from vllm.v1.outputs import ModelRunnerOutput

        req = self._request(tokens, keys)
        req.sampling_params.update_from_generation_config({}, eos_token_id=0)
        self.sched.add_request(req)
        hit = -1
        pages: tuple[int, ...] = ()
        for _ in range(1 + len(tokens) // BATCH):
            out = self.sched.schedule()
            for new in out.scheduled_new_reqs:
                if new.req_id == req.request_id:
                    hit, pages = int(new.num_computed_tokens), tuple(int(b) for b in new.block_ids[0])
            ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
            sampled = [[1] if out.num_scheduled_tokens[i] else [] for i in ids]
            result = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={i: k for k, i in enumerate(ids)}, sampled_token_ids=sampled
            )
            self.sched.update_from_output(out, result)
            if req.request_id not in self.sched.requests:
                break
        if hit < 0 or req.request_id in self.sched.requests:
            raise RuntimeError(f"vLLM's scheduler did not serve {req.request_id} to its end")
        return Served(hit, pages)


def probe() -> VLLMProbe:
    return VLLMProbe()


def probe_scheduler() -> VLLMSchedulerProbe:
    return VLLMSchedulerProbe()
