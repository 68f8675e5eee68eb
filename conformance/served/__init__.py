"""Served targets: an engine certified as users deploy it — its real server processes on a model kvcert makes,
driven over HTTP and judged end to end (SPEC.md §16, docs/served.md).

| module | owns |
|---|---|
| `model` | the tiny random-weight Llama (and its tokenizer) kvcert makes from a seed |
| `standins` | what a served SGLang needs on a CPU (kernel package, HiCache's CUDA host registration), declared |
| `targets` | the served targets: environment, entry point, flags, twin, deviations |
| `server` | one server process in its own process group, started and stopped whole; or one attached to |
| `traffic` | seeded conversations: sessions, turns, think times, priorities, keys, aborts, cuts, malformed requests |
| `client` | the HTTP client in each engine's API (SGLang's /generate, the OpenAI completions API) |
| `events` | the KV-event stream received over ZMQ and replayed into what a router believes |
| `rules` | the end-to-end rules INV-E2E-1..6 over what was recorded |
| `harness` | the servers, event stream and clients of one target, and the judgment of a conversation |
| `run` | `serve-certify`: the walk, the shrink, the replay file, the certificate |
| `plants` | planted bugs in kvcert's SGLang backend, switched on inside a server (`KVCERT_SERVED_PLANT`), each failing the end-to-end rule it breaks |
| `bench` | `kvcert bench served`: SGLang's caches and kvcert's plugin on one traffic, with the simulator's prediction |

The folder `pythonpath/` holds the `sitecustomize` a served SGLang's processes import at start-up.
"""
