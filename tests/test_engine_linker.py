"""The reference engine with a direct linker (conformance/engine_linker.py): the linker rules' positive control.

Over the reference model and over kvcert.gpu it certifies, reaching the store's hits, loads and offloads; a
directed conversation takes a load back and aborts a failed one. Each rule of SPEC.md §14 that the engine keeps is
then broken on purpose in the engine (a directed mutant) and the certification, or the conversation, fails under
that rule: the rules can fail on a cache that breaks them.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from _linker import RELOAD, conversation

from kvcert.conformance import engine_linker
from kvcert.conformance.certification.certify import certify
from kvcert.conformance.harness.driver import ConformanceFailure

E = engine_linker.LinkedEngine


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
        cert = certify(f"kvcert.conformance.engine_linker:{target}", examples=25, page_sizes=(1, 4),
                       policies=("lru",), out_dir=Path(out))  # fmt: skip
    assert cert.passed
    ops: Counter[str] = Counter()
    for c in cert.cells:
        ops.update(c.ops)
    assert ops["linker:load batch landed"] > 0 and ops["linker:offload stored"] > 0, ops


def _serve_failed_load(self: Any) -> None:
    """Treats a failed batch as landed: the request computes past slots the store tore."""
    if self.loading:
        self.store.finish(self.store.start())
        for r in self.running:
            r.computed += self.loading.get(r.id, 0)
        self.loading = {}
    else:
        self.store.start()


def _stored_on_failure(self: Any) -> None:
    for _ in range(self.store.completed()):
        node, keys = self.offloads.pop(0)
        self.store.pop()
        self.stored |= set(keys)
        self.flying -= set(keys)
        self.cache.dec_lock_ref(node)


def _unlocked_offload(real: Any) -> Any:
    def cached(self: Any, r: Any, node: int) -> None:
        before = len(self.offloads)
        real(self, r, node)
        if len(self.offloads) > before:  # the lock goes at once; the result's taking drops it again
            locked, keys = self.offloads[-1]
            self.cache.dec_lock_ref(locked)
            self.cache.inc_lock_ref(self.cache.snapshot().root)
            self.offloads[-1] = (self.cache.snapshot().root, keys)

    return cached


def _load_past_lookup(self: Any, r: Any) -> None:
    from kvcert.spec import pages

    cap = pages.page_floor(len(r.tokens) - 1, self.ps)
    tail = self._keys(r.namespace, r.tokens, cap)[r.computed // self.ps :]
    n = max(self.store.lookup(r.id, tail), default=0)
    if n and n < len(tail) and self.store.load(r.id, tail[: n + 1], r.row[r.computed : r.computed + (n + 1) * self.ps]):
        self.loading[r.id] = n * self.ps


MUTANTS: dict[str, tuple[str, Any, set[str]]] = {
    "serve-failed-load": ("_loaded", _serve_failed_load, {"INV-KV-1", "INV-REQ-2"}),
    "stored-on-failure": ("_take_results", _stored_on_failure, {"INV-LINK-6"}),
    "offload-unpinned": ("_cached", _unlocked_offload(E._cached), {"INV-HOST-6", "INV-LINK-5"}),
    "load-past-lookup": ("_admitted", _load_past_lookup, {"INV-LINK-1"}),
}


@pytest.fixture(params=sorted(MUTANTS))
def mutant(request: Any) -> Iterator[tuple[str, set[str]]]:
    name, (attr, fn, rules) = request.param, MUTANTS[request.param]
    with mock.patch.object(E, attr, fn):
        yield name, rules


def test_each_directed_mutant_fails_under_its_rule(mutant: tuple[str, set[str]]) -> None:
    name, rules = mutant
    if name == "serve-failed-load":  # a failed batch needs the directed conversation
        with pytest.raises(ConformanceFailure) as caught:
            _conversation(fail_load=True)
        assert {v.inv for v in caught.value.violations} & rules
        return
    with tempfile.TemporaryDirectory() as out:
        cert = certify("kvcert.conformance.engine_linker:factory", examples=40, page_sizes=(4,), policies=("lru",),
                       out_dir=Path(out))  # fmt: skip
    found = {f["invariant"] for c in cert.cells for f in c.failures}
    assert not cert.passed and found & rules, (name, found)
