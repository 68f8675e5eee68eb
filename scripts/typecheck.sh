#!/usr/bin/env bash
# mypy over kvcert.spec and kvcert.refimpl, resolved as the package users import.
# The package maps top-level folders to kvcert.* (setuptools package-dir), which mypy cannot
# follow; a throwaway tree of symlinks gives it the real module names, so imports between
# modules are checked instead of silently becoming Any.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MYPY="${MYPY:-$ROOT/.venv/bin/mypy}"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/kvcert"
ln -s "$ROOT/spec" "$tree/kvcert/spec"
ln -s "$ROOT/refimpl" "$tree/kvcert/refimpl"
cd "$tree"
"$MYPY" --config-file "$ROOT/pyproject.toml" -p kvcert.spec -p kvcert.refimpl
