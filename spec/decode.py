"""Decode-side admission: a decode server that reuses its own cached prefix and takes the rest of a prompt's KV
from a prefill peer (SPEC.md §15; SGLang's PD decode worker with `--disaggregation-decode-enable-radix-cache`,
the seed's decode-side HiCache).

A request arrives at the decode server with its prompt; the prefill computes the prompt's KV elsewhere. Admission
has two phases. The first matches the prompt against the decode server's tiers (device, host, storage), reserves
the room the request needs, allocates the *destination*, the slots the prefill will write, and *promises* the prefill
a prefix length it need not send: the device prefix the request holds plus the host and storage span the decode
server will restore itself. The second restores that span to the device, then waits for the prefill's bytes; the
*commit* hands the request its whole row, prefix and destination, and it decodes. Either phase may fail: the
peer dies, the restore finds no room, a storage prefetch comes up short, the client aborts.

`DecodeLedger` watches the promises, commits and failures a decode server makes, whichever engine it is, and
judges each against the rules below with the tree's slots and locks. The bytes are judged by the request path's
own rules (INV-REQ-2 through the committed row, INV-KV-1 on the tree). Rules marked (profile) are one engine's
choices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvcert.spec.invariants import Violation
from kvcert.spec.types import Snapshot

__all__ = ["FAULTS", "RULES", "DecodeLedger", "Promise", "tree_slots"]

RULES: dict[str, str] = {
    "INV-DEC-1": "a promise's destination is one slot per prompt token past the promised prefix, distinct, "
    "allocated, and held by no tree node and no other transfer in flight: the prefill writes nobody else's KV",
    "INV-DEC-2": "the device part of a promised prefix is the request's own path, in the tree and locked from the "
    "promise: the prefill skips those tokens, so nothing may evict them before the commit",
    "INV-DEC-3": "a transfer in flight keeps what it was promised: its device prefix stays cached and locked, its "
    "destination allocated and outside the tree, until it commits or fails",
    "INV-DEC-4": "a commit hands the request a row whose promised prefix is device slots of its own path, locked "
    "(the restored span included), and whose rest is its destination, unchanged: a span the server could not "
    "restore fails the request instead (profile: SGLang aborts it)",
    "INV-DEC-5": "a transfer that failed or was aborted, at any point, caches nothing of its destination (the prefill "
    "did not finish those bytes); once the client is done nothing it held is locked, allocated or queued",
    "INV-DEC-6": "a request whose prompt and output can never fit the device ends, refused or aborted, and is never "
    "left waiting (head of the line, it would starve every request behind it); nothing it held outlives it "
    "(profile: SGLang refuses a prompt longer than the device at arrival)",
}

FAULTS = ("transfer_fail",)
"""What the trace may cue a decode server's prefill peer to do (`PeerFault`): fail the oldest transfer in flight
(the peer died, its write failed). A correct decode server fails that request, cleans up what it held wherever its
admission stood (waiting on a prefetch, restoring, transferring), and serves every other request."""


def tree_slots(snap: Snapshot) -> tuple[set[int], set[int], set[int]]:
    """What the ledger judges a decode server's slots against: the allocator's free slots, the tree's device slots,
    and those of its locked nodes."""
    cached = {s for n in snap.nodes if n.slots for s in n.slots}
    locked = {s for n in snap.nodes if n.slots and n.lock_ref > 0 for s in n.slots}
    return set(snap.free_slots), cached, locked


@dataclass
class Promise:
    """One transfer in flight: what the decode server told the prefill, and what it holds for it."""

    rid: str
    prefix: int
    """Tokens the prefill need not send (device prefix + the span the server restores itself)."""
    device: tuple[int, ...]
    """The device part of the prefix: the slots of the request's path it holds, in token order."""
    dest: tuple[int, ...]
    """The destination: one slot per prompt token past `prefix`, in token order."""
    restored: int = 0
    """Tokens of the prefix a lower tier restores (host, storage)."""


