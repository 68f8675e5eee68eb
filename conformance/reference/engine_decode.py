"""The reference decode server (SPEC.md §15): kvcert's plain scheduler as the decode side of a PD deployment.

It is the positive control of the decode-admission rules, as `conformance.reference.engine_linker` is of the linker's: the
textbook decode server, over the reference model or `kvcert.gpu`, with its prefill peer in-process.

- **Arrival.** A request whose prompt and output can never fit the device is refused at once (INV-DEC-6).
- **Admission, phase one.** The head of the queue is matched on the device and the host, read-only. It is admitted
  when its whole final size, less its device prefix, fits after eviction in its scope; otherwise it waits, and
  nothing it matched was loaded, locked or evicted for good (what eviction freed stays free).
- **Admission, phase two.** The host span is loaded back (all or nothing: a refused load-back shortens the prefix,
  the prefill then sends those tokens too), the whole device prefix is locked, the rest of the final size is
  allocated, and the prefill is promised the device prefix: it writes the prompt's remaining KV into the first of
  the request's own slots (`DecodeLedger.promise`).
- **Transfer.** The prefill takes a step per `PREFILL_CHUNK_PAGES` pages of what it sends. Once its bytes landed the
  request is committed: it reads its prefix and its destination through one row, has its first output token (the
  prefill's), and decodes as the reference engine does. A transfer the peer fails (`PeerFault`) fails its request:
  its slots are freed, its lock dropped, nothing of it cached.

    kvcert certify kvcert.conformance.reference.engine_decode:factory        # over the reference model
    kvcert certify kvcert.conformance.reference.engine_decode:factory_gpu    # over kvcert.gpu
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from kvcert.conformance.reference import engine as _engine
from kvcert.spec import pages
from kvcert.spec.decode import FAULTS, DecodeLedger, tree_slots
from kvcert.spec.invariants import Violation
from kvcert.spec.types import CacheConfig

__all__ = ["DecodeEngine", "factory", "factory_gpu"]

PREFILL_CHUNK_PAGES = 2
"""Pages of a prompt the prefill peer sends per step (at least one step): requests spend steps in transfer."""


@dataclasses.dataclass
class _Transfer:
    request: Any
    prefix: int
    dest: list[int]
    """The slots the prefill was told to write: the prompt's tokens past `prefix`."""
    at: int
    fail: bool = False


