"""The conformance suite: it certifies a cache against the spec and the model.

Its modules and its rooms (subpackages, `name/`), each room with a package docstring that maps its modules:

| module | owns |
|---|---|
| `backend` | the Backend protocols an adapter implements, `Factory`, and a key-partitioning `Probe` |
| `aliases` | old target names (adapter modules before their rooms by engine, the reference engines before `reference/`) and what they name now |
| `harness/` | one step of a trace on a backend and every check of it; the request-path harness |
| `generation/` | the state machines, their draws and loop, the random-walk driver, shrinking, determinism |
| `certification/` | cells, certificates, replays, the findings log, Ray and `--jobs`, reports, `explain`, `diff`, the pytest plugin |
| `zoo/` | planted bugs in the model and in the reference engines, and the suite's measured power on them (`selftest`) |
| `bench/` | `kvcert bench meta` and `kvcert bench harness` |
| `reference/` | kvcert's reference engines (request path, linker, decode) and the linker store: the request-path harness's positive controls |
| `served/` | `kvcert serve-certify`: an engine's real server processes on a model kvcert makes, judged end to end over HTTP |
| `cli` | the command line |
| `adapters/` | real engines behind the suite's protocols, a room per engine (`sglang/`, `refaware/`, `vllm/`, `kvcr/`) and the public adapter kit (`kit/`) |

The folder `findings/` holds the findings log (`index.json`) and each finding's traces and fixes, which
`certification/known` and `certification/fixes` read.
"""
