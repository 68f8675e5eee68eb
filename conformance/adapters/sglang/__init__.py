"""SGLang 0.5.23 behind the suite's protocols: its own caches, scheduler, linkers and decode server, unpatched, on
a CPU (docs/sglang.md). Runs in `.venv` with SGLang installed (`KVCERT_SGLANG=1 scripts/bootstrap.sh`).

| module | owns |
|---|---|
| `env` | the pinned version, its install hint, SGLang's mem_cache classes imported behind the kit's CPU shims |
| `_events` | SGLang's KV events replayed into what a router believes |
| `radix` | the device-tier `RadixCache` at its API |
| `hicache` | a deterministic driver of HiCache (UnifiedRadixCache + host tier) and the ack ledgers it needs |
| `hicache_backend` | HiCache behind the host-tier and storage-tier protocols |
| `session` | the session-ref `UnifiedRadixCache` (`--enable-session-radix-cache`) against SPEC.md §11 |
| `requests` | the scheduler built and stepped on CPU: the request-path targets (SPEC.md §12) |
| `partition` | the scheduler as a key-partitioning probe (`kvcert partition`) |
| `plugin` | kvcert's own cache as SGLang runs it (`--radix-cache-backend kvcert`), judged through its scheduler |
| `decode` | the decode server of PD disaggregation, its prefill peer and its L3 tier |
| `linker` | the direct external linker path (SPEC.md §14) |
| `fs_linker` | `sglang-fs-linker`, an out-of-tree filesystem linker, behind SGLang's wrapper |
| `storage/` | SGLang's L3 storage: its threads stepped by the harness, and its `file` and S3 backends |
"""
