"""An SGLang-family engine's imports on a CPU-only machine, and the determinism its node sets need: what any
adapter of SGLang, a fork of it, or a PR against it needs before the engine's first import.

SGLang imports `triton` and (through `transformers` and its multimodal configs) `torchvision` on the path to
`mem_cache`. Neither works on a CPU machine: triton has no CPU wheel and the PyPI torchvision is a CUDA build
("operator torchvision::nms does not exist"). SGLang ships its own triton stub for platforms without one
(`sglang/_platform_stubs.py`), but installs it only on Apple Silicon, so `install_shims` loads that file directly
(without running `sglang/__init__`) and builds the same stub. torchvision gets a stub too, with a real
`InterpolationMode` enum, because transformers reads `InterpolationMode.NEAREST_EXACT` at import time once
`find_spec` sees it. A wheel without `_platform_stubs.py` (SGLang 0.5.10) builds its own stubs (see the RefAware
room's `env`) and takes only `InterpolationMode`, `quiet_imports` and `OrderedSet` from here.

Everything here is idempotent and only touches `sys.modules` / `sys.meta_path` for names that are not importable
for real (../shared/SGLANG_ON_CPU.md).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["InterpolationMode", "OrderedSet", "install_finder", "install_shims", "platform_stubs", "quiet_imports"]

_STUBS_NAME = "_kvcert_sglang_platform_stubs"


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode, member for member (transformers maps PIL modes onto it)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed: the CPU shims load its own _platform_stubs.py")
    return Path(next(iter(spec.submodule_search_locations)))


def platform_stubs() -> types.ModuleType:
    """sglang/_platform_stubs.py loaded from file, so `sglang/__init__` does not run before the stubs exist."""
    mod = sys.modules.get(_STUBS_NAME)
    if mod is not None:
        return mod
    path = _sglang_dir() / "_platform_stubs.py"
    spec = importlib.util.spec_from_file_location(_STUBS_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_STUBS_NAME] = mod  # dataclasses look the module up while it executes
    spec.loader.exec_module(mod)
    return mod


class _PrefixFinder(importlib.abc.Loader):
    """Meta-path finder and loader that answer every `PREFIX.*` import with a stub module."""

    def __init__(self, prefix: str, make: Any) -> None:
        self.prefix, self.make = prefix, make

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.prefix and not fullname.startswith(self.prefix + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = sys.modules.get(spec.name) or self.make(spec.name)
        mod.__spec__, mod.__loader__ = spec, self
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def install_finder(prefix: str, make: Any) -> None:
    if not any(isinstance(f, _PrefixFinder) and f.prefix == prefix for f in sys.meta_path):
        sys.meta_path.insert(0, _PrefixFinder(prefix, make))


def _stub_triton(stubs: types.ModuleType) -> None:
    """The triton stub `installplatform_stubs()` builds on macOS, minus its torch.mps patches."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    make = stubs._make_mock
    install_finder("triton", make)
    triton = make("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv, triton.next_power_of_2, triton.Config = stubs._cdiv, stubs._next_power_of_2, stubs._Config

    class constexpr:
        def __init__(self, value: Any = None) -> None:
            self.value = value

    class JITFunction:
        pass

    def classes(*names: str, base: type = stubs._StubBase) -> dict[str, type]:
        return {n: type(n, (base,), {}) for n in names}

    attrs: dict[str, dict[str, Any]] = {
        "triton.language": {"constexpr": constexpr},
        "triton.language.extra": {},
        "triton.language.extra.libdevice": {},
        "triton.runtime": {},
        "triton.runtime.jit": {"JITFunction": JITFunction, **classes("KernelInterface")},
        "triton.runtime.cache": {"triton_key": stubs._triton_key},
        "triton.runtime.autotuner": classes("OutOfResources", "PTXASError", base=Exception),
        "triton.runtime.driver": {},
        "triton.compiler": classes("CompiledKernel"),
        "triton.compiler.compiler": {"triton_key": stubs._triton_key, **classes("ASTSource")},
        "triton.testing": {},
        "triton.tools": {},
        "triton.tools.tensor_descriptor": {},
        "triton.backends": {},
        "triton.backends.compiler": classes("GPUTarget"),
    }
    for name, members in attrs.items():  # parents come first in the table
        mod = make(name)
        for key, value in members.items():
            setattr(mod, key, value)
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, mod)


