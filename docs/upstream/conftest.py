"""Only for running these reproducers on a machine without a GPU (kvcert's CI).

SGLang imports `triton` on the way to its scheduler modules, and triton has no CPU wheel. Where triton is missing,
this installs the stand-in kvcert's CPU runs use (SGLang's own `_platform_stubs`, loaded from its file); on a machine
with triton it does nothing. The reproducers themselves import only the engine, pytest and unittest.
"""

import importlib.util

if importlib.util.find_spec("triton") is None:
    try:
        from kvcert.conformance.adapters._sglang_env import install_shims
    except ImportError:  # the RefAware fork's environment ships kvcert too; elsewhere install triton
        pass
    else:
        install_shims()
