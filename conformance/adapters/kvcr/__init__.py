"""The seed's KVCR direct linker (SGLang PR #39946) through its own API (docs/linkers.md). Runs in `.venv-kvcr`
(scripts/install_kvcr.sh).

| module | owns |
|---|---|
| `env` | SGLang 0.5.23 with the PR's files over it, placed first on `sys.path`, behind the kit's CPU shims |
| `_core` | a stand-in KVCR core handed to the linker through its own hook, and the stub modules it imports |
| `linker` | the walk target: the linker, its pools and the stand-in core, judged by SPEC.md §14's linker side |
"""