class DecodeEngine(_engine.ReferenceEngine):
    """`ReferenceEngine` as a PD decode server: requests' prompts arrive as KV from an in-process prefill peer."""

    def __init__(self, cache: Any, config: CacheConfig, priority_refs: Optional[bool] = None) -> None:
        super().__init__(cache, config, priority_refs)
        self.ledger = DecodeLedger()
        self.transfers: list[_Transfer] = []
        self.steps = 0
        self.faults = 0
        """Peer faults cued and not yet taken by a transfer."""

    # ------------------------------------------------------------------ tree facts the ledger reads

    def _facts(self) -> tuple[set[int], set[int], set[int]]:
        return tree_slots(self.cache.snapshot())

    # ------------------------------------------------------------------ arrival and admission

    def _take(self, message: tuple[Any, ...]) -> None:
        if message[0] == "submit":
            _, rid, _, _, tokens, _, output = message
            if pages.page_ceil(len(tokens) + output, self.ps) > self.config.capacity:
                super()._take(message)
                self.ledger.refuse(rid)
                self._end(self.waiting[-1], "aborted")
                return
        if message[0] == "abort":
            for t in self.transfers:
                if t.request.id == message[1]:
                    self.transfers.remove(t)
                    super()._take(message)
                    self.ledger.abort(message[1], self._facts()[1])
                    return
        super()._take(message)

    def _admit(self) -> None:
        """First come, first served, in two phases (module docstring)."""
        while self.waiting:
            r = self.waiting[0]
            cap = pages.page_floor(len(r.tokens) - 1, self.ps)  # the prefill computes a token at least
            got = self.cache.match_prefix(r.namespace, tuple(r.tokens[:cap]))
            final = pages.page_ceil(len(r.tokens) + r.output, self.ps)
            self.cache.inc_lock_ref(got.node)  # eviction for its room must not take its own prefix
            short = final - got.length - self._free_tokens()
            if short > 0:
                self.cache.evict(short, **self._scope(r))
            fits = final - got.length <= self._free_tokens()
            self.cache.dec_lock_ref(got.node)
            if not fits:
                return  # the head waits: nothing behind it goes first
            device = got.length
            if got.host_length and got.host_node is not None:
                self.cache.load_back(got.host_node)
                got = self.cache.match_prefix(r.namespace, tuple(r.tokens[:cap]))
            self.cache.inc_lock_ref(got.node)
            need = final - got.length
            if need > self._free_tokens():  # the load-back took room the request needed: it waits, unloaded
                self.cache.dec_lock_ref(got.node)
                return
            own = list(self.cache.alloc(need))
            self.waiting.pop(0)
            r.row, r.protected, r.node = list(got.slots) + own, got.length, got.node
            r.computed, r.target, r.state = got.length, len(r.tokens), "running"
            self.running.append(r)
            free, cached, locked = self._facts()
            dest = own[: len(r.tokens) - got.length]
            self.ledger.promise(
                r.id, len(r.tokens), got.length, got.slots, dest, got.length - device, free, cached, locked
            )
            self.transfers.append(_Transfer(r, got.length, dest, self.steps))

    # ------------------------------------------------------------------ the prefill peer

    def step(self) -> None:
        self.steps += 1
        super().step()
        free, cached, locked = self._facts()
        self.ledger.held(free, cached, locked)

    def _loaded(self) -> None:
        """The prefill peer: a transfer whose bytes had their time lands (or fails, on the trace's cue), and is
        committed before the step's forwards."""
        assert self.model is not None, "attach_model first"
        for t in list(self.transfers):
            if self.faults and not t.fail:
                self.faults -= 1
                t.fail = True
            r = t.request
            count = len(r.tokens) - t.prefix
            if self.steps - t.at < max(1, -(-count // (PREFILL_CHUNK_PAGES * self.ps))):
                continue
            self.transfers.remove(t)
            sent = count // 2 if t.fail else count  # a failed transfer lands torn: its first half only
            if sent:  # the prefill's writes, into the slots it was told
                self.cache.write_kv(t.dest[:sent], self.model.kv(r.namespace, r.tokens, t.prefix, sent))
            if t.fail:
                self._end(r, "aborted")
                self.ledger.fail(r.id, self._facts()[1])
                continue
            _, cached, locked = self._facts()
            self.ledger.commit(r.id, r.row[: len(r.tokens)], cached, locked)
            r.computed = len(r.tokens)
            r.tokens.append(self.model.next_token(r.namespace, tuple(r.tokens)))  # the prefill sampled it
            if len(r.tokens) - r.prompt >= r.output:
                self._end(r, "finished")

    def _forward(self, r: Any) -> None:
        if any(t.request is r for t in self.transfers):
            return  # still in transfer
        super()._forward(r)

    def peer_fault(self, kind: str) -> None:
        if kind not in FAULTS:
            raise ValueError(f"unknown peer fault {kind!r}; one of {FAULTS}")
        self.faults += 1

    # ------------------------------------------------------------------ what the suite reads

    def failed_loads(self) -> set[str]:
        return set(self.ledger.failed)

    def reached(self) -> dict[str, int]:
        return dict(self.ledger.reached)

    def observed(self, profile: str) -> list[Violation]:
        found, self.ledger.found = self.ledger.found, []
        return found

    def bookkeeping(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        out = super().bookkeeping()
        out["transfers in flight"] = (len(self.transfers), ())
        out["promises open"] = (len(self.ledger.open), ())
        return out


def _decode(make: Callable[[CacheConfig], Any], name: str) -> Callable[[CacheConfig], DecodeEngine]:
    return _engine._variant(
        make,
        name,
        DecodeEngine,
        " as a PD decode server",
        "PD decode server: two-phase admission (read-only match, then load-back, lock and allocation), the "
        f"prefill peer in-process ({PREFILL_CHUNK_PAGES} pages a step), a request that can never fit refused "
        "at arrival",
        peer_faults=FAULTS,
        never_fit=True,
    )


factory = _decode(_engine._refimpl, "factory")
"""`kvcert certify kvcert.conformance.reference.engine_decode:factory`: the reference decode server over the model."""
factory_gpu = _decode(_engine._gpu, "factory_gpu")
"""`...:factory_gpu`: the reference decode server over kvcert.gpu."""
