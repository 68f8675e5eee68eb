"""A stand-in KVCR core for the seed's KVCR direct linker (`kvcr.linker`), handed to it through its own
`_kvcr_factory` hook, and the stub `kvcr.{config,types,policy,control_channels}` modules that supply exactly the
names the linker imports (the target's README lists them). It is kvcert's code, written from what the linker
expects of KVCR, not KVCR's: the revision the PR targets cannot be had (the target's README).

What the linker expects, and what this core does:

- **Residency.** An object (one page of one pool, under the linker's key) is *filling* from the `deposit` that
  wrote it until that copy completes, then *resident* in a slot of the DRAM regions the linker carved
  (`LocalDramOptions`), one slot per object and subpool; a failed copy leaves it absent. `query` says HIT for a
  resident object, PENDING for a filling one, REMOTE for one a hint of the request names, MISS otherwise.
- **Claims.** `fetch` completes per object: a resident one is claimed for the fetching request (success, with a
  release handle); one still filling is waited for; a hinted one is pulled from the peer the hint names (a live
  peer that still has the page writes it into a local slot, and it is claimed; a stale peer answers that it has
  nothing; a dead peer never answers, until the operation times out); anything else fails. A claimed object is
  never evicted; `release` drops a claim.
- **Capacity.** A `deposit` that finds no free slot evicts the policy's victim (FIFO: oldest stored, LRU: least
  recently stored, fetched or delivered) among resident, unclaimed objects and announces it to the linker's
  inventory sink; with no victim the object fails. The walk may also evict the oldest unclaimed object at any time
  (other tenants, peers).
- **Copies.** `deposit` reads the device slots its descriptors name and `deliver` writes them, with `ctypes.memmove`
  over real CPU tensors, when the operation completes, whether or not the linker polls: the walk's virtual clock
  decides (`advance`). An operation completes `LATENCY_S` after it was submitted, unless the walk held it (it then
  completes when released, or fails at the operation timeout); a failed `deliver` writes the first half of the
  object and zeros the rest. `poll_completed` hands over what completed, once, in completion order.
- **Close.** `close` refuses (raises) while an operation is in flight.
"""

from __future__ import annotations

import ctypes
import enum
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["LATENCY_S", "Peer", "StandInCore", "World", "install_stub_modules"]

LATENCY_S = 0.001
"""How long an operation nobody holds takes, in virtual seconds."""


