"""`kvcert bench policy`: a discrete-event serving simulator that drives real caches (docs/bench_policy.md).

The seed's multi-turn stress test, reproduced: SGLang's priority-blind HiCache, kvcert.gpu's
proactive manager (SPEC.md §11), the RefAware fork, and two bounds, under one engine model.

| module | owns |
|---|---|
| `cli` | `kvcert bench policy`: its options, tables, maps and plots |
| `policy` | one row's run (`run_one`), tables, sweeps, maps and repeated runs over workload seeds |
| `workload` | sessions of turns: the seed's stress test, the agentic workload, shared-prefix groups, JSONL traces |
| `engine` | the discrete-event engine: SGLang 0.5.23's schedulers (and the fork's admission) over a cache driver |
| `costs` | the engine's costs and limits (prefill, decode, loads, pools), and the named engines |
| `sizing` | pools and limits sized for a named model and GPU under SGLang's memory defaults |
| `caches` | the drivers that call a real cache as an engine does (`ProtocolDriver`, `SGLangDriver`) |
| `targets` | the contenders by name, and the caches they build through their kvcert targets |
| `bounds` | the infinite and the offline bound |
| `report` | a run's figures: each priority class's block, per turn, the summary |
| `remote` | a contender run in another environment (the RefAware fork's), in a subprocess |
| `elsewhere` | the other side of `remote`: one contender's run there, its summary as JSON |
"""
