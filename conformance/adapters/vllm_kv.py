"""vLLM 0.32.0's prefix cache (`vllm.v1.core.kv_cache_manager.KVCacheManager`) as a key-partitioning probe.

Runs in `.venv-vllm` (scripts/install_vllm.sh): `.venv-vllm/bin/kvcert partition
kvcert.conformance.adapters.vllm_kv:probe`. A request is served as vLLM's scheduler serves a prefill:
`get_computed_blocks`, `allocate_slots` for the uncached rest (which caches its full blocks), the step's
computed tokens recorded (`_update_after_schedule`'s part), then `free`. Each request is a real `Request`
carrying the block hasher vLLM's engine gives it (sha256, `EngineCore`), with its keys as vLLM takes them:
a `LoRARequest`, `cache_salt`, and one `MultiModalFeatureSpec` per image. One full-attention group of
16-token blocks, 64 blocks.

What the adapter chooses, not vLLM: a LoRA's integer id (vLLM requires one; each (name, path) gets its own,
in the order first seen, and vLLM does not hash it); the image's modality ("image") and its data (None: the
hasher reads the identifier and the placeholder only).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from kvcert.conformance.partition import Keys, Served

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

__all__ = ["VLLMProbe", "probe"]

BLOCK = 16
BLOCKS = 64


class VLLMProbe:
    """vLLM's `KVCacheManager`, one fresh per case; requests served through it as its scheduler serves them."""

    page = BLOCK

    def __init__(self) -> None:
        warnings.filterwarnings("ignore")
        import torch
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
        self._config = KVCacheConfig(
            num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        self._lora_ids: dict[tuple[str, str], int] = {}
        self._n = 0
        self.fresh()

    def fresh(self) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        self.mgr = KVCacheManager(
            self._config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
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


def probe() -> VLLMProbe:
    return VLLMProbe()
