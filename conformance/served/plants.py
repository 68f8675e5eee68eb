"""Planted bugs in kvcert's own SGLang backend, installed inside a served server's processes: each must fail the
end-to-end rule it breaks (tests/test_served.py), which is how the served rules show they can fail.

`KVCERT_SERVED_PLANT=<name>` in a served SGLang's environment makes its `sitecustomize` patch the backend's class
right after SGLang's plugin loader imports it; nothing is patched otherwise. Each plant is a real bug class:
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from kvcert.conformance.served.standins import AfterImport

__all__ = ["PLANTS", "install"]

PLANTS: dict[str, str] = {
    "match-one-page-off": "a hit's last page is read from the wrong slots (its first page's): a request computes "
    "over KV of other tokens for one page of its cached prefix",
    "leak-lock": "every third lock a finished request drops is kept: its path stays protected for good",
    "drop-store-event": "every third page the device stores is not announced to the KV-event recorder",
}


def _match_one_page_off(module: types.ModuleType) -> None:
    cls = module.KvcertRadixCache
    real = cls.prefix_device_indices

    def prefix_device_indices(self: Any, req: Any) -> torch.Tensor:
        slots = real(self, req)
        ps = self.page_size
        if len(slots) < 2 * ps:
            return slots
        slots = slots.clone()
        slots[len(slots) - ps :] = slots[:ps]  # the hit's last page read from its first page's slots
        return slots

    cls.prefix_device_indices = prefix_device_indices


def _leak_lock(module: types.ModuleType) -> None:
    cls = module.KvcertRadixCache
    real = cls.dec_lock_ref
    calls = [0]

    def dec_lock_ref(self: Any, node: Any, params: Any = None) -> Any:
        calls[0] += 1
        if calls[0] % 3 == 0 and int(node) != self.root_node:
            return module.DecLockRefResult(delta=0)
        return real(self, node, params)

    cls.dec_lock_ref = dec_lock_ref


def _drop_store_event(module: types.ModuleType) -> None:
    cls = module.EventWatch
    real = cls.stored
    calls = [0]

    def stored(self: Any, node: Any, tier: str) -> None:
        calls[0] += 1
        if calls[0] % 3 == 0 and tier == module.DEVICE:
            return
        real(self, node, tier)

    cls.stored = stored


_WHERE = {
    "match-one-page-off": ("kvcert.integrations.sglang.cache", _match_one_page_off),
    "leak-lock": ("kvcert.integrations.sglang.cache", _leak_lock),
    "drop-store-event": ("kvcert.integrations.sglang.events", _drop_store_event),
}


def install(name: str) -> None:
    if name not in _WHERE:
        raise ValueError(f"unknown served plant {name!r}; known: {sorted(PLANTS)}")
    module, patch = _WHERE[name]
    if module in sys.modules:
        patch(sys.modules[module])
    else:
        sys.meta_path.insert(0, AfterImport(module, patch))
