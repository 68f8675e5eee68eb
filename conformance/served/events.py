"""A served engine's KV events, as a router receives them, replayed into the page-level core (SPEC.md §16.2).

`EventStream` binds a ZMQ SUB socket at the address the engine's publisher connects to (SGLang and vLLM publish
the same wire format: frames `[topic, seq (8 bytes big-endian), payload]`, the payload a msgpack array
`[ts, events, dp_rank]` whose events are maps tagged by `type`), stamps each batch with its arrival time, and
asks the publisher's replay socket for any batch it missed (a subscriber joins after the publisher's first
sends). It decodes with msgspec alone: no engine class is imported, so one stream serves every engine.

`BlockReplay` applies batches in sequence order to what a router would believe each medium holds — a multiset of
block hashes per medium (one hash may be held twice: vLLM recomputes a last block under the same hash) — and
says where the stream contradicts itself: a sequence gap, a block stored under a parent the stream never
stored, a block removed that no medium held. `held_prefix` answers, for a prompt, how many of its leading tokens
the replayed cache holds in whole blocks: the most a correct engine can report cached.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
import zmq

__all__ = ["Batch", "BlockReplay", "EventStream", "decode_batch"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Batch:
    """One published batch: its sequence number, when kvcert received it (monotonic), and its events."""

    seq: int
    arrival: float
    events: tuple[dict[str, Any], ...]


def decode_batch(seq: int, arrival: float, payload: bytes) -> Batch:
    """A payload as both engines encode it: `[ts, [event, ...], dp_rank]`, each event a map with `type`."""
    body = msgspec.msgpack.decode(payload)
    events = body[1] if isinstance(body, (list, tuple)) and len(body) > 1 else []
    out = []
    for ev in events:
        if isinstance(ev, dict):
            out.append(ev)
        elif isinstance(ev, (list, tuple)) and ev:  # an array-like tagged struct: [type, fields...]
            out.append(_positional(ev))
    return Batch(seq, arrival, tuple(out))


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _positional(ev: Sequence[Any]) -> dict[str, Any]:
    kind = str(ev[0])
    return {"type": kind, **dict(zip(_FIELDS.get(kind, ()), ev[1:]))}


class EventStream:
    """Receives a publisher's batches on a background thread; `batches()` returns them in sequence order."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = "") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.bind(endpoint)
        self._got: dict[int, Batch] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors: list[str] = []
        """What the stream sent that does not decode (the engine's)."""
        self.receiver_errors: list[str] = []
        """What went wrong on kvcert's side of the socket (reported apart from the engine's rules)."""
        self._thread = threading.Thread(target=self._run, name="kvcert-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(100)):
                    continue
                frames = self._sub.recv_multipart()
            except zmq.ZMQError as e:  # the receiver keeps going: a silent stop would read as an empty stream
                self.receiver_errors.append(f"kvcert's event receiver: {e}")
                continue
            now = time.monotonic()
            if len(frames) != 3:
                self.errors.append(f"a message of {len(frames)} frames (expected topic, seq, payload)")
                continue
            self._keep(int.from_bytes(frames[1], "big", signed=True), now, frames[2])

    def _keep(self, seq: int, arrival: float, payload: bytes) -> None:
        try:
            batch = decode_batch(seq, arrival, payload)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            self.errors.append(f"batch {seq} does not decode: {e}")
            return
        with self._lock:
            self._got.setdefault(seq, batch)

    def fill_gaps(self, timeout: float = 5.0) -> int:
        """Ask the replay socket for every buffered batch from seq 0 and keep those not received live; returns
        how many it added. Arrival is stamped as the earliest live arrival after them (they were missed before)."""
        if self.replay_endpoint is None:
            return 0
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        added = 0
        try:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                    self.errors.append(f"the replay socket {self.replay_endpoint} did not finish within {timeout} s")
                    break
                frames = sock.recv_multipart()
                if END_SEQ in frames[1:3]:  # [b"", b"", END, b""] (SGLang 0.5.23) or [b"", END, b""] (0.5.10, vLLM)
                    break
                if len(frames) not in (3, 4):
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)  # [b"", (topic,) seq, payload]
                with self._lock:
                    if seq in self._got:
                        continue
                    later = [b.arrival for s, b in self._got.items() if s > seq]
                arrival = min(later) if later else time.monotonic()
                self._keep(seq, arrival, frames[-1])
                added += 1
        finally:
            sock.close()
        return added

    def batches(self) -> list[Batch]:
        with self._lock:
            return [self._got[s] for s in sorted(self._got)]

    def wait_quiet(self, quiet: float = 0.5, timeout: float = 10.0) -> None:
        """Until no batch has arrived for `quiet` seconds since the call or the last batch, whichever is later (the
        publisher drained), at most `timeout`. Counting from the call too: a publisher that has not sent yet (busy,
        or on a loaded machine) is not taken as drained at once."""
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            with self._lock:
                last = max((b.arrival for b in self._got.values()), default=start)
            if time.monotonic() - max(last, start) >= quiet:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sub.close(linger=0)
        self._ctx.term()


