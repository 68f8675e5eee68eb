# Over 600 lines: the decode worker, its prefill peer and its L3 tier are one target of one engine seam.
"""SGLang 0.5.23's decode server of PD disaggregation, with its decode-side radix cache and HiCache: a request-path
target (SPEC.md §12).

    kvcert certify kvcert.conformance.adapters.sglang.decode:factory           # decode radix cache, + HiCache (host)
    kvcert certify kvcert.conformance.adapters.sglang.decode:factory_storage   # + an L3 store in host cells

What runs is SGLang's own decode worker: `Scheduler.event_loop_normal_disagg_decode`, one iteration per `step()`
(`ingest_requests` -> `process_decode_queue` -> `get_next_disagg_decode_batch_to_run` -> `run_batch` ->
`process_batch_result`), with its `DecodePreallocQueue` (prefix match and lock, `DecodeHiCachePreallocMixin`'s L2/L3
prefix and prefetch, the admission budget, `_pre_alloc` with its eviction), its `DecodeTransferQueue`
(`DecodeHiCacheTransferMixin`'s load-back state machine behind the restore-gated poll, the commit that hands the
restored lock to the request, the cleanup of a failed transfer), the prebuilt batch, decode retraction and the
abort paths. `enable_decode_hicache` is SGLang's own: `--disaggregation-decode-enable-radix-cache` and
`--enable-hierarchical-cache` (a cell with a host tier).

The scheduler is `sglang_requests.SGLangRequestPath`'s stand-in, built in decode mode: the same `init_*` methods, the
request-row pool PD decode builds (`DecodeReqToTokenPool`, `--disaggregation-decode-extra-slots` rows for requests in
transfer) and the allocator's `need_sort`, as `kv_cache_configurator` builds them for a decode server.

The transfer engine is SGLang's `fake` backend (`FakeKVManager`, `FakeKVReceiver`): a receiver concludes its transfer
at the first poll after `send_metadata`. The harness is the prefill peer. Requests carry a bootstrap address and room
as the router sets them, so SGLang takes its real-transfer path, not the warmup one (`_is_fake_transfer`): its
metadata gate holds a transfer until the prefill's metadata row lands. The peer serves each `send_metadata` SGLang
made (the page indices, the metadata row, `decode_prefix_len`) once its prefill has had its time (`PREFILL_CHUNK_PAGES`
pages of prompt a step): after that iteration it writes the model's KV of the prompt's tokens from
`decode_prefix_len` into those pages and the first output token and the bootstrap room into the metadata row, as the
prefill's RDMA writes do. An engine that sends wrong pages or a wrong prefix length gets
wrong bytes, which the suite reads back.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvcert.conformance.adapters.kit.kv import write_pool
from kvcert.conformance.adapters.sglang import env as _env
from kvcert.conformance.adapters.sglang import requests as _sr
from kvcert.conformance.adapters.sglang.storage.stepped import Transfer
from kvcert.spec import pages as _pages
from kvcert.spec import storage as l3
from kvcert.spec.decode import FAULTS, DecodeLedger, tree_slots
from kvcert.spec.invariants import Violation
from kvcert.spec.requests import RequestView
from kvcert.spec.types import CacheConfig, Capabilities, PendingCopy, PendingPrefetch, Snapshot

with _env.quiet_imports():
    import torch
    from sglang.srt import runtime_context as _rc
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import PrefillServerInfo
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

__all__ = ["SGLangDecodePath", "SGLangDecodeStoragePath", "factory", "factory_fitting", "factory_storage"]

PEER_HOST = "prefill.kvcert"
"""The prefill peer's bootstrap host (any host but SGLang's warmup marker FAKE_BOOTSTRAP_HOST)."""
PEER_PORT = 8998
"""--disaggregation-bootstrap-port's default."""
QUEUED_COPY_IDS = 1 << 40
"""Ids of queued, unsubmitted writes in snapshots (CacheOperation's id, offset past the driver's copy ids)."""
PREFILL_CHUNK_PAGES = 2
"""Pages of a prompt the prefill peer computes per step (sglang_requests' --chunked-prefill-size)."""
RESERVED_DECODE_TOKENS = 4
"""--num-reserved-decode-tokens: SGLang's 512 is sized for a GPU's pool; a cell's pool holds tens of tokens."""
DEFAULT_RESERVED_DECODE_TOKENS = 512
"""SGLang's own --num-reserved-decode-tokens (`factory_default_reserve`)."""


@dataclasses.dataclass
class _Sent:
    """One `send_metadata` SGLang made: what the prefill peer is told."""

    decode_req: Any
    pages: tuple[int, ...]
    aux: int
    decode_prefix_len: int
    at: int
    """The step in which SGLang sent it."""
    served: bool = False
    judged: bool = False
    """Its promise is in the ledger (judged after the iteration that sent it)."""
    fail: bool = False
    """The peer fails it (`PeerFault`): half its bytes land, then the receiver reports the transfer failed."""


class _OneRankCpuGroup:
    """The decode queues' gloo group for a world of one rank: `dist.get_world_size(group)` reads `size()`, and at 1
    SGLang's `all_reduce_flags` returns each rank's own flags without a collective."""

    def size(self) -> int:
        return 1


