"""vLLM 0.32's `BlockPool` at its API: an API-level target judged by the page-level core (SPEC.md §13) and compared,
call by call, with the `vllm-0.32` profile's model of a block pool (`kvcert.spec.block_table`).

    .venv-vllm/bin/kvcert certify kvcert.conformance.adapters.vllm.block_pool:factory

The walk composes the pool's calls as vLLM's `KVCacheManager` and its `FullAttentionManager` make them: a request is
admitted with a prefix lookup (`get_cached_block` over its block hashes, at most `len − 1` tokens), `touch` of the
blocks hit, `get_new_blocks` for the rest and `cache_full_blocks` for its full blocks; it grows by output tokens
(`Request.append_output_token_ids`, new blocks, `cache_full_blocks`); it ends with `free_blocks` of its blocks in
reverse. A KV connector's `evict_blocks` and `reset_prefix_cache` arrive between them. Requests are real `Request`s
with the engine's sha256 block hasher; a namespace is a LoRA adapter. The harness writes each computed token's KV
into the blocks it was given (`block_id × block_size + offset`) and reads every cached page and every request's
blocks back after every call.

Rules: the page-level core (INV-PAGE-1/2, INV-LOCK-1, INV-ACCT-1/2/3, INV-SLOT-1/2/4, INV-KV-1, INV-REQ-2); a lookup
returns the longest run of the request's own hashes that is cached (INV-MATCH-1) and the blocks holding them
(INV-MATCH-2); the KV event stream, applied to the cached hashes before a call, gives those after it (INV-EVENT-1);
and under the profile, the blocks handed out, the free queue's order, the hash table and every reference count are
the model's (INV-POOL-1).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from kvcert.conformance.adapters.vllm import env as _env
from kvcert.conformance.backend import WalkCell, WalkFailure, unexercised
from kvcert.spec import storage as l3
from kvcert.spec.invariants import Violation
from kvcert.spec.page_table import PageTable, check_pages, holders_exact
from kvcert.spec.requests import RequestView
from kvcert.spec.types import Capabilities

__all__ = ["BlockPoolTarget", "BlockPoolWalk", "factory"]

BLOCKS = 17
"""Blocks in a cell's pool: the null block and 16 more, so that three requests fill it and evict."""
REQUESTS = 3
NAMESPACES = (None, "lora-a")


class _KV:
    """The model's KV (SPEC.md §9.12's content function, one layer): what each token's slot must hold."""

    def __init__(self) -> None:
        self._memo: dict[tuple[Optional[str], tuple[int, ...]], tuple[bytes, ...]] = {}

    def entries(self, namespace: Optional[str], tokens: tuple[int, ...]) -> tuple[bytes, ...]:
        key = (namespace, tokens)
        if key not in self._memo:
            self._memo[key] = l3.token_entries(namespace, tokens, 1)
        return self._memo[key]

    def content(self, namespace: Optional[str], tokens: tuple[int, ...]) -> Optional[tuple[bytes, ...]]:
        return self.entries(namespace, tokens) if tokens else None


@dataclass
class _Live:
    request: Any
    namespace: Optional[str]
    blocks: list[Any] = field(default_factory=list)
    cached: int = 0
    """Blocks of it already cached (`num_cached_block`)."""


