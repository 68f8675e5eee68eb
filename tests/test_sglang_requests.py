"""SGLang 0.5.23's own scheduler request path (conformance/adapters/sglang/requests.py), factory by factory.

Each cell drives one scenario through the RequestPathBackend protocol: a two-turn conversation beside a one-shot
request, a prompt long enough to be chunked, an abort mid-prompt, eviction under pressure and (with a host tier)
a host hit loaded back. After every step the snapshot passes every state invariant, every cached node's KV bytes
(device and host) are the spec's entries of its path, and every running request's row holds the KV of its
tokens; once every request finished nothing is locked, lent, pending or leaked. Skipped as a whole without the
`sglang` extra (required with KVCERT_SGLANG=1).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Optional

import pytest
from _sglang import require_sglang

require_sglang()

from kvcert.conformance.adapters.sglang import requests as sglang_requests  # noqa: E402
from kvcert.conformance.backend import RequestPathBackend  # noqa: E402
from kvcert.spec import storage  # noqa: E402
from kvcert.spec.invariants import check_snapshot  # noqa: E402
from kvcert.spec.requests import RequestView, output_token  # noqa: E402
from kvcert.spec.types import CacheConfig, Snapshot  # noqa: E402

pytestmark = pytest.mark.sglang

CAPACITY, HOST = 32, 64
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
CELLS = [
    ("factory", 1, 0, ""),
    ("factory", 4, 0, ""),
    ("factory", 1, HOST, "write_through"),
    ("factory", 4, HOST, "write_through"),
    ("factory", 1, HOST, "write_back"),
    ("factory", 4, HOST, "write_through_selective"),
    ("factory_rust", 1, HOST, "write_through"),
    ("factory_rust", 4, HOST, "write_back"),
    ("factory_radix", 1, 0, ""),
    ("factory_radix", 4, 0, ""),
    ("factory_sessions", 1, 0, ""),
    ("factory_sessions", 4, HOST, "write_through"),
    ("sglang.plugin:factory", 1, 0, ""),  # kvcert's own cache as SGLang's --radix-cache-backend kvcert
    ("sglang.plugin:factory_sessions", 4, 0, ""),
    ("sglang.plugin:factory", 4, HOST, "write_back"),
]
PER_REQUEST = (
    "scheduler.waiting_queue",
    "scheduler.running_batch",
    "scheduler.chunked_req",
    "scheduler._pending_chunked_abort_req",
    "scheduler._deferred_input_requests",
    "scheduler.result_queue",
    "req_to_token_pool.rows_in_use",
    "cache.ongoing_write_through",
    "cache.ongoing_load_back",
    "cache.ongoing_backup",
    "cache.ongoing_prefetch",
    "cache_controller.write_queue",
    "cache_controller.load_queue",
    "cache_controller.ack_write_queue",
    "cache_controller.ack_load_queue",
)
"""Bookkeeping that must be empty once the engine is idle (session generations and tombstones outlive requests)."""


def adapter_factory(name: str) -> Any:
    """A factory of this module's adapter, or "module:factory" of another adapter module (`sglang.plugin`)."""
    module, _, attr = name.rpartition(":")
    adapters = importlib.import_module(f"kvcert.conformance.adapters.{module}") if module else sglang_requests
    return getattr(adapters, attr)