class SGLangDecodePath(_sr.SGLangRequestPath):
    """SGLang's decode worker over UnifiedRadixCache (Python tree core); the RequestPathBackend protocol."""

    def __init__(self, config: CacheConfig, reserve: int = RESERVED_DECODE_TOKENS) -> None:
        """`reserve`: --num-reserved-decode-tokens (the capabilities' `output_reserve` must say the same)."""
        self._reserve = reserve
        self._sent: list[_Sent] = []
        self._rooms = 0
        self.ledger = DecodeLedger()
        self._promised: dict[str, _Sent] = {}
        """Transfers whose promise the ledger holds, by rid, until they commit or end."""
        self._faults = 0
        self._aborted_by_client: set[str] = set()
        super().__init__(config, kind="unified", core="python")

    # ------------------------------------------------------------------ construction

    def _server_args(self) -> dict[str, Any]:
        """A decode server: `--disaggregation-mode decode --disaggregation-decode-enable-radix-cache` (HiCache when
        the cell has a host tier). The transfer backend named here is `mooncake`, SGLang's default, because its
        argument checks refuse `fake` beside the decode radix cache; the context is switched to `fake` before the
        scheduler is built (a declared deviation)."""
        return super()._server_args() | {
            "disaggregation_mode": "decode",
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_decode_enable_radix_cache": True,
            "num_reserved_decode_tokens": self._reserve,
        }

    def _build_scheduler(self) -> Any:
        _rc.get_context().override("kvcert.sglang_decode", disaggregation_transfer_backend="fake")
        s = super()._build_scheduler()
        queue = s.disagg_decode_prealloc_queue
        queue.gloo_group = s.disagg_decode_transfer_queue.gloo_group = _OneRankCpuGroup()
        # The bootstrap registry's answer for the prefill peer (CommonKVManager fills it from the bootstrap server).
        queue.kv_manager.prefill_info_table = {
            f"{PEER_HOST}:{PEER_PORT}": PrefillServerInfo(
                attn_tp_size=1,
                attn_cp_size=1,
                dp_size=1,
                pp_size=1,
                page_size=self.page_size,
                kv_cache_dtype=None,
                follow_bootstrap_room=True,
            )
        }
        create = queue._create_receiver_and_enqueue

        def create_receiver_and_enqueue(req: Any, *args: Any, **kwargs: Any) -> Any:
            decode_req = create(req, *args, **kwargs)
            self._observe_metadata(decode_req)
            return decode_req

        queue._create_receiver_and_enqueue = create_receiver_and_enqueue
        transfer = s.disagg_decode_transfer_queue
        commit = transfer._commit_transfer_to_req

        def commit_transfer_to_req(decode_req: Any) -> Any:
            out = commit(decode_req)
            self._committed(decode_req)
            return out

        transfer._commit_transfer_to_req = commit_transfer_to_req
        pop = transfer.pop_transferred

        def pop_transferred(*args: Any, **kwargs: Any) -> Any:
            out = pop(*args, **kwargs)
            self._settle_transfers(judge=True)
            return out

        transfer.pop_transferred = pop_transferred
        return s

    def _observe_metadata(self, decode_req: Any) -> None:
        """Record what SGLang sends the prefill through this receiver (the fake one only logs it)."""
        receiver = decode_req.kv_receiver
        send = receiver.send_metadata

        def send_metadata(kv_indices: Any, aux_index: Any = None, *args: Any, **kwargs: Any) -> Any:
            pages = tuple(int(p) for p in kv_indices)
            prefix = kwargs.get("decode_prefix_len")
            self._sent.append(_Sent(decode_req, pages, int(aux_index), int(prefix or 0), self._step))
            return send(kv_indices, aux_index, *args, **kwargs)

        receiver.send_metadata = send_metadata

    def _init_model_worker(self, s: Any) -> None:
        """The base worker stand-in, with the pools a decode server builds: `DecodeReqToTokenPool` (rows for
        requests in transfer on top of --max-running-requests) and a `need_sort` allocator."""
        super()._init_model_worker(s)
        self._req_pool = DecodeReqToTokenPool(
            size=_sr.MAX_RUNNING,
            max_context_len=s.model_config.context_len + get_req_to_token_extra_context_len(),
            device="cpu",
            enable_memory_saver=False,
            pre_alloc_size=_rc.get_disagg().disaggregation_decode_extra_slots,
        )
        self.cache.req_to_token_pool = self._req_pool
        runner = s.tp_worker.model_runner
        runner.req_to_token_pool = self._req_pool
        runner.kv_cache_dtype_str = _rc.get_model().kv_cache_dtype
        self._allocator.need_sort = True

    # ------------------------------------------------------------------ plumbing

    def _send(self, message: Any) -> None:
        """A generate request as the PD router forwards it to a decode server: the prefill's bootstrap address and
        a room of its own (never 0: SGLang's metadata gate reads room 0 as not yet written)."""
        if isinstance(message, TokenizedGenerateReqInput):
            self._rooms += 1
            message.bootstrap_host, message.bootstrap_port, message.bootstrap_room = PEER_HOST, PEER_PORT, self._rooms
        super()._send(message)

    # ------------------------------------------------------------------ RequestPathBackend

    def step(self) -> None:
        """One iteration of SGLang's `event_loop_normal_disagg_decode`, the outputs the tokenizer side receives,
        then the prefill peer's writes for every destination SGLang published in it."""
        self._step += 1
        self._hook.calls = 0
        with self._engine():
            try:
                self.scheduler.event_loop_normal_disagg_decode()
            except _sr._IterationDone:
                pass
            else:  # pragma: no cover - the loop only returns on a graceful exit
                raise RuntimeError("SGLang's decode event loop returned")
        for message in self._to_detokenizer.drain() + self._to_tokenizer.drain():
            self._receive(message)
        self._judge_transfers()
        self._serve_prefill()

    # ------------------------------------------------------------------ decode admission (SPEC.md §15)

    def _tree_slots(self) -> tuple[set[int], set[int], set[int]]:
        return tree_slots(self.snapshot())

    def _row_of(self, req: Any, upto: int) -> tuple[int, ...]:
        idx = req.kv.req_pool_idx if getattr(req, "kv", None) is not None else getattr(req, "req_pool_idx", None)
        if idx is None:
            return ()
        return tuple(int(x) for x in self._req_pool.req_to_token[idx][:upto])

    def _judge_transfers(self) -> None:
        """The promises SGLang made this iteration, the commits and failures it took, and every transfer still in
        flight against the tree (DecodeLedger): after the iteration, with the tree as it left it."""
        free, cached, locked = self._tree_slots()
        ps = self.page_size
        for sent in self._sent:
            if sent.judged:
                continue
            sent.judged = True
            req = sent.decode_req.req
            prompt = len(req.origin_input_ids)
            pm = getattr(sent.decode_req, "prefix_match", None)
            l1 = pm.l1_prefix_len if pm is not None else sent.decode_prefix_len
            dest = [sent.pages[j // ps] * ps + j % ps for j in range(prompt - sent.decode_prefix_len)]
            self.ledger.promise(str(req.rid), prompt, sent.decode_prefix_len, self._row_of(req, l1), dest,
                                sent.decode_prefix_len - l1, free, cached, locked)  # fmt: skip
            self._promised[str(req.rid)] = sent
        self._settle_transfers(judge=False)
        self.ledger.held(free, cached, locked)
        for rid, record in self._submitted.items():
            if record.ended == "aborted" and rid not in self.ledger.refused and record.req is not None:
                if _pages.page_ceil(len(record.req.origin_input_ids) + int(record.req.sampling_params.max_new_tokens),
                              ps) > self.config.capacity:  # fmt: skip
                    self.ledger.refuse(rid)

    def _settle_transfers(self, judge: bool) -> None:
        """Promised transfers that left SGLang's transfer queue without a commit: failed by the peer (INV-DEC-5, the
        engine may abort them), aborted by the client, or failed by the engine itself (INV-RP-5 judges that). `judge`:
        right after `pop_transferred` released them, before anything of the iteration can reuse their slots, their
        destinations are checked against the tree; at the iteration's end (a transfer that left some other way)
        they are only closed."""
        in_transfer = {id(dr) for dr in self.scheduler.disagg_decode_transfer_queue.queue}
        gone = [(rid, sent) for rid, sent in self._promised.items() if id(sent.decode_req) not in in_transfer]
        if not gone:
            return
        cached = self._tree_slots()[1] if judge else set()
        for rid, sent in gone:
            del self._promised[rid]
            if sent.fail:
                self.ledger.fail(rid, cached)
            elif judge and rid in self._aborted_by_client:
                self.ledger.abort(rid, cached)
            else:
                self.ledger.open.pop(rid, None)

    def _committed(self, decode_req: Any) -> None:
        """INV-DEC-4 at SGLang's commit (`_commit_transfer_to_req`), before anything else of the iteration runs: the
        request's row and the tree as the commit left them (a later insert of the same tokens may point the row at
        the tree's own slots, which is not the commit's doing)."""
        req = decode_req.req
        rid = str(req.rid)
        if rid not in self._promised or type(req.finished_reason).__name__ == "FINISH_ABORT":
            return
        del self._promised[rid]
        _, cached, locked = self._tree_slots()
        self.ledger.commit(rid, self._row_of(req, len(req.origin_input_ids)), cached, locked)

    def peer_fault(self, kind: str) -> None:
        """The prefill peer fails a transfer SGLang is still waiting on (one restoring a span if any, else the oldest),
        when it serves it (`_serve_prefill`):
        half the bytes land, then the receiver reports the transfer failed (`KVPoll.Failed`), as a real receiver does
        when its peer dies."""
        if kind not in FAULTS:
            raise ValueError(f"unknown peer fault {kind!r}; one of {FAULTS}")
        self._faults += 1

    def abort(self, request: str) -> None:
        self._aborted_by_client.add(str(request))
        super().abort(request)

    def failed_loads(self) -> set[str]:
        return set(self.ledger.failed)

    def reached(self) -> dict[str, int]:
        return dict(self.ledger.reached)

    def observed(self, profile: str) -> list[Violation]:
        out, self.ledger.found = self.ledger.found, []
        return out

    def _serve_prefill(self) -> None:
        """The prefill peer: for each destination SGLang sent and still waits on, once the prefill has had its time,
        the model's KV of the prompt from `decode_prefix_len` into the pages it named, then the metadata row (first
        output token, bootstrap room). The prefill computes `PREFILL_CHUNK_PAGES` pages of the prompt a step (at least
        one step), so a request spends steps in transfer, where aborts and other admissions meet it."""
        if self._model is None:
            return
        waiting = {id(dr) for dr in self.scheduler.disagg_decode_transfer_queue.queue}
        ps, layers, pool = self.page_size, self.config.kv_layers, self._kv_pool
        buffers = self.scheduler.disagg_metadata_buffers
        if self._faults:  # the peer fails a transfer restoring a span if one is, else the oldest (SPEC.md §15)
            live = [s for s in self._sent if not s.served and not s.fail and id(s.decode_req) in waiting]
            restoring = [s for s in live if getattr(s.decode_req, "hicache_restore_lock", None) is not None]
            for sent in (restoring or live)[: self._faults]:
                self._faults -= 1
                sent.fail = True
        for sent in self._sent:
            if sent.served or id(sent.decode_req) not in waiting:
                continue
            req = sent.decode_req.req
            prompt = [int(t) for t in req.origin_input_ids]
            start = sent.decode_prefix_len
            count = len(prompt) - start
            if self._step - sent.at < max(1, -(-count // (PREFILL_CHUNK_PAGES * ps))):
                continue
            sent.served = True
            if sent.fail:
                count //= 2  # torn: the first half landed
                sent.decode_req.kv_receiver.conclude_state = KVPoll.Failed
            slots = [sent.pages[j // ps] * ps + j % ps for j in range(count)]
            ns = self.content_of(req)
            if count > 0:
                write_pool(pool, slots, self._model.kv(ns, prompt, start, count), layers)
            if sent.fail:
                continue
            buffers.output_ids[sent.aux][0] = self._model.next_token(ns, prompt)
            buffers.cached_tokens[sent.aux][:4] = 0
            buffers.bootstrap_room[sent.aux][0] = int(req.bootstrap_room)
        self._sent = [s for s in self._sent if not s.served and id(s.decode_req) in waiting]

    # ------------------------------------------------------------------ observation

    def _decode_reqs(self) -> list[Any]:
        """SGLang's DecodeRequests: preallocating, then in transfer."""
        s = self.scheduler
        return [*s.disagg_decode_prealloc_queue.queue, *s.disagg_decode_transfer_queue.queue]

    def _live_reqs(self) -> list[Any]:
        """The base's (waiting queue, batches) and the decode queues': preallocating, in transfer, retracted."""
        out = super()._live_reqs()
        seen = {id(r) for r in out}
        more = [dr.req for dr in self._decode_reqs()] + list(
            self.scheduler.disagg_decode_prealloc_queue.retracted_queue
        )
        for req in more:
            if id(req) not in seen:
                seen.add(id(req))
                out.append(req)
        return out

    def _view(self, record: Any, waiting: set[int]) -> RequestView:
        """A request in transfer holds its row, but only its device prefix (`req.prefix_len`) reads KV yet: the
        restored and the transferred spans land at the commit. Its view is that prefix; the rest of its allocation is
        lent (the snapshot's `lent_slots`)."""
        view = super()._view(record, waiting)
        req = record.req
        if req is None or record.ended is not None or view.state != "running":
            return view
        if any(dr.req is req for dr in self.scheduler.disagg_decode_transfer_queue.queue):
            computed = int(req.prefix_len or 0)
            return dataclasses.replace(view, computed=computed, row=view.row[:computed])
        return view

    def snapshot(self) -> Snapshot:
        """The base's, with every write SGLang has queued and not yet submitted listed as a pending write copy: a
        request that finishes in its prebuilt batch queues its backup outside `process_batch_result`, and the next
        iteration's `check_hicache_events` submits it. Its host slots are reserved and its node locked meanwhile,
        their bytes not yet written."""
        snap = super().snapshot()
        if not self.host:
            return snap
        ongoing = self.cache.ongoing_write_through

        def nodes(op: Any) -> tuple[int, ...]:  # a queued write's nodes, as SGLang rewrites them on a split
            out: list[int] = []
            for ack_id in op.node_ids:
                pending = ongoing.get(ack_id)
                out += [int(ack_id)] if pending is None else [int(n) for n in pending.publish_node_ids]
            return tuple(out)

        queued = tuple(
            PendingCopy(QUEUED_COPY_IDS + int(op.id), "write", nodes(op))
            for op in self.cache.cache_controller.write_queue
        )
        return dataclasses.replace(snap, pending=snap.pending + queued) if queued else snap

    def bookkeeping(self) -> dict[str, tuple[Any, ...]]:
        """The base's, and the decode worker's own: its queues, held releases, metadata rows and the
        transfer engine's per-request map."""
        out = super().bookkeeping()
        s = self.scheduler
        pre, tq = s.disagg_decode_prealloc_queue, s.disagg_decode_transfer_queue

        def put(name: str, entries: int, reqs: Sequence[Any] = ()) -> None:
            out[name] = (int(entries), tuple(sorted({_sr._node_id(n) for n in _sr._locked(reqs)})), None)

        put("decode.prealloc_queue", len(pre.queue), [dr.req for dr in pre.queue])
        put("decode.prealloc_queue.pending_reqs", len(pre.pending_reqs))
        put("decode.prealloc_queue.retracted_queue", len(pre.retracted_queue), pre.retracted_queue)
        put("decode.prealloc_queue.held_rebootstrap_reqs", len(pre.held_rebootstrap_reqs))
        put("decode.transfer_queue", len(tq.queue), [dr.req for dr in tq.queue])
        put("decode.transfer_queue._deferred_releases", len(tq._deferred_releases))
        restore_locks = [dr.hicache_restore_lock.node for dr in tq.queue if dr.hicache_restore_lock is not None]
        out["decode.transfer_queue.hicache_restore_locks"] = (
            len(restore_locks),
            tuple(sorted({_sr._node_id(n) for n in restore_locks})),
            None,
        )
        allocator = s.req_to_metadata_buffer_idx_allocator
        put("decode.metadata_buffers.in_use", allocator.size - allocator.available_size())
        put("decode.kv_manager.req_to_decode_prefix_len", len(pre.kv_manager.req_to_decode_prefix_len))
        return out


# --------------------------------------------------------------------------- L3: the decode server's storage tier

PREFETCH_POLICY = "timeout"
"""--hicache-storage-prefetch-policy: SGLang's default, which a decode server keeps (DecodeHiCachePreallocMixin reads
the cache's `prefetch_stop_policy`; nothing on the decode path overrides it)."""
PREFETCH_TIMEOUT_TICKS = (64, 1)
"""The timeout policy's wait, (base, per page) in ticks of the harness's logical clock (one op a tick). SGLang's is
1 s + 0.25 s per 1K tokens of wall time, tens of decode iterations; a prefetch here lands within two iterations."""


class SGLangDecodeStoragePath(SGLangDecodePath):
    """The decode worker with an L3 tier in host cells: `--hicache-storage-backend` over the stepped bridge to a store
    it shares with the prefill peer. SGLang's own decode path runs on it: `query_storage_hit_length` at the prefix
    match, `_start_hicache_prefetch` after admission, the transfer queue's wait on `check_prefetch_progress` before
    the load-back, and the write-through backups of what it inserts (`write_backup_storage`).

    The storage threads never run on their own: after each iteration the adapter runs their bodies over what the
    iteration queued, until none has anything left (the backup thread's `batch_set`s, the prefetch thread's hit
    query, the io-aux transfer of every operation the scheduler gave host pages, the sync thread's acks); SGLang's
    scheduler drains their results at its next iteration (`check_hicache_events`), as it does with real threads."""

    def __init__(self, config: CacheConfig) -> None:
        self.store = l3.MemoryStorage()
        """The L3 store the decode server shares with its peers (SGLang reaches it through the bridge)."""
        self.reach: Counter[str] = Counter()
        """What the L3 tier did: pages SGLang stored, pages the peer published, hit queries, prefetch transfers and
        pages they read."""
        self._learned: dict[int, int] = {}
        """id(Req) -> tokens of it the bridge has learned."""
        self._violations: list[Violation] = []
        self.l3: Any = None
        """The driver's stepped storage path (`SteppedStorage`); None in device-only cells."""
        self.bridge: Any = None
        if config.host_capacity > 0:
            base, per_page = PREFETCH_TIMEOUT_TICKS
            config = dataclasses.replace(
                config,
                prefetch_policy=PREFETCH_POLICY,
                prefetch_timeout_base=base,
                prefetch_timeout_per_page=per_page,
            )
        super().__init__(config)
        if not self.host:
            return
        self.l3 = self._driver.l3
        bridge = self.bridge = self.l3.bridge
        assert bridge is not None, "the stepped storage path over the bridge"
        bridge.store = self.store
        store_pages = bridge.batch_set

        def batch_set(keys: list[str], values: Any = None, *args: Any, **kwargs: Any) -> bool:
            self._check_stored(keys, values)
            return store_pages(keys, values, *args, **kwargs)

        bridge.batch_set = batch_set  # type: ignore[method-assign]

    def _server_args(self) -> dict[str, Any]:
        """Host cells: `--hicache-storage-backend` (the cache the driver built is over the bridge) with SGLang's
        prefetch policy and `prefetch_threshold` one page (the driver's extra config)."""
        args = super()._server_args()
        if self.host:
            args |= {
                "hicache_storage_backend": "file",
                "hicache_storage_prefetch_policy": PREFETCH_POLICY,
                "hicache_storage_backend_extra_config": json.dumps({"prefetch_threshold": self.page_size}),
            }
        return args

    # ------------------------------------------------------------------ what SGLang stores

    def _check_stored(self, keys: Sequence[str], values: Any) -> None:
        """INV-STORE-1 for every page SGLang's backup thread hands the store: the spec's payload of the page its key
        names (the bridge learned each key's path from the requests' tokens)."""
        assert self.bridge is not None
        ps, layers = self.page_size, self.config.kv_layers
        for key, value in zip(keys, values or (), strict=False):
            self.reach["l3_pages_stored"] += 1
            known = self.bridge.paths.get(key)
            if known is None:
                self._violations.append(
                    Violation("INV-STORE-1", f"SGLang stores page key {key[:16]}… of no path any request sent")
                )
                continue
            ns, path = known
            want = l3.page_payload(ns, path, len(path) // ps - 1, ps, layers)
            got = bytes(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
            if got != want:
                self._violations.append(
                    Violation(
                        "INV-STORE-1",
                        f"SGLang stores page {len(path) // ps - 1} of a {len(path)}-token path (namespace {ns!r}) "
                        "with other bytes than the spec's KV of its tokens",
                    )
                )

    def observed(self, profile: str) -> list[Violation]:
        out, self._violations = self._violations, []
        return super().observed(profile) + out

    # ------------------------------------------------------------------ the peer's and the threads' part

    def _learn(self) -> None:
        """Teach the bridge every request's tokens (prompt and output so far): the paths SGLang's page keys name."""
        assert self.l3 is not None
        for record in self._submitted.values():
            req = record.req
            if req is None:
                continue
            tokens = [*req.origin_input_ids, *req.output_ids]
            if self._learned.get(id(req), -1) // self.page_size == len(tokens) // self.page_size:
                continue
            self._learned[id(req)] = len(tokens)
            for learn in self.l3.learners:
                learn(req.extra_key, tokens)

    def _serve_prefill(self) -> None:
        """The prefill peer, which also stores what it computed: once it served a prompt, its whole pages are in the
        shared store (a prefill instance with HiCache storage backs its prefix up to the L3 the decode reads)."""
        before = [s for s in self._sent if not s.served]
        super()._serve_prefill()
        if not self.host or self._model is None:
            return
        assert self.bridge is not None
        for sent in before:
            if not sent.served:
                continue
            req = sent.decode_req.req
            prompt = [int(t) for t in req.origin_input_ids]
            ns = self.content_of(req)
            keys = l3.page_keys(ns, prompt, self.page_size, self.bridge.digest)
            new = [(i, k) for i, (k, v) in enumerate(zip(keys, self.store.batch_get(keys))) if v is None]
            records = [
                l3.encode_page(k, l3.page_payload(ns, prompt, i, self.page_size, self.config.kv_layers)) for i, k in new
            ]
            self.store.batch_set([k for _, k in new], records)
            self.reach["l3_pages_published"] += len(new)

    def step(self) -> None:
        super().step()
        if self.host:
            with self._engine():
                self._run_storage_threads()

    def _run_storage_threads(self) -> None:
        """The storage threads' bodies over what SGLang queued, until none has anything left."""
        l3s = self.l3
        assert l3s is not None
        cc = l3s.cc
        self._learn()
        for _ in range(64):
            moved = False
            for op_id in [i for i in l3s.stores if i not in l3s.store_done]:  # backup_thread_func
                l3s.complete_store(op_id)
                moved = True
            if cc.prefetch_queue.held:  # prefetch_thread_func: one hit query (batch_exists) per operation
                self.reach["l3_hit_queries"] += len(cc.prefetch_queue.held)
                cc.prefetch_queue.release()
                l3s._run_body(cc.prefetch_thread_func)
                moved = True
            for op in list(cc.prefetch_buffer.held):  # prefetch_io_aux_func: the transfer, page by page
                cc.prefetch_buffer.held.remove(op)
                reads = self.bridge.reads
                transfer = Transfer(cc, op)
                while not transfer.done:
                    transfer.step()
                self.reach["l3_transfers"] += 1
                self.reach["l3_pages_read"] += self.bridge.reads - reads
                moved = True
            if cc.prefetch_sync_queue.held:  # prefetch_sync_thread_func: acks to the scheduler
                cc.prefetch_sync_queue.release()
                l3s._run_body(cc.prefetch_sync_thread_func)
                moved = True
            if not moved:
                return
        raise RuntimeError("SGLang's storage threads never ran out of work")

    # ------------------------------------------------------------------ observation

    def snapshot(self) -> Snapshot:
        """The base's, with SGLang's own prefetches: each running one (its anchor, the tokens its hit query asked
        for, those its transfer fetched, its host pages), and host pages a finished one returned that the scheduler
        frees at its next drain (`host_mem_release_queue`), held at the root meanwhile."""
        snap = super().snapshot()
        if not self.host:
            return snap
        cache = self.cache
        out = []
        for i, info in enumerate(cache.ongoing_prefetch.values()):
            op = info.operation
            slots = tuple(int(x) for x in info.host_indices.tolist()) if info.host_indices is not None else ()
            fetched = min(int(op.completed_tokens), len(slots))
            failed = op.is_terminated() and fetched < len(slots)
            out.append(PendingPrefetch(i, int(info.anchor_node_id), len(slots), fetched, failed, slots))
        released = [int(x) for t in list(cache.cache_controller.host_mem_release_queue.queue) for x in t.tolist()]
        if released:
            root = int(cache.root_node_handle())
            out.append(PendingPrefetch(len(out), root, len(released), 0, True, tuple(released)))
        return dataclasses.replace(snap, prefetches=snap.prefetches + tuple(out)) if out else snap

    def bookkeeping(self) -> dict[str, tuple[Any, ...]]:
        """The base's, and the storage path's own: stores issued and not yet acknowledged, the controller's
        prefetch and backup queues."""
        out = super().bookkeeping()
        if not self.host:
            return out
        assert self.l3 is not None
        cc = self.l3.cc
        out["cache_controller.prefetch_queue"] = (len(cc.prefetch_queue.held) + len(cc.prefetch_queue.ready), (), None)
        out["cache_controller.prefetch_buffer"] = (len(cc.prefetch_buffer.held), (), None)
        out["cache_controller.backup_queue"] = (len(cc.backup_queue.held), (), None)
        cache = self.cache
        for name in ("_storage_prefetch_hit_remaining_by_reqid", "prefetch_loaded_storage_start_by_reqid"):
            out[f"cache.{name}"] = (len(getattr(cache, name)), (), None)
        out["cache.ongoing_prefetch.anchors"] = (
            len(self.cache.ongoing_prefetch),
            tuple(sorted({int(i.anchor_node_id) for i in self.cache.ongoing_prefetch.values()})),
            None,
        )
        return out


# --------------------------------------------------------------------------- factories

_NOTES = (
    "SGLang's decode worker of PD disaggregation: Scheduler.event_loop_normal_disagg_decode, one iteration per "
    "step(), on sglang_requests' stand-in Scheduler built in decode mode; requests arrive as TokenizedGenerateReqInput "
    "with the prefill's bootstrap address and a room, as the PD router forwards them",
    "the harness is the prefill peer: it computes 2 pages of a prompt per step (at least one step), then after that "
    "iteration it writes the model's KV of the prompt from the "
    "decode_prefix_len SGLang sent into the pages it sent, and the first output token (the model's) and the room into "
    "the metadata row it named; SGLang's metadata gate commits the transfer at the next iteration",
    "--disaggregation-decode-enable-radix-cache; with a host tier also --enable-hierarchical-cache, so "
    "enable_decode_hicache: the L2 prefix is promised to the prefill and loaded back by the transfer queue's restore "
    "state machine",
    "the model is the harness's: the scripted worker writes model.kv() of each decoded token into the slot SGLang "
    "allocated and samples model.next_token(); a prebuilt batch runs no forward, as in SGLang",
    "server args as sglang_requests (--max-running-requests 8, --disable-overlap-schedule), and what a decode server "
    "resolves: --disaggregation-decode-extra-slots 16, decode retraction backup cpu_tensor",
    "--num-reserved-decode-tokens 4 (SGLang's default 512 is sized for a GPU's pool: no request would ever be "
    "admitted to a cell's pool of tens of tokens)",
    "abort(request) = AbortReq(rid) to abort_request: a request preallocating or in transfer has its receiver aborted",
    "clients leave request ids to the engine (distinct-ids): SGLang's abort matches rids by prefix (finding SG-ABORT, "
    "the same code on the decode queues)",
    "snapshot: a write SGLang queued and has not yet submitted (cache_controller.write_queue; a request finishing in "
    "its prebuilt batch queues its backup outside process_batch_result, and the next iteration's check_hicache_events "
    "submits it) is listed as a pending write copy, as a submitted one is",
    "no sessions on a decode server: a session is the client's conversation only; close_session sends nothing",
)

_DEVIATIONS = (
    "transfer backend: SGLang's fake one (FakeKVManager, FakeKVReceiver), which its argument checks refuse beside "
    "--disaggregation-decode-enable-radix-cache (the fake moves no KV; here the harness writes it); the server args "
    "name mooncake and the resolved disagg config is switched to fake before the scheduler is built",
    "bootstrap: FakeKVManager is given the prefill_info_table CommonKVManager fills from the bootstrap server (one "
    "prefill, dp_size 1), so requests take the real-transfer path and its metadata gate",
    "observation: DecodePreallocQueue._create_receiver_and_enqueue is wrapped to record each receiver's "
    "send_metadata arguments (page indices, metadata row, decode_prefix_len) for the prefill peer; both still run",
    "observation: DecodeTransferQueue._commit_transfer_to_req is wrapped to judge the commit it made (the request's "
    "row and the tree as it left them, DecodeLedger.commit) once it returns, and pop_transferred to judge the "
    "transfers it failed or released (their destinations against the tree) once it returns; both still run",
    "process groups: the decode queues' gloo group is a one-rank stand-in (size() 1), so their all-reduces of polls "
    "and flags return this rank's own, as for a world of one; no torch.distributed",
    "pools: the decode request pool (DecodeReqToTokenPool) and need_sort are set on the stand-in's pools after the "
    "base builds them, as kv_cache_configurator builds them for a decode server",
)


def _capabilities() -> Capabilities:
    base = _sr.factory.capabilities
    keep = tuple(d for d in base.deviations if d not in _sr._LORA_DEVIATION)
    return Capabilities(
        name=f"sglang {_env.SGLANG_VERSION} decode server (PD disaggregation), decode radix cache + HiCache "
        "(UnifiedRadixCache, Python tree core)",
        page_sizes=(1, 4),
        policies=("lru",),
        namespaces=True,
        strict_input=False,
        write_policies=("write_through", "write_through_selective", "write_back"),
        kv_reads=True,
        profile="sglang-0.5.23",
        notes=_NOTES,
        deviations=keep + _DEVIATIONS,
        kind="request-path",
        client=("distinct-ids",),
        loras=False,
        peer_faults=FAULTS,
        never_fit=True,
    )


def factory(config: CacheConfig) -> SGLangDecodePath:
    """SGLang's decode worker with its decode radix cache (and HiCache in host cells)."""
    return SGLangDecodePath(config)


factory.capabilities = _capabilities()  # type: ignore[attr-defined]


def factory_fitting(config: CacheConfig) -> SGLangDecodePath:
    """`factory` with a client that sends no request that can never fit the device (finding SG-DECODE-NEVER-FIT:
    SGLang admits one whose prompt fits and whose output does not, and aborts a running request for its room)."""
    return SGLangDecodePath(config)


factory_fitting.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=factory.capabilities.name + ", a client whose requests fit the device",  # type: ignore[attr-defined]
    never_fit=False,
)


def factory_default_reserve(config: CacheConfig) -> SGLangDecodePath:
    """`factory` at SGLang's own --num-reserved-decode-tokens, 512: a replay target for traces on pools of thousands
    of slots (finding SG-DECODE-RETRACT-FINISHED); a walk's cells of tens of slots would admit nothing."""
    return SGLangDecodePath(config, reserve=DEFAULT_RESERVED_DECODE_TOKENS)


_BASE: Capabilities = factory.capabilities  # type: ignore[attr-defined]
factory_default_reserve.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
    _BASE,
    name=_BASE.name + f", --num-reserved-decode-tokens {DEFAULT_RESERVED_DECODE_TOKENS} (SGLang's default)",
    notes=tuple(n for n in _BASE.notes if not n.startswith("--num-reserved-decode-tokens"))
    + (f"--num-reserved-decode-tokens {DEFAULT_RESERVED_DECODE_TOKENS}, SGLang's default",),
)


_STORAGE_NOTES = (
    "L3 (host cells): --hicache-storage-backend over the stepped bridge to a store shared with the prefill peer "
    "(sglang_hicache_storage.BridgeStorage; spec records under spec keys), --hicache-storage-prefetch-policy timeout "
    "(SGLang's default: the decode path keeps the cache's policy), its wait 64 ticks + 1 a page of the harness's "
    "logical clock (one op a tick)",
    "L3: after each iteration the adapter runs SGLang's storage threads' bodies over what the iteration queued until "
    "none has work left: backup_thread_func (one batch_set a store), prefetch_thread_func (the hit query), the io-aux "
    "transfer (_page_transfer, page by page), prefetch_sync_thread_func; SGLang's scheduler drains their results at "
    "its next iteration's check_hicache_events",
    "L3: the prefill peer stores what it computed: once it served a prompt, the prompt's whole pages are published to "
    "the shared store (the spec's records of the model's KV), as a prefill instance with HiCache storage backs its "
    "prefix up; SGLang's own write-through backups go to the same store",
    "L3: every page SGLang stores must be the spec's KV of the path its key names (INV-STORE-1, checked at the "
    "bridge's batch_set); every page it reads is the spec's record or a miss (the bridge checks it); what a prefetch "
    "inserts is read back on the host and, once loaded, on the device (INV-KV-1/2); SGLang's running prefetches and "
    "the host pages a finished one returns are listed in the snapshot (INV-HOST-4/5, INV-PF-1)",
)

_STORAGE_DEVIATIONS = (
    "L3: prefetch_threshold one page (the extra config's; SGLang's default 256 tokens would prefetch nothing in a "
    "cell's pool of tens of tokens)",
    "L3: SGLang's storage threads are built inert and their bodies run by the adapter after each iteration "
    "(sglang_hicache_storage.SteppedStorage's queues), not on timers",
)


def _storage_capabilities() -> Capabilities:
    base = factory_fitting.capabilities  # type: ignore[attr-defined]
    return dataclasses.replace(
        base,
        name=base.name + " + L3 storage (host cells)",
        notes=base.notes + _STORAGE_NOTES,
        deviations=base.deviations + _STORAGE_DEVIATIONS,
    )


def factory_storage(config: CacheConfig) -> SGLangDecodeStoragePath:
    """SGLang's decode worker with its decode radix cache, HiCache and an L3 store in host cells."""
    return SGLangDecodeStoragePath(config)


factory_storage.capabilities = _storage_capabilities()  # type: ignore[attr-defined]
