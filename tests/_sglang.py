"""One guard for the SGLang test modules: skip the module, saying why, when SGLang cannot be imported.

With `KVCERT_SGLANG=1` (what `scripts/test.sh` and CI set) SGLang is required: a module that cannot
import it fails instead of skipping, so an environment that lost SGLang cannot pass as green.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

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
    from kvcert.conformance.adapters.sglang.env import import_sglang

    try:
        import_sglang()
    except ImportError as exc:  # installed, but a pinned hard import is missing
        missing(f"sglang cannot be imported: {exc}")


def drop_mid_prefetch(config: Any) -> tuple[list[Any], list[str]]:
    """An L3 trace for a backend that keeps SGLang's own store (its `file` or `seaweedfs` backend), page size 1: the
    engine stores two pages of its own, a peer publishes three more, a prefetch of them starts, and the third is
    dropped mid-fetch, so the batch ends with the two pages before it. -> (ops, the peer's three page keys)."""
    from kvcert.spec import storage as l3
    from kvcert.spec.ops import CheckPrefetch, Complete, Fetch, Insert, Match, Poll, Prefetch, Publish, StorageFault

    digest = l3.canonical_digest(1, config.model_id)
    keys = list(l3.page_keys(None, (1, 2, 3), 1, digest))
    stored = sorted(keys + list(l3.page_keys(None, (7, 8), 1, digest)))  # StorageFault names a page by its place
    ops = [
        Insert(None, (7, 8)),
        Complete(0),
        Poll(),
        Complete(1),
        Poll(),  # the engine's own store of its two pages
        Publish(None, (1, 2, 3)),
        Match(None, (1, 2, 3)),
        Prefetch(6),
        Fetch(0),
        StorageFault("drop", stored.index(keys[2])),
        Fetch(0),
        Fetch(0),  # the dropped page: a miss ends the batch with the two pages before it
        CheckPrefetch(0),
    ]
    return ops, keys