class QueryStatus(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"
    REMOTE = "remote"


class _Record:
    """A config or binding record: keeps its fields as attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)


class FrameworkMemoryRegion(_Record): ...


class KVCRConfig(_Record): ...


class KVCRBackendConfigs(_Record): ...


class LocalDramOptions(_Record):
    def __init__(self, regions: Sequence[tuple[str, int, int]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.regions = list(regions)


class RemoteFWDramOptions(_Record): ...


class KVCRBindings(_Record): ...


class KVCachePolicy:
    name = ""


class FIFOPolicy(KVCachePolicy):
    name = "fifo"


class LRUPolicy(KVCachePolicy):
    name = "lru"


@dataclass(frozen=True)
class MemDescriptor:
    end_point_name: str
    mem_type: str
    addr: int
    size: int
    device_Id: int  # noqa: N815 (the linker's keyword)
    info: str


class ZmqPeerControlChannel:
    """The peer control channel: only its endpoint; the walk's peers are the world's (`World.peers`)."""

    def __init__(self, host: str, port: int, advertise: Optional[str]) -> None:
        self.endpoint = f"tcp://{advertise or host}:{port}"


class _NoCore:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this kvcr is kvcert's stub: construct the linker with _kvcr_factory")


@dataclass(frozen=True)
class Entry:
    success: bool
    release_handle: Optional[int] = None


@dataclass(frozen=True)
class InventoryEvent:
    removed: bool
    keys: tuple[bytes, ...]


def install_stub_modules() -> None:
    """`kvcr`, `kvcr.config`, `kvcr.types`, `kvcr.policy`, `kvcr.control_channels` in sys.modules, with exactly the
    names the linker imports; a real kvcr is never imported."""
    def module(name: str, **names: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(names)
        mod.__kvcert_stub__ = True  # type: ignore[attr-defined]
        sys.modules[name] = mod
        return mod

    root = module("kvcr", KVCR=_NoCore, KVCRBindings=KVCRBindings)
    root.__path__ = []  # type: ignore[attr-defined]
    root.config = module(  # type: ignore[attr-defined]
        "kvcr.config",
        FrameworkMemoryRegion=FrameworkMemoryRegion,
        KVCRConfig=KVCRConfig,
        KVCRBackendConfigs=KVCRBackendConfigs,
        LocalDramOptions=LocalDramOptions,
        RemoteFWDramOptions=RemoteFWDramOptions,
    )
    root.types = module("kvcr.types", MemDescriptor=MemDescriptor, QueryStatus=QueryStatus)  # type: ignore[attr-defined]
    root.policy = module("kvcr.policy", FIFOPolicy=FIFOPolicy, LRUPolicy=LRUPolicy, KVCachePolicy=KVCachePolicy)  # type: ignore[attr-defined]
    root.control_channels = module("kvcr.control_channels", ZmqPeerControlChannel=ZmqPeerControlChannel)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- the world the cores live in


@dataclass
class Peer:
    """A peer a hint may name: `alive` peers answer, with the pages they still hold; a dead one never answers."""

    endpoint: str
    alive: bool = True
    pages: set[int] = field(default_factory=set)
    """Event hashes (the page hash's first 64 bits) it still holds."""


@dataclass
class World:
    """What every core of one walk shares: the virtual clock, the peers, the KV of every page (a peer's copy is the
    page's true KV), and the walk's faults, each armed for the next operation of its kind."""

    content: Callable[[bytes, int], bytes]
    """(object key, bytes) -> the object's true KV, descriptor spans concatenated."""
    now: float = 0.0
    peers: dict[str, Peer] = field(default_factory=dict)
    hold: dict[str, int] = field(default_factory=dict)
    """Operation kind -> how many of the next ones are held."""
    fail: dict[str, int] = field(default_factory=dict)
    """Operation kind -> how many of the next ones fail one object."""
    stuck: dict[str, int] = field(default_factory=dict)
    """Operation kind -> how many of the next ones are stuck: held past the operation timeout, until released or
    the abandon timeout."""
    evictions: list[tuple[bytes, ...]] = field(default_factory=list)
    """Keys of every eviction any core announced, per event, in order."""
    cores: list[StandInCore] = field(default_factory=list)

    def advance(self, dt: float) -> None:
        self.now += dt
        for core in self.cores:
            core.advance(self.now)

    def arm(self, table: dict[str, int], kind: str) -> bool:
        if table.get(kind, 0) > 0:
            table[kind] -= 1
            return True
        return False


@dataclass
class _Object:
    pool: str
    slot: int
    resident: bool = False
    claims: set[int] = field(default_factory=set)
    stamp: int = 0
    """Policy order: when it was stored (FIFO) or last used (LRU)."""


@dataclass
class _Op:
    id: int
    kind: str
    keys: list[bytes]
    blocks: dict[bytes, list[MemDescriptor]]
    request_id: str
    submitted: float
    held: bool
    fail_key: Optional[bytes]
    stuck: bool = False
    done: bool = False
    entries: dict[bytes, Entry] = field(default_factory=dict)
    """Fetch: the objects already settled (a filling one waits)."""


def _pool_of(key: bytes) -> str:
    return key.decode("utf-8").split("#", 3)[3]


def _event_hash(key: bytes) -> int:
    return int(key.decode("utf-8")[:16], 16)


class StandInCore:
    """One KVCR core over the linker's DRAM regions (module docstring)."""

    def __init__(self, config: Any, bindings: Any, backend: Any, world: World) -> None:
        self.world, self.bindings = world, bindings
        self.timeout = float(config.operation_timeout_ms) / 1000.0
        self.abandon = float(config.abandon_timeout_ms) / 1000.0
        self.policy = getattr(bindings.policy, "name", "lru")
        self.span = dict(config.pool_layouts)
        """subpool -> span bytes."""
        self.regions = {name: (addr, length) for name, addr, length in backend.local_dram.regions}
        self.subpools: dict[str, list[str]] = {}
        for sub in self.span:
            self.subpools.setdefault(sub.split("/", 1)[0], []).append(sub)
        self.capacity = min(length // self.span[name] for name, (_, length) in self.regions.items())
        self.objects: dict[bytes, _Object] = {}
        self.claims: dict[int, tuple[bytes, str]] = {}
        """release handle -> (object key, the fetching request id)."""
        self.claim_op: dict[int, int] = {}
        """release handle -> the fetch that took it."""
        self.submissions: list[tuple[str, int, list[bytes]]] = []
        """(kind, op id, keys) of every operation submitted, in order."""
        self.hints: dict[str, tuple[str, set[int]]] = {}
        self.ops: dict[int, _Op] = {}
        self.completed: list[tuple[int, dict[bytes, Entry]]] = []
        self.next_op = 1
        self.next_handle = 1
        self.stamp = 0
        self.closed = False
        self.log: list[tuple[str, int, dict[bytes, bool]]] = []
        """(kind, op id, key -> success) of every completed operation, in completion order (what the walk judges)."""
        world.cores.append(self)

    # ------------------------------------------------------------------ the linker's calls

    def query(self, keys: Sequence[bytes], request_id: str = "") -> list[tuple[QueryStatus, None]]:
        out = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is not None:
                out.append((QueryStatus.HIT if obj.resident else QueryStatus.PENDING, None))
            elif self._hinted(key, request_id) is not None:
                out.append((QueryStatus.REMOTE, None))
            else:
                out.append((QueryStatus.MISS, None))
        return out

    def fetch(self, keys: Sequence[bytes], request_id: str = "", expected_layout: Any = None) -> int:
        return self._submit("fetch", list(keys), {}, request_id)

    def deposit(self, blocks: Mapping[bytes, list[MemDescriptor]]) -> int:
        op = self._submit("deposit", list(blocks), dict(blocks), "")
        for key in blocks:  # room is taken when the copy starts
            if key not in self.objects:
                slot = self._slot(_pool_of(key))
                if slot is not None:
                    self.objects[key] = _Object(_pool_of(key), slot)
        return op

    def deliver(self, blocks: Mapping[bytes, list[MemDescriptor]]) -> int:
        return self._submit("deliver", list(blocks), dict(blocks), "")

    def release(self, handles: Iterable[int]) -> list[tuple[int, bool]]:
        out = []
        for h in handles:
            got = self.claims.pop(h, None)
            self.claim_op.pop(h, None)
            if got is not None and got[0] in self.objects:
                self.objects[got[0]].claims.discard(h)
            out.append((h, got is not None))
        return out

    def poll_completed(self) -> list[tuple[int, dict[bytes, Entry]]]:
        done, self.completed = self.completed, []
        return done

    def submit_hint(self, hint: Mapping[str, Any], request_id: str = "") -> None:
        payload = hint["actions"][0]["payload"]
        self.hints[request_id] = (str(payload["source_control_endpoint"]), {int(h) for h in payload["block_hashes"]})

    def discard_hint(self, request_id: str) -> None:
        self.hints.pop(request_id, None)

    def close(self) -> None:
        live = [op.id for op in self.ops.values() if not op.done]
        if live:
            raise RuntimeError(f"KVCR core close with {len(live)} transfers in flight")
        self.closed = True

    # ------------------------------------------------------------------ the walk's calls

    def claim_op_done(self, handle: int) -> bool:
        """Whether the fetch that took claim `handle` completed (the linker may know of it)."""
        op = self.ops.get(self.claim_op.get(handle, -1))
        return op is not None and op.done

    def held_ops(self) -> int:
        return sum(1 for op in self.ops.values() if not op.done)

    def release_held(self) -> int:
        n = 0
        for op in self.ops.values():
            if op.held and not op.done:
                op.held, n = False, n + 1
        return n

    def evict_one(self) -> Optional[bytes]:
        """Capacity pressure from outside the linker: the policy's victim among resident unclaimed objects."""
        victim = self._victim()
        if victim is not None:
            self._evict(victim)
        return victim

    def resident(self, key: bytes) -> bool:
        obj = self.objects.get(key)
        return obj is not None and obj.resident

    def claimed_by(self, key: bytes) -> set[str]:
        """The request ids holding a claim on `key`."""
        obj = self.objects.get(key)
        return {self.claims[h][1] for h in obj.claims} if obj is not None else set()

    def read(self, key: bytes) -> bytes:
        """The object's bytes in this core's DRAM, spans concatenated."""
        obj = self.objects[key]
        return b"".join(ctypes.string_at(self._addr(sub, obj.slot), self.span[sub]) for sub in self.subpools[obj.pool])

    # ------------------------------------------------------------------ time

    def advance(self, now: float) -> None:
        for op in list(self.ops.values()):
            if op.done:
                continue
            if not op.held and now - op.submitted >= LATENCY_S and self._settle(op):
                continue
            if now - op.submitted >= (self.abandon if op.stuck else self.timeout):  # what has not settled fails; what has is reported
                self._finish(op, {k: op.entries.get(k, Entry(False)) for k in op.keys}, timed_out=True)

    def _settle(self, op: _Op) -> bool:
        """Complete `op` now; False while it must wait (a fetch of a filling object, a dead peer)."""
        if op.kind == "deposit":
            self._finish(op, self._do_deposit(op))
        elif op.kind == "deliver":
            self._finish(op, self._do_deliver(op))
        else:
            for key in op.keys:
                if key not in op.entries:
                    got = self._fetch_one(op, key)
                    if got is not None:
                        op.entries[key] = got
            if len(op.entries) < len(op.keys):
                return False
            self._finish(op, dict(op.entries))
        return True

    def _finish(self, op: _Op, entries: dict[bytes, Entry], timed_out: bool = False) -> None:
        op.done = True
        if timed_out and op.kind == "deposit":
            for key in op.keys:  # an abandoned copy stores nothing
                obj = self.objects.get(key)
                if obj is not None and not obj.resident:
                    del self.objects[key]
        self.completed.append((op.id, entries))
        self.log.append((op.kind, op.id, {k: e.success for k, e in entries.items()}))

    # ------------------------------------------------------------------ the three copies

    def _do_deposit(self, op: _Op) -> dict[bytes, Entry]:
        out = {}
        for key in op.keys:
            obj = self.objects.get(key)
            if obj is None:
                out[key] = Entry(False)  # no room when it started
                continue
            if obj.resident:
                out[key] = Entry(True)  # already stored (a second offload of the page)
                continue
            if key == op.fail_key:
                del self.objects[key]
                out[key] = Entry(False)
                continue
            for sub, desc in zip(self.subpools[obj.pool], op.blocks[key]):
                ctypes.memmove(self._addr(sub, obj.slot), desc.addr, min(desc.size, self.span[sub]))
            obj.resident, obj.stamp = True, self._tick()
            out[key] = Entry(True)
        return out

    def _do_deliver(self, op: _Op) -> dict[bytes, Entry]:
        out = {}
        for key in op.keys:
            obj = self.objects.get(key)
            if obj is None or not obj.resident:
                out[key] = Entry(False)
                continue
            data = self.read(key)
            if key == op.fail_key:
                data = data[: len(data) // 2] + bytes(len(data) - len(data) // 2)  # torn
            at = 0
            for desc in op.blocks[key]:
                ctypes.memmove(desc.addr, data[at : at + desc.size], desc.size)
                at += desc.size
            if self.policy == "lru":
                obj.stamp = self._tick()
            out[key] = Entry(key != op.fail_key)
        return out

    def _fetch_one(self, op: _Op, key: bytes) -> Optional[Entry]:
        """A settled fetch entry for `key`, or None while it must wait."""
        obj = self.objects.get(key)
        if obj is not None and not obj.resident:
            return None  # filling: wait for the deposit
        if obj is None:
            peer = self._hinted(key, op.request_id)
            if peer is None:
                return Entry(False)
            if not peer.alive:
                return None  # a dead peer never answers
            if _event_hash(key) not in peer.pages or key == op.fail_key:
                return Entry(False)  # stale: the peer no longer holds it
            slot = self._slot(_pool_of(key))
            if slot is None:
                return Entry(False)
            obj = self.objects[key] = _Object(_pool_of(key), slot, True, stamp=self._tick())
            data = self.world.content(key, sum(self.span[s] for s in self.subpools[obj.pool]))
            at = 0
            for sub in self.subpools[obj.pool]:
                ctypes.memmove(self._addr(sub, slot), data[at : at + self.span[sub]], self.span[sub])
                at += self.span[sub]
        elif key == op.fail_key:
            return Entry(False)
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.claims[handle] = (key, op.request_id)
        self.claim_op[handle] = op.id
        obj.claims.add(handle)
        if self.policy == "lru":
            obj.stamp = self._tick()
        return Entry(True, handle)

    # ------------------------------------------------------------------ slots

    def _submit(self, kind: str, keys: list[bytes], blocks: dict[bytes, list[MemDescriptor]], rid: str) -> int:
        if self.closed:
            raise RuntimeError("KVCR core is closed")
        op_id, self.next_op = self.next_op, self.next_op + 1
        fail = self.world.arm(self.world.fail, kind)
        stuck = self.world.arm(self.world.stuck, kind)
        held = stuck or self.world.arm(self.world.hold, kind)
        self.ops[op_id] = _Op(op_id, kind, keys, blocks, rid, self.world.now, held,
                              keys[len(keys) // 2] if fail and keys else None, stuck)  # fmt: skip
        self.submissions.append((kind, op_id, list(keys)))
        return op_id

    def _hinted(self, key: bytes, request_id: str) -> Optional[Peer]:
        hint = self.hints.get(request_id)
        if hint is None or _event_hash(key) not in hint[1]:
            return None
        return self.world.peers.get(hint[0])

    def _slot(self, pool: str) -> Optional[int]:
        used = {o.slot for o in self.objects.values() if o.pool == pool}
        free = next((s for s in range(self.capacity) if s not in used), None)
        if free is not None:
            return free
        victim = self._victim(pool)
        if victim is None:
            return None
        slot = self.objects[victim].slot
        self._evict(victim)
        return slot

    def _victim(self, pool: Optional[str] = None) -> Optional[bytes]:
        candidates = [
            (o.stamp, k) for k, o in self.objects.items() if o.resident and not o.claims and pool in (None, o.pool)
        ]
        return min(candidates)[1] if candidates else None

    def _evict(self, key: bytes) -> None:
        del self.objects[key]
        self.world.evictions.append((key,))
        self.bindings.inventory_sink(InventoryEvent(True, (key,)))

    def _addr(self, sub: str, slot: int) -> int:
        return self.regions[sub][0] + slot * self.span[sub]

    def _tick(self) -> int:
        self.stamp += 1
        return self.stamp
