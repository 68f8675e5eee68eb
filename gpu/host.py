"""The host tier (SPEC.md §9): host pool bookkeeping, backups, host eviction, load-back, retraction.

`HostTier` owns the pinned host pool and its allocator (which carries the armed `host_alloc`
faults) and everything that moves KV onto, within or off the host: write-through backups (one
write copy per insert, parents first), write-back's synchronous backup of a device victim, host
eviction (write-back's settled duplicates oldest first, then host-only leaves by rank, demoting an
idle high session when both ran dry), the deletion of host-only subtrees, load-back, and
retraction backups. It works on its cache's tree (`tree`, typed as `kvcert.gpu.tiers.TierTree`): the
node table, `refresh`, `lock_path`, the copy registry, and the device tier for load-back's room.

Host eviction's reclaim order is free in the spec; oldest-first (lowest id) is deterministic and
the model's own default, which matters where a harness cannot see a reclaim (a duplicate
reclaimed and backed up again within one write-back eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

from kvcert.gpu.alloc import PageAllocator, to_tuple
from kvcert.gpu.copy_engine import CopyJob, Ticket
from kvcert.gpu.kv import KVPool
from kvcert.gpu.node import Copy, Node, Retraction, is_id
from kvcert.gpu.run import Run
from kvcert.gpu.tiers import TierTree
from kvcert.gpu.watch import HOST
from kvcert.spec import pages
from kvcert.spec.types import WRITE_THROUGH_THRESHOLD, LengthMismatch, SlotNotOwned, UnknownRetraction


class HostTier:
    """The host pool of one cache and the operations that fill and drain it."""

    def __init__(self, tree: TierTree, kv: KVPool, write_policy: str, load_back_threshold: int) -> None:
        self.tree = tree
        self.kv = kv
        self.alloc = PageAllocator(kv.capacity, tree.page_size)
        self.write_policy = write_policy
        self.threshold = WRITE_THROUGH_THRESHOLD.get(write_policy)
        """Hits after which an insert backs a node up (None: write-back, which backs up at eviction)."""
        self.load_back_threshold = load_back_threshold
        self.retractions: OrderedDict[int, Retraction] = OrderedDict()
        self._next_retraction = 0

    # ------------------------------------------------------------------ host slots and backups

    def take(self, n: int, reclaim_all: bool = False) -> Optional[Run]:
        """`n` host slots for the cache; host eviction makes room first (the shortfall, or all `n` with
        `reclaim_all`: a retraction backup, D17). None without room or on an armed fault."""
        alloc = self.alloc
        if alloc.available < n:
            self.evict(n if reclaim_all else n - alloc.available)
        if alloc.consume_failure():
            return None
        if alloc.available < n:
            return None
        return Run(alloc.take_raw(n))

    def write_through(self, path: list[Node]) -> None:
        """Back up the hot nodes of one insert's path, parents first, as one write copy with one ack (SPEC.md §9.2)."""
        threshold = self.threshold
        assert threshold is not None
        tree = self.tree
        wanted = [n for n in path if n.slots is not None and n.host_slots is None and n.hit_count >= threshold]
        written: list[Node] = []
        for n in wanted:
            parent = n.parent
            if parent is not None and (parent is tree.root or parent.host_slots is not None):
                got = self.take(n.size)
                if got is None:
                    continue
                n.host_slots = got
                tree.lock_path(n, +1)
                written.append(n)
                if tree.watch is not None:
                    tree.watch.stored(n, HOST)
        if written:
            src = to_tuple(b"".join([n.slots.raw for n in written]))  # type: ignore[union-attr]  # (on both tiers)
            dst = to_tuple(b"".join([n.host_slots.raw for n in written]))  # type: ignore[union-attr]
            tree.issue_copy("write", written, list(written), CopyJob(tree.kv, src, self.kv, dst))

    def backup_now(self, n: Node) -> bool:
        """Write-back: back a victim up synchronously (the engine waits for it), if host room allows."""
        got = self.take(n.size)
        if got is None:
            return False
        assert n.slots is not None
        self.tree.engine.copy_now(self.tree.kv, n.slots.to_tuple(), self.kv, got.to_tuple())
        n.host_slots = got
        self.tree.refresh(n)
        if self.tree.watch is not None:
            self.tree.watch.stored(n, HOST)
        return True

    # ------------------------------------------------------------------ host eviction

    def evict(self, n: int) -> int:
        """Write-back's settled duplicates first, then host-only leaves by rank (SPEC.md §9.4, §11.4).

        Leaves go UNUSED first, then LOW_REF; a HIGH_REF copy never goes directly. With both exhausted
        short of `n`, an idle high session is demoted and the loop goes on (`Sessions.demote_idle`).
        """
        tree = self.tree
        index = tree.index
        freed = 0
        while freed < n and index.dups:
            victim = index.pop_dup()
            if victim is None:
                continue  # stale: it stopped being a duplicate
            tree.chosen.append(("reclaim", victim.id))
            self.alloc.release_raw(victim.host_slots.raw if victim.host_slots is not None else b"")
            if tree.watch is not None:
                tree.watch.removed(victim, HOST)
            victim.host_slots = None
            tree.refresh(victim)
            freed += victim.size
        while freed < n:
            leaf = index.pop_host(tree.nodes)
            if leaf is None:
                if tree.refs.sessions and tree.refs.demote_idle():
                    continue  # its host copies may be LOW_REF now (SPEC.md §11.4)
                break
            tree.chosen.append(("host_evict", leaf.id))
            self.delete_subtree(leaf)
            freed += leaf.size
        return freed

    def delete_subtree(self, top: Node) -> None:
        """Remove a host-only subtree; sessions that ended in it now end at `top`'s parent."""
        tree = self.tree
        parent = top.parent
        assert parent is not None
        stack = [top]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.alloc.release_raw(n.host_slots.raw if n.host_slots is not None else b"")
            tree.forget(n, parent)
        del parent.children[tree.selector(parent, top)]
        tree.refresh(parent)

    # ------------------------------------------------------------------ load-back

    def load_back(self, n: Node) -> int:
        """Restore the host-only nodes above and at `n` to the device, evicting for room (SPEC.md §9.5).

        Refused (0) under `load_back_threshold` tokens or when the device cannot make room; otherwise
        the device slots are taken now and one load copy fills them, its path locked until the ack.
        """
        tree = self.tree
        chain: list[Node] = []
        cur: Optional[Node] = n
        while cur is not None and cur is not tree.root and cur.slots is None:
            chain.append(cur)
            cur = cur.parent
        if not chain:
            return 0
        chain.reverse()
        size = sum(c.size for c in chain)
        if size < self.load_back_threshold:
            return 0
        holder = Copy(-1, "load", [], [n], [], Ticket(-1, None))
        tree.host_lock(n, holder)  # the host copy must survive the room-making eviction
        tree.lock_path(n, +1)  # and so must the device path it hangs from
        alloc_dev = tree.alloc_dev
        if alloc_dev.available < size:
            tree.evict_device(size - alloc_dev.available)
        if alloc_dev.available < size:
            tree.lock_path(n, -1)
            tree.host_unlock_all(holder)
            tree.compact()
            return 0
        got = Run(alloc_dev.take_raw(size))
        offset = 0
        for c in chain:
            tree.set_device(c, got.cut(offset, offset + c.size))
            offset += c.size
        src = to_tuple(b"".join([c.host_slots.raw for c in chain]))  # type: ignore[union-attr]  # (host only)
        copy = tree.issue_copy("load", chain, [n], CopyJob(self.kv, src, tree.kv, got.to_tuple()))
        copy.host_locked = holder.host_locked  # hand the segment over to the real copy
        n.hl_owners[n.hl_owners.index(holder)] = copy
        tree.compact()
        return size

    # ------------------------------------------------------------------ retraction (SPEC.md §9.11)

    def retraction_backup(self, slots: Sequence[int]) -> Optional[int]:
        """Back up a retracted request's device slots (checked by the caller) into fresh host slots."""
        tree = self.tree
        got_run = self.take(pages.page_ceil(len(slots), tree.page_size), reclaim_all=True)  # D17
        if got_run is None:
            tree.compact()
            return None
        got = got_run.to_tuple()
        loading = self._loading_slots()
        pairs = list(zip(slots, got))
        landed = [(x, h) for x, h in pairs if x not in loading]
        if landed:
            tree.engine.copy_now(tree.kv, tuple(x for x, _ in landed), self.kv, tuple(h for _, h in landed))
        early = [(loading[x], h) for x, h in pairs if x in loading]
        if early:  # a load-back's bytes have not landed there yet: its host copy (protected until the ack) has them
            self.kv.copy_from(self.kv, [x for x, _ in early], [h for _, h in early])
        r = Retraction(self._next_retraction, len(slots), got)
        self._next_retraction += 1
        self.retractions[r.id] = r
        tree.compact()
        return r.id

    def _loading_slots(self) -> dict[int, int]:
        """Device slot -> host slot, for the slots of unfinished load-backs (their bytes are still on the host)."""
        out: dict[int, int] = {}
        for c in self.tree.copies.values():
            if c.kind == "load" and not c.finished:
                for n in c.nodes:
                    if n.slots is not None and n.host_slots is not None:
                        out.update(zip(n.slots.to_tuple(), n.host_slots.to_tuple()))
        return out

    def retraction(self, backup: object) -> Retraction:
        r = self.retractions.get(backup) if is_id(backup) else None
        if r is None:
            raise UnknownRetraction(f"no retraction backup {backup!r}")
        return r

    def retraction_restore(self, backup: object, slots: Sequence[int]) -> None:
        """Copy a backup into lent device slots and drop it; `SlotNotOwned` / `LengthMismatch` change nothing."""
        r = self.retraction(backup)
        tree = self.tree
        if not tree.alloc_dev.are_lent(slots):
            raise SlotNotOwned(f"cannot restore into slots {tuple(slots)[:8]}: not all lent to the caller")
        if len(slots) != r.tokens:
            raise LengthMismatch(f"backup {backup} holds {r.tokens} tokens, restore gave {len(slots)} slots")
        tree.engine.copy_now(self.kv, r.host_slots[: r.tokens], tree.kv, tuple(slots))
        del self.retractions[r.id]
        self.alloc.release(r.host_slots)

    def retraction_discard(self, backup: object) -> None:
        r = self.retraction(backup)
        del self.retractions[r.id]
        self.alloc.release(r.host_slots)
