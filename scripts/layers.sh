#!/usr/bin/env bash
# The layering contract (pyproject.toml [tool.importlinter]), checked by import-linter over kvcert.* as users
# import it: the same tree of symlinks as scripts/typecheck.sh, since package-dir hides the real module names.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
"$ROOT/scripts/package_tree.sh" "$tree"
cd "$tree"
PYTHONPATH="$tree" "$ROOT/.venv/bin/lint-imports" --config "$ROOT/pyproject.toml" --no-cache
