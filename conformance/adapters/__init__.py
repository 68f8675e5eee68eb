"""Real engines behind the suite's protocols, one room per engine, and the kit they share.

| module | owns |
|---|---|
| `kit/` | what any adapter needs besides its engine: node handles, tree walks, KV bytes in an engine's pools, an SGLang-family import on a CPU; public, for outside adapter authors too |
| `sglang/` | SGLang 0.5.23: its radix and HiCache trees, its scheduler's request path, sessions, key partitioning, linkers, decode server, L3 storage backends (`storage/`), and kvcert's own plugin as SGLang runs it |
| `refaware/` | the RefAware fork of SGLang (base 0.5.10): its radix and hierarchical caches and its scheduler |
| `vllm/` | vLLM 0.32: its block pool, prefix cache, CPU offload tier and v1 scheduler |
| `kvcr/` | the seed's KVCR direct linker (an SGLang PR) through its own API |

Each engine's room has its environment module (`env`: its pinned version, install hint and CPU shims). No room
imports another engine's room, nor anything underscored outside its own (an import-linter contract and
tests/test_structure.py hold it); all may import the kit. Old module names (`sglang_requests`, `refaware_hicache`,
…) keep working as targets through `kvcert.conformance.aliases`. The served targets' drivers (an engine's real
server processes, over HTTP) are `kvcert.conformance.served`.
"""
