"""One guard for the SGLang test modules: skip the module, saying why, when SGLang cannot be imported.

With `KVCERT_SGLANG=1` (what `scripts/test.sh` and CI set) SGLang is required: a module that cannot
import it fails instead of skipping, so an environment that lost SGLang cannot pass as green.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def required() -> bool:
    return os.environ.get("KVCERT_SGLANG", "0") == "1"


def require_sglang() -> None:
    """Skip the calling module unless the `sglang` extra imports (through kvcert's CPU shims); fail instead
    of skipping when KVCERT_SGLANG=1 says SGLang must be there."""

    def missing(why: str) -> None:
        if required():
            pytest.fail(f"KVCERT_SGLANG=1 but {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)

    if importlib.util.find_spec("sglang") is None:
        missing("sglang not installed: run scripts/install_sglang.sh (requirements/sglang.txt)")
        return
    from kvcert.conformance.adapters._sglang_env import import_sglang

    try:
        import_sglang()
    except ImportError as exc:  # installed, but a pinned hard import is missing
        missing(f"sglang cannot be imported: {exc}")
