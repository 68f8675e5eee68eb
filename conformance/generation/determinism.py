"""Same seed, same run: generation that depends on nothing but the seed and the cell.

Hypothesis seeds its own random stream, but since 6.131 it also draws, one draw in
twenty or so, from a pool of literals it harvests from every imported module it
deems "local" (outside site-packages, not a test file). That pool is process
history: which kvcert modules were imported (the CLI or pytest), whether kvcert
is an editable install (local) or a wheel (site-packages, harvested from
nowhere), any new constant anywhere in the tree. While a kvcert run generates,
`fixed_generation()` empties that pool, so only Hypothesis's built-in constants
remain, which are the same in every process.

`StepDigest` is the proof: a running SHA-256 over every op a run executes, in
order, which a certificate records per cell. Two runs made the same choices
exactly when their digests are equal, whatever process or install made them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

from kvcert.spec.ops import OMITTED_WHEN_NONE, Op, op_to_json

__all__ = ["StepDigest", "fixed_generation"]


@contextlib.contextmanager
def fixed_generation() -> Iterator[None]:
    """Hypothesis draws no constants harvested from imported modules while the block runs.

    Hypothesis versions without the harvest (before 6.131) need nothing; a version that
    moved it fails here loudly rather than generate from process history.
    """
    from kvcert.conformance.generation.hypothesis_compat import providers

    if providers is None:  # pragma: no cover - Hypothesis always has it
        yield
        return
    if not hasattr(providers, "_get_local_constants"):
        if hasattr(providers, "_local_constants") or hasattr(providers, "local_constants"):
            raise RuntimeError(
                "this Hypothesis harvests module constants in a way kvcert does not know how to switch off; "
                "pin hypothesis as requirements/core.txt does"
            )
        yield
        return
    empty = providers.Constants()
    saved = providers._get_local_constants
    cache: Any = getattr(providers, "CONSTANTS_CACHE", None)

    def _clear() -> None:  # cached pools computed with the harvested constants must not leak in or out
        if cache is not None:
            cache.cache.clear()

    providers._get_local_constants = lambda: empty
    _clear()
    try:
        yield
    finally:
        providers._get_local_constants = saved
        _clear()


class StepDigest:
    """A running SHA-256 of the ops a run executed, with a mark where each example starts."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def example(self) -> None:
        self._hash.update(b"\x1e")

    def step(self, op: Op) -> None:
        self._hash.update(step_bytes(op))
        self._hash.update(b"\n")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


_FIELDS: dict[type, tuple[str, ...]] = {}
_ENCODE = json.JSONEncoder(sort_keys=True, default=repr).encode
"""`json.dumps(x, sort_keys=True, default=repr)` without building an encoder per call (what `dumps` does whenever
an argument is not its default)."""


def step_bytes(op: Op) -> bytes:
    """What a step adds to the digest: `json.dumps(op_to_json(op), sort_keys=True, default=repr)`, the same bytes
    built without `asdict`'s deep copy (a tenth of a checked step). No op type holds a dataclass; should one,
    `op_to_json` encodes it, so the bytes, and every digest recorded before, stay the same."""
    names = _FIELDS.get(type(op))
    if names is None:
        names = _FIELDS[type(op)] = tuple(f.name for f in fields(op))  # type: ignore[arg-type]
    body: dict[str, Any] = {"op": type(op).__name__}
    for name in names:
        value = getattr(op, name)
        if value is None and name in OMITTED_WHEN_NONE:
            continue
        if is_dataclass(value):
            return _ENCODE(op_to_json(op)).encode()
        body[name] = value
    return _ENCODE(body).encode()
