#!/usr/bin/env bash
# mypy over every package of kvcert, resolved as the package users import.
# The package maps top-level folders to kvcert.* (setuptools package-dir), which mypy cannot
# follow; a throwaway tree of symlinks gives it the real module names, so imports between
# modules are checked instead of silently becoming Any. scripts/layers.sh reads the same tree.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MYPY="${MYPY:-$ROOT/.venv/bin/mypy}"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
"$ROOT/scripts/package_tree.sh" "$tree"
cd "$tree"
"$MYPY" --config-file "$ROOT/pyproject.toml" -p kvcert.spec -p kvcert.refimpl -p kvcert.gpu -p kvcert.conformance -p kvcert.sim -p kvcert.integrations
