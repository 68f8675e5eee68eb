"""The priority-aware ("ref-aware") SGLang fork (base 0.5.10) behind the suite's protocols (docs/priority.md).
Runs in `.venv-refaware` (scripts/install_refaware.sh).

| module | owns |
|---|---|
| `env` | the fork's pin, its install hint, its CPU shims and host-memory budget, its classes imported |
| `radix` | the device-only `RefAwareRadixCache` at its API |
| `hicache` | `RefAwareHiRadixCache`: the host tier with SPEC.md §11's priorities |
| `requests` | the fork's scheduler built and stepped on CPU: a request-path target |
"""
