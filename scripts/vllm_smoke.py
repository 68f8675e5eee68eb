"""Smoke run of vLLM 0.32.0's prefix cache on CPU: its `KVCacheManager` driven through its own API with real
`Request` objects, as its scheduler drives it (match, allocate, compute, free).

    .venv-vllm/bin/python scripts/vllm_smoke.py                  # one JSON line: every case's hit and pages
    .venv-vllm/bin/python scripts/vllm_smoke.py --plant keyless  # vLLM with its extra keys dropped: must fail
    .venv-vllm/bin/python scripts/vllm_smoke.py --plant cold     # vLLM with caching off: must fail

Each case serves a prompt once (a request that computes and frees it), then serves a second request and reports
how many of its tokens came from the cache, and whether those are the first request's pages. A positive control
(the same prompt and keys) must reuse every full page; requests that differ in one key (cache salt, LoRA name,
LoRA path, a multimodal item's identifier) must reuse nothing from where that key applies: a salt and a LoRA from
the first page, an image from the page its placeholder starts in; requests whose keys agree (the same salt; the
same LoRA under another id, which vLLM does not hash) must reuse. The script exits non-zero if a case does not.
(A page id seen again is not reuse: a freed page that held no full block goes back to the pool and is handed out
next.) Groundwork for vLLM's kvcert targets (issue 35), not a certification.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BLOCK = 16
PROMPT = list(range(1000, 1000 + 4 * BLOCK + 3))  # four full pages and a partial one
init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def _image(identifier: str) -> list[MultiModalFeatureSpec]:
    """One image whose placeholder covers tokens 16..31 of the prompt (the second page)."""
    return [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset=BLOCK, length=BLOCK)
        )
    ]


class Serve:
    """A fresh manager with one full-attention group, and requests served through it."""

    caching = True

    def __init__(self) -> None:
        spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        self.mgr = KVCacheManager(
            config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=self.caching
        )
        self.n = 0

    def run(self, **keys: Any) -> tuple[int, list[int]]:
        """Serve `PROMPT` with `keys`: the tokens it found cached, and its pages."""
        self.n += 1
        req = Request(f"r{self.n}", list(PROMPT), SamplingParams(max_tokens=4), None, block_hasher=HASHER, **keys)
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        if self.mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            raise RuntimeError("the pool could not hold one prompt")
        req.num_computed_tokens = req.num_tokens  # the forward pass ran (the scheduler's _update_after_schedule)
        pages = list(self.mgr.get_block_ids(req.request_id)[0])
        self.mgr.free(req)
        return hit, pages


LORA_A = LoRARequest("adapter-a", 1, "/adapters/a")
FULL = (len(PROMPT) - 1) // BLOCK  # pages a prompt's second request may reuse (its last token is always computed)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], int]] = [
    # (case, the first request's keys, the second's, the pages the second must reuse: no more, no fewer)
    ("the same prompt (positive control)", {}, {}, FULL),
    ("the same cache salt", {"cache_salt": "tenant-1"}, {"cache_salt": "tenant-1"}, FULL),
    (
        "the same LoRA under another id",
        {"lora_request": LORA_A},
        {"lora_request": LoRARequest("adapter-a", 2, "/adapters/a")},
        FULL,
    ),
    ("the same image", {"mm_features": _image("img-1")}, {"mm_features": _image("img-1")}, FULL),
    ("a cache salt against none", {}, {"cache_salt": "tenant-1"}, 0),
    ("another cache salt", {"cache_salt": "tenant-1"}, {"cache_salt": "tenant-2"}, 0),
    ("a LoRA against none", {}, {"lora_request": LORA_A}, 0),
    ("another LoRA name", {"lora_request": LORA_A}, {"lora_request": LoRARequest("adapter-b", 1, "/adapters/a")}, 0),
    ("another LoRA path", {"lora_request": LORA_A}, {"lora_request": LoRARequest("adapter-a", 1, "/adapters/b")}, 0),
    (
        "another image (the page before it is shared)",
        {"mm_features": _image("img-1")},
        {"mm_features": _image("img-2")},
        1,
    ),
    ("a salt that spells a LoRA's name", {"lora_request": LORA_A}, {"cache_salt": "adapter-a"}, 0),
]


def plant(kind: str) -> None:
    """Break vLLM on purpose, to show the cases catch it: `keyless` hashes blocks without their extra keys (LoRA,
    salt, images), `cold` turns prefix caching off."""
    import vllm.v1.core.kv_cache_utils as utils

    if kind == "keyless":
        utils.generate_block_hash_extra_keys = lambda request, start, end, mm_idx: (None, mm_idx)
    elif kind == "cold":
        Serve.caching = False
    else:
        raise SystemExit(f"unknown plant {kind!r}: keyless or cold")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--plant"] and len(argv) == 2:
        plant(argv[1])
    elif argv:
        raise SystemExit("usage: vllm_smoke.py [--plant keyless|cold]")
    out, failed = [], []
    for name, first, second, reuse in CASES:
        serve = Serve()
        _, pages_a = serve.run(**first)
        hit, pages_b = serve.run(**second)
        ok = hit == reuse * BLOCK and pages_b[:reuse] == pages_a[:reuse]
        out.append({"case": name, "reused_pages": reuse, "hit_tokens": hit, "ok": ok})
        if not ok:
            failed.append(name)
    print(json.dumps({"vllm_cases": out, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