class Model:
    """The suite's model: the spec's KV entries and `output_token`."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def kv(self, namespace: Optional[str], tokens: Sequence[int], start: int, count: int) -> list[bytes]:
        return list(storage.token_entries(namespace, tokens, self.layers)[start : start + count])

    def next_token(self, namespace: Optional[str], tokens: Sequence[int]) -> int:
        return output_token(namespace, tokens)


class Driver:
    """Drives one adapter and checks it after every step."""

    def __init__(self, name: str, page_size: int, host: int, write_policy: str = "write_through") -> None:
        self.config = CacheConfig(
            page_size=page_size, capacity=CAPACITY, host_capacity=host, write_policy=write_policy or "write_through"
        )
        self.target = adapter_factory(name)(self.config)
        self.target.attach_model(Model(self.config.kv_layers))
        self.seen: list[RequestView] = []
        self.snaps: list[Snapshot] = []

    def step(self) -> tuple[RequestView, ...]:
        self.target.step()
        self.target.sanity_check()
        snap = self.target.snapshot()
        assert check_snapshot(snap) == [], check_snapshot(snap)
        self.check_kv(snap)
        views = self.target.requests()
        self.check_requests(snap, views)
        observed = getattr(self.target, "observed", None)
        if observed is not None:  # its KV events, replayed (INV-EVENT-1)
            found = observed("sglang-0.5.23")
            assert not found, found
        self.seen += views
        self.snaps.append(snap)
        return views

    def check_kv(self, snap: Snapshot) -> None:
        """Every node's bytes on both tiers; a backup still in flight has no host bytes yet (they land at its ack)."""
        layers, paths = self.config.kv_layers, {}
        landing = {n for c in snap.pending if c.kind == "write" for n in c.nodes}
        for node in snap.nodes:
            if node.parent is None:
                paths[node.id] = ()
                continue
            path = paths[node.id] = paths[node.parent] + node.key
            want = list(storage.token_entries(node.namespace, path, layers)[-len(node.key) :])
            if node.slots is not None:
                assert self.target.read_kv(node.slots) == want, f"device KV of node {node.id} {path}"
            if node.host_slots is not None and node.id not in landing:
                assert self.target.read_host_kv(node.host_slots) == want, f"host KV of node {node.id} {path}"

    def check_requests(self, snap: Snapshot, views: Sequence[RequestView]) -> None:
        tree = {s for node in snap.nodes for s in node.slots or ()}
        own: set[int] = set()
        for view in views:
            assert view.state in ("waiting", "running", "finished", "aborted")
            if view.state != "running":
                assert not view.row and not view.own and view.computed == 0, view
                continue
            assert len(view.row) == view.computed <= len(view.tokens)
            want = list(storage.token_entries(view.namespace, view.tokens[: view.computed], self.config.kv_layers))
            assert self.target.read_kv(view.row) == want, f"the KV in request {view.id}'s row"
            assert not (set(view.own) & tree) and not (set(view.own) & own), view
            own |= set(view.own)
        assert own == set(snap.lent_slots)
        assert not (own & set(snap.free_slots))

    def until_done(self, limit: int = 60) -> tuple[RequestView, ...]:
        ended: dict[str, RequestView] = {}
        for _ in range(limit):
            views = self.step()
            ended |= {v.id: v for v in views if v.state in ("finished", "aborted")}
            for view in views:
                if view.state == "finished":  # SGLang's output is what the model sampled, token for token
                    assert view.tokens == sampled(view.namespace, view.tokens[: view.prompt], len(view.tokens))
            if all(v.state in ("finished", "aborted") for v in views):
                return tuple(ended.values())
        raise AssertionError(f"requests still running after {limit} steps: {self.target.requests()}")

    def device_paths(self) -> set[tuple[Optional[str], tuple[int, ...]]]:
        snap, out = self.target.snapshot(), set()
        paths: dict[int, tuple[int, ...]] = {}
        for node in snap.nodes:
            paths[node.id] = () if node.parent is None else paths[node.parent] + node.key
            if node.parent is not None and node.slots is not None:
                out.add((node.namespace, paths[node.id]))
        return out


def sampled(namespace: Optional[str], prompt: Sequence[int], length: int) -> tuple[int, ...]:
    tokens = list(prompt)
    while len(tokens) < length:
        tokens.append(output_token(namespace, tokens))
    return tuple(tokens)


def finished(views: Sequence[RequestView], rid: str) -> RequestView:
    (view,) = [v for v in views if v.id == rid]
    assert view.state == "finished", view
    return view


