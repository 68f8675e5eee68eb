"""The conformance suite: it certifies a cache against the spec and the model.

Which module owns what:

| module | owns |
|---|---|
| `backend` | the Backend protocols an adapter implements, `Factory` |
| `driver` | `Harness`: one step = the op on the backend, the oracle steered beside it, every check; `run_trace` |
| `scheduler` | the caller's side of each op on one cache (`Side`, the op table), `settle`, `insert_request` |
| `ledger` | what a trace's positions (handles, the k-th copy, ...) name on each side |
| `steering` | leading the oracle to the backend's legal choices (eviction witness, reclaim order) |
| `checks` | the op's contract, the state invariants, the state against the oracle, KV bytes |
| `queries` | the narrow, per-step cached questions the generator may ask |
| `machine`, `draws`, `runner` | the state machine: the rules that choose ops, what they draw from, and the loop that runs them on Hypothesis's choices |
| `certify` | cells, runs, certificates, scope (`NOT CHECKED`) |
| `fuzz` | the machine on a seeded random walk instead of Hypothesis (`kvcert fuzz`) |
| `reports`, `explain`, `diff`, `pytest_plugin` | JUnit and Markdown certificates; an invariant's rule from SPEC.md; backend vs model snapshots side by side (`replay --diff-at`); certification cells as pytest tests |
| `shrink`, `determinism` | trace shrinking; same seed, same run |
| `hypothesis_compat` | every use of Hypothesis's internals, in one module |
| `storage` | L3 stores with fault injection, storage-side trace events |
| `zoo`, `selftest` | planted bugs and the suite's measured power on them |
| `bench`, `cli` | `kvcert bench meta`; the command line |
| `adapters/` | SGLang's RadixCache and UnifiedRadixCache + HiCache (with L3), its session-ref mode, the RefAware fork's caches |
"""