def _stub_torchvision(stubs: types.ModuleType) -> None:
    """A torchvision that imports: mock modules plus the real InterpolationMode enum."""
    if "torchvision" in sys.modules:
        return
    try:
        import torchvision  # noqa: F401  (a working CPU torchvision needs no stub)

        return
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    install_finder("torchvision", stubs._make_mock)
    tv = stubs._make_mock("torchvision")
    tv.__version__ = "0.0.0+kvcert.stub"
    for name in ("torchvision.transforms", "torchvision.transforms.functional"):
        mod = stubs._make_mock(name)
        mod.InterpolationMode = InterpolationMode
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, mod)


def install_shims() -> None:
    """Stub triton and torchvision where they are missing or broken; safe to call repeatedly."""
    stubs = platform_stubs()
    _stub_triton(stubs)
    _stub_torchvision(stubs)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Silence import-time noise that says nothing about the CPU caches: requests misses chardet /
    charset_normalizer, and SGLang's AWQ/GGUF modules announce they need a GPU."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*character detection dependency.*")
        warnings.filterwarnings("ignore", message="Only CUDA.*", category=UserWarning)
        yield


class OrderedSet(dict):  # type: ignore[type-arg]
    """An insertion-ordered set, for SGLang's sets of tree nodes.

    SGLang keeps candidate leaves in `set`s of node objects, which hash by address, and
    heapifies them in set order: candidates of equal rank then leave in an order that
    changes from process to process. Insertion order is one of the orders a set could
    produce, and the same in every run.

    A dict of keys, so that `in`, `add`, `remove`, `len` and `clear` are dict's own C methods:
    these sit in SGLang's hot path, and `bench meta` times SGLang with this set in place
    (scripts/bench_shims.py measures what it costs). Iteration is a dict's: mutating the set
    while iterating raises RuntimeError, as it does on a set, so this set hides no such bug.
    Set algebra and comparison (`-`, `&`, `|`, `==`, used by SGLang's `sanity_check`) are a set's.
    Adapters that put it in place declare it as a deviation (a certificate prints it).
    """

    __slots__ = ()

    def __init__(self, items: Iterable[Any] = ()) -> None:
        super().__init__(dict.fromkeys(items))

    add = dict.setdefault  # item -> None when absent; returns None, as set.add
    remove = dict.pop  # KeyError when absent, as set.remove

    def discard(self, item: Any) -> None:
        self.pop(item, None)

    def copy(self) -> OrderedSet:  # type: ignore[override]
        return OrderedSet(dict.keys(self))

    def _set(self) -> set[Any]:
        return set(dict.keys(self))

    @staticmethod
    def _other(other: object) -> object:
        return other._set() if isinstance(other, OrderedSet) else other

    def __eq__(self, other: object) -> bool:
        return self._set() == self._other(other)

    def __ne__(self, other: object) -> bool:
        return self._set() != self._other(other)

    __hash__ = None  # type: ignore[assignment]

    def __sub__(self, other: Any) -> set[Any]:
        return self._set() - self._other(other)  # type: ignore[operator]

    def __rsub__(self, other: Any) -> set[Any]:
        return self._other(other) - self._set()  # type: ignore[operator]

    def __and__(self, other: Any) -> set[Any]:
        return self._set() & self._other(other)  # type: ignore[operator]

    __rand__ = __and__

    def __or__(self, other: Any) -> set[Any]:  # type: ignore[override]
        return self._set() | self._other(other)  # type: ignore[operator]

    __ror__ = __or__  # type: ignore[assignment]

    def __le__(self, other: Any) -> bool:
        return self._set() <= self._other(other)  # type: ignore[operator]

    def __ge__(self, other: Any) -> bool:
        return self._set() >= self._other(other)  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"OrderedSet({list(dict.keys(self))!r})"
