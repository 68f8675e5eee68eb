"""SGLang 0.5.23's direct external linker path (conformance/adapters/sglang/linker.py), judged through its scheduler.

A directed conversation drives the store's whole cycle through SGLang's own wrapper (offload, device eviction, a
lookup hit, a load, a failed load batch) and must pass; the same conversation fails when SGLang's wrapper is made
to serve a failed load. A short certification of the unmodified engine passes and reaches lookups, loads and
offloads; each bug planted into the wrapper (tests/sglang_linker_plants.py) fails it under the rule it breaks.
Skipped as a whole without the `sglang` extra (required with KVCERT_SGLANG=1).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _sglang import require_sglang

require_sglang()

from _linker import conversation, flush_mid_offload  # noqa: E402
from sglang_linker_plants import PLANTS, planted  # noqa: E402

from kvcert.conformance.adapters.sglang import linker as sglang_linker  # noqa: E402
from kvcert.conformance.certification.certify import certify  # noqa: E402
from kvcert.conformance.harness.driver import ConformanceFailure  # noqa: E402
from kvcert.conformance.harness.requests import RequestHarness  # noqa: E402
from kvcert.conformance.reference.linker import LinkerStore  # noqa: E402

pytestmark = pytest.mark.sglang

TARGET = "kvcert.conformance.adapters.sglang.linker:factory"


def _conversation(fail_load: bool) -> tuple[Any, RequestHarness]:
    return conversation(sglang_linker.factory, "load_fail" if fail_load else None)


def test_a_hit_loads_back_and_a_failed_load_is_aborted_not_served() -> None:
    backend, h = _conversation(fail_load=False)
    reached = backend.linker.store.reached
    assert reached["lookup hit"] >= 1 and reached["load batch landed"] >= 1 and reached["offload stored"] >= 10
    h.close()
    backend, h = _conversation(fail_load=True)
    assert backend.linker.store.reached["load batch failed"] == 1
    assert backend.failed_loads() == {"r99"}
    assert "r99" not in h.finished and "r99" not in h.in_flight()  # SGLang aborted it: 503, output discarded
    h.close()


def test_a_flush_resets_the_linker_with_an_offload_in_flight() -> None:
    """SGLang's deferred flush (`/flush_cache` with a timeout) once the request is done, its offload held by the store:
    the wrapper resets the linker and releases the offload it waited on; the next request's offload is the first
    result taken. With the wrapper still waiting on the forgotten offload (`reset-keeps-pending`), it fails."""
    backend, h = flush_mid_offload(sglang_linker.factory)
    h.close()
    assert backend.linker.store.reached["reset with offloads in flight"] == 1, backend.linker.store.reached
    with planted("reset-keeps-pending"), pytest.raises(ConformanceFailure) as caught:
        flush_mid_offload(sglang_linker.factory)
    assert {v.inv for v in caught.value.violations} == {"INV-LIVE-2"}, caught.value  # pending_offloads names dead nodes


def test_a_failed_load_served_as_landed_is_caught() -> None:
    with planted("serve-failed-load"), pytest.raises(ConformanceFailure) as caught:
        _conversation(fail_load=True)
    assert {v.inv for v in caught.value.violations} & {"INV-LINK-4", "INV-KV-1", "INV-REQ-2"}


@pytest.fixture(scope="module")
def stores() -> Iterator[list[LinkerStore]]:
    """Every store a certification in this module builds (to count what the runs reached)."""
    made: list[LinkerStore] = []
    real = LinkerStore.__post_init__

    def post(self: LinkerStore) -> None:
        real(self)
        made.append(self)

    LinkerStore.__post_init__ = post  # type: ignore[method-assign]
    try:
        yield made
    finally:
        LinkerStore.__post_init__ = real  # type: ignore[method-assign]


def _certify(examples: int, page_sizes: Any = None) -> Any:
    with tempfile.TemporaryDirectory() as out:
        return certify(TARGET, examples=examples, page_sizes=page_sizes, out_dir=Path(out))


def test_the_unmodified_engine_certifies_and_reaches_the_store(stores: list[LinkerStore]) -> None:
    stores.clear()
    cert = _certify(30)
    assert cert.passed, [f for c in cert.cells for f in c.failures]
    reached: Counter[str] = Counter()
    for s in stores:
        reached.update(s.reached)
    for what in ("lookup hit", "lookup miss", "load batch landed", "offload stored", "offload failed"):
        assert reached[what] > 0, (what, reached)


EXPECTED = {
    "stored-on-failure": {"INV-LINK-6"},
    "offload-unpinned": {"INV-HOST-6", "INV-LINK-5"},
    "hit-past-lookup": {"INV-LINK-1"},
    "results-lifo": {"INV-LINK-6", "INV-LINK-5", "INV-HOST-6"},
}
BUDGET = {"stored-on-failure": (40, None), "offload-unpinned": (20, None), "hit-past-lookup": (40, (4,)),
          "results-lifo": (80, None)}  # fmt: skip
"""Examples per cell (and page sizes) each plant's certification runs: a few times what it took at seed 0."""


@pytest.mark.parametrize("plant", [p for p in PLANTS if p in EXPECTED])
def test_each_planted_wrapper_bug_fails_certification_under_its_rule(plant: str) -> None:
    with planted(plant):
        cert = _certify(*BUDGET[plant])
    rules = {f["invariant"] for c in cert.cells for f in c.failures}
    assert not cert.passed and rules and rules <= EXPECTED[plant] | {"INV-RP-1"}, rules
    assert rules & EXPECTED[plant], rules


def test_the_target_imports_in_a_fresh_process() -> None:
    """`kvcert certify ...sglang_linker:factory` imports the module first: SGLang's CPU shims must come before it."""
    done = subprocess.run([sys.executable, "-c", "import kvcert.conformance.adapters.sglang.linker"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
