#!/usr/bin/env bash
# package_tree.sh DIR: DIR/kvcert/<package> -> the repository's folders, as pyproject's package-dir maps them,
# so that tools which follow files (mypy, import-linter) see kvcert.* under its real module names.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1/kvcert"
for package in spec refimpl gpu conformance sim integrations; do
    ln -s "$ROOT/$package" "$1/kvcert/$package"
done
