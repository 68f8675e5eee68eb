"""The seed's KVCR direct linker broken on purpose, certified at its API: run in `.venv-kvcr` by
tests/test_kvcr_linker.py as `python tests/kvcr_linker_plants.py EXAMPLES PLANT...`.

`none` is the PR's linker unmodified; `fixed` has the two defects the walk found repaired (`repaired()`); every other
plant is one bug put into the repaired linker, so that it is judged alone. One JSON line per plant: the rules the
certificate's failures name, what the run reached, what it did not check.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from kvcert.conformance.adapters.kvcr import env as _kvcr_env
from kvcert.conformance.certification.certify import certify

TARGET = "kvcert.conformance.adapters.kvcr.linker:factory"


@contextlib.contextmanager
def repaired(mod: Any) -> Iterator[None]:
    """The two defects fixed: a preparation retired before the owner thread starts it is never started (its bytes
    would never leave the in-flight budget), and a fetch's failed objects count as settled, not abandoned."""
    L = mod.KVCRDirectLinker
    start, completion = L._start_preparation, L._fetch_completion

    def start_live(self: Any, prep: Any) -> None:
        if prep.state == "fetching":
            start(self, prep)

    def settled(self: Any, prep: Any, pool: str, pages: list[int], keys: list[Any]) -> Any:
        real = completion(self, prep, pool, pages, keys)

        def done(entries: Any) -> None:
            late, before = prep.state != "fetching", prep.bytes_confirmed
            real(entries)
            if not late:
                prep.bytes_confirmed = before + len(pages) * self.layouts[pool].object_bytes

        return done

    with mock.patch.object(L, "_start_preparation", start_live), mock.patch.object(L, "_fetch_completion", settled):
        yield


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    mod = _kvcr_env.import_linker()
    L = mod.KVCRDirectLinker
    if name == "none":
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(repaired(mod))
        if name == "lookup-unclaimed":  # lookup counts one page past the claimed prefix
            real_lookup = L.lookup

            def longer(self: Any, rid: str, transfers: Any) -> list[int]:
                got = real_lookup(self, rid, transfers)
                n = len(transfers[0].keys or [])
                return got + [max(got) + 1] if got and max(got) < n else got

            stack.enter_context(mock.patch.object(L, "lookup", longer))
        elif name == "fifo-broken":  # an offload's result is published when it finishes, not in queue order
            def publish(self: Any, task: Any) -> None:
                with self._lock:
                    task.done = True
                    self._inflight_offload_bytes -= task.bytes
                    self._offload_tasks.remove(task)
                    self._offload_results.append(task.success)

            stack.enter_context(mock.patch.object(L, "_finish_offload", publish))
        elif name == "counter-early":  # the layer counter completes when the batch starts, before the bytes land
            real_start = L.start_layer_wise_loading

            def early(self: Any) -> int:
                index = real_start(self)
                if index >= 0:
                    self.layer_done_counter.complete_all(index)
                return index

            stack.enter_context(mock.patch.object(L, "start_layer_wise_loading", early))
        elif name == "failed-load-completes":  # a deliver's failed objects are ignored
            def blind(self: Any, batch: Any, keys: list[Any]) -> Any:
                def completion(entries: Any) -> None:
                    batch.outstanding -= 1
                    if batch.outstanding == 0:
                        self._finish_load(batch)

                return completion

            stack.enter_context(mock.patch.object(L, "_load_completion", blind))
        elif name == "late-claims-kept":  # a late fetch's claims are never released
            stack.enter_context(mock.patch.object(L, "_release_handles", lambda self, handles: None))
        elif name == "reset-no-quarantine":  # reset trusts the core to be quiescent
            stack.enter_context(mock.patch.object(L, "_drain", lambda self, timeout_s: True))
            stack.enter_context(mock.patch.object(L, "_close_core", lambda self, kvcr: True))
        elif name == "removed-dropped":  # the core's evictions never reach the router
            stack.enter_context(mock.patch.object(L, "_on_inventory_event", lambda self, event: None))
        elif name != "fixed":
            raise SystemExit(f"unknown plant {name!r}")
        yield


def main(plants: list[str], examples: int) -> None:
    for name in plants:
        with tempfile.TemporaryDirectory() as out, planted(name):
            cert = certify(TARGET, examples=examples, out_dir=Path(out))
        cells = {n: sorted({f["invariant"] for f in c.failures}) for n, c in zip(cert.planned, cert.cells)}
        ops: dict[str, int] = {}
        for c in cert.cells:
            for k, v in c.ops.items():
                ops[k] = ops.get(k, 0) + v
        print(json.dumps({"plant": name, "passed": cert.passed, "rules": sorted({r for v in cells.values() for r in v}),
                          "cells": cells, "ops": ops, "not_checked": cert.not_checked,
                          "digests": [c.digest for c in cert.cells], "failures": [c.failure for c in cert.cells if c.failure]}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[2:], int(sys.argv[1]))
