"""vLLM 0.32 behind the suite's protocols (docs/vllm.md). Runs in `.venv-vllm` (scripts/install_vllm.sh).

| module | owns |
|---|---|
| `env` | the pin, `VLLM_TARGET_DEVICE`, the stand-ins for what vLLM builds on a GPU, its KV-event recorder |
| `block_pool` | the `BlockPool` at its API, judged by the page-level core (SPEC.md §13) |
| `kv` | the prefix cache (`KVCacheManager`) and the v1 `Scheduler` as key-partitioning probes |
| `offload` | the CPU offloading manager: a host tier judged by the offload contract |
| `requests` | the v1 scheduler driven request by request, with and without its KV connector |
"""
