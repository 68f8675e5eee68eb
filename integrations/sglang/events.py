"""KV events (`--kv-events-config`): kvcert's tree announces its pages to a KV-aware router as SGLang's caches do.

A router (Dynamo, SGLang's own) rebuilds each worker's cache from `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` and routes a prompt to the worker whose blocks it hashes to. So the events must name pages
with SGLang's block hashes, chained from the root, namespaced as SGLang namespaces them, and with
SGLang's batching. `EventWatch` is the tree's watch (`kvcert.gpu.watch`): told of every page arriving on or
leaving the device (medium GPU) or the host (CPU_PINNED), it hands SGLang's own `KVCacheEventRecorder` a
mirror of the node with the fields the recorder reads (key, parent, hash values), so the recorder computes
the hashes and batches the events exactly as it does for `UnifiedRadixCache`. Mirrors are cached per node
and rebuilt when a split moves the node's start.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import compute_node_hash_values

from kvcert.gpu.node import Node
from kvcert.gpu.watch import DEVICE, HOST

__all__ = ["EventWatch"]

MEDIUM = {DEVICE: StorageMedium.GPU, HOST: StorageMedium.CPU}
"""The medium of each tier's events (SGLang's GPU and CPU_PINNED)."""


class _Mirror:
    """What SGLang's recorder reads of a tree node: its key (tokens and namespace), its parent, its hash values."""

    __slots__ = ("event_hash_value", "hash_value", "key", "parent", "size")

    def __init__(self, key: Any, parent: Optional[_Mirror], size: int) -> None:
        self.key, self.parent, self.size = key, parent, size
        self.hash_value: Optional[list[str]] = None
        self.event_hash_value: Optional[list[str]] = None


class EventWatch:
    """The tree's watch: each tier change becomes SGLang's event for the node's pages."""

    def __init__(self, recorder: Any, page_size: int, nodes: dict[int, Node]) -> None:
        self.recorder, self.page_size, self.nodes = recorder, page_size, nodes
        self.session: Optional[str] = None
        """The session of the request whose insert is running: a device store's attribution (`session_id`)."""
        self._root = _Mirror(RadixKey([]), None, 0)
        self._root.hash_value = []
        self._mirrors: dict[int, _Mirror] = {}

    def stored(self, node: Node, tier: str) -> None:
        session = self.session if tier == DEVICE else None
        self.recorder.record_store(self._mirror(node), medium=MEDIUM[tier], session_id=session)

    def removed(self, node: Node, tier: str) -> None:
        self.recorder.record_remove(self._mirror(node), medium=MEDIUM[tier])

    def _mirror(self, node: Node) -> _Mirror:
        """`node`'s mirror, rebuilding it and any ancestor's a split made stale (a stale parent makes its
        children's stale: their hashes chain from it)."""
        chain: list[Node] = []
        cur: Optional[Node] = node
        while cur is not None and cur.parent is not None:
            chain.append(cur)
            cur = cur.parent
        parent = self._root
        mirrors = self._mirrors
        for n in reversed(chain):
            m = mirrors.get(n.id)
            if m is None or m.parent is not parent or m.size != n.size:
                extra, salt = (None, None) if n.ns is None else json.loads(n.ns)
                m = _Mirror(RadixKey(list(n.key.to_tuple()), extra_key=extra, cache_salt=salt), parent, n.size)
                m.hash_value = compute_node_hash_values(m, self.page_size)
                mirrors[n.id] = m
            parent = m
        if len(mirrors) > 2 * len(self.nodes) + 64:  # mirrors of nodes that left the tree: amortised O(1)
            for gone in [i for i in mirrors if i not in self.nodes]:
                del mirrors[gone]
        return parent
