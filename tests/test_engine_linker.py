"""The reference engine with a direct linker (conformance/reference/engine_linker.py): the linker rules' positive control.

Over the reference model and over kvcert.gpu it certifies, reaching the store's hits, loads and offloads; a
directed conversation takes a load back and aborts a failed one. That the rules of SPEC.md §14 can fail on an engine
that breaks them is the engine zoo's (conformance/zoo/engines.py, tests/test_engine_zoo.py).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _linker import RELOAD, conversation, flush_mid_offload

from kvcert.conformance.certification.certify import certify
from kvcert.conformance.reference import engine_linker


def _conversation(fail_load: bool) -> Any:
    backend, h = conversation(engine_linker.factory, "load_fail" if fail_load else None)
    h.close()
    return backend


def test_a_hit_is_loaded_back_and_a_failed_load_aborts_its_request() -> None:
    reached = _conversation(fail_load=False).store.reached
    assert reached["lookup hit"] >= 1 and reached["load batch landed"] == 1
    backend = _conversation(fail_load=True)
    assert backend.store.reached["load batch failed"] == 1 and backend.failed_loads() == {RELOAD}


@pytest.mark.parametrize("target", ["factory", "factory_gpu"])
def test_it_certifies_over_the_model_and_over_gpu(target: str) -> None:
    with tempfile.TemporaryDirectory() as out:
        cert = certify(f"kvcert.conformance.reference.engine_linker:{target}", examples=25, page_sizes=(1, 4),
                       policies=("lru",), out_dir=Path(out))  # fmt: skip
    assert cert.passed
    ops: Counter[str] = Counter()
    for c in cert.cells:
        ops.update(c.ops)
    assert ops["linker:load batch landed"] > 0 and ops["linker:offload stored"] > 0, ops


def test_a_flush_resets_the_store_with_an_offload_in_flight() -> None:
    """The client's flush once its request is done, its offload still held by the store: the engine unlocks the
    offload's node and resets the store, which forgets it (INV-LINK-7's reset); nothing is left locked or owed."""
    backend, h = flush_mid_offload(engine_linker.factory)
    h.close()
    assert backend.store.reached["reset with offloads in flight"] == 1, backend.store.reached
