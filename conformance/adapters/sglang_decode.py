"""SGLang 0.5.23's decode server of PD disaggregation, with its decode-side radix cache and HiCache: a request-path
target (SPEC.md §12).

    kvcert certify kvcert.conformance.adapters.sglang_decode:factory           # decode radix cache, + HiCache (host)

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
from collections.abc import Sequence
from typing import Any

from kvcert.conformance.adapters import _sglang_env as _env
from kvcert.conformance.adapters import sglang_requests as _sr
from kvcert.conformance.adapters._sglang_kv import write_pool
from kvcert.spec.requests import RequestView
from kvcert.spec.types import CacheConfig, Capabilities, PendingCopy, Snapshot

with _env.quiet_imports():
    from sglang.srt import runtime_context as _rc
    from sglang.srt.disaggregation.common.conn import PrefillServerInfo
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

__all__ = ["SGLangDecodePath", "factory"]

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


class _OneRankCpuGroup:
    """The decode queues' gloo group for a world of one rank: `dist.get_world_size(group)` reads `size()`, and at 1
    SGLang's `all_reduce_flags` returns each rank's own flags without a collective."""

    def size(self) -> int:
        return 1


class SGLangDecodePath(_sr.SGLangRequestPath):
    """SGLang's decode worker over UnifiedRadixCache (Python tree core); the RequestPathBackend protocol."""

    def __init__(self, config: CacheConfig) -> None:
        self._sent: list[_Sent] = []
        self._rooms = 0
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
            "num_reserved_decode_tokens": RESERVED_DECODE_TOKENS,
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
        self._serve_prefill()

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
            slots = [sent.pages[j // ps] * ps + j % ps for j in range(count)]
            ns = self.content_of(req)
            if count > 0:
                write_pool(pool, slots, self._model.kv(ns, prompt, start, count), layers)
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
        queued = tuple(
            PendingCopy(QUEUED_COPY_IDS + int(op.id), "write", tuple(int(n) for n in op.node_ids))
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
    )


def factory(config: CacheConfig) -> SGLangDecodePath:
    """SGLang's decode worker with its decode radix cache (and HiCache in host cells)."""
    return SGLangDecodePath(config)


factory.capabilities = _capabilities()  # type: ignore[attr-defined]
