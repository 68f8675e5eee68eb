"""SGLang 0.5.23 keys a LoRA request's KV by the caller's `extra_key` with the adapter's id appended
(`Req.__init__`: `extra_key = (extra_key or "") + lora_id`, `managers/schedule_batch.py`), so a request without an
adapter whose `extra_key` spells an adapter's id is keyed like that adapter's requests, and the two share KV: KV
computed by the base model served to the adapter's requests. For adapters given at launch (`--lora-paths`) the id
is `uuid5(NAMESPACE_URL, name + "\\0" + path).hex` (`LoRARef.deterministic_id`), which any client that knows the
adapter's name and path can compute; `extra_key` is a field of the generate request.

Reproduced through SGLang's own scheduler (the request-path adapter, `lora_id` set on the tokenized request as the
tokenizer sets it). A candidate finding: its entry in the findings log needs LoRA in kvcert's request ops."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Optional

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang import requests as sglang_requests  # noqa: E402
from kvcert.conformance.harness.requests import ModelPlayer  # noqa: E402
from kvcert.conformance.harness.side import KVModel  # noqa: E402
from kvcert.spec.types import CacheConfig  # noqa: E402

A = ("adapter-a", "/adapters/a")
B = ("adapter-b", "/adapters/b")
ADAPTER = uuid.uuid5(uuid.NAMESPACE_URL, "adapter-a\0/adapters/a").hex
OTHER = uuid.uuid5(uuid.NAMESPACE_URL, "adapter-b\0/adapters/b").hex
PROMPT = list(range(10, 42))


@pytest.fixture
def engine() -> Iterator[sglang_requests.SGLangRequestPath]:
    config = CacheConfig(page_size=1, capacity=256, host_capacity=0, write_policy="write_through")
    target = sglang_requests.factory(config)
    target.attach_model(ModelPlayer(KVModel(config.kv_layers)))
    yield target
    target.close()


def _cached(
    engine: sglang_requests.SGLangRequestPath, rid: str, extra_key: Optional[str], lora: Optional[tuple[str, str]]
) -> int:
    """Serve one request to its end; the prompt tokens SGLang found cached for it."""
    engine.submit(rid, None, extra_key, PROMPT, 0, 2, lora=lora)
    for _ in range(40):
        engine.step()
        if engine.req(rid) is not None and engine.req(rid).finished():
            break
    assert engine.req(rid).finished()
    return int(engine.req(rid).cached_tokens)


def test_a_base_model_request_keyed_with_an_adapters_id_shares_kv_with_that_adapter(
    engine: sglang_requests.SGLangRequestPath,
) -> None:
    assert _cached(engine, "base", ADAPTER, None) == 0
    assert engine.req("base").extra_key == ADAPTER
    assert _cached(engine, "lora", None, A) == len(PROMPT) - 1  # served the base model's KV
    assert engine.req("lora").extra_key == ADAPTER


def test_other_keys_stay_apart(engine: sglang_requests.SGLangRequestPath) -> None:
    """The control: another adapter, and no key at all, reuse nothing of the first request."""
    assert _cached(engine, "a", None, A) == 0
    assert _cached(engine, "b", None, B) == 0
    assert engine.req("b").extra_key == OTHER
    assert _cached(engine, "c", None, None) == 0
    assert _cached(engine, "d", None, A) == len(PROMPT) - 1  # and the same adapter reuses (positive control)
