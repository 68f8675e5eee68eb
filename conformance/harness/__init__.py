"""The harness: one step of a trace on a backend, judged.

| module | owns |
|---|---|
| `driver` | `Harness`: one step = the op on the backend, the oracle steered beside it, every check; `run_trace` |
| `scheduler` | the caller's side of each op on one cache (the op table, `run_op`), `settle`, `insert_request` |
| `side` | `Side`, one of the two caches a step runs on; `StepNotes`, what its checks read; `KVModel`, the model's KV |
| `ledger` | what a trace's positions (handles, the k-th copy, ...) name on each side |
| `steering` | leading the oracle to the backend's legal choices (eviction witness, reclaim order) |
| `decide` | the steered choices as the oracle's `Decisions` for one attempt at a step, and the attempts |
| `checks` | the op's contract, the state invariants, the state against the oracle, KV bytes |
| `queries` | the narrow, per-step cached questions the generator may ask |
| `running` | running requests: the caller's row, its checkpoint, `TraceInvalid` |
| `windows` | the in-flight race windows a step entered |
| `storage` | L3 stores with fault injection, storage-side trace events |
| `requests` | `RequestHarness`: a request-path target sent what clients send and judged after every op (SPEC.md §12) |
| `partition` | key partitioning (`kvcert partition`): requests that differ in a cache key never reuse each other's KV, and requests that agree do |
"""
