"""SGLang 0.5.23's own scheduler as a key-partitioning probe (`kvcert partition`, docs/vllm.md).

    KVCERT_SGLANG=1 .venv/bin/kvcert partition kvcert.conformance.adapters.sglang.partition:probe
    KVCERT_SGLANG=1 .venv/bin/kvcert partition kvcert.conformance.adapters.sglang.partition:probe_extra_key

Each case runs on a fresh request path (`sglang.requests`: SGLang's `Scheduler`, unpatched, with real requests). A
request is served through its first step, which prefills it; the hit is what SGLang counted as cached for it
(`Req.cached_tokens`), its pages those of its row. A LoRA adapter reaches the scheduler as the id SGLang's tokenizer
resolves for an adapter loaded at launch (`LoRARef.deterministic_id`); a salt as the generate request's `cache_salt`
(`probe`) or its `extra_key` (`probe_extra_key`), the two fields SGLang keys its radix tree by. The probe names the
engine's id for an adapter (`spellings`), so the cases include a salt that spells it. Images are NOT CHECKED: the
request path takes no multimodal input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from kvcert.conformance.adapters.sglang import requests as sglang_requests
from kvcert.conformance.backend import Keys, Served
from kvcert.spec import storage as l3
from kvcert.spec.requests import output_token
from kvcert.spec.types import CacheConfig

__all__ = ["SGLangProbe", "probe", "probe_extra_key"]

PAGE = 4
CAPACITY = 512


class _Model:
    """The model the engine's forward runs (`conformance.backend.Model`): the spec's KV entries and output tokens."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def kv(self, namespace: Optional[str], tokens: Sequence[int], start: int, count: int) -> list[bytes]:
        return list(l3.token_entries(namespace, tuple(tokens), self.layers)[start : start + count])

    def next_token(self, namespace: Optional[str], tokens: Sequence[int]) -> int:
        return output_token(namespace, tuple(tokens))


class SGLangProbe:
    """SGLang's request path, one fresh per case; `field` is where a case's salt goes ("cache_salt" or "extra_key")."""

    page = PAGE
    kinds = frozenset({"lora", "salt"})

    def __init__(self, field: str = "cache_salt") -> None:
        self.field = field
        self.engine: Optional[sglang_requests.SGLangRequestPath] = None
        self.n = 0

    def fresh(self) -> None:
        if self.engine is not None:
            self.engine.close()
        config = CacheConfig(page_size=PAGE, capacity=CAPACITY)
        self.engine = sglang_requests.factory(config)
        self.engine.attach_model(_Model(config.kv_layers))

    def spellings(self, lora: tuple[str, str]) -> tuple[str, ...]:
        """What SGLang calls an adapter in its keys: the id its tokenizer resolves for one loaded at launch."""
        return (sglang_requests.LoRARef.deterministic_id(*lora),)

    def serve(self, tokens: Sequence[int], keys: Keys) -> Served:
        engine = self.engine
        assert engine is not None, "fresh() first"
        self.n += 1
        rid = f"p{self.n:06d}"
        salt: dict[str, Any] = {"cache_salt": keys.salt} if self.field == "cache_salt" else {}
        namespace = keys.salt if self.field == "extra_key" else None
        engine.submit(rid, None, namespace, list(tokens), 0, 2, lora=keys.lora, **salt)
        pages: tuple[int, ...] = ()
        for _ in range(32):  # prefilled in chunks, then decoded to its end, so its KV is cached for the next request
            engine.step()
            view = next((v for v in engine.requests() if v.id == rid), None)
            if view is not None and len(view.row) > len(pages) * PAGE:
                pages = tuple(dict.fromkeys(x // PAGE for x in view.row))  # its pages, the reused ones first
            req = engine.req(rid)
            if req is not None and req.finished():
                return Served(int(req.cached_tokens), pages)
        raise RuntimeError(f"SGLang did not finish {rid} within 32 steps")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def probe() -> SGLangProbe:
    return SGLangProbe("cache_salt")


def probe_extra_key() -> SGLangProbe:
    return SGLangProbe("extra_key")
