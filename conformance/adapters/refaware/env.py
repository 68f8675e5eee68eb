"""Import shims for the priority-aware ("ref-aware") SGLang fork (base 0.5.10) on a CPU-only machine.

The fork lives in its own environment (`.venv-refaware`, built by `scripts/install_refaware.sh`):
sglang 0.5.10 from PyPI with the fork's changed files copied over it. SGLang 0.5.10 and 0.5.23
cannot share an environment, so nothing here imports the 0.5.23 adapter's modules except the
version-agnostic `InterpolationMode` enum.

What 0.5.10 needs that a CPU machine lacks, and what stands in for it:

* `triton`: no CPU wheel; imported at module level by `mem_cache/{allocator,common,memory_pool,
  utils}.py` only to define kernels that the CPU path never launches. 0.5.10 has no
  `sglang/_platform_stubs.py` (0.5.23's triton stub), so this module carries its own: every
  `triton.*` import yields a mock package whose calls are pass-through decorators, whose
  CamelCase attributes are subclassable classes, plus the few real values read at import time
  (`cdiv`, `next_power_of_2`, `Config`, `language.constexpr`, `__version__`).
* `sgl_kernel` (the CUDA kernel package): `srt/utils/common.py` and the layer modules import it,
  and `memory_pool_host.py` binds thirteen `sgl_kernel.kvcacheio` transfer ops unconditionally
  (0.5.23 binds them only on CUDA/HIP/XPU). The stub answers every name; the kvcacheio op used
  by the host tier's `direct` io backend with the `layer_first` layout (`transfer_kv_direct`)
  is a real torch index copy, every other kvcacheio op raises NotImplementedError when called.
* `torchvision`: the PyPI wheel is a CUDA build ("operator torchvision::nms does not exist");
  transformers calls `find_spec("torchvision")` and reads `InterpolationMode.NEAREST_EXACT`, so
  the stub carries the real enum.

Everything is idempotent and stubs only names that are not importable for real.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from kvcert.conformance.adapters.kit.cpu import InterpolationMode, quiet_imports  # plain Python, no sglang inside

REFAWARE_SGLANG_VERSION = "0.5.10"
INSTALL_HINT = (
    "build the fork's environment with `scripts/install_refaware.sh` and run with `.venv-refaware/bin/python` "
    "(see requirements/refaware.txt)"
)


# --------------------------------------------------------------------------- mock packages


class _StubClass:
    """What a CamelCase attribute of a mock package is: a class code may subclass or instantiate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