@dataclass
class BlockReplay:
    """What a router believes each medium holds, built from the stream alone (SPEC.md §16.2)."""

    held: dict[str, Counter[int]] = field(default_factory=dict)
    """medium -> block hash -> how many blocks of that hash it holds."""
    ever: set[int] = field(default_factory=set)
    """Every hash the stream ever stored (a parent must be one of these)."""
    children: dict[tuple[Optional[int], tuple[int, ...]], set[int]] = field(default_factory=dict)
    """(parent hash, the block's tokens) -> the hashes stored under it: how a prompt's blocks are found."""
    last_seq: Optional[int] = None
    tolerate_sparse: bool = False
    """Take a store whose tokens span more blocks than it names hashes (vLLM's sliding-window and Mamba groups skip
    null blocks: finding VLLM-EV-SPARSE) without a contradiction; its blocks are held but cannot be found by prompt."""
    sparse: int = 0
    """Such stores seen."""
    synced: bool = True
    """False for a subscriber that joined a running server without its replay socket: what the stream said before
    it joined is unknown, so nothing is judged until the first AllBlocksCleared (a flush) makes the state known."""
    stored: Counter[str] = field(default_factory=Counter)
    removed: Counter[str] = field(default_factory=Counter)
    cleared: int = 0

    def apply(self, batch: Batch) -> list[str]:
        """Apply one batch; the contradictions it shows (empty: consistent)."""
        bad: list[str] = []
        if not self.synced:
            self.last_seq = batch.seq
            cleared = any(ev.get("type") == "AllBlocksCleared" for ev in batch.events)
            if not cleared:
                for ev in batch.events:  # learn what it stores; judge nothing
                    if ev.get("type") == "BlockStored":
                        self._stored(ev, str(ev.get("medium") or "GPU"), batch.seq)
                return []
            self.synced = True
            self.held.clear()
            events = batch.events[[ev.get("type") for ev in batch.events].index("AllBlocksCleared") + 1 :]
            batch = Batch(batch.seq, batch.arrival, tuple(events))
            self.last_seq = batch.seq - 1
        if batch.seq != (self.last_seq + 1 if self.last_seq is not None else 0):
            after = f"after {self.last_seq}" if self.last_seq is not None else "first (the publisher counts from 0)"
            bad.append(f"sequence gap: batch {batch.seq} {after}")
        self.last_seq = batch.seq
        for ev in batch.events:
            kind = ev.get("type")
            medium = str(ev.get("medium") or "GPU")
            if kind == "BlockStored":
                bad += self._stored(ev, medium, batch.seq)
            elif kind == "BlockRemoved":
                held = self.held.setdefault(medium, Counter())
                for h in ev.get("block_hashes") or ():
                    if held[h] <= 0:
                        bad.append(f"batch {batch.seq}: BlockRemoved {h} on {medium}, which the stream never left held there")
                    else:
                        held[h] -= 1
                        if not held[h]:
                            del held[h]
                    self.removed[medium] += 1
            elif kind == "AllBlocksCleared":
                self.held.clear()
                self.cleared += 1
        return bad

    def _stored(self, ev: dict[str, Any], medium: str, seq: int) -> list[str]:
        bad = []
        hashes = list(ev.get("block_hashes") or ())
        tokens = list(ev.get("token_ids") or ())
        size = int(ev.get("block_size") or 0)
        parent = ev.get("parent_block_hash")
        if parent is not None and parent not in self.ever:
            bad.append(f"batch {seq}: BlockStored {hashes[:1]} under parent {parent}, which the stream never stored")
        if size <= 0 or len(tokens) != size * len(hashes):
            if self.tolerate_sparse and size > 0 and len(tokens) % size == 0 and len(tokens) > size * len(hashes):
                self.sparse += 1
            else:
                bad.append(f"batch {seq}: BlockStored of {len(hashes)} blocks of size {size} carries {len(tokens)} tokens")
            size = 0
        held = self.held.setdefault(medium, Counter())
        for i, h in enumerate(hashes):
            held[h] += 1
            self.ever.add(h)
            self.stored[medium] += 1
            if size:
                self.children.setdefault((parent, tuple(tokens[i * size : (i + 1) * size])), set()).add(h)
            parent = h
        return bad

    def holds(self, h: int) -> bool:
        return any(c.get(h, 0) > 0 for c in self.held.values())

    def held_prefix(self, prompt: Sequence[int], block: int) -> int:
        """Leading tokens of `prompt` the replayed cache holds in whole blocks, on any medium, under any keys (an
        upper bound: a request's salt or adapter can only narrow what it may reuse)."""
        frontier: set[Optional[int]] = {None}
        n = 0
        while (n + 1) * block <= len(prompt):
            page = tuple(prompt[n * block : (n + 1) * block])
            nxt = {h for p in frontier for h in self.children.get((p, page), ()) if self.holds(h)}
            if not nxt:
                break
            frontier = set(nxt)
            n += 1
        return n * block


def replay_all(batches: Iterable[Batch]) -> tuple[BlockReplay, list[str]]:
    """Every batch applied in order: the final replay and every contradiction."""
    replay = BlockReplay()
    bad: list[str] = []
    for b in batches:
        bad += replay.apply(b)
    return replay, bad
