# Over 600 lines: the MUTANTS table, one entry per bug class with its edit and why it is real, read as one catalogue.
"""The zoo's mutants: textual edits of the reference model (`refimpl/`), one real bug class each.

Each mutant names the model's modules it edits, and each `find` must occur exactly once in them, so a refactor of
the model breaks the zoo loudly instead of silently mutating nothing. `MUTANTS` are killed by generation; `DIRECTED` by hand-written traces
(`conformance.zoo.selftest.DIRECTED_TRACES`), generation being tried on them too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DIRECTED", "MUTANTS", "Mutant"]


@dataclass(frozen=True)
class Mutant:
    name: str
    doc: str
    """The real bug class this reproduces."""
    edits: tuple[tuple[str, str], ...]
    """(find, replace) pairs; each `find` occurs exactly once in the files named."""
    files: tuple[str, ...] = ()
    """The model's modules (`refimpl/<file>`) its edits touch."""
    page_sizes: tuple[int, ...] = (1, 4)
    policies: tuple[str, ...] = ("lru",)
    write_policies: tuple[str, ...] = ()
    """Host-tier cells to run; () runs the device-only cells."""
    prefetch_policies: tuple[str, ...] = ()
    """Storage cells to run (with `write_policies`) instead of the plain host-tier cells."""
    budget: int = 1
    """Examples per cell, as a multiple of the selftest's: for a bug class whose window generation enters
    rarely (the unmodified model's control run gets the same budget on the same cells)."""


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "lock_skips_self",
        "lock walk starts at the parent: the matched node itself stays evictable",
        (
            (
                "        cur: Optional[Node] = node\n        while cur is not None and cur is not self.root:",
                "        cur: Optional[Node] = node.parent\n        while cur is not None and cur is not self.root:",
            ),
        ),
        files=("tree.py",),
    ),
    Mutant(
        "size_units_mismatch",
        "evictable size credited in pages but debited in tokens",
        (
            (
                "            self.evictable_size += sign * len(node.key)\n",
                "            self.evictable_size += sign * (len(node.key) // self.page_size if sign > 0 else len(node.key))\n",
            ),
        ),
        files=("tree.py",),
        page_sizes=(4,),
    ),
    Mutant(
        "evict_frees_less",
        "eviction skips a leaf that would overshoot, freeing less than asked while leaves remain",
        (
            (
                "            victim = self._pick(leaves, choose)\n            if victim.host_slots is None and",
                "            victim = self._pick(leaves, choose)\n"
                "            if freed + len(victim.key) > n:\n                break\n"
                "            if victim.host_slots is None and",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "evict_never_stops",
        "eviction ignores the request size and drains every evictable leaf",
        (
            (
                "        while freed < n:\n            leaves = [v for v in self.evictable_leaves() if v.id not in skipped]",
                "        while True:\n            leaves = [v for v in self.evictable_leaves() if v.id not in skipped]",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "split_drops_lock",
        "split creates the prefix node with lock_ref 0 instead of the child's",
        (("            lock_ref=child.lock_ref,\n", "            lock_ref=0,\n"),),
        files=("tree.py",),
    ),
    Mutant(
        "match_crosses_namespace",
        "child selector ignores the namespace (extra_key): prefixes leak across LoRA ids",
        (
            (
                "        return namespace, pages.first_page(key, self.page_size)",
                "        return None, pages.first_page(key, self.page_size)",
            ),
        ),
        files=("tree.py",),
    ),
    Mutant(
        "split_unaligned",
        "split at the raw common prefix instead of a page boundary",
        (
            (
                "            n = pages.match_len(child.key, key[matched:], self.page_size)",
                "            n = pages.common_prefix_len(child.key, key[matched:])",
            ),
            (
                "        head_key, tail_key = pages.split_key(child.key, at, self.page_size)",
                "        head_key, tail_key = child.key[:at], child.key[at:]",
            ),
        ),
        files=("tree.py",),
        page_sizes=(4,),
    ),
    Mutant(
        "double_free_on_evict",
        "an evicted leaf's slots are pushed onto the free list twice",
        (
            (
                "        self.pool.release(leaf.slots or ())\n",
                "        self.pool.release(leaf.slots or ())\n        self.pool.release((leaf.slots or ())[:1])\n",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "unlock_below_zero",
        "dec_lock_ref accepted with no lock held: counts go negative",
        (
            (
                "        if node.own_locks == 0:\n            raise LockUnderflow",
                "        if node.own_locks < 0:\n            raise LockUnderflow",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "evict_locked",
        "eviction candidates ignore lock_ref: a node in use is freed",
        (
            (
                "            and n.slots is not None\n            and n.lock_ref == 0\n            and not any(",
                "            and n.slots is not None\n            and not any(",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "stale_handle_accepted",
        "a handle to an evicted node is still accepted, locking a detached path",
        (
            (
                "        del self.nodes[leaf.id]\n",
                "        self.graveyard = getattr(self, 'graveyard', {})\n        self.graveyard[leaf.id] = self.nodes.pop(leaf.id)\n",
            ),
            (
                "        node = self.nodes.get(node_id) if isinstance(node_id, int) else None\n",
                "        node = self.nodes.get(node_id) if isinstance(node_id, int) else None\n"
                "        node = node or getattr(self, 'graveyard', {}).get(node_id)\n",
            ),
        ),
        files=("device.py", "tree.py"),
    ),
    Mutant(
        "evict_leaks_slots",
        "an evicted leaf's slots never return to the pool",
        (("        self.pool.release(leaf.slots or ())\n", ""),),
        files=("device.py",),
    ),
    Mutant(
        "insert_overwrites_prefix",
        "insert replaces the slots of an already-cached prefix with the new request's slots",
        (
            (
                "        def hit(node: Node) -> None:\n            reached[0] += len(node.key)\n",
                "        def hit(node: Node) -> None:\n            reached[0] += len(node.key)\n"
                "            node.slots = tuple(slots[:len(node.slots)])\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "match_does_not_touch",
        "match_prefix does not refresh last_access: LRU evicts a prefix that was just used",
        (
            (
                "            child.last_access = self.now\n            n = pages.match_len",
                "            child.last_access = child.last_access if on_node is None else self.now\n            n = pages.match_len",
            ),
            (
                "        _, path = self._walk(namespace, key, lambda n: None)",
                "        _, path = self._walk(namespace, key, None)",
            ),
            ("            on_node(child)\n", "            if on_node is not None:\n                on_node(child)\n"),
        ),
        files=("tree.py", "device.py"),
        page_sizes=(1,),
    ),
    Mutant(
        "lfu_ignores_hits",
        "LFU never counts hits on re-insert, so a hot prefix ranks as cold",
        (("            node.hit_count += 1\n", "            pass\n"),),
        files=("device.py",),
        page_sizes=(1,),
        policies=("lfu",),
    ),
    # ------------------------------------------------------------------ host tier (SPEC.md §9)
    Mutant(
        "demote_without_backup",
        "eviction demotes a node that has no host copy: its KV is on neither tier (silent loss)",
        (("            if victim.host_slots is not None:\n", "            if True:\n"),),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_through_selective",),
    ),
    Mutant(
        "selective_ignores_threshold",
        "write_through_selective backs up on the first hit, like write_through",
        (("and node.hit_count >= threshold", "and node.hit_count >= 1"),),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through_selective",),
    ),
    Mutant(
        "write_ack_keeps_lock",
        "a consumed write ack never releases its node: protected size grows forever",
        (("                    self._lock_path(anchor, -1)\n", "                    pass\n"),),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "host_evicts_device_nodes",
        "host eviction also takes backed-up leaves still on the device: their device KV is orphaned",
        (
            (
                "            and n.slots is None\n            and not n.children\n",
                "            and not n.children\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "split_drops_prefix_backup",
        "a split keeps the host copy of the suffix only: the prefix's host pages leak",
        (
            (
                "        head_host, child_host = _cut(child.host_slots, at)\n",
                "        head_host, child_host = None, _cut(child.host_slots, at)[1]\n",
            ),
        ),
        files=("tree.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "restore_frees_host_keeps_flag",
        "restoring an evicted node frees its host pages but the node still claims them (seed 003)",
        (
            (
                "                self.pool.adopt(node.slots)\n",
                "                self.pool.adopt(node.slots)\n                self.host.release(node.host_slots or ())  # type: ignore[union-attr]\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "load_without_host_lock",
        "load-back leaves the host copy unprotected until the ack",
        (
            (
                "        slots = self.pool.alloc(size)\n        self.pool.adopt(slots)\n",
                "        slots = self.pool.alloc(size)\n        self.pool.adopt(slots)\n        node.host_lock_ref -= 1\n",
            ),
            ("                    n.host_lock_ref -= 1\n", "                    pass\n"),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "load_back_refusal_leaks_lock",
        "a load-back refused for lack of device room keeps its lock: the path is pinned forever (seed 003)",
        (
            (
                "            self._lock_path(node, -1)\n            node.host_lock_ref -= 1\n            return 0\n",
                "            node.host_lock_ref -= 1\n            return 0\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1, 4),
        write_policies=("write_through",),
    ),
    Mutant(
        "match_crosses_evicted_node",
        "the device match does not stop at an evicted node: host-only tokens count as device hits (seed 003)",
        (
            (
                "        device = [n for n in path if n.slots is not None]  # a prefix of the path (INV-HOST-2)\n",
                "        device = list(path)\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "match_slots_out_of_order",
        "the matched slots are joined leaf first: a two-node prefix hands the request its KV pages in the wrong order",
        (
            (
                "            slots=tuple(x for n in device for x in n.slots or ()),\n",
                "            slots=tuple(x for n in reversed(device) for x in n.slots or ()),\n",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "host_hit_counts_device_part",
        "the host hit length counts the device-resident head again: the scheduler loads back tokens it already has",
        (
            (
                "            host_length=sum(len(n.key) for n in on_host),\n",
                "            host_length=sum(len(n.key) for n in path),\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "load_back_counts_last_node",
        "load_back reports the tokens of the node asked for, not of the whole host-only chain it loaded",
        (
            (
                '        self.copies.append(Copy(self._next_copy, "load", chain, anchors=[node], host_locked=held))\n'
                "        self._next_copy += 1\n        return size\n",
                '        self.copies.append(Copy(self._next_copy, "load", chain, anchors=[node], host_locked=held))\n'
                "        self._next_copy += 1\n        return len(node.key)\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "restore_leaks_host_value",
        "restoring an evicted node drops its host copy without freeing the host pages (seed 003)",
        (
            (
                "                self.pool.adopt(node.slots)\n",
                "                self.pool.adopt(node.slots)\n                node.host_slots = None\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "reclaim_during_inflight_load",
        "write-back's host reclaim ignores in-flight loads and host locks: it frees pages a load is reading",
        (("            and n.host_lock_ref == 0\n            and id(n) not in moving\n", ""),),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_back",),
    ),
    Mutant(
        "host_leaves_ignore_locks",
        "the host-leaf set is computed from the host lock alone: a locked host-only node is host-evicted",
        (("            and not n.children\n            and n.lock_ref == 0\n", "            and not n.children\n"),),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_back",),
    ),
    Mutant(
        "split_copy_keeps_suffix",
        "a split between a backup's issue and its ack leaves the new prefix half out of the copy",
        (("            if child in copy.nodes:\n                copy.nodes.append(head)\n", ""),),
        files=("tree.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    # ------------------------------------------------------------------ storage tier (SPEC.md §10)
    Mutant(
        "prefetch_zero_of_zero",
        "a prefetch with no stored page is issued anyway and reports '0 of 0 pages' complete",
        (
            ("        if size == 0 or self.host is None:\n", "        if self.host is None:\n"),
            ("        if take < self.page_size:\n", "        if take < min(size, self.page_size):\n"),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("wait_complete",),
    ),
    Mutant(
        "prefetch_anchor_unpinned",
        "a running prefetch does not protect its anchor: host eviction frees the node its pages hang from",
        (
            (
                "        if anchor is not self.root:\n"
                "            anchor.host_lock_ref += 1  # before making room: the anchor must not be the room made\n",
                "",
            ),
            (
                "            if anchor is not self.root:\n                anchor.host_lock_ref -= 1\n            return 0\n",
                "            return 0\n",
            ),
            ("        locked = [anchor] if anchor is not self.root else []\n", "        locked: list[Node] = []\n"),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("wait_complete",),
    ),
    Mutant(
        "fetch_trusts_storage",
        "a fetched page is used without its checksum and content check: a torn or corrupt page becomes KV",
        (
            (
                "        if payload is not None and payload == l3.page_payload(",
                "        if blob is not None or payload == l3.page_payload(",
            ),
        ),
        files=("storage.py",),
        page_sizes=(1, 4),
        write_policies=("write_through", "write_back"),
        prefetch_policies=("wait_complete",),
    ),
    Mutant(
        "deferred_prefetch_never_retriggered",
        "a request whose prefetch found nothing is never prefetched again, even once storage has it (seed 003)",
        (
            (
                "        if size == 0 or self.host is None:\n            return 0\n",
                "        if size == 0 or self.host is None:\n"
                "            self._tried = getattr(self, '_tried', set()) | {(namespace, key)}\n"
                "            return 0\n",
            ),
            (
                "        keys = l3.page_keys(namespace, key, self.page_size, self.digest)[start // self.page_size :]\n",
                "        if (namespace, key) in getattr(self, '_tried', set()):\n            return 0\n"
                "        keys = l3.page_keys(namespace, key, self.page_size, self.digest)[start // self.page_size :]\n",
            ),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "demote_after_failed_write_back",
        "write-back demotes a victim whose backup failed: its KV is on neither tier (seed 003)",
        (
            (
                "            if victim.host_slots is not None:\n",
                '            if victim.host_slots is not None or self.write_policy == "write_back":\n',
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_back",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "failed_store_visible",
        "the cache indexes pages it meant to store, so a failed storage write stays visible to lookups",
        (
            (
                "                self.storage.batch_set(keys, values)\n",
                "                self._index = getattr(self, '_index', set()) | set(keys)\n"
                "                self.storage.batch_set(keys, values)\n",
            ),
            (
                "        hit = self.storage.batch_exists(keys)\n",
                "        hit = next((i for i, k in enumerate(keys) if k not in getattr(self, '_index', set())"
                " and not self.storage.batch_exists([k])), len(keys))\n",
            ),
        ),
        files=("host.py", "storage.py"),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort", "wait_complete", "timeout"),
    ),
    Mutant(
        "retracted_resume_without_last_node",
        "a resumed retracted request gets no locked last node, so its final unlock has nothing to release (seed 003)",
        (("        self.root.own_locks += 1\n        return self.root.id\n", "        return self.root.id\n"),),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "failed_copy_acked_as_done",
        "a failed device-to-host copy is acked like a finished one: the node can be demoted onto garbage host KV",
        (
            (
                "                return  # a failed device<->host copy is retried",
                "                copy.finished = True\n                return  # a failed device<->host copy is retried",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "failed_store_copy_written",
        "a store copy the copy engine failed still lands in storage",
        (
            (
                "            copy.finished = True\n            return  # a failed store copy ends without writing",
                "            copy.finished = True  # a failed store copy ends without writing",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "retraction_discard_leaks_host",
        "discarding a retraction backup forgets it without freeing its host slots",
        (
            (
                "        self.retractions.remove(backup)\n        self.host.release(backup.host_slots)\n",
                "        self.retractions.remove(backup)\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "retraction_without_reclaim",
        "a retraction backup gives up when the host pool is full instead of host-evicting to make room",
        (
            (
                "        host_slots = self._host_alloc(pages.page_ceil(len(slots), self.page_size), reclaim_all=True)  # D17\n",
                "        need = pages.page_ceil(len(slots), self.page_size)\n"
                "        host_slots = self._host_alloc(need, reclaim_all=True) if len(self.host.free_list) >= need else None\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1, 4),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    # ------------------------------------------------------------- priority tiers (SPEC.md §11)
    Mutant(
        "high_ref_evicted_for_low_requester",
        "a low-priority requester's eviction (allow_high=False) still takes HIGH_REF nodes",
        (
            (
                "        return tier == 0 or (tier == 1 and allow_low) or (tier == 2 and allow_high)\n",
                "        return tier == 0 or (tier == 1 and allow_low) or tier == 2\n",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "split_drops_refs",
        "a split's new prefix node starts with no refs: the tier sets miss it until the sessions move",
        (("            high_ref=child.high_ref,\n            low_ref=child.low_ref,\n", ""),),
        files=("tree.py",),
    ),
    Mutant(
        "host_eviction_leaks_refs",
        "host eviction deletes a session's last node but the session still holds it (a ref on a dead node)",
        (
            (
                "        self.host.release(node.host_slots or ())\n        self._sessions_leave(node)\n",
                "        self.host.release(node.host_slots or ())\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "eviction_scope_leaks",
        "a scoped eviction's (allow_low, allow_high) is never popped: the next plain evict inherits it",
        (("            self.scope = outer  # the scope belongs to this call (SPEC.md §11.3)\n", "            pass\n"),),
        files=("device.py",),
    ),
    Mutant(
        "partial_residency_over_budget",
        "partial residency is admitted on the streaming time alone, forgetting the decode step's own time",
        (
            (
                "                or profile.step + (layers_all - layers) * tokens * (profile.load + profile.store)",
                "                or (layers_all - layers) * tokens * (profile.load + profile.store)",
            ),
        ),
        files=("sessions.py",),
        budget=2,  # seed 0 meets a profile whose step alone tips the residency only past the first budget since
        # half of a retain-capable backend's session steps became tool calls
    ),
    Mutant(
        "high_priority_retracted",
        "admission retracts any running request, high-priority ones included",
        (
            (
                "        low = [r for r in running if r.priority < self.threshold]  # a high-priority request is never",
                "        low = list(running)  # a high-priority request is never",
            ),
        ),
        files=("sessions.py",),
    ),
    Mutant(
        "tier_size_drift",
        "a ref change moves a node between tiers without moving its tokens between the per-tier sizes",
        (
            (
                "            if node.slots is not None:\n"
                "                self._account(node, -1)\n"
                "            if high:\n"
                "                node.high_ref += sign\n"
                "            else:\n"
                "                node.low_ref += sign\n"
                "            if node.slots is not None:\n"
                "                self._account(node, +1)\n",
                "            if high:\n                node.high_ref += sign\n            else:\n                node.low_ref += sign\n",
            ),
        ),
        files=("sessions.py",),
    ),
    Mutant(
        "reregister_keeps_old_refs",
        "registering a session again adds refs on its new path and never drops those on the path it left (the RefAware "
        "fork's R2: a conversation that moves to another branch keeps protecting the old one)",
        (("            self._hold(old, -1)\n", "            pass  # the old path keeps its refs\n"),),
        files=("sessions.py",),
    ),
    Mutant(
        "demotion_counts_twice",
        "a demotion adds the session's low refs without taking away its high ones: its nodes count in both tiers",
        (("        self._hold(victim, -1)\n", ""),),
        files=("sessions.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "host_eviction_strands_session",
        "a host-only node a session ends at is host-evicted and the session still names it: refs for a node gone",
        (("        self._sessions_leave(node)\n", ""),),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "host_evicts_high_tier",
        "host eviction treats HIGH_REF host copies like any other: a waiting high-priority session loses them",
        (("            and self.tier(n) != HIGH_REF\n", ""),),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    # ------------------------------------------------------------- KV bytes (SPEC.md §9.12)
    Mutant(
        "split_host_slices_swapped",
        "a split cuts the host copy from the wrong end: each half gets the right number of host slots, "
        "holding the other half's KV",
        (
            (
                "        head_host, child_host = _cut(child.host_slots, at)\n",
                "        child_host, head_host = _cut(child.host_slots, len(child.key) - at)\n",
            ),
        ),
        files=("tree.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "load_back_slots_leaf_first",
        "a load-back hands the chain's fresh device slots out leaf first while its copy fills them root first",
        (
            (
                "        for n in chain:\n            n.slots = tuple(slots[offset : offset + len(n.key)])\n",
                "        for n in reversed(chain):\n            n.slots = tuple(slots[offset : offset + len(n.key)])\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "restore_reversed",
        "a retraction restore copies the backup into the request's slots back to front",
        (
            (
                "        _move_kv(self.host_kv, backup.host_slots[: backup.tokens], self.kv, slots)",
                "        _move_kv(self.host_kv, backup.host_slots[: backup.tokens], self.kv, slots[::-1])",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "prefetch_keeps_unfetched_slots",
        "a prefetch that ends early hangs the last reserved host slots on the new node, not the fetched ones",
        (
            (
                "                    host_slots=p.host_slots[at - p.start : keep],\n",
                "                    host_slots=p.host_slots[len(p.host_slots) - (end - at) :],\n",
            ),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_through_selective",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "prefetch_end_not_an_access",
        "ending a prefetch is not an access: the anchor and the nodes its pages join keep their old "
        "recency, and LRU evicts them first (calibration D16)",
        (
            (
                "        return self._end_prefetch(p, keep=p.published * self.page_size, touch=True)\n",
                "        return self._end_prefetch(p, keep=p.published * self.page_size, touch=False)\n",
            ),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_back",),
        prefetch_policies=("best_effort", "wait_complete"),
        # Seen only when a deferred prefetch ends after other requests touched the tree and an eviction then
        # ranks its anchor (at quiescence, write-back's backups in eviction order): at 600 examples per cell,
        # each generator this suite has had killed it at about half to two thirds of seeds; at 4x, at 7 or 8 of 8
        # (docs/speed.md: scripts/kill_rate.py). Since SGLang's storage batches (FETCH) an early end keeps no page,
        # so the cells are the policies whose ends insert: wait_complete, and best_effort after the last page
        # (5 of 6 seeds at 600 examples).
        budget=4,
    ),
    # ---- Each killed by one core rule alone (SPEC.md §6.4; tests/test_profiles.py ALONE, scripts/alone.py):
    # accounting, slots, shape, namespaces, handles and reports that only their own rule sees.
    # ---- alone: device tier
    Mutant(
        "protected_counts_locks",
        "protected_size counts a node's tokens once per lock on it, not once per locked node",
        (
            (
                "            self.protected_size += sign * len(node.key)\n",
                "            self.protected_size += sign * len(node.key) * node.lock_ref\n",
            ),
        ),
        files=("tree.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "alloc_cut_off_by_one",
        "alloc cuts the free list one entry late (as if entry 0 were a padding slot): the first slot it "
        "hands out stays free and the slot after its run is lost",
        (("        del self.free_list[:n]\n", "        del self.free_list[1 : n + 1]\n"),),
        files=("records.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "split_rehomes_prefix",
        "a split of a node no one locks compacts the new prefix's KV into fresh slots and frees the old ones: "
        "slots a caller matched before the split now point at free memory",
        (
            (
                "        head_slots, child_slots = _cut(child.slots, at)  # bytes stay in their slots: cutting moves none\n",
                "        head_slots, child_slots = _cut(child.slots, at)\n"
                "        if head_slots is not None and not child.lock_ref and len(self.pool.free_list) >= len(head_slots):\n"
                "            fresh = self.pool.alloc(len(head_slots))\n"
                "            self.pool.adopt(fresh)\n"
                "            _move_kv(self.kv, head_slots, self.kv, fresh)\n"
                "            self.pool.release(head_slots)\n"
                "            head_slots = fresh\n",
            ),
            ("    _cut,\n)\n", "    _cut,\n    _move_kv,\n)\n"),  # the compaction copies KV: tree.py needs the helper
        ),
        files=("tree.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "alloc_pops_descending",
        "alloc pops slots one by one off the end of the free list: each page comes out descending, "
        "not as one aligned device page",
        (
            (
                "        taken = tuple(self.free_list[:n])\n        del self.free_list[:n]\n",
                "        taken = tuple(self.free_list.pop() for _ in range(n))\n",
            ),
        ),
        files=("records.py",),
        page_sizes=(4,),
    ),
    Mutant(
        "relock_not_counted",
        "a node locked again by the same owner counts one lock on its path: lock_ref counts locked nodes, not locks",
        (
            (
                "        node.own_locks += 1\n        self._lock_path(node, +1)\n",
                "        node.own_locks += 1\n        if node.own_locks == 1:\n            self._lock_path(node, +1)\n",
            ),
            (
                "        node.own_locks -= 1\n        self._lock_path(node, -1)\n",
                "        node.own_locks -= 1\n        if node.own_locks == 0:\n            self._lock_path(node, -1)\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "split_suffix_loses_namespace",
        "a split re-keys the suffix node from a token slice that drops its namespace (extra key)",
        (
            (
                "        child.key, child.slots, child.host_slots, child.parent = tail_key, child_slots, child_host, head\n",
                "        child.key, child.slots, child.host_slots, child.parent = tail_key, child_slots, child_host, head\n"
                "        child.namespace = None\n",
            ),
        ),
        files=("tree.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "handle_index_ignores_namespace",
        "a match's handle is looked up in a token-path index that ignores the namespace: it can be another "
        "namespace's node with the same tokens",
        (
            (
                "            node.children[self._selector(namespace, leaf.key)] = leaf\n",
                "            node.children[self._selector(namespace, leaf.key)] = leaf\n"
                "            self.by_tokens = getattr(self, 'by_tokens', {})\n"
                "            self.by_tokens[tuple(key)] = leaf\n",
            ),
            (
                "            node=device[-1].id if device else self.root.id,\n",
                "            node=(lambda hit, own: hit.id if hit is not None and hit.id in self.nodes else own)(\n"
                "                getattr(self, 'by_tokens', {}).get(tuple(key[: sum(len(n.key) for n in device)])),\n"
                "                device[-1].id if device else self.root.id,\n"
                "            ),\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "insert_prefix_excludes_own_head",
        "insert reports as prefix only the duplicates it was handed, not a head the caller passed back as the "
        "tree's own slots (a running request's checkpoint)",
        (
            (
                "        return InsertOut(prefix_len=prefix_len, node=node.id)\n",
                "        k = next((i for i, (a, b) in enumerate(zip(slots, held)) if a != b), min(len(slots), len(held)))\n"
                "        return InsertOut(prefix_len=prefix_len - min(k, prefix_len), node=node.id)\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "insert_returns_walk_end",
        "insert returns the node its walk ended on, not the new leaf it hung below it",
        (("            path.append(leaf)\n            node = leaf\n", "            path.append(leaf)\n"),),
        files=("device.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "evict_reports_asked",
        "evict reports at most what it was asked for: the overshoot of the last whole node is freed but not counted",
        (
            (
                "                self._delete_leaf(victim)\n            freed += len(victim.key)\n        return freed\n",
                "                self._delete_leaf(victim)\n            freed += len(victim.key)\n        return min(freed, n)\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "kv_write_floors_pages",
        "write_kv counts pages with floor division: a partial last page's entries are never written",
        (
            (
                "        self.kv.update(zip(slots, entries))\n",
                "        whole = len(slots) // self.page_size * self.page_size\n"
                "        self.kv.update(zip(slots[:whole], entries[:whole]))\n",
            ),
        ),
        files=("cache.py",),
        page_sizes=(4,),
    ),
    Mutant(
        "insert_no_path_compression",
        "insert hangs the new part as a chain of one-page nodes instead of one edge (no path compression)",
        (
            (
                "        if matched < len(key):\n            leaf = self._new_node(\n                parent=node,\n"
                "                namespace=namespace,\n                key=key[matched:],\n"
                "                slots=tuple(slots[matched:]),\n",
                "        while matched < len(key):\n            leaf = self._new_node(\n                parent=node,\n"
                "                namespace=namespace,\n                key=key[matched : matched + self.page_size],\n"
                "                slots=tuple(slots[matched : matched + self.page_size]),\n",
            ),
            (
                "            path.append(leaf)\n            node = leaf\n",
                "            path.append(leaf)\n            node = leaf\n            matched += len(leaf.key)\n",
            ),
        ),
        files=("device.py",),
    ),
    Mutant(
        "slot_ids_one_based",
        "slot ids are one-based (slot 0 kept for padding, as in SGLang's pool) but the pool is not enlarged for it: "
        "the last slot id is one past the end",
        (
            (
                "        self.free_list: list[int] = list(range(capacity))\n",
                "        self.free_list: list[int] = list(range(1, capacity + 1))\n",
            ),
            ("        _check_ids(slots, self.pool.capacity)\n", "        _check_ids(slots, self.pool.capacity + 1)\n"),
        ),
        files=("records.py", "cache.py"),
        page_sizes=(1,),
    ),
    Mutant(
        "free_group_left_open",
        "a caller's free goes into a free group that the free path never closes; the allocator merges the group "
        "on its next call (as SGLang's allocator merges its release list lazily): between calls the pool reports "
        "the freed slots as neither free nor owned, and admission sees less room than there is",
        (
            (
                '        self.require_lent(slots, "free")\n        self.lent.difference_update(slots)\n'
                "        self.free_list.extend(slots)\n",
                '        self.require_lent(slots, "free")\n        self.lent.difference_update(slots)\n'
                "        self.group = [*getattr(self, 'group', []), *slots]\n",
            ),
            (
                "        if n > len(self.free_list):\n            raise PoolExhausted",
                "        self.free_list += getattr(self, 'group', [])\n        self.group = []\n"
                "        if n > len(self.free_list):\n            raise PoolExhausted",
            ),
        ),
        files=("records.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "evicted_node_lingers",
        "eviction unlinks a leaf from its parent and frees its KV but leaves it in the node registry that "
        "enumerates the tree and resolves handles: a detached node with no parent, no KV and a live id",
        (
            (
                "        del self.nodes[leaf.id]\n        self._account(leaf, -1)\n"
                "        self.pool.release(leaf.slots or ())\n        self._sessions_leave(leaf)\n",
                "        self._account(leaf, -1)\n        self.pool.release(leaf.slots or ())\n"
                "        self._sessions_leave(leaf)\n        leaf.parent, leaf.slots = None, None\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "evict_empty_crashes",
        "eviction picks a victim without checking that a candidate is left: min() of nothing raises",
        (
            (
                "            if not leaves:\n                break\n            victim = self._pick(leaves, choose)\n",
                "            victim = self._pick(leaves, choose)\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
    ),
    # ---- alone: host tier (SPEC.md §9)
    Mutant(
        "restore_deferred_host_free",
        "a restored retraction backup's host slots go on a deferred-free list that only the next device eviction "
        "drains (a free group opened on the restore path): until then the host pool is short by them",
        (
            (
                "        self._drop_retraction(backup)\n        self.root.own_locks += 1\n",
                "        self.retractions.remove(backup)\n"
                "        self._deferred = getattr(self, '_deferred', []) + list(backup.host_slots)\n"
                "        self.root.own_locks += 1\n",
            ),
            (
                "        freed = 0\n        skipped: set[int] = set()\n",
                "        freed = 0\n        skipped: set[int] = set()\n"
                "        if self.host is not None:  # the free group ends here\n"
                "            self.host.release(getattr(self, '_deferred', []))\n"
                "            self._deferred = []\n",
            ),
        ),
        files=("host.py", "device.py"),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "host_pool_pops_reversed",
        "the host pool hands slots out token by token off the top of a stack: at page size > 1 a backup's "
        "pages come out reversed, not as aligned ascending pages",
        (
            (
                "        slots = self.host.alloc(n)\n        self.host.adopt(slots)\n",
                "        slots = self.host.alloc(n)\n        self.host.adopt(slots)\n        slots = slots[::-1]\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(4,),
        write_policies=("write_through",),
    ),
    Mutant(
        "evict_host_uncounts_reclaim",
        "write-back host eviction returns only the host-only leaves it removed: the settled duplicate backups "
        "its first phase dropped are freed but not counted",
        (
            (
                "            victim.host_slots = None\n            freed += len(victim.key)\n"
                "        while freed < n and self.host is not None:\n",
                "            victim.host_slots = None\n            freed += len(victim.key)\n"
                "        reclaimed = freed\n"
                "        while freed < n and self.host is not None:\n",
            ),
            (
                "        return freed\n\n    def _evict_host_by_rank",
                "        return freed - reclaimed\n\n    def _evict_host_by_rank",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_back",),
    ),
    Mutant(
        "write_back_restore_drops_backup",
        "under write-back, inserting over an evicted node treats the restored KV as dirty: its host copy is "
        "freed, and the next eviction writes the same KV back again",
        (
            (
                "                self.pool.adopt(node.slots)\n",
                "                self.pool.adopt(node.slots)\n"
                '                if self.write_policy == "write_back":\n'
                "                    self.host.release(node.host_slots or ())  # type: ignore[union-attr]\n"
                "                    node.host_slots = None\n",
            ),
        ),
        files=("device.py",),
        page_sizes=(1,),
        write_policies=("write_back",),
    ),
    Mutant(
        "split_host_lock_not_segment",
        "host locks are counts on the node they were taken on, not segments: a split of a loading node leaves "
        "the new prefix half's host copy unprotected until the ack",
        (
            ("            host_lock_ref=child.host_lock_ref,\n", "            host_lock_ref=0,\n"),
            ("            if child in copy.host_locked:\n                copy.host_locked.append(head)\n", ""),
            (
                "        for p in self.prefetches:  # so does a prefetch's protection of its anchor\n"
                "            if child in p.host_locked:\n                p.host_locked.append(head)\n",
                "",
            ),
        ),
        files=("tree.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "poll_count_reset_per_queue",
        "poll's ack counter is reset for each queue: it reports only the store queue's acks, not every ack it consumed",
        (
            (
                '        consumed = 0\n        for kind in ("write", "load", "store"):\n',
                '        for kind in ("write", "load", "store"):\n            consumed = 0\n',
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    # ---- alone: storage tier (SPEC.md §10)
    Mutant(
        "failed_prefetch_frees_reservation_early",
        "a prefetch whose fetch fails gives its unfetched pages' host slots back at once while still "
        "reporting them requested: the reservation no longer matches the request",
        (
            (
                "            p.failed = True  # a miss, a torn or corrupt page: never wrong KV\n",
                "            p.failed = True  # a miss, a torn or corrupt page: never wrong KV\n"
                "            self.host.release(p.host_slots[p.fetched * self.page_size :])  # type: ignore[union-attr]\n"
                "            p.host_slots = p.host_slots[: p.fetched * self.page_size]\n",
            ),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("wait_complete",),
    ),
    Mutant(
        "prefetch_reports_unshrunk",
        "a prefetch shrunk to the host room left (D9) reports the stored run it looked up, not the part it reserved",
        (
            ("        size = len(slots)  # D9: the part that fits\n", "        asked, size = size, len(slots)  # D9\n"),
            (
                "        self._next_prefetch += 1\n        return size\n",
                "        self._next_prefetch += 1\n        return asked\n",
            ),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "prefetch_end_counts_fetched",
        "check_prefetch reports the tokens fetched, not the host tokens the tree gained: fetched pages the tree "
        "already holds (write-back walks past a device node, D15) count again",
        (
            (
                "        self.host.release(tuple(slot for slot in p.host_slots if slot not in kept))\n        return added\n",
                "        self.host.release(tuple(slot for slot in p.host_slots if slot not in kept))\n        return keep\n",
            ),
        ),
        files=("storage.py",),
        page_sizes=(1,),
        write_policies=("write_back",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "retraction_backup_one_extra",
        "a retraction backup reserves room for one more token than the request holds (decode-length off by one)",
        (
            (
                "pages.page_ceil(len(slots), self.page_size), reclaim_all=True)  # D17\n",
                "pages.page_ceil(len(slots) + 1, self.page_size), reclaim_all=True)  # D17\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
    ),
    Mutant(
        "retraction_reclaim_without_retry",
        "a retraction backup short of host room host-evicts for it, then gives up instead of retrying the "
        "allocation (D17: SGLang reclaims and retries once)",
        (
            (
                "        host_slots = self._host_alloc(pages.page_ceil(len(slots), self.page_size), reclaim_all=True)  # D17\n",
                "        need = pages.page_ceil(len(slots), self.page_size)\n"
                "        if len(self.host.free_list) < need:  # type: ignore[union-attr]\n"
                "            self.evict_host(need, choose=self.decided.reclaim.host or self.decided.rank.pick)\n"
                "            return None\n"
                "        host_slots = self._host_alloc(need, reclaim_all=True)  # D17\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
        prefetch_policies=("best_effort",),
        budget=2,  # a backup short of host room while the host holds only what it may evict: first met after 660
    ),
    # ---- alone: priority tiers (SPEC.md §11)
    Mutant(
        "rank_ignores_tiers",
        "eviction ranks by the policy alone: a session's idle path goes before KV no session holds",
        (
            (
                "        return (tier, *held, node.high_ref, node.low_ref, *policy)\n",
                "        return tuple(policy)\n",
            ),
        ),
        files=("tree.py",),
        page_sizes=(4,),  # seed 0: the page-1 device cell survives 600 examples, the page-4 one kills it in 4 ops
    ),
    Mutant(
        "reregister_keeps_priority",
        "registering a session again moves it to its new path but keeps its first priority",
        (
            (
                "        session = Session(session_id, node, priority, self._next_seq)\n",
                "        session = Session(session_id, node, old.priority if old is not None else priority, self._next_seq)\n",
            ),
        ),
        files=("sessions.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "admission_refusal_drops_scope",
        "a refused admission returns a default plan: a high-priority request's refusal reports allow_high=False",
        (("        return AdmissionPlan(False, allow_high=high)\n", "        return AdmissionPlan(False)\n"),),
        files=("sessions.py",),
        page_sizes=(1,),
    ),
    Mutant(
        "waiting_retention_runs_out",
        "a retention runs out at its TTL although the session's next turn arrived within it and still waits",
        (
            (
                "        return session.until is not None and (session.waiting or self.now < session.until)\n",
                "        return session.until is not None and self.now < session.until\n",
            ),
        ),
        files=("sessions.py",),
        page_sizes=(1,),
    ),
)


DIRECTED: tuple[Mutant, ...] = (
    Mutant(
        "acks_out_of_order",
        "acks consumed past an unfinished one: a later copy is published before an earlier one",
        (
            (
                "                if not copy.finished:\n                    break\n",
                "                if not copy.finished:\n                    continue\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1, 4),
        write_policies=("write_through",),
    ),
    Mutant(
        "write_acks_drained_on_one_path",
        "write acks are drained only when no load is pending: protected size grows while loads run",
        (
            (
                "            for copy in [c for c in self.copies if c.kind == kind]:\n",
                '            if kind == "write" and any(c.kind == "load" for c in self.copies):\n'
                "                continue\n"
                "            for copy in [c for c in self.copies if c.kind == kind]:\n",
            ),
        ),
        files=("host.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "demotion_never_restored",
        "releasing a high-priority session pops a demoted session but never makes it high again",
        (("        back.demoted = False\n", ""),),
        files=("sessions.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "demotes_longest_session",
        "host pressure demotes the idle high-priority session with the most cached tokens, not the fewest",
        (
            (
                "            victim = min(spare or candidates, key=lambda s: (-self._deadline(s), len(self._full_path(s.node)), "
                "s.seq))\n",
                "            victim = max(spare or candidates, key=lambda s: (len(self._full_path(s.node)), -s.seq))\n",
            ),
        ),
        files=("sessions.py",),
        page_sizes=(1,),
        write_policies=("write_through",),
    ),
    Mutant(
        "tier_ignores_ref_counts",
        "within a tier the policy alone orders victims: a node many sessions hold goes before one held by few",
        (
            (
                "        return (tier, *held, node.high_ref, node.low_ref, *policy)\n",
                "        return (tier, *held, *policy)\n",
            ),
        ),
        files=("tree.py",),
    ),
)
"""Mutants the state machine kills in only some runs at the zoo's budget: each is killed by a
hand-written trace (`conformance.zoo.selftest.DIRECTED_TRACES`), and `kvcert selftest` also runs each through
generation and reports whether it reached it, so the day it does shows. `write_acks_drained_on_one_path` was killed only after 157–344 of 600 examples
at seeds 0–2, and survived in some runs (see `run_mutant_isolated`); `demotion_never_restored` needs a demoted session and a high one to coexist
when the high one ends (seed 0 took 48 ops and most of the budget); `demotes_longest_session` needs two idle high-priority sessions on the host
while host eviction has nothing UNUSED or LOW_REF left; `tier_ignores_ref_counts` needs two same-tier candidates held by different
numbers of sessions with the policy preferring the busier one; 600 examples at seed 0 did not
build that (`failed_store_visible` left this list once warm storage requests reached it)."""
