"""The storage tier (SPEC.md §10): store copies and prefetch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from kvcert.refimpl.records import (
    Copy,
    Node,
    Prefetching,
)
from kvcert.refimpl.tree import Tree
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.types import (
    Namespace,
    UnknownPrefetch,
    check_tokens,
)


class StorageTier(Tree):
    """Store copies and prefetch over an L3 backend."""

    def attach_storage(self, storage: l3.StorageBackend) -> None:
        """The harness hands over the L3 store (it owns it, to inject faults)."""
        self.storage = storage

    def _pages_of(self, nodes: list[Node]) -> tuple[list[str], list[bytes]]:
        """Keys and records of every page of `nodes`, shallowest first."""
        keys: list[str] = []
        values: list[bytes] = []
        for node in sorted((n for n in nodes if n.id in self.nodes), key=lambda n: len(self._full_path(n))):
            path = self._full_path(node)
            all_keys = l3.page_keys(node.namespace, path, self.page_size, self.digest)
            for page in range((len(path) - len(node.key)) // self.page_size, len(path) // self.page_size):
                payload = l3.page_payload(node.namespace, path, page, self.page_size, self.kv_layers)
                keys.append(all_keys[page])
                values.append(l3.encode_page(all_keys[page], payload))
        return keys, values

    def _store(self, nodes: list[Node]) -> None:
        """Back freshly written host copies up to storage: one store copy, host-locking its nodes."""
        if self.storage is None or not nodes:
            return
        for n in nodes:
            n.host_lock_ref += 1
        self.copies.append(Copy(self._next_copy, "store", list(nodes), anchors=[], host_locked=list(nodes)))
        self._next_copy += 1

    def _prefetching(self, prefetch_id: object) -> Prefetching:
        ok = isinstance(prefetch_id, int) and not isinstance(prefetch_id, bool)
        found = next((p for p in self.prefetches if ok and p.id == prefetch_id), None)
        if found is None:
            raise UnknownPrefetch(f"no running prefetch {prefetch_id!r}")
        return found

    def prefetch(self, node_id: int, namespace: Namespace, tokens: Sequence[int]) -> int:
        """Reserve host room for the stored pages that follow `node_id`'s path in `tokens`.

        Returns the tokens requested: the run of consecutive pages storage holds, or 0
        (nothing stored, or no host room even after host eviction: declined). The anchor
        is host-protected until the prefetch ends.
        """
        anchor = self._live(node_id)
        key = check_tokens(tokens)
        key = key[: pages.page_floor(len(key), self.page_size)]
        start = len(self._full_path(anchor))
        if self.storage is None or key[:start] != self._full_path(anchor) or len(key) <= start:
            return 0
        if anchor is not self.root and anchor.namespace != namespace:
            return 0
        if anchor is not self.root and anchor.host_slots is None:
            return 0  # D18: it lost its backup since its match (§9.4's reclaim); no storage call
        if self._throttled():
            return 0  # THROTTLE: declined for admission, no storage call
        keys = l3.page_keys(namespace, key, self.page_size, self.digest)[start // self.page_size :]
        try:
            hit = self.storage.batch_exists(keys)
        except l3.StorageError:
            hit = 0  # a failed lookup is a miss (SPEC.md §10.2)
        size = hit * self.page_size
        if size == 0 or self.host is None:
            return 0
        if anchor is not self.root:
            anchor.host_lock_ref += 1  # before making room: the anchor must not be the room made
        slots = self._prefetch_alloc(size)
        if slots is None:
            if anchor is not self.root:
                anchor.host_lock_ref -= 1
            return 0
        size = len(slots)  # D9: the part that fits
        span_pages, hit = len(keys), size // self.page_size
        locked = [anchor] if anchor is not self.root else []
        self.prefetches.append(
            Prefetching(
                self._next_prefetch, anchor, namespace, key[: start + size], start, keys[:hit], slots, self.now, locked
            )
        )
        self.prefetches[-1].span_pages = span_pages
        self._next_prefetch += 1
        return size

    def _throttled(self) -> bool:
        """Whether admission declines the next prefetch (THROTTLE): only ever while another one runs under the core."""
        throttle = self.decided.throttle
        if throttle.admit is not None and self.prefetches:
            return not throttle.admit
        if throttle.fraction is None or self.host is None:
            return False
        occupied = sum(p.span_pages for p in self.prefetches) * self.page_size
        return occupied >= int(throttle.fraction * self.host.capacity)

    def _prefetch_alloc(self, size: int) -> Optional[tuple[int, ...]]:
        """D9: if `size` does not fit, host-evict `size` tokens (`_make_room`); reserve the longest whole-page part
        that fits."""
        assert self.host is not None
        self._make_room(size)
        if self.armed_faults.get("host_alloc"):  # an injected failure declines the prefetch (SPEC.md §10.5)
            self.armed_faults["host_alloc"] -= 1
            return None
        take = min(size, pages.page_floor(len(self.host.free_list), self.page_size))
        if take < self.page_size:
            return None
        slots = self.host.alloc(take)
        self.host.adopt(slots)
        return slots

    def fetch(self, prefetch_id: int) -> None:
        """Storage delivers the prefetch's next page: one `batch_get`, verified before it counts."""
        p = self._prefetching(prefetch_id)
        if p.failed or p.fetched == len(p.keys):
            raise UnknownPrefetch(f"prefetch {prefetch_id} has no page left to fetch")
        assert self.storage is not None
        key = p.keys[p.fetched]
        page = p.start // self.page_size + p.fetched
        raised = False
        try:
            blob = self.storage.batch_get([key])[0]
        except l3.StorageError:
            blob, raised = None, True
        payload = l3.decode_page(key, blob)
        if payload is not None and payload == l3.page_payload(
            p.namespace, p.tokens, page, self.page_size, self.kv_layers
        ):
            self._fill_page(p, page)
            p.fetched += 1
        else:
            p.failed = True  # a miss, a torn or corrupt page: never wrong KV
            if raised:  # a read that raises loses its batch: the pages not yet published (FETCH)
                p.fetched = p.published
        ends = p.failed or p.fetched == len(p.keys)  # a batch's miss or the last page publishes everything
        fetch = self.decided.fetch
        publish = ends or (p.fetched % fetch.batch == 0 if fetch.publish is None else fetch.publish)
        if publish:
            p.published = p.fetched

    def _fill_page(self, p: Prefetching, page: int) -> None:
        """A verified page lands in the prefetch's next reserved host page: its entries, token by token.

        The payload was checked equal to the content function's, so its entries are `token_entries`
        of the path up to the page's end, sliced to the page.
        """
        start = p.fetched * self.page_size
        entries = l3.token_entries(p.namespace, p.tokens[: (page + 1) * self.page_size], self.kv_layers)
        self.host_kv.update(zip(p.host_slots[start : start + self.page_size], entries[page * self.page_size :]))

    def check_prefetch(self, prefetch_id: int) -> Optional[int]:
        """End the prefetch if its stop policy allows; then insert what was fetched.

        None: still running. Otherwise the host tokens the tree gained (new host-only nodes,
        and backups of device nodes the walk met, SPEC.md §10.4).
        """
        p = self._prefetching(prefetch_id)
        done = p.failed or p.fetched == len(p.keys)
        base, per_page = self.timeout
        expired = (
            self.prefetch_policy == "timeout"
            and p.waiting_since is not None
            and self.now - p.waiting_since > base + per_page * p.span_pages
        )
        if not (done or self.prefetch_policy == "best_effort" or expired):
            if p.waiting_since is None:
                p.waiting_since = self.now  # D11: the deadline starts at the first check that keeps it running
            return None
        return self._end_prefetch(p, keep=p.published * self.page_size, touch=True)

    def abort_prefetch(self, prefetch_id: int) -> None:
        """The request is gone: release everything, insert nothing."""
        self._end_prefetch(self._prefetching(prefetch_id), keep=0)

    def _end_prefetch(self, p: Prefetching, keep: int, touch: bool = False) -> int:
        """Insert the first `keep` prefetched tokens below the anchor; free the rest.

        The walk backs up a device node without a backup with the fetched pages under the
        write-through policies and walks past it under write-back (calibration D15). With
        `touch` (the prefetch ended by `check_prefetch`, not aborted) the insertion is an
        access: the anchor and every node the walk enters become the most recent (D16).
        """
        assert self.host is not None
        self.prefetches.remove(p)
        for n in p.host_locked:
            n.host_lock_ref -= 1
        node, at, added = p.anchor, p.start, 0
        end = p.start + keep
        kept: set[int] = set()
        if touch:
            node.last_access = self.now
        while at < end:
            child = node.children.get(self._selector(p.namespace, p.tokens[at:end]))
            if child is None:
                leaf = self._new_node(
                    parent=node,
                    namespace=p.namespace,
                    key=p.tokens[at:end],
                    slots=None,
                    host_slots=p.host_slots[at - p.start : keep],
                    last_access=self.now,
                    creation=self.now,
                )
                node.children[self._selector(p.namespace, leaf.key)] = leaf
                self._made(leaf)
                kept.update(leaf.host_slots or ())
                added += end - at
                break
            if touch:
                child.last_access = self.now
            run = pages.match_len(child.key, p.tokens[at:end], self.page_size)
            if run < len(child.key):
                child = self._split(child, run)
            if child.host_slots is None and self.write_policy != "write_back":
                child.host_slots = p.host_slots[at - p.start : at - p.start + run]  # D15: a refill backs it up
                kept.update(child.host_slots)
                added += run
            node, at = child, at + run  # D15: write_back walks past a device node without a backup
        self.host.release(tuple(slot for slot in p.host_slots if slot not in kept))
        return added
