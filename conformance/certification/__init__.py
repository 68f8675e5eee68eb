"""Certification: cells, runs and certificates, and what reads or writes them.

| module | owns |
|---|---|
| `certify` | cells and the run loop: every cell walked, shrunk, replayed; targets loaded by name |
| `replay` | a trace replayed on a fresh backend beside the oracle (`replay`, `Replay`), under the profile it was judged by |
| `walk` | certifying an API-level target whose operations are not the radix protocol's (a block pool, an offload tier) |
| `certificate` | the record: each cell's result, each finding's replay, the certificate and its JSON |
| `scope` | what a certificate did not check (`NOT CHECKED`) |
| `known` | the findings log as data, replayed before every certification |
| `fixes` | a finding's minimal fix applied to the engine in-process (`--with-fixes`) |
| `cluster` | cells run in worker processes (`--jobs`) or on a Ray cluster (`--ray`) |
| `reports` | JUnit and Markdown certificates |
| `explain`, `diff` | an invariant's rule from SPEC.md; backend vs model snapshots side by side (`replay --diff-at`) |
| `pytest_plugin` | certification cells as pytest tests |
"""
