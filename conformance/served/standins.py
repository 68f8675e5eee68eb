"""The stand-ins a served SGLang target needs on a CPU (installed by the server's `sitecustomize`).

Each is named in `STANDINS` with what it changes; a served certificate prints the ones its target used under
NOT CHECKED. Nothing here runs in kvcert's own process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterable
from typing import Any

STANDINS: dict[str, str] = {
    "sglang": "the CUDA-only kernel package sgl_kernel is a stand-in whose every function raises if called "
    "(none is on the CPU path served here), and triton and torchvision are import stubs",
    "hicache-host": "HiCache's host pool is not pinned (its CUDA registration, cudaHostRegister, is a no-op "
    "stand-in) and its direct-io transfer ops, bound by SGLang only on CUDA/HIP/XPU, are torch index copies "
    "(kvcert's in-process HiCache shims): the CUDA copy kernels and streams a GPU runs are not exercised",
    "refaware": "SGLang 0.5.10's CUDA-only kernel package sgl_kernel is a stand-in whose every function raises if "
    "called, but for the host tier's direct copy (kvcacheio.transfer_kv_direct: a torch index copy), with kvcert's "
    "triton and torchvision import stubs for 0.5.10; its host pool is not pinned (pin_memory=False); the fork's "
    "scheduler files over the 0.5.10 wheel read ModelConfig.think_end_id, which that wheel lacks: None stands in",
}


class KernelMissing(RuntimeError):
    """A CUDA kernel was called in a served CPU run: the run reached code the stand-in cannot serve."""


class _Kernel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise KernelMissing(f"{self.name} called: sgl_kernel is a CPU stand-in without kernels (kvcert served run)")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Kernel(f"{self.name}.{attr}")


class _KernelModule(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__version__ = "0.0.0+kvcert.standin"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Kernel(f"{self.__name__}.{attr}")


class _KernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `sgl_kernel` and every submodule with a `_KernelModule` (with `real` functions where given)."""

    def __init__(self, real: dict[str, dict[str, Any]] | None = None) -> None:
        self.real = real or {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _KernelModule(spec.name)
        for name, fn in self.real.get(spec.name, {}).items():
            setattr(module, name, fn)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after `name` is imported (its real loader runs first)."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patch

        class _Then(importlib.abc.Loader):
            def create_module(self, s: Any) -> Any:
                return loader.create_module(s)

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                patch(module)

        spec.loader = _Then()
        return spec


def _no_host_register(module: types.ModuleType) -> None:
    module._cuda_host_register = lambda *args, **kwargs: None  # type: ignore[attr-defined]


def _host_copies(module: types.ModuleType) -> None:
    """The direct-io transfer ops SGLang binds only on CUDA/HIP/XPU (`pool_host/mha.py`), as torch index copies,
    and host pools unpinned: kvcert's in-process HiCache shims (`sglang_hicache.install_cpu_shims`)."""
    from kvcert.conformance.adapters.sglang.hicache import install_cpu_shims

    install_cpu_shims()


def _unpinned_host(module: types.ModuleType) -> None:
    from kvcert.conformance.adapters.refaware import env as _refaware_env

    _refaware_env.install_host_cpu_shims()


def _think_end_default(module: types.ModuleType) -> None:
    """The fork's scheduler reads `model_config.think_end_id`, which the 0.5.10 wheel's ModelConfig does not define
    (the fork's own base sets it only with --reasoning-parser): None, as a model without a reasoning parser has."""
    if not hasattr(module.ModelConfig, "think_end_id"):
        module.ModelConfig.think_end_id = None


def install(names: Iterable[str]) -> None:
    """Install the named stand-ins (unknown names are refused: a typo must not serve unshimmed)."""
    names = set(names)
    unknown = names - set(STANDINS)
    if unknown:
        raise ValueError(f"unknown served stand-ins {sorted(unknown)}; known: {sorted(STANDINS)}")
    if "sglang" in names:
        from kvcert.conformance.adapters.sglang.env import install_shims

        install_shims()
        if not any(isinstance(f, _KernelFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _KernelFinder())
    if "hicache-host" in names:
        sys.meta_path.insert(0, AfterImport("sglang.srt.mem_cache.pool_host.common", _no_host_register))
        sys.meta_path.insert(0, AfterImport("sglang.srt.mem_cache.pool_host.mha", _host_copies))
    if "refaware" in names:
        from kvcert.conformance.adapters.refaware import env as _refaware_env

        _refaware_env.stub_triton()
        _refaware_env.stub_torchvision()
        if not any(isinstance(f, _KernelFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _KernelFinder({"sgl_kernel.kvcacheio": {"transfer_kv_direct": _refaware_env.transfer_kv_direct}}))
        sys.meta_path.insert(0, AfterImport("sglang.srt.mem_cache.memory_pool_host", _unpinned_host))
        sys.meta_path.insert(0, AfterImport("sglang.srt.configs.model_config", _think_end_default))
