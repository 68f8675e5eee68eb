"""The linker tests' directed conversation (SPEC.md §14), one for every linker target.

A prompt, three long prompts that leave nothing of it on a 96-slot device, then (after a fault, if any) the prompt
again with a page more: its first pages come back from the linker's store.
"""

from __future__ import annotations

from typing import Any, Optional

from kvcert.conformance.backend import capabilities_of
from kvcert.conformance.harness.requests import RequestHarness
from kvcert.spec.ops import Flush, LinkerFault, Step, Submit
from kvcert.spec.types import CacheConfig

CONFIG = CacheConfig(page_size=4, capacity=96, host_capacity=0)
PROMPT = tuple([1] * 4 + [2] * 4 + [3] * 4 + [0] * 4 + [1] * 4)
FLOODS = (tuple([2] * 44), tuple([3] * 44), tuple([0, 0, 0, 1] * 11))
"""Three long prompts that evict PROMPT from the device."""
RELOAD = "r99"
"""The request that loads PROMPT's pages back."""


def conversation(factory: Any, fault: Optional[str] = None) -> tuple[Any, RequestHarness]:
    """Run the conversation on a fresh `factory(CONFIG)`, judged after every op; the harness is left open for the
    caller to read and close (closed here if the run raises)."""
    backend = factory(CONFIG)
    h = RequestHarness(backend, CONFIG, capabilities_of(factory))
    try:
        for i, prompt in enumerate((PROMPT, *FLOODS)):
            h.step(Submit(f"r{i:02d}", None, prompt, 0, 2))
            for _ in range(12):
                h.step(Step())
        if fault is not None:
            h.step(LinkerFault(fault))
        h.step(Submit(RELOAD, None, PROMPT + (2, 2, 2, 2), 0, 2))
        h.quiesce()
    except BaseException:
        h.close()
        raise
    return backend, h


def flush_mid_offload(factory: Any) -> tuple[Any, RequestHarness]:
    """A request whose offload the store holds (`offload_hold`), then the client's flush once the request is done:
    the engine resets its linker with that offload in flight (SPEC.md §14, INV-LINK-7); then another request, whose
    offload must be the first the engine takes a result for. The harness is left open."""
    backend = factory(CONFIG)
    h = RequestHarness(backend, CONFIG, capabilities_of(factory))
    try:
        h.step(LinkerFault("offload_hold"))
        h.step(Submit("r01", None, PROMPT[:12], 0, 2))  # three pages: one offload, held past the request's end
        while h.in_flight():
            h.step(Step())
        h.step(Flush())
        for _ in range(4):
            h.step(Step())
        h.step(Submit("r02", None, FLOODS[0][:12], 0, 2))  # after the reset: its offload is the store's first
        h.quiesce()
    except BaseException:
        h.close()
        raise
    return backend, h