def quiet(driver: Driver) -> Snapshot:
    """Idle steps until SGLang consumed every ack; then nothing may be locked, lent, pending or leaked."""
    for _ in range(3):
        assert driver.step() == ()
    snap = driver.target.snapshot()
    body = [n for n in snap.nodes if n.parent is not None]
    assert all(n.lock_ref == 0 and n.host_lock_ref == 0 for n in body), [(n.id, n.lock_ref) for n in body]
    assert not snap.lent_slots and not snap.pending and not snap.prefetches and not snap.retractions
    device = sorted(s for n in body for s in n.slots or ())
    assert sorted(device + list(snap.free_slots)) == list(range(snap.page_size, snap.page_size + snap.capacity))
    host = sorted(s for n in body for s in n.host_slots or ())
    assert sorted(host + list(snap.host_free_slots)) == list(range(snap.host_capacity))
    book = driver.target.bookkeeping()
    assert {name: book[name] for name in PER_REQUEST if name in book and book[name][0]} == {}
    live = {n.id for n in snap.nodes}
    assert all(set(entry[1]) <= live for entry in book.values()), book
    return snap


@pytest.mark.parametrize(("name", "page_size", "host", "write_policy"), CELLS, ids=lambda v: str(v))
def test_scenario(name: str, page_size: int, host: int, write_policy: str) -> None:
    d = Driver(name, page_size, host, write_policy)
    t = d.target
    assert isinstance(t, RequestPathBackend)
    sessions = name.endswith("factory_sessions")
    ps, chunk = page_size, 2 * page_size

    # A conversation's first turn (chunked: longer than the 2-page chunk) beside a one-shot request.
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 2, 1, 0, 3, 1, 2, 0, 2, 3, 1][: chunk + ps + 1]
    t.submit("c1", "s", None, prompt, 0, 3)
    t.submit("one", None, "ns", [3, 3, 2, 2, 1], 1, 2)
    views = d.step()
    (c1,) = [v for v in views if v.id == "c1"]
    assert c1.state == "running" and 0 < c1.computed < len(prompt), "the prompt is prefilled in chunks"
    ended = d.until_done()
    turn1 = finished(ended, "c1")
    one = finished(ended, "one")
    assert one.namespace == "ns" and len(one.tokens) == 5 + 2 and len(turn1.tokens) == len(prompt) + 3
    kept = turn1.tokens[: (len(turn1.tokens) - 1) // ps * ps]  # the last token's KV is never computed
    assert (None, kept) in d.device_paths(), "turn 1 is cached"
    if sessions:
        (view,) = d.snaps[-1].sessions
        assert view.id == "s" and _path(d.snaps[-1], view.node) == kept, "the session holds turn 1's path"

    # The second turn extends the first: its prefix is a hit.
    t.submit("c2", "s", None, list(turn1.tokens) + [2, 2], 0, 2)
    views = d.step()
    (c2,) = [v for v in views if v.id == "c2"]
    assert c2.computed > len(turn1.tokens) - 1 - ps, "turn 2 reuses turn 1's KV"
    turn2 = finished(d.until_done(), "c2")

    # An abort mid-prompt: the chunk already computed is SGLang's to keep or free, the request ends aborted.
    t.submit("ab", None, None, [2, 0] * (chunk // 2 + ps), 0, 4)
    (ab,) = d.step()
    assert ab.state == "running" and 0 < ab.computed < len(ab.tokens)
    t.abort("ab")
    (ab,) = d.until_done()
    assert ab.id == "ab" and ab.state == "aborted"

    # Eviction under pressure: four prompts in their own namespaces, more than the pool holds.
    before = d.device_paths()
    for i in range(4):
        t.submit(f"p{i}", None, f"e{i}", [i % 4, 3] * (CAPACITY // 6), 0, 2)
    assert all(v.state == "finished" for v in d.until_done(80))
    assert before - d.device_paths(), "the pressure evicted cached KV"

    # The conversation again: with a host tier its prefix comes back from the host.
    loads = _loads(t)
    t.submit("c3", "s", None, list(turn2.tokens) + [0, 1], 0, 2)
    finished(d.until_done(), "c3")
    if host:
        assert _loads(t) > loads, "the host hit was loaded back"
    if sessions:
        t.close_session("s")
        d.step()
        assert d.snaps[-1].sessions == ()
    quiet(d)
    t.close()


def _path(snap: Snapshot, node: int) -> tuple[int, ...]:
    by_id = {n.id: n for n in snap.nodes}
    out: tuple[int, ...] = ()
    while by_id[node].parent is not None:
        out = by_id[node].key + out
        node = by_id[node].parent  # type: ignore[assignment]
    return out


def _loads(target: Any) -> int:
    """H2D loads SGLang submitted (the HiCache driver's copy ops), or host tokens kvcert's backend loaded back."""
    if target.kind == "kvcert":
        return int(target.cache.loaded_back)
    driver = getattr(target, "_driver", None)
    return sum(op.kind == "load" for op in driver.ops.values()) if driver is not None and target.host else 0


def test_same_calls_same_results() -> None:
    """Two adapters in one process, the same calls: the same snapshots, ids included."""
    runs = []
    for _ in range(2):
        d = Driver("factory", 1, HOST)
        d.target.submit("a", "s", None, [1, 2, 3, 0, 1, 2], 0, 2)
        d.target.submit("b", None, "x", [1, 2, 3, 3], 0, 2)
        d.until_done()
        quiet(d)
        runs.append(d.snaps)
        d.target.close()
    assert runs[0] == runs[1]


def test_capabilities() -> None:
    for name in ("factory", "factory_rust", "factory_radix", "factory_sessions"):
        caps = getattr(sglang_requests, name).capabilities
        assert caps.kind == "request-path" and caps.kv_reads and caps.profile == "sglang-0.5.23"
        assert caps.page_sizes == (1, 4) and caps.deviations and caps.notes
        assert caps.priority_refs == (name == "factory_sessions") and "update" not in caps.priority_parts
    assert sglang_requests.factory_radix.capabilities.write_policies == ()
    assert sglang_requests.factory.capabilities.write_policies == WRITE_POLICIES


def test_reprioritize_is_not_offered_and_plain_closes_send_nothing() -> None:
    d = Driver("factory_radix", 1, 0)
    with pytest.raises(NotImplementedError):
        d.target.reprioritize("s", 1)
    d.target.close_session("s")
    assert d.step() == () and d.target._noop_closes == ["s"]


def test_abort_matches_rids_by_prefix() -> None:
    """SGLang's abort_request matches `rid.startswith(abort.rid)`: aborting r1 aborts r10 too."""
    d = Driver("factory", 1, 0)
    d.target.submit("r1", None, None, [1, 2, 3], 0, 2)
    d.target.submit("r10", None, None, [3, 2, 1], 0, 2)
    d.target.abort("r1")
    assert {v.id: v.state for v in d.step()} == {"r1": "aborted", "r10": "aborted"}


def test_clients_that_leave_ids_to_sglang_walk_past_sg_abort(tmp_path: Any) -> None:
    """SG-ABORT needs a client-chosen id that extends one in flight. `factory_engine_ids` declares clients that leave
    ids to SGLang (uuid4 rids), so SG-ABORT's traces are out of its scope and its cells walk on; every other logged
    trace of the engine is still replayed before the walk."""
    from kvcert.conformance.certification import known
    from kvcert.conformance.certification.certify import certify

    target = "kvcert.conformance.adapters.sglang.requests:factory_engine_ids"
    caps = sglang_requests.factory_engine_ids.capabilities  # type: ignore[attr-defined]
    assert caps.client == ("distinct-ids",) and caps.kind == "request-path"
    judged = known.replay_findings(target, sglang_requests.factory_engine_ids, caps)
    aborts = [j for j in judged if j.finding.id == "SG-ABORT"]
    assert aborts and all(not j.reproduced and "distinct-ids" in j.summary for j in aborts)
    cert = certify(target, examples=10, steps=30, page_sizes=[1], write_policies=[], prefetch_policies=[],
                   out_dir=tmp_path)  # fmt: skip
    assert cert.passed and cert.total_steps > 0, cert


@pytest.mark.parametrize("target", ["factory_engine_ids", "sglang.plugin:factory"])
def test_a_burst_of_long_answers_makes_sglang_retract_and_resume(target: str, monkeypatch: Any) -> None:
    """Clients leave ignore_eos off, so SGLang admits on an estimate of each running request's remaining output:
    three one-token questions with 24-token answers outgrow the 64-token pool while decoding. SGLang's own
    update_running_batch retracts one (retract_decode) and resumes it later, and every step's checks hold (every
    request finishing, INV-LIVE-3, among them); on SGLang's tree and on kvcert's backend."""
    from sglang.srt.managers import schedule_batch

    from kvcert.conformance.certification.replay import replay
    from kvcert.conformance.generation.request_machine import request_cells
    from kvcert.spec.ops import Step, Submit

    retracted: list[int] = []
    retract = schedule_batch.ScheduleBatch.retract_decode

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = retract(self, *args, **kwargs)
        retracted.append(len(out[0]))
        return out

    monkeypatch.setattr(schedule_batch.ScheduleBatch, "retract_decode", counting)
    make = adapter_factory(target)
    caps = make.capabilities  # type: ignore[attr-defined]
    (config,) = request_cells([CacheConfig(page_size=1, capacity=8)], caps)
    assert config.capacity == 64
    ops = [Submit(f"r{i:06d}", None, (10 * i + 1,), 0, 24, None) for i in range(3)] + [Step() for _ in range(60)]
    got = replay(make, caps, config, ops)
    assert got.failure is None, got.failure
    assert sum(retracted) >= 1, "no request was retracted: the burst no longer outgrows the pool"


@pytest.mark.parametrize("core", ["python", "rust"])
def test_a_kv_event_sglang_leaves_out_fails_certification(core: str, monkeypatch: Any, tmp_path: Any) -> None:
    """SGLang's caches publish KV events (--kv-events-config); after every op the request path replays them as a
    router would and compares each medium's blocks with SGLang's tree (INV-EVENT-1). Unmodified, they agree (every
    certification of these targets); on either tree core, events that leave out device removals fail, as a router
    would keep sending prompts to blocks the worker evicted."""
    from sglang.srt.disaggregation.kv_events import BlockRemoved
    from sglang.srt.mem_cache.events import KVCacheEventRecorder
    from sglang.srt.mem_cache.rust_tree_core.adapter import _RustKVCacheEventRecorder

    from kvcert.conformance.certification.certify import certify

    recorder = KVCacheEventRecorder if core == "python" else _RustKVCacheEventRecorder
    take = recorder.take

    def drops(self: Any) -> list[Any]:
        return [e for e in take(self) if not (isinstance(e, BlockRemoved) and str(getattr(e.medium, "value", e.medium)) == "GPU")]

    monkeypatch.setattr(recorder, "take", drops)
    target = "factory_engine_ids" if core == "python" else "factory_rust_engine_ids"
    cert = certify(
        f"kvcert.conformance.adapters.sglang.requests:{target}", examples=20, steps=30, page_sizes=[1],
        policies=["lru"], write_policies=[], out_dir=tmp_path,
    )  # fmt: skip
    assert not cert.passed and "INV-EVENT-1" in str(cert.cells[0].failure)


@pytest.mark.parametrize("target", ["factory", "sglang.plugin:factory"])
def test_host_eviction_is_announced_to_a_router(target: str, monkeypatch: Any) -> None:
    """Generated request-path walks seldom fill the host tier (twice the device's); a dozen prompts in their own
    namespaces do. The host copies evicted for room are published as CPU_PINNED removals, and every step's replay
    of the KV events agrees with the tree (INV-EVENT-1): on SGLang's HiCache and on kvcert's backend."""
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    removed: list[str] = []
    remove = KVCacheEventRecorder.record_remove

    def counting(self: Any, node: Any, medium: Any = None) -> None:
        removed.append(str(getattr(medium, "value", medium)))
        remove(self, node, medium)

    monkeypatch.setattr(KVCacheEventRecorder, "record_remove", counting)
    d = Driver(target, 1, HOST, "write_through")
    for i in range(12):
        d.target.submit(f"h{i}", None, f"e{i}", [i % 4, 3, i % 3, 1] * 6, 0, 2)
        assert all(v.state == "finished" for v in d.until_done(80))
    assert "CPU_PINNED" in removed, "the host tier never evicted: the prompts no longer fill it"
    quiet(d)
    d.target.close()