class BlockPoolTarget:
    """One fresh `BlockPool` and the requests the walk holds in it."""

    def __init__(self, cell: WalkCell) -> None:
        from vllm.v1.core.block_pool import BlockPool

        self.ps = cell.page_size
        self.pool = BlockPool(BLOCKS, enable_caching=True, hash_block_size=self.ps, enable_kv_cache_events=True)
        self.hasher = _env.block_hasher(self.ps)
        self.observer = _env.PoolObserver(self.pool, ())
        """Compares every call the walk makes on the pool with the profile's pool (INV-POOL-1), as on the request
        path."""
        self.kv: list[bytes] = [b""] * (BLOCKS * self.ps)
        self.contents: dict[bytes, tuple[Optional[str], tuple[int, ...]]] = {}
        self.live: dict[int, _Live] = {}
        self.loras: dict[str, Any] = {}
        self.n = 0

    def _request(self, namespace: Optional[str], tokens: Sequence[int]) -> Any:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.n += 1
        lora = None
        if namespace is not None:
            lora = self.loras.setdefault(namespace, LoRARequest(namespace, len(self.loras) + 1, f"/adapters/{namespace}"))
        return Request(f"r{self.n}", list(tokens), SamplingParams(max_tokens=64), None, lora_request=lora,
                       block_hasher=self.hasher)  # fmt: skip

    def learn(self, live: _Live) -> None:
        tokens = tuple(live.request.all_token_ids)
        for i, h in enumerate(live.request.block_hashes):
            self.contents.setdefault(bytes(h), (live.namespace, tokens[: (i + 1) * self.ps]))

    def write(self, live: _Live, start: int, kv: _KV) -> None:
        """The model runner: KV for the request's tokens from `start` on, into its blocks."""
        tokens = tuple(live.request.all_token_ids)
        entries = kv.entries(live.namespace, tokens)
        for pos in range(start, len(tokens)):
            self.kv[live.blocks[pos // self.ps].block_id * self.ps + pos % self.ps] = entries[pos]

    def table(self) -> PageTable:
        return _env.pool_pages(self.pool, self.ps, (BLOCKS - 1) * self.ps, self.contents,
                               [lv.blocks for lv in self.live.values()])  # fmt: skip


class BlockPoolWalk:
    """The walk: blind ops over three request slots; an op its state makes inapplicable is skipped."""

    def cells(self, capabilities: Capabilities) -> list[WalkCell]:
        return [WalkCell("lru", ps, tier="device (BlockPool)") for ps in capabilities.page_sizes]

    def generate(self, rng: random.Random, cell: WalkCell, steps: int) -> list[dict[str, Any]]:
        ps, out = cell.page_size, []
        for _ in range(steps):
            r, kind = rng.randrange(REQUESTS), rng.random()
            if kind < 0.4:
                base = rng.choice([[0] * 8 * ps, [1, 0] * 4 * ps, [2] * 8 * ps, [0, 1, 2] * 3 * ps])
                length = rng.randint(1, 5 * ps + ps - 1)
                tokens = [t if rng.random() > 0.05 else rng.randrange(3) for t in base[:length]]
                out.append({"op": "admit", "r": r, "ns": rng.choice(NAMESPACES), "tokens": tokens})
            elif kind < 0.6:
                out.append({"op": "extend", "r": r, "tokens": [rng.randrange(3) for _ in range(rng.randint(1, 2 * ps))]})
            elif kind < 0.9:
                out.append({"op": "free", "r": r})
            elif kind < 0.97:
                out.append({"op": "uncache", "block": rng.randrange(1, BLOCKS)})
            else:
                out.append({"op": "reset"})
        return out

    def replay(
        self, factory: Callable[[WalkCell], Any], cell: WalkCell, ops: Sequence[dict[str, Any]]
    ) -> tuple[Optional[WalkFailure], Counter[str]]:
        seen: Counter[str] = Counter()
        t: BlockPoolTarget = factory(cell)
        kv = _KV()
        for step, op in enumerate(ops):
            before = _env.cached_hashes(t.pool)
            try:
                found = self._apply(t, op, kv, seen)
            except Exception as err:  # out of vLLM's code: the engine core dies
                crash = [Violation("INV-ERR-3", f"vLLM raised {type(err).__name__}: {err}")]
                return WalkFailure(step, op, crash), seen + t.observer.counts
            if found is None:
                seen["skipped"] += 1
                continue
            seen[f"op:{op['op']}"] += 1
            found += self._events(t, before)
            found += self._state(t, kv)
            if found:
                return WalkFailure(step, op, found), seen + t.observer.counts
        return None, seen + t.observer.counts

    # ------------------------------------------------------------------ the calls, as vLLM's managers make them

    def _apply(self, t: BlockPoolTarget, op: dict[str, Any], kv: _KV, seen: Counter[str]) -> Optional[list[Violation]]:
        """One op, as the managers call the pool (each call also goes to the profile's pool through `t.observer`);
        None when its state makes the op inapplicable."""
        pool, ps = t.pool, t.ps
        kind = op["op"]
        if kind == "admit":
            if op["r"] in t.live or not op["tokens"]:
                return None
            live = _Live(t._request(op["ns"], op["tokens"]), op["ns"])
            hit: list[Any] = []
            for h in live.request.block_hashes[: (len(op["tokens"]) - 1) // ps]:  # a hit leaves the last token
                got = pool.get_cached_block(h, [0])
                if got is None:
                    break
                hit.append(got[0])
            need = -(-len(op["tokens"]) // ps) - len(hit)
            if need + sum(b.ref_cnt == 0 for b in hit) > pool.get_num_free_blocks():
                return None  # KVCacheManager.allocate_slots refuses it: the scheduler would not admit it
            out = self._lookup(t, live, hit)
            pool.touch(hit)
            new = pool.get_new_blocks(need)
            seen["hit"] += bool(hit)
            live.blocks, live.cached = hit + new, len(hit)  # the hit blocks are cached already (num_cached_block)
            t.write(live, len(hit) * ps, kv)
            self._cache(t, live)
            t.live[op["r"]] = live
            t.learn(live)
            return out
        if kind == "extend":
            grown = t.live.get(op["r"])
            if grown is None:
                return None
            live = grown
            start = len(live.request.all_token_ids)
            need = -(-(start + len(op["tokens"])) // ps) - len(live.blocks)
            if need > pool.get_num_free_blocks():
                return None
            live.request.append_output_token_ids(list(op["tokens"]))
            live.blocks += pool.get_new_blocks(need)
            t.write(live, start, kv)
            self._cache(t, live)
            t.learn(live)
            return []
        if kind == "free":
            if op["r"] not in t.live:
                return None
            pool.free_blocks(reversed(t.live.pop(op["r"]).blocks))  # FullAttentionManager.free: the tail first
            return []
        if kind == "uncache":
            pool.evict_blocks({op["block"]})
            return []
        if kind == "reset":
            seen[f"reset:{pool.reset_prefix_cache()}"] += 1
            return []
        raise ValueError(f"unknown op {kind!r}")

    def _cache(self, t: BlockPoolTarget, live: _Live) -> None:
        full = len(live.request.all_token_ids) // t.ps
        t.pool.cache_full_blocks(live.request, live.blocks, live.cached, full, t.ps, 0)
        live.cached = max(live.cached, full)

    def _lookup(self, t: BlockPoolTarget, live: _Live, hit: list[Any]) -> list[Violation]:
        """INV-MATCH-1/2: the hit is the longest run of the request's own hashes the pool holds, and its blocks hold
        them. (That each is the first block cached under its hash, the profile's choice, the observer checks.)"""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        keys = [bytes(make_block_hash_with_group_id(h, 0)) for h in live.request.block_hashes]
        cached = 0
        for key in keys[: (len(live.request.all_token_ids) - 1) // t.ps]:
            if t.observer.model.lookup(key) is None:
                break
            cached += 1
        out = []
        if len(hit) != cached:
            out.append(Violation("INV-MATCH-1", f"a lookup hit {len(hit)} blocks; {cached} of the request's hashes are cached"))  # fmt: skip
        wrong = [b.block_id for b, key in zip(hit, keys) if t.observer.model.hash[b.block_id] != key]
        if wrong:
            out.append(Violation("INV-MATCH-2", f"the lookup returned blocks {wrong}, which do not hold the hashes asked for"))  # fmt: skip
        return out

    # ------------------------------------------------------------------ after every call

    def _events(self, t: BlockPoolTarget, before: Counter[Any]) -> list[Violation]:
        """INV-EVENT-1: the events the call published, applied to the cached hashes before it, give those after it."""
        return _env.events_agree(before, t.pool.take_events(), _env.cached_hashes(t.pool))

    def _state(self, t: BlockPoolTarget, kv: _KV) -> list[Violation]:
        table = t.table()
        out = check_pages(table)
        views = [
            RequestView(live.request.request_id, None, live.namespace, tuple(live.request.all_token_ids),
                        live.request.num_prompt_tokens, "running", 0, computed=len(live.request.all_token_ids),
                        row=tuple(b.block_id * t.ps + i for b in live.blocks for i in range(t.ps)))
            for live in t.live.values()
        ]  # fmt: skip
        out += holders_exact(table, views)
        for page in table.pages:  # INV-KV-1
            want = kv.content(page.namespace, page.tokens)
            got = [t.kv[x] for x in page.slots]
            if want is not None and got != list(want[-t.ps :]):
                out.append(Violation("INV-KV-1", f"block {page.id} (tokens to {len(page.tokens)} under {page.namespace!r}) holds other KV"))  # fmt: skip
        for v in views:  # INV-REQ-2
            want = kv.content(v.namespace, v.tokens)
            if want is not None and [t.kv[x] for x in v.row[: len(v.tokens)]] != list(want):
                out.append(Violation("INV-REQ-2", f"request {v.id}'s blocks hold other KV than its own tokens'"))
        out += t.observer.take()  # the profile's pool: free queue, hash table, reference counts (INV-POOL-1)
        return out

    def gaps(self, capabilities: Capabilities, exercised: Counter[str]) -> list[str]:
        out = [
            "the scheduler around the pool: judged through vLLM's own request path (vllm_requests:factory)",
            "hybrid KV cache groups (sliding window, Mamba), partial-block hashes (hash_block_size < block_size) and "
            "block masks: one full-attention group only",
            "unpin_blocks and its reuse watchers (a connector's deferred frees): not sent",
        ]
        return out + unexercised(exercised, (("prefix hits", "hit"), ("evictions", "evicted"),
                                             ("evict_blocks of a cached block", "uncached"),
                                             ("a reset that succeeds", "reset:True")))  # fmt: skip


def factory(cell: WalkCell) -> BlockPoolTarget:
    return BlockPoolTarget(cell)


factory.walk = BlockPoolWalk()  # type: ignore[attr-defined]
factory.capabilities = Capabilities(  # type: ignore[attr-defined]
    name=f"vllm {_env.VLLM_VERSION} BlockPool (API level)",
    page_sizes=(1, 4),
    policies=("lru",),
    kv_reads=True,
    profile="vllm-0.32",
    kind="block-pool",
    notes=(
        f"vLLM {_env.VLLM_VERSION}'s BlockPool with prefix caching and KV events, {BLOCKS} blocks (block 0 null), "
        "called as KVCacheManager and FullAttentionManager call it; real Requests with sha256 block hashes; a "
        "namespace is a LoRA adapter",
        "compared call by call with the vllm-0.32 profile's block pool (kvcert.spec.block_table): blocks handed out, "
        "free-queue order, hash table, reference counts (INV-POOL-1)",
    ),
)
