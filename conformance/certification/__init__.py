"""Certification: cells, runs and certificates, and what reads or writes them.

| module | owns |
|---|---|
| `certify` | cells, runs, certificates, scope (`NOT CHECKED`) |
| `known` | the findings log as data, replayed before every certification |
| `cluster` | cells run in worker processes (`--jobs`) or on a Ray cluster (`--ray`) |
| `reports` | JUnit and Markdown certificates |
| `explain`, `diff` | an invariant's rule from SPEC.md; backend vs model snapshots side by side (`replay --diff-at`) |
| `pytest_plugin` | certification cells as pytest tests |
"""
