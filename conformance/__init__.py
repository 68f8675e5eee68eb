"""The conformance suite: it certifies a cache against the spec and the model.

Its modules and its rooms (subpackages, `name/`), each room with a package docstring that maps its modules:

| module | owns |
|---|---|
| `backend` | the Backend protocols an adapter implements, `Factory` |
| `harness/` | one step of a trace on a backend and every check of it; the request-path harness |
| `generation/` | the state machines, their draws and loop, the random-walk driver, shrinking, determinism |
| `certification/` | cells, certificates, replays, the findings log, Ray and `--jobs`, reports, `explain`, `diff`, the pytest plugin |
| `zoo/` | planted bugs in the model and in the reference engines, and the suite's measured power on them (`selftest`) |
| `bench/` | `kvcert bench meta` and `kvcert bench harness` |
| `served/` | `kvcert serve-certify`: an engine's real server processes on a model kvcert makes, judged end to end over HTTP |
| `engine` | kvcert's reference engine (SPEC.md §12): its own scheduler around a protocol cache, the request-path harness's positive control |
| `engine_linker` | the reference engine with a direct linker, keeping the linker tier's rules (§14) |
| `engine_decode` | the reference decode server (§15): the decode side of a PD deployment |
| `linker` | the harness's external store behind a direct linker (§14): a correct linker in a faulty world |
| `partition` | key partitioning (`kvcert partition`): requests that differ in a cache key never reuse each other's KV, and requests that agree do |
| `cli` | the command line |
| `adapters/` | real engines behind the suite's protocols: SGLang 0.5.23's caches, schedulers, L3 backends, linkers and decode server, and kvcert's own plugin in it (`sglang_*`); the RefAware fork's caches and scheduler (`refaware_*`); vLLM 0.32's block pool, offload tier and scheduler (`vllm_*`); the KVCR linker (`kvcr_linker`) |

The folder `findings/` holds the findings log (`index.json`) and each finding's traces and fixes, which
`certification/known` and `certification/fixes` read.
"""