class MockPackage(types.ModuleType):
    """A package whose unknown attributes are child packages (lower case) or stub classes (CamelCase).

    Calling it is a pass-through decorator, so `@triton.jit`, `@triton.jit(...)` and
    `@triton.autotune(configs=[...])` leave the decorated function as it was.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__package__ = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value: Any
        if name[:1].isupper():
            value = type(name, (_StubClass,), {"__module__": self.__name__})
        else:
            value = _new_mock(full)
        setattr(self, name, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    def __repr__(self) -> str:
        return f"<kvcert stub {self.__name__!r}>"


def _new_mock(name: str) -> MockPackage:
    mod = sys.modules.get(name)
    if isinstance(mod, MockPackage):
        return mod
    mod = MockPackage(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, _StubFinder.instance(), is_package=True)
    mod.__loader__ = _StubFinder.instance()
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `import P` and `import P.x.y` with mock packages, for each stubbed top-level name P."""

    _instance: _StubFinder | None = None

    def __init__(self) -> None:
        self.prefixes: set[str] = set()

    @classmethod
    def instance(cls) -> _StubFinder:
        if cls._instance is None:
            instance = cls()
            sys.meta_path.insert(0, instance)
            cls._instance = instance
        return cls._instance

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.partition(".")[0] not in self.prefixes:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        return _new_mock(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _stub_package(prefix: str, members: dict[str, dict[str, Any]]) -> None:
    """Make `prefix` and its subpackages mocks; `members` maps dotted names to real attribute values."""
    _StubFinder.instance().prefixes.add(prefix)
    for name in sorted(members, key=lambda n: n.count(".")):  # parents first
        mod = _new_mock(name)
        for key, value in members[name].items():
            setattr(mod, key, value)


def _importable(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- triton


class _TritonConfig:
    """triton.Config as `@triton.autotune(configs=[...])` builds it at import time."""

    def __init__(self, kwargs: Any = None, num_warps: int = 4, num_stages: int = 2, **extra: Any) -> None:
        self.kwargs, self.num_warps, self.num_stages, self.extra = kwargs or {}, num_warps, num_stages, extra


class _Constexpr:
    """triton.language.constexpr: used as an annotation and, in a few places, constructed."""

    def __init__(self, value: Any = None) -> None:
        self.value = value


def stub_triton() -> None:
    if _importable("triton") and not isinstance(sys.modules.get("triton"), MockPackage):
        return
    _stub_package(
        "triton",
        {
            "triton": {
                "__version__": "3.0.0",
                "cdiv": lambda a, b: -(a // -b),
                "next_power_of_2": lambda n: 1 << (n - 1).bit_length() if n > 0 else 1,
                "Config": _TritonConfig,
            },
            "triton.language": {"constexpr": _Constexpr},
            "triton.runtime.cache": {"triton_key": lambda: "kvcert-triton-stub"},
            "triton.runtime.autotuner": {"OutOfResources": type("OutOfResources", (Exception,), {})},
            "triton.compiler.compiler": {"triton_key": lambda: "kvcert-triton-stub"},
        },
    )


# --------------------------------------------------------------------------- sgl_kernel


def transfer_kv_direct(
    src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """sgl_kernel.kvcacheio.transfer_kv_direct on CPU: for each layer tensor [slots, ...], dst[dst_idx] = src[src_idx]."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def _unavailable(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.kvcacheio.{name} is a CUDA kernel with no CPU stand-in in kvcert's shims; "
            "use hicache_io_backend='direct' with hicache_mem_layout='layer_first'"
        )

    op.__name__ = name
    return op


_KVCACHEIO_OPS = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)


def _stub_sgl_kernel() -> None:
    if _importable("sgl_kernel") and not isinstance(sys.modules.get("sgl_kernel"), MockPackage):
        return
    kvcacheio: dict[str, Any] = {op: _unavailable(op) for op in _KVCACHEIO_OPS}
    kvcacheio["transfer_kv_direct"] = transfer_kv_direct
    _stub_package("sgl_kernel", {"sgl_kernel": {"__version__": "0.0.0+kvcert.stub"}, "sgl_kernel.kvcacheio": kvcacheio})


# --------------------------------------------------------------------------- torchvision


def stub_torchvision() -> None:
    if isinstance(sys.modules.get("torchvision"), MockPackage):
        return
    if "torchvision" in sys.modules:
        return
    if _importable("torchvision"):
        try:
            import torchvision  # noqa: F401  (a working CPU torchvision needs no stub)

            return
        except Exception:
            for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
                del sys.modules[name]
    members: dict[str, dict[str, Any]] = {"torchvision": {"__version__": "0.0.0+kvcert.stub"}}
    for name in ("torchvision.transforms", "torchvision.transforms.functional"):
        members[name] = {"InterpolationMode": InterpolationMode}
    _stub_package("torchvision", members)


# --------------------------------------------------------------------------- host tier


HOST_BUDGET_BYTES = 1 << 30
HOST_BUDGET_DEVIATION = (
    "host pools: 0.5.10's free-memory check (psutil's available RAM less a 10 GiB reserve) reads a fixed 1 GiB "
    "allowance above that reserve while a pool is built, not the machine's free RAM (a cell's pool is kilobytes)"
)


class _BudgetedPsutil:
    """`psutil` as 0.5.10's host pool check reads it while a pool is built: `available` is the 10 GiB it reserves plus
    `HOST_BUDGET_BYTES`, so a cell does not fail on a machine busy with something else. Everything else is psutil's."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def virtual_memory(self) -> Any:
        return self._real.virtual_memory()._replace(available=10 * (1 << 30) + HOST_BUDGET_BYTES)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def install_host_cpu_shims() -> None:
    """Make 0.5.10's host KV pools constructible on CPU: force `pin_memory=False`, and check memory against a fixed
    budget (`_BudgetedPsutil`, a declared deviation); idempotent.

    `HiRadixCache.__init__` builds `MHATokenToKVPoolHost(...)` without a pin_memory argument
    (default True), and `HostKVCache` then registers its buffer with
    `torch.cuda.cudart().cudaHostRegister` (`memory_pool_host.alloc_with_host_register`), which
    fails without CUDA. The subclass passes pin_memory to `HostKVCache.__init__` positionally,
    so the wrapper binds the call to the signature before overriding it. Call after
    `import_refaware()`.
    """
    import inspect

    from sglang.srt.mem_cache import memory_pool_host

    base = memory_pool_host.HostKVCache
    original = base.__init__
    if getattr(original, "_kvcert_unpinned", False):
        return
    signature = inspect.signature(original)

    def unpinned_init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = False
        real = memory_pool_host.psutil
        memory_pool_host.psutil = _BudgetedPsutil(real)
        try:
            original(*bound.args, **bound.kwargs)
        finally:
            memory_pool_host.psutil = real

    unpinned_init._kvcert_unpinned = True  # type: ignore[attr-defined]
    base.__init__ = unpinned_init  # type: ignore[method-assign]


# --------------------------------------------------------------------------- public


def install_shims() -> None:
    """Stub triton, sgl_kernel (with kvcacheio) and torchvision where missing or broken; idempotent."""
    stub_triton()
    _stub_sgl_kernel()
    stub_torchvision()


def _check_fork_installed() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"sglang=={REFAWARE_SGLANG_VERSION} (ref-aware fork) is not installed; {INSTALL_HINT}")
    root = next(iter(spec.submodule_search_locations))
    if not os.path.isfile(os.path.join(root, "srt", "mem_cache", "ref_aware_radix_cache.py")):  # no import yet
        raise ImportError(
            f"the sglang at {root} has no ref_aware_radix_cache (the fork's overlay is not installed); {INSTALL_HINT}"
        )


def import_refaware() -> types.SimpleNamespace:
    """Install the shims and import the fork's two caches.

    Returns a namespace with `RefAwareRadixCache`, `RefAwareHiRadixCache` and `version`
    (sglang's version string). Raises ImportError with an install hint when the fork
    (or one of its pinned hard imports) is missing.
    """
    _check_fork_installed()  # its errors carry the hint already
    try:
        install_shims()
        with quiet_imports():
            from sglang.srt.mem_cache.ref_aware_hiradix_cache import RefAwareHiRadixCache
            from sglang.srt.mem_cache.ref_aware_radix_cache import RefAwareRadixCache
            from sglang.version import __version__
    except ImportError as exc:
        raise ImportError(f"cannot import the ref-aware SGLang caches ({exc}); {INSTALL_HINT}") from exc
    if __version__ != REFAWARE_SGLANG_VERSION:
        warnings.warn(
            f"the ref-aware fork is based on sglang {REFAWARE_SGLANG_VERSION}, found {__version__}", stacklevel=2
        )
    return types.SimpleNamespace(
        version=__version__,
        RefAwareRadixCache=RefAwareRadixCache,
        RefAwareHiRadixCache=RefAwareHiRadixCache,
    )


# --------------------------------------------------------------------------- the fork's scheduler

_SCHEDULER_ONLY_IMPORTS = ("setproctitle", "einops")
"""Hard imports of `managers/scheduler.py` (and, through it, the model layers) that the fork's pinned set leaves
out: `setproctitle` names the scheduler's process (`run_scheduler_process` only), `einops` is imported by layer
modules whose code the request path never runs. Stubbed where missing (empty mock packages)."""


def import_refaware_scheduler() -> types.SimpleNamespace:
    """Install the shims (as `import_refaware`), stub `setproctitle` / `einops` where missing, and import the fork's
    scheduler (`scripts/install_refaware.sh` puts it in `.venv-refaware`: its reference scheduler files and the
    six other scheduler-side hunks of its diff).

    Returns a namespace with the `scheduler` module and `Scheduler`. Raises ImportError with an install hint when
    the installed scheduler is 0.5.10's own (no `/release_ref` handler): the environment predates the scheduler
    step of the install script.
    """
    import_refaware()
    for name in _SCHEDULER_ONLY_IMPORTS:
        if not _importable(name):
            _stub_package(name, {name: {}})
    try:
        with quiet_imports():
            from sglang.srt.managers import scheduler
    except ImportError as exc:
        raise ImportError(f"cannot import the ref-aware fork's scheduler ({exc}); {INSTALL_HINT}") from exc
    if not hasattr(scheduler.Scheduler, "handle_release_ref"):
        raise ImportError(
            f"the sglang scheduler at {scheduler.__file__} is 0.5.10's, not the ref-aware fork's; {INSTALL_HINT}"
        )
    return types.SimpleNamespace(scheduler=scheduler, Scheduler=scheduler.Scheduler)
