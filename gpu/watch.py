"""`Watch`: told whenever a node's KV arrives on a tier or leaves it, so an engine can publish KV events.

A KV-aware router rebuilds each worker's cache from its events (stored on the device, backed up on the host,
removed from either). The tree calls a watch at every place a node gains or loses a tier's copy: a node whose
pages are stored on a tier is announced once, and announced gone once, before it leaves the tree. A split
changes no residency and tells nothing: the watch's page identities (paths from the root) do not move.
`GpuCache.watch` is None unless an engine sets one; the tree then pays one attribute test per change.
"""

from __future__ import annotations

from typing import Protocol

from kvcert.gpu.node import Node

__all__ = ["DEVICE", "HOST", "Watch"]

DEVICE = "device"
HOST = "host"


class Watch(Protocol):
    """A node's pages arrived on (`stored`) or left (`removed`) a tier (`DEVICE` or `HOST`); the node is still
    linked to its parent when either is called."""

    def stored(self, node: Node, tier: str) -> None: ...

    def removed(self, node: Node, tier: str) -> None: ...
