"""The environment of the seed's KVCR direct linker (SGLang PR #39946; `kvcr.linker`): SGLang 0.5.23 with the PR's
files over it, in `.venv-kvcr/site` (scripts/install_kvcr.sh), placed first on `sys.path` before SGLang imports, and
SGLang's CPU shims (`kit.cpu`). Nothing here installs anything."""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

from kvcert.conformance.adapters.kit import cpu

__all__ = ["INSTALL_HINT", "LINKER", "SITE", "import_linker", "overlaid"]

ROOT = Path(__file__).resolve().parents[3]
SITE = Path(os.environ.get("KVCERT_KVCR_SITE", str(ROOT / ".venv-kvcr" / "site")))
"""SGLang 0.5.23 + the PR's overlay (`pip install --no-deps --target`, then `overlay/sglang` copied over it)."""
LINKER = "sglang.srt.mem_cache.storage.kvcr.kvcr_direct_linker"
INSTALL_HINT = "build it with scripts/install_kvcr.sh, then run .venv-kvcr/bin/kvcert"


def _under_site(module: types.ModuleType) -> bool:
    where = getattr(module, "__file__", None) or ""
    return bool(where) and Path(where).resolve().is_relative_to(SITE.resolve())


def overlaid() -> bool:
    """Whether the imported sglang is the overlaid copy in SITE."""
    mod = sys.modules.get("sglang")
    return mod is not None and _under_site(mod)


def import_linker() -> types.ModuleType:
    """The PR's `kvcr_direct_linker` module, imported from SITE (ImportError with a hint when it cannot be)."""
    if not (SITE / "sglang" / "srt" / "mem_cache" / "storage" / "kvcr" / "kvcr_direct_linker.py").is_file():
        raise ImportError(f"the KVCR linker's environment is missing ({SITE}); {INSTALL_HINT}")
    if "sglang" in sys.modules and not overlaid():
        raise ImportError(f"sglang was imported from {sys.modules['sglang'].__file__} before the KVCR linker's "
                          f"overlaid copy in {SITE}; {INSTALL_HINT}")  # fmt: skip
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
    cpu.install_shims()
    with cpu.quiet_imports():
        return importlib.import_module(LINKER)
