"""What the simulator's tests share: tiny pools, and one row served from its cache by name."""

from __future__ import annotations

from kvcert.sim import engine, workload
from kvcert.sim.costs import Costs
from kvcert.sim.targets import build

TINY = Costs(device_tokens=64 * 256, host_tokens=64 * 512)
"""256 device pages, 512 host pages: small enough that a few sessions press on both."""


def serve(name: str, w: workload.Workload, costs: Costs = TINY, **kw: object) -> engine.Run:
    """`w` served from the contender `name`'s cache over `costs`' pools; the cache closed after."""
    future: dict[str, float] = {}
    cache = build(name, costs, w, future)
    try:
        return engine.simulate(w, cache, costs, future=future, **kw)  # type: ignore[arg-type]
    finally:
        cache.close()
