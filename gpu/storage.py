"""The storage tier (SPEC.md §10): store copies of backed-up pages, prefetch into reserved host slots.

`StorageTier` holds the attached `StorageBackend`, the prefetches in flight and the storage
settings (stop policy, timeout, digest). A write ack issues one store copy of the written nodes,
host-locked until its own ack; its completion writes every page (`encode_page` of the host bytes
transposed) in one `batch_set`. A prefetch asks `batch_exists` once, reserves host room for the
part that fits (D9), fetches page by page (each verified against `page_payload` before it counts:
never wrong KV), publishes its progress per batch of pages as SGLang's storage batches do, and,
when it ends, hangs the kept pages below its anchor as host-only nodes or as backups of device
nodes without one (D15). It works on its cache's tree (`tree`, typed as `StorageTree`: the tiers'
`TierTree` with the host tier, for host room, and the ranks' agreement).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional, Protocol

from kvcert.gpu.agreement import Agreement
from kvcert.gpu.node import Node, Prefetch, is_id
from kvcert.gpu.run import Run, ints_run
from kvcert.gpu.tiers import TierTree
from kvcert.gpu.watch import HOST
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.types import CacheConfig, Namespace, UnknownPrefetch, check_tokens

if TYPE_CHECKING:
    from kvcert.gpu.host import HostTier


class StorageTree(TierTree, Protocol):
    """What the storage tier needs of its tree beyond `TierTree`."""

    host: Optional[HostTier]
    """The host tier: a prefetch's room, a store's payloads."""
    agreement: Agreement
    """The ranks agree on the pages a prefetch keeps."""


class StorageTier:
    """Storage and prefetch of one cache."""

    def __init__(self, tree: StorageTree, config: CacheConfig) -> None:
        self.tree = tree
        self.storage: Optional[l3.StorageBackend] = None
        self.prefetch_policy = config.prefetch_policy
        self.timeout = (config.prefetch_timeout_base, config.prefetch_timeout_per_page)
        self.kv_layers = config.kv_layers
        self.digest = l3.canonical_digest(config.page_size, config.model_id)
        self.prefetches: OrderedDict[int, Prefetch] = OrderedDict()
        self._next_prefetch = 0

    # ------------------------------------------------------------------ store copies

    def store(self, nodes: list[Node]) -> None:
        """A write ack issues one store copy of the same nodes, each host-locked until its ack (§10.3)."""
        if self.storage is None or not nodes:
            return
        tree = self.tree
        c = tree.issue_copy("store", nodes, [], None)
        for n in nodes:
            tree.host_lock(n, c)

    def write(self, nodes: list[Node]) -> None:
        """A store copy completed: write its live nodes' pages in one `batch_set` (a failure stores nothing)."""
        if self.storage is None:
            return
        keys, values = self.pages_of(nodes)
        try:
            self.storage.batch_set(keys, values)
        except l3.StorageError:
            pass  # not stored: later lookups miss

    def pages_of(self, nodes: list[Node]) -> tuple[list[str], list[bytes]]:
        """Keys and records of every page of `nodes`, shallowest first, payloads read from the host pool."""
        tree = self.tree
        assert tree.host is not None
        host_kv = tree.host.kv
        ps = tree.page_size
        live = [(len(p), p, n) for n in nodes if n.id in tree.nodes for p in (tree.path_tokens(n),)]
        live.sort(key=lambda t: t[0])
        keys: list[str] = []
        values: list[bytes] = []
        for _, path, n in live:
            all_keys = l3.page_keys(n.ns, path, ps, self.digest)
            first = (len(path) - n.size) // ps
            host = n.host_slots.to_tuple() if n.host_slots is not None else ()
            for i in range(n.size // ps):
                key = all_keys[first + i]
                payload = host_kv.read_page_payload(host[i * ps : (i + 1) * ps])
                keys.append(key)
                values.append(l3.encode_page(key, payload))
        return keys, values

    # ------------------------------------------------------------------ prefetch

    def get(self, prefetch: object) -> Prefetch:
        p = self.prefetches.get(prefetch) if is_id(prefetch) else None
        if p is None:
            raise UnknownPrefetch(f"no running prefetch {prefetch!r}")
        return p

    def prefetch(self, anchor: Node, namespace: Namespace, tokens: Sequence[int]) -> int:
        """Reserve host room for the stored pages of `tokens` after `anchor`'s path; the tokens it will fetch."""
        tree = self.tree
        ps = tree.page_size
        key = check_tokens(tokens)
        key = key[: pages.page_floor(len(key), ps)]
        path = tree.path_tokens(anchor)
        start = len(path)
        if self.storage is None or key[:start] != path or len(key) <= start:
            return 0
        if anchor is not tree.root and (anchor.ns != namespace or anchor.host_slots is None):
            return 0  # D18: an anchor that lost its backup since its match asks storage nothing
        host = tree.host
        if host is not None:  # admission: running prefetches' requested spans may hold half the host pool
            occupied = sum(q.span_pages for q in self.prefetches.values()) * ps
            if occupied >= int(l3.PREFETCH_ADMIT_FRACTION * host.kv.capacity):
                return 0
        keys = l3.page_keys(namespace, key, ps, self.digest)[start // ps :]
        try:
            hit = self.storage.batch_exists(keys)
        except l3.StorageError:
            hit = 0
        size = hit * ps
        if size == 0 or tree.host is None:
            return 0
        p = Prefetch(self._next_prefetch, anchor, namespace, (), start, (), (), tree.now, span_pages=len(keys))
        if anchor is not tree.root:
            tree.host_lock(anchor, p)  # first: the anchor must not be the room made
        got = self._reserve(size)
        if got is None:
            tree.host_unlock_all(p)
            tree.compact()
            return 0
        size = len(got)  # D9: the part that fits
        p.tokens, p.keys, p.host_slots = key[: start + size], keys[: size // ps], got
        self._next_prefetch += 1
        self.prefetches[p.id] = p
        tree.compact()
        return size

    def _reserve(self, size: int) -> Optional[tuple[int, ...]]:
        """D9: short of room, host-evict `size` tokens, then reserve the longest whole-page part that fits."""
        host = self.tree.host
        assert host is not None
        alloc = host.alloc
        if alloc.available < size:
            host.evict(size)
        if alloc.consume_failure():  # an injected failure declines the prefetch (SPEC.md §10.5)
            return None
        take = min(size, alloc.available)
        if take < self.tree.page_size:
            return None
        return Run(alloc.take_raw(take)).to_tuple()

    def fetch(self, prefetch: object) -> None:
        """Fetch the next page; a miss, a torn or a corrupt page fails the prefetch (never wrong KV)."""
        p = self.get(prefetch)
        if p.failed or p.fetched == len(p.keys):
            raise UnknownPrefetch(f"prefetch {prefetch} has no page left to fetch")
        tree = self.tree
        assert self.storage is not None and tree.host is not None
        ps = tree.page_size
        key = p.keys[p.fetched]
        page = p.start // ps + p.fetched
        raised = False
        try:
            blob = self.storage.batch_get([key])[0]
        except l3.StorageError:
            blob, raised = None, True
        payload = l3.decode_page(key, blob)
        if payload is None or payload != l3.page_payload(p.ns, p.tokens, page, ps, self.kv_layers):
            p.failed = True
            if raised:  # a read that raises loses the pages of its batch not yet published
                p.fetched = p.published
        else:
            tree.host.kv.write_page_payload(p.host_slots[p.fetched * ps : (p.fetched + 1) * ps], payload)
            p.fetched += 1
        if p.failed or p.fetched == len(p.keys) or p.fetched % l3.FETCH_BATCH_PAGES == 0:
            p.published = p.fetched  # a batch's end: its progress reaches the engine

    def check(self, prefetch: object) -> Optional[int]:
        """End the prefetch if done, or if its stop policy says so (SPEC.md §10.4): tokens added; None: running."""
        p = self.get(prefetch)
        tree = self.tree
        done_here = p.failed or p.fetched == len(p.keys)
        done_all, fetched = tree.agreement.agree([int(done_here), p.published])  # the slowest rank decides
        done = bool(done_all)
        base, per_page = self.timeout
        expired = (
            self.prefetch_policy == "timeout"
            and p.waiting_since is not None
            and tree.now - p.waiting_since > base + per_page * p.span_pages
        )
        if not (done or self.prefetch_policy == "best_effort" or expired):
            if p.waiting_since is None:
                p.waiting_since = tree.now  # D11: the deadline starts at the first check that waits
            return None
        added = self.end(p, fetched * tree.page_size, touch=True)
        tree.compact()
        return added

    def end(self, p: Prefetch, keep: int, touch: bool = False) -> int:
        """Hang the first `keep` fetched tokens below the anchor as host-only nodes; free the rest.

        `touch` (ended by check_prefetch): the anchor and every node the walk enters are accessed now (D16).
        """
        tree = self.tree
        assert tree.host is not None
        del self.prefetches[p.id]
        tree.host_unlock_all(p)
        ps, now = tree.page_size, tree.now
        tokens, host = ints_run(p.tokens), Run.of_ints(p.host_slots)
        node, added = p.anchor, 0
        base = at = p.start  # tokens into `tokens`; `host` starts at the anchor's end
        end = p.start + keep
        kept = array("q")
        if touch and node is not tree.root:
            node.last_access = now
            tree.refresh(node)
        while at < end:
            page = tokens.page(at, ps)
            child = node.children.get((p.ns, page) if node is tree.root else page)
            if child is None:
                leaf = tree.new_node(node, p.ns, tokens.cut(at, end), end - at)
                leaf.host_slots = host.cut(at - base, end - base)
                leaf.last_access = leaf.creation = now
                node.children[tree.selector(node, leaf)] = leaf
                tree.refresh(leaf)
                tree.refresh(node)
                if tree.watch is not None:
                    tree.watch.stored(leaf, HOST)
                kept.frombytes(leaf.host_slots.raw)
                added += end - at
                break
            if touch:
                child.last_access = now
                tree.refresh(child)
            step = child.size if tokens.startswith(child.key, at) and at + child.size <= end else 0
            if not step:
                step = tokens.common(child.key, at, end, ps)
                child = tree.split(child, step)
            if child.host_slots is None and not tree.write_back:
                # D15: a device node without a backup takes the fetched pages as its backup
                child.host_slots = host.cut(at - base, at - base + step)
                kept.frombytes(child.host_slots.raw)
                added += step
                tree.refresh(child)
                if tree.watch is not None:
                    tree.watch.stored(child, HOST)
            node, at = child, at + step  # D15: write-back walks past a device node without a backup
        mine = set(kept)
        tree.host.alloc.release(tuple(s for s in p.host_slots if s not in mine))
        return added