@dataclass
class DecodeLedger:
    """Promises, commits and failures of a decode server, judged as they happen (RULES). Violations collect in
    `found`; `failed` names the requests whose transfer failed (the engine may fail them: INV-RP-5 excused)."""

    found: list[Violation] = field(default_factory=list)
    open: dict[str, Promise] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    """Requests the server refused at arrival (INV-DEC-6)."""
    reached: dict[str, int] = field(default_factory=dict)

    def _bad(self, inv: str, message: str) -> None:
        self.found.append(Violation(inv, message))

    def _count(self, what: str) -> None:
        key = f"decode:{what}"
        self.reached[key] = self.reached.get(key, 0) + 1

    def promise(
        self,
        rid: str,
        prompt: int,
        prefix: int,
        device: Sequence[int],
        dest: Sequence[int],
        restored: int,
        free: Collection[int],
        cached: Collection[int],
        locked: Collection[int],
    ) -> None:
        """The server promised `rid`'s prefill a prefix of `prefix` tokens of its `prompt`, holding `device` (the
        device part) and writing the rest into `dest`; `restored` of the prefix's tokens come from a lower tier (restored
        already, inside `device`, or still to be, past it); `free`, `cached` and `locked` are the allocator's free
        slots, the tree's device slots and those of its locked nodes, now."""
        device, dest = tuple(int(s) for s in device), tuple(int(s) for s in dest)
        self._count("promise with a restore" if restored else "promise")
        if len(dest) != prompt - prefix or len(set(dest)) != len(dest):
            self._bad("INV-DEC-1", f"request {rid}: {len(dest)} destination slots for the {prompt - prefix} prompt "
                      f"tokens past its promised prefix of {prefix}" + ("" if len(set(dest)) == len(dest) else
                                                                          ", some named twice"))  # fmt: skip
        others = {s for p in self.open.values() if p.rid != rid for s in p.dest}
        clash = sorted(set(dest) & (set(free) | set(cached) | others))
        if clash:
            self._bad("INV-DEC-1", f"request {rid}'s destination slots {clash[:4]} are free, cached in the tree or "
                      "another transfer's: the prefill would overwrite KV that is not this request's")  # fmt: skip
        if len(device) > prefix:
            self._bad("INV-DEC-2", f"request {rid} holds {len(device)} device tokens of a prefix of {prefix}")
        loose = sorted(set(device) - (set(cached) & set(locked)))
        if loose:
            self._bad("INV-DEC-2", f"request {rid}'s promised device prefix has slots {loose[:4]} that are not "
                      "cached and locked: eviction may take tokens the prefill was told to skip")  # fmt: skip
        if rid in self.open:
            self._bad("INV-DEC-1", f"request {rid} promised a second transfer while its first is in flight")
        self.open[rid] = Promise(rid, prefix, device, dest, restored)

    def held(self, free: Collection[int], cached: Collection[int], locked: Collection[int]) -> None:
        """INV-DEC-3 for every transfer in flight, against the tree and the allocator now."""
        kept = set(cached) & set(locked)
        for p in self.open.values():
            lost = sorted(set(p.device) - kept)
            if lost:
                self._bad("INV-DEC-3", f"request {p.rid}'s promised device prefix lost slots {lost[:4]} (no longer "
                          "cached and locked) while its transfer is in flight")  # fmt: skip
            gone = sorted(set(p.dest) & (set(free) | set(cached)))
            if gone:
                self._bad("INV-DEC-3", f"request {p.rid}'s destination slots {gone[:4]} were freed or cached while "
                          "the prefill still writes them")  # fmt: skip

    def commit(self, rid: str, row: Sequence[int], cached: Collection[int], locked: Collection[int]) -> None:
        """The server handed `rid` its row (its first prompt tokens' slots) and the request decodes."""
        p = self.open.pop(rid, None)
        if p is None:
            self._bad("INV-DEC-4", f"request {rid} committed a transfer it never promised")
            return
        self._count("commit with a restore" if p.restored else "commit")
        row = tuple(int(s) for s in row)
        prefix = row[: p.prefix]
        if len(prefix) < p.prefix or set(prefix) - (set(cached) & set(locked)):
            self._bad("INV-DEC-4", f"request {rid} commits a prefix of {p.prefix} tokens whose row slots are not "
                      "all cached and locked: it would decode over KV nobody restored or holds")  # fmt: skip
        if prefix[: len(p.device)] != p.device:
            self._bad("INV-DEC-4", f"request {rid}'s committed row starts with other slots than the device "
                      "prefix it promised")  # fmt: skip
        if row[p.prefix : p.prefix + len(p.dest)] != p.dest:
            self._bad("INV-DEC-4", f"request {rid}'s committed row does not read its destination past token "
                      f"{p.prefix}: the prefill's bytes are elsewhere")  # fmt: skip

    def fail(self, rid: str, cached: Collection[int]) -> None:
        """`rid`'s transfer failed (the peer, a restore, a prefetch): the engine fails the request. `cached`: the
        tree's device slots once the engine cleaned up, less any another live request now holds."""
        p = self.open.pop(rid, None)
        self.failed.add(rid)
        if p is not None:
            self._count("transfer failed")
            self.settled(p, cached)

    def abort(self, rid: str, cached: Collection[int]) -> None:
        """The client aborted `rid`; with a transfer in flight, its destination must not be cached."""
        p = self.open.pop(rid, None)
        if p is None:
            return
        self._count("aborted in transfer")
        self.settled(p, cached)

    def settled(self, p: Promise, cached: Collection[int]) -> None:
        """INV-DEC-5 for a transfer that ended without a commit: none of its destination is in the tree."""
        leaked = sorted(set(p.dest) & set(cached))
        if leaked:
            self._bad("INV-DEC-5", f"request {p.rid}'s unfinished transfer left destination slots {leaked[:4]} in "
                      "the tree: KV the prefill never finished is served as cached")  # fmt: skip

    def refuse(self, rid: str) -> None:
        """The server refused `rid` at arrival as one that can never fit (INV-DEC-6)."""
        self._count("refused at arrival")
        self.refused.add(rid)
