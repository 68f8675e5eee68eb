"""Only for running these reproducers on a machine without a GPU (kvcert's CI).

SGLang imports `triton` (and the RefAware fork's 0.5.10 base also `sgl_kernel`) on the way to its scheduler modules,
and neither has a CPU wheel. Where triton is missing, this installs the stand-ins kvcert's CPU runs use (for 0.5.23,
SGLang's own `_platform_stubs` loaded from its file; for the fork's 0.5.10, which has no such file, kvcert's). On a
machine with triton it does nothing. The reproducers themselves import only the engine, pytest and unittest.
"""

import importlib.util
from pathlib import Path

if importlib.util.find_spec("triton") is None:
    spec = importlib.util.find_spec("sglang")
    ships_stubs = spec is not None and any(
        (Path(p) / "_platform_stubs.py").exists() for p in spec.submodule_search_locations or ()
    )
    try:
        if ships_stubs:
            from kvcert.conformance.adapters.sglang.env import install_shims
        else:
            from kvcert.conformance.adapters.refaware.env import install_shims
    except ImportError:  # kvcert not installed here: install triton instead
        pass
    else:
        install_shims()
