"""The host tier (SPEC.md §9): backups under a write policy, host eviction, load-back, copies and their acks,
and retraction backups (§9.11)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from kvcert.refimpl.records import (
    Copy,
    Node,
    Retraction,
    _move_kv,
)
from kvcert.refimpl.tree import Tree
from kvcert.spec import pages
from kvcert.spec import storage as l3
from kvcert.spec.decisions import Chooser
from kvcert.spec.types import (
    FAULTS,
    HIGH_REF,
    WRITE_THROUGH_THRESHOLD,
    InvalidCount,
    LengthMismatch,
    SlotNotOwned,
    UnknownCopy,
    UnknownFault,
    UnknownRetraction,
    check_count,
)


class HostTier(Tree):
    """Backups, host eviction, load-back, copies, retraction."""

    def _wants_backup(self, node: Node) -> bool:
        """Write-through: on the device, not backed up, hot enough (the parent is checked when it is written)."""
        threshold = WRITE_THROUGH_THRESHOLD.get(self.write_policy)
        return (
            threshold is not None and node.slots is not None and node.host_slots is None and node.hit_count >= threshold
        )

    def _write_through(self, path: list[Node]) -> None:
        """Back up hot nodes of one insert, parents first, as one copy (SPEC.md §9.2).

        A node is written only if its parent is the root or backed up, so the host copy
        stays a prefix. Every written node stays locked until the copy's one ack.
        """
        written: list[Node] = []
        for node in path:
            parent = node.parent
            if parent is not None and (parent is self.root or parent.host_slots is not None):
                if self._write_backup(node):
                    self._lock_path(node, +1)
                    written.append(node)
        if self.decided.batch.cut == "per_node":
            groups = [[n] for n in reversed(written)]
        elif self.decided.batch.cut == "per_node_parents_first":
            groups = [[n] for n in written]
        else:
            groups = [written] if written else []
        for group in groups:
            self.copies.append(Copy(self._next_copy, "write", list(group), anchors=list(group)))
            self._next_copy += 1

    def _write_backup(self, node: Node) -> bool:
        """Give `node` host slots for its KV; False if host eviction cannot make room (or the allocation fails)."""
        slots = self._host_alloc(len(node.key))
        if slots is None:
            return False
        node.host_slots = slots
        _move_kv(self.kv, node.slots or (), self.host_kv, slots)  # the backup's bytes, as it is issued
        return True

    def _host_alloc(self, n: int, reclaim_all: bool = False) -> Optional[tuple[int, ...]]:
        """`n` host slots for the tree, host eviction making room first; None without room or on an injected fault.

        Host eviction frees the shortfall, or with `reclaim_all` (a retraction backup, D17) all `n` tokens.
        """
        assert self.host is not None
        if reclaim_all:
            self._make_room(n)
        else:  # a node's backup: the shortfall (SGLang) or the whole size (ROOM), the seated room spent backup by backup
            self._make_room(n, whole=self.decided.room.backup == "whole", spend=True)
        if self.armed_faults.get("host_alloc"):
            self.armed_faults["host_alloc"] -= 1
            return None
        if len(self.host.free_list) < n:
            return None
        slots = self.host.alloc(n)
        self.host.adopt(slots)
        return slots

    def _make_room(self, size: int, whole: Optional[bool] = None, spend: bool = False) -> None:
        """Host room for `size` tokens that do not fit (ROOM): host eviction asks for all of them (`whole`; by
        default as `Room.prefetch` says for a prefetch or a retraction backup), or the shortfall, or the operation's
        decided ask (`room_left`, at most `size`; with `spend`, what this eviction freed is taken off it)."""
        assert self.host is not None
        free = len(self.host.free_list)
        if free >= size:
            return
        if whole is None:
            whole = self.decided.room.prefetch == "whole"
        ask = size if whole else size - free
        if self.room_left is not None:
            ask = min(self.room_left, size)
        if ask:
            freed = self.evict_host(ask, choose=self.decided.reclaim.host or self.decided.rank.pick)
            if spend and self.room_left is not None:
                self.room_left = max(0, self.room_left - freed)

    def inject_fault(self, kind: str) -> None:
        """Arm one fault: the next allocation of `kind` fails (SPEC.md §10.5)."""
        if kind not in FAULTS:
            raise UnknownFault(f"no fault kind {kind!r}; this cache has {FAULTS}")
        self.armed_faults[kind] = self.armed_faults.get(kind, 0) + 1

    def host_leaves(self) -> list[Node]:
        """Host eviction candidates: on the host only, no children, unlocked, no host protection."""
        # fmt: off
        return [
            n
            for n in self.nodes.values()
            if n is not self.root
            and n.slots is None
            and not n.children
            and n.lock_ref == 0
            and n.host_lock_ref == 0
            and self.tier(n) != HIGH_REF
        ]
        # fmt: on

    def host_duplicates(self) -> list[Node]:
        """Write-back's first host victims: settled backups of device-resident nodes (SPEC.md §9.4)."""
        moving = {id(n) for c in self.copies for n in c.nodes}
        return [
            n
            for n in self.nodes.values()
            if n is not self.root
            and n.slots is not None
            and n.host_slots is not None
            and n.host_lock_ref == 0
            and id(n) not in moving
        ]

    def evict_host(self, n: int, choose: Optional[Chooser] = None) -> int:
        """Free `n` host tokens: write-back's duplicate backups (any order), then host-only leaves by rank."""
        check_count(n)
        freed = 0
        if not self.decided.reclaim.first and self.write_policy == "write_back":
            return self._evict_host_by_rank(n, choose)
        while freed < n and self.host is not None and self.write_policy == "write_back":
            duplicates = self.host_duplicates()
            if not duplicates:
                break
            ids = sorted(d.id for d in duplicates)
            drop = self.decided.reclaim.drop
            pick = drop(ids) if drop else None
            victim = self.nodes[ids[0] if pick is None else pick]
            self.chosen.append(("reclaim", victim.id))
            self.host.release(victim.host_slots or ())
            victim.host_slots = None
            freed += len(victim.key)
        while freed < n and self.host is not None:
            leaves = self.host_leaves()
            if not leaves:
                if self._demote_idle_session():
                    continue  # its host copies may be LOW_REF now (SPEC.md §11.4)
                break
            victim = self._pick(leaves, choose)
            self.chosen.append(("host_evict", victim.id))
            self._delete_host_leaf(victim)
            freed += len(victim.key)
        return freed

    def _evict_host_by_rank(self, n: int, choose: Optional[Chooser]) -> int:
        """The alternative write-back host eviction: duplicate backups and host-only leaves in one rank order."""
        assert self.host is not None
        freed = 0
        while freed < n:
            candidates = self.host_duplicates() + self.host_leaves()
            if not candidates:
                if self._demote_idle_session():
                    continue
                break
            victim = self._pick(candidates, choose)
            self.chosen.append(("reclaim" if victim.slots is not None else "host_evict", victim.id))
            if victim.slots is not None:
                self.host.release(victim.host_slots or ())
                victim.host_slots = None
            else:
                self._delete_host_leaf(victim)
            freed += len(victim.key)
        return freed

    def load_back(self, node_id: int) -> int:
        """Bring the host-only part of the path ending at `node_id` back to the device.

        All or nothing: refused (0) below the threshold or when the device cannot make
        room. The loaded path stays locked, and its host copy protected, until the ack.
        """
        node = self._live(node_id)
        chain = [n for n in self._path_to_root(node) if n.slots is None]
        if not chain:
            return 0
        chain.reverse()
        size = sum(len(n.key) for n in chain)
        if size < self.load_back_threshold:
            return 0
        node.host_lock_ref += 1  # the host copy must survive eviction made for room
        self._lock_path(node, +1)  # and so must the device path it hangs from
        if len(self.pool.free_list) < size:
            room = self.decided.load_room
            ask = size if room.ask == "whole" else size - len(self.pool.free_list)
            self.evict(ask, *room.scope, choose=self.decided.rank.pick)  # LOAD_ROOM
        if len(self.pool.free_list) < size:
            self._lock_path(node, -1)
            node.host_lock_ref -= 1
            return 0
        slots = self.pool.alloc(size)
        self.pool.adopt(slots)
        offset = 0
        for n in chain:
            n.slots = tuple(slots[offset : offset + len(n.key)])
            offset += len(n.key)
            self._account(n, +1)  # locked: protected
        _move_kv(self.host_kv, [x for n in chain for x in n.host_slots or ()], self.kv, slots)  # one job
        host_lock = self.decided.load_lock.host_lock
        if not host_lock:  # from here the copy's own pins protect the host copy (LOAD_LOCK)
            node.host_lock_ref -= 1
        held = [node] if host_lock else []
        self.copies.append(Copy(self._next_copy, "load", chain, anchors=[node], host_locked=held))
        self._next_copy += 1
        return size

    def complete(self, copy_id: int) -> None:
        """The copy engine finished copy `copy_id`; its ack waits for `poll`.

        A store copy writes its pages to storage now, in one `batch_set` (SPEC.md §10.3).
        """
        ok = isinstance(copy_id, int) and not isinstance(copy_id, bool)
        copy = next((c for c in self.copies if ok and c.id == copy_id and not c.finished), None)
        if copy is None:
            raise UnknownCopy(f"no pending copy {copy_id!r}")
        if self.armed_faults.get("copy"):
            self.armed_faults["copy"] -= 1
            if copy.kind != "store":
                if copy.kind == "write" and self.decided.retry.on_failure == "invalidate" and self._give_up(copy):
                    return  # the backups are invalidated, the ack still releases the copy's locks
                return  # a failed device<->host copy is retried: both ends stay pinned, the copy unfinished
            copy.finished = True
            return  # a failed store copy ends without writing: its pages are simply not in storage
        copy.finished = True
        if copy.kind == "store" and self.storage is not None:
            keys, values = self._pages_of(copy.nodes)
            try:
                self.storage.batch_set(keys, values)
            except l3.StorageError:
                pass  # a failed write is simply not stored: later lookups miss

    def _give_up(self, copy: Copy) -> bool:
        """Invalidate a failed write copy: its nodes and every host copy below them lose their backups, host-only
        nodes leaving the tree. False (retry instead) when one of those is moving, host-locked, locked or held by
        a high-priority session: dropping it would lose KV someone still reads."""
        assert self.host is not None
        moving = {id(n) for c in self.copies if c is not copy for n in c.nodes}
        below: list[Node] = []
        todo = list(copy.nodes)
        while todo:
            n = todo.pop()
            if n.host_slots is not None and n not in below:
                below.append(n)
            todo += n.children.values()
        for n in below:
            if id(n) in moving or n.host_lock_ref or (n.slots is None and (n.lock_ref or self.tier(n) == HIGH_REF)):
                return False
        copy.finished = copy.given_up = True
        copy.nodes = []  # it moves nothing now; its ack still releases its locks
        for n in sorted(below, key=lambda n: -len(self._full_path(n))):  # deepest first: leaves before parents
            if n.id not in self.nodes:
                continue
            if n.slots is None:
                self._delete_host_leaf(n)
            else:
                self.host.release(n.host_slots or ())
                n.host_slots = None
        return True

    def poll(self) -> int:
        """Consume finished acks in issue order, per kind, stopping at the first unfinished one."""
        consumed = 0
        for kind in ("write", "load", "store"):
            for copy in [c for c in self.copies if c.kind == kind]:
                if not copy.finished:
                    break
                self.copies.remove(copy)
                for anchor in copy.anchors:
                    self._lock_path(anchor, -1)
                for n in copy.host_locked:
                    n.host_lock_ref -= 1
                consumed += 1
                if kind == "write" and not copy.given_up:
                    ordered = sorted(copy.nodes, key=lambda n: len(self._full_path(n)))
                    for group in [ordered] if self.decided.batch.cut == "per_ack" else [[n] for n in ordered]:
                        self._store(group)  # D7: one store copy per node (SGLang)
        return consumed

    def regroup(self, count: int, groups: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Re-cut the last `count` copies issued into `groups` (kind, node ids), in that order: the backend's
        grouping of the same nodes (SPEC.md §6.1 BATCH). A write copy locks the path of each of its nodes and a
        store copy host-locks each, so the locks carry over unchanged; load copies keep theirs, in order."""
        cut = len(self.copies) - count
        old = self.copies[cut:]
        loads = iter([c for c in old if c.kind == "load"])
        new: list[Copy] = []
        for kind, ids in groups:
            if kind == "load":
                new.append(next(loads))
                continue
            nodes = [self.nodes[i] for i in ids]
            if kind == "write":
                new.append(Copy(self._next_copy, kind, nodes, anchors=list(nodes)))
            else:
                new.append(Copy(self._next_copy, kind, nodes, anchors=[], host_locked=list(nodes)))
            self._next_copy += 1
        moved = sorted((c.kind, n.id) for c in old if c.kind != "load" for n in c.nodes)
        assert moved == sorted((c.kind, n.id) for c in new if c.kind != "load" for n in c.nodes), "not a re-cut"
        del self.copies[cut:]
        self.copies += new

    # ------------------------------------------------------------------ retraction (SPEC.md §9.11)

    def retraction_backup(self, slots: Sequence[int]) -> Optional[int]:
        """Back a retracted request's KV up to host slots outside the tree; the backup's id.

        `slots` are the device slots the request reads: the tree's (its prefix) and its own.
        Synchronous, as in SGLang (the engine waits for the copy). Host eviction makes room;
        None when there is none even then: the request will recompute, nothing is half-saved.
        """
        if not isinstance(slots, Sequence) or isinstance(slots, (str, bytes)) or not slots:
            raise InvalidCount(f"a retraction backs up at least one slot, got {slots!r}")
        free = set(self.pool.free_list)
        if any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < self.pool.capacity for x in slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: not device slot ids")
        if len(set(slots)) != len(slots) or free.intersection(slots):
            raise SlotNotOwned(f"cannot back up slots {tuple(slots)[:8]}: repeated or free")
        if self.host is None:
            return None
        host_slots = self._host_alloc(pages.page_ceil(len(slots), self.page_size), reclaim_all=True)  # D17
        if host_slots is None:
            return None
        _move_kv(self.kv, slots, self.host_kv, host_slots)  # synchronous: the engine waits for it
        backup = Retraction(self._next_retraction, len(slots), host_slots)
        self._next_retraction += 1
        self.retractions.append(backup)
        return backup.id

    def _retraction(self, backup_id: object) -> Retraction:
        ok = isinstance(backup_id, int) and not isinstance(backup_id, bool)
        found = next((r for r in self.retractions if ok and r.id == backup_id), None)
        if found is None:
            raise UnknownRetraction(f"no retraction backup {backup_id!r}")
        return found

    def retraction_restore(self, backup_id: int, slots: Sequence[int]) -> int:
        """Copy a backup into the caller's fresh `slots` and free it; the resumed request's last node.

        That node is the root, locked once for the request: its later `dec_lock_ref` must
        balance (SGLang's decode path once resumed with no last node and crashed unlocking it).
        """
        backup = self._retraction(backup_id)
        self.pool.require_lent(slots, "restore into")
        if len(slots) != backup.tokens:
            raise LengthMismatch(f"backup {backup_id} holds {backup.tokens} tokens, restore gave {len(slots)} slots")
        _move_kv(self.host_kv, backup.host_slots[: backup.tokens], self.kv, slots)  # in the request's order
        self._drop_retraction(backup)
        self.root.own_locks += 1
        return self.root.id

    def retraction_discard(self, backup_id: int) -> None:
        """The retracted request is gone for good: free its backup."""
        self._drop_retraction(self._retraction(backup_id))

    def _drop_retraction(self, backup: Retraction) -> None:
        assert self.host is not None
        self.retractions.remove(backup)
        self.host.release(backup.host_slots)
