"""The conformance suite: it certifies a cache against the spec and the model.

Its rooms, each with a package docstring that maps its modules:

| room | owns |
|---|---|
| `backend` | the Backend protocols an adapter implements, `Factory` |
| `harness/` | one step of a trace on a backend and every check of it; the request-path harness |
| `generation/` | the state machines, their draws and loop, the random-walk driver, shrinking, determinism |
| `certification/` | cells, certificates, the findings log, Ray and `--jobs`, reports, `explain`, `diff`, the pytest plugin |
| `zoo/` | planted bugs (`mutants`) and the suite's measured power on them (`selftest`) |
| `bench/` | `kvcert bench meta` |
| `served/` | `kvcert serve-certify`: an engine's real server processes on a model kvcert makes, judged end to end over HTTP |
| `engine` | kvcert's reference engine: the request-path harness's positive control, a target |
| `cli` | the command line |
| `adapters/` | SGLang's RadixCache and UnifiedRadixCache + HiCache (with L3), its session-ref mode and scheduler, the RefAware fork's caches and scheduler |
"""
