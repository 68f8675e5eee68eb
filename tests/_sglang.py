"""One guard for the SGLang test modules: skip the module, saying why, when SGLang cannot be imported."""

from __future__ import annotations

import importlib.util

import pytest


def require_sglang() -> None:
    """Skip the calling module unless the `sglang` extra imports (through kvcert's CPU shims)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(
            "sglang not installed: run scripts/install_sglang.sh (requirements/sglang.txt)", allow_module_level=True
        )
    from kvcert.conformance.adapters._sglang_env import import_sglang

    try:
        import_sglang()
    except ImportError as exc:  # installed, but a pinned hard import is missing
        pytest.skip(f"sglang cannot be imported: {exc}", allow_module_level=True)
