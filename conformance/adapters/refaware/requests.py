# Over 600 lines: the fork's scheduler built and stepped on CPU; much of it is the request view and the declared deviations.
"""The priority-aware ("ref-aware") SGLang fork (base 0.5.10) driven through its own scheduler: a request-path target.

    .venv-refaware/bin/kvcert certify kvcert.conformance.adapters.refaware.requests:factory

Runs only in the fork's own environment (`.venv-refaware`: `scripts/install_refaware.sh` installs the fork's
scheduler there, its reference scheduler files and the six other scheduler-side hunks of its diff). The fork's
`Scheduler` owns everything a request meets: `recv_requests` and `process_input_requests` take the messages, the
request dispatcher turns a `TokenizedGenerateReqInput` into a `Req` (`handle_generate_request`,
`_add_request_to_queue`), `get_next_batch_to_run` admits, retracts and chunks (`PrefillAdder`, the fork's
high-priority admission), `ScheduleBatch.prepare_for_extend` / `prepare_for_decode` allocate, `run_batch` calls
the model worker, `process_batch_result` caches and releases (`cache_unfinished_req`, `release_kv_cache`) and
registers refs (`_maybe_register_ref`), `/release_ref` and `/update_ref` are its `handle_release_ref` /
`handle_update_ref`, an abort its `abort_request`. The cache is what `init_cache_with_memory_pool` builds:
`RefAwareRadixCache`, or `RefAwareHiRadixCache` with a host tier (`config.host_capacity > 0`).

What the adapter does, and nothing more:

* `submit` queues the `TokenizedGenerateReqInput` the tokenizer would send (rid = the session, or the request when
  it has none: the fork keys refs by rid, so a session is a reused rid; `max_new_tokens=output`, `ignore_eos`
  off as clients leave it, `priority`, `extra_key=namespace`); `close_session` / `reprioritize` / `abort` queue
  `ReleaseRefReqInput` / `UpdateRefReqInput` / `AbortReq`. Each message is pickled as ZMQ would carry it.
* `step` runs the fork's own `Scheduler.event_loop_normal` for exactly one iteration: the scheduler's ZMQ sockets
  are in-process stand-ins, and the tokenizer socket raises `_StepDone` (out of `recv_requests`, before it reads
  anything) when the loop comes round for a second message poll.
* The model worker (`_Worker`) is the model kvcert plays: for every request of a batch it writes
  `model.kv(namespace, tokens, start, count)` into the `out_cache_loc` slots the engine allocated for those
  positions (`extend_prefix_lens` / `extend_seq_lens`, or the last position in decode; the tokens are the
  request's sequence with the engine's `input_ids` at the computed positions) and samples
  `model.next_token(namespace, tokens_so_far)`.
* `requests()` reads the engine's own `Req` objects (waiting queue, running batch, chunked request, the last and
  the current batch); a request is finished / aborted when the engine says so on its output channel (a
  `BatchTokenIDOutput` with a finished reason, or an `AbortReq` back to the tokenizer), and is listed with that
  state once, after the step in which it ended.

Determinism. While (and only while) a call runs the fork's code, the adapter swaps in its own logical clock (the
`time` globals of `radix_cache` and `hiradix_cache`: node stamps), its own `TreeNode.counter` and
`CacheOperation.counter` (process-wide ids), the insertion-ordered `RefInfo` of `refaware.radix`, and its own
`ServerArgs` as sglang's global server args (several targets can live in one process). The fork's leaf sets
become `OrderedSet`s right after the scheduler builds the cache, before any use (as in the other RefAware
adapters). The scheduler's own timestamps (`time_stats`: the waiting queue's FCFS order, session reaping) stay on
the real clock: they only order requests by arrival, which the call sequence fixes. Not thread-safe.

What the fork does on this path (tests/test_refaware_requests.py asserts the first four as facts): every finished
or running-then-aborted request registers its rid, one-shot requests included, and nothing releases those (so
`rid_to_ref_info` grows by one per one-shot request); a `/release_ref` that arrives while the session's turn runs
is undone when the turn finishes (it registers again); the host cache's idle high-priority heap keeps a rid after
its release; `extra_key` never reaches the `Req`. Also seen with this target, not asserted: a session turn whose
prompt does not extend the path the session holds (edited history, or a turn rejected as too long, which the
scheduler still prefills one token of and registers) leaves the session holding two branches (INV-TIER-1, as
calibration R2); a same-rid turn in another priority class without `/update_ref` makes the event loop raise
"Priority class mismatch"; and with a host tier an admission of a high-priority request can raise the fork's own
"Ref-aware allocation ledger drift" RuntimeError (its diagnostic: 4 tokens required, 1 free, 20 evictable only in
the high tier, no high-tier authorization; not analysed further).
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvcert.conformance.adapters.kit.cpu import OrderedSet
from kvcert.conformance.adapters.kit.kv import entries_of, read_pool, write_pool
from kvcert.conformance.adapters.kit.radix import RADIX_POLICIES, LogicalTime, RadixTreeAdapter
from kvcert.conformance.adapters.refaware.env import (
    HOST_BUDGET_DEVIATION,
    REFAWARE_SGLANG_VERSION,
    import_refaware_scheduler,
    install_host_cpu_shims,
)
from kvcert.conformance.adapters.refaware.hicache import _start_gloo, host_ratio_for
from kvcert.conformance.adapters.refaware.radix import (
    FORK,
    _OrderedRefInfo,
    device_pools,
    free_slots,
    node_view,
    session_views,
    tier_counters,
)
from kvcert.spec.requests import RequestView
from kvcert.spec.types import (
    CacheConfig,
    Capabilities,
    NodeView,
    PendingCopy,
    SessionView,
    Snapshot,
)

if TYPE_CHECKING:
    from kvcert.conformance.backend import Model

__all__ = ["RefAwareRequestPath", "factory"]

SCHED = import_refaware_scheduler()
"""The fork's scheduler module; importing this module fails here, with an install hint, outside `.venv-refaware`."""

import zmq  # noqa: E402  (pyzmq: in the fork's pinned set)
from sglang.srt import server_args as _server_args  # noqa: E402
from sglang.srt.distributed import parallel_state as _parallel_state  # noqa: E402
from sglang.srt.managers import cache_controller as _cc  # noqa: E402
from sglang.srt.managers import mm_utils as _mm_utils  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    AbortReq,
    ReleaseRefReqInput,
    TokenizedGenerateReqInput,
    UpdateRefReqInput,
)
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache import allocator as _allocator  # noqa: E402
from sglang.srt.mem_cache import hiradix_cache as _hiradix  # noqa: E402
from sglang.srt.mem_cache import radix_cache as _radix_cache  # noqa: E402
from sglang.srt.mem_cache import ref_aware_cache_core as _core  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelImpl  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

if _mm_utils._is_default_tensor_transport is None:
    # `recv_requests` -> `unwrap_shm_features` asks `tokenizer_manager._determine_tensor_transport_mode` once per
    # process; importing tokenizer_manager needs fastapi and uvloop, which the fork's pinned set leaves out. Its
    # answer for a one-node server (no dist_init_addr) is "cuda_ipc", i.e. not the default transport; with
    # skip_tokenizer_init the function returns its input either way.
    _mm_utils._is_default_tensor_transport = False

PAGE_SIZES = (1, 4, 16)
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
MAX_RUNNING_REQUESTS = 8
"""Rows of `ReqToTokenPool`, and the scheduler's `max_running_requests`."""
CONTEXT_LEN = 4096
"""The synthetic model's context length; a request is still bounded by the pool (`max_req_len`, as TpModelWorker)."""
CHUNKED_PREFILL_TOKENS = 32
"""`chunked_prefill_size` in tokens (rounded up to whole pages): small enough that the suite's prompts chunk."""
VOCAB_SIZE = 1 << 30
"""The synthetic model's vocabulary: prompts may use any token id below it; the model samples 0..OUTPUT_VOCAB-1."""


class _StepDone(BaseException):
    """Raised out of `recv_requests` when the event loop comes round for its next message poll: one iteration ran."""


# --------------------------------------------------------------------------- stand-ins for the process around it


class _TokenizerSocket:
    """`recv_from_tokenizer` / `recv_from_rpc` (ZMQ PULL / DEALER in `init_ipc_channels`), in process.

    The tokenizer socket hands out what the adapter queued (pickled, as `send_pyobj` carries it) and then
    `zmq.ZMQError` (nothing more), as a non-blocking receive does; reading the rpc socket, which `recv_requests`
    does after the tokenizer's, ends the step's one poll. The next poll's first read raises `_StepDone`.
    """

    def __init__(self) -> None:
        self.queued: deque[bytes] = deque()
        self.polls_left = 0

    def put(self, message: Any) -> None:
        self.queued.append(pickle.dumps(message))

    def recv_pyobj(self, flags: int = 0) -> Any:
        if self.polls_left <= 0:
            raise _StepDone
        if self.queued:
            return pickle.loads(self.queued.popleft())
        raise zmq.ZMQError(zmq.EAGAIN)


class _RpcSocket:
    def __init__(self, tokenizer: _TokenizerSocket) -> None:
        self.tokenizer = tokenizer

    def recv_pyobj(self, flags: int = 0) -> Any:
        self.tokenizer.polls_left -= 1  # the poll is over: recv_requests reads rpc after the tokenizer socket
        raise zmq.ZMQError(zmq.EAGAIN)


class _OutputSocket:
    """`send_to_tokenizer` / `send_to_detokenizer`'s ZMQ PUSH socket: what the scheduler sends, kept in order."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_pyobj(self, obj: Any, flags: int = 0) -> None:
        self.sent.append(obj)


class _Group(SimpleNamespace):
    """A one-rank process group as the scheduler reads it (rank, ranks, world size; no collective is called)."""

    def __init__(self) -> None:
        super().__init__(
            world_size=1, rank=0, rank_in_group=0, ranks=[0], first_rank=0, is_first_rank=True, cpu_group=None
        )


class _Worker:
    """The model worker (`TpModelWorker` / `ModelRunner`) the fork's scheduler calls: kvcert's model plays the
    forward. It holds the pools the real worker builds (`get_memory_pool`) and nothing else of a model."""

    def __init__(self, owner: RefAwareRequestPath) -> None:
        self.owner = owner
        self.is_hybrid_swa = False
        self.model_runner = SimpleNamespace(
            hybrid_gdn_config=None, mamba2_config=None, hisparse_coordinator=None, lora_manager=None
        )
        self.model_config = SimpleNamespace(use_ngram_embedding=False, hf_config=None)
        self.forwards = 0

    def get_memory_pool(self) -> tuple[Any, Any]:
        return self.owner.req_to_token_pool, self.owner.allocator

    def get_pad_input_ids_func(self) -> None:
        return None

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        """No layer-wise wait: the forward reads no KV, and CPU host transfers finish before the call returns."""

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        model = self.owner._model
        if model is None:
            raise RuntimeError("refaware_requests: a forward ran before attach_model")
        self.forwards += 1
        owner = self.owner
        out = batch.out_cache_loc.tolist()
        fed = batch.input_ids.tolist()
        extend = batch.forward_mode.is_extend()
        seq_lens = batch.seq_lens.tolist()
        samples, pos = [], 0
        for i, req in enumerate(batch.reqs):
            if extend:
                start, count = int(batch.extend_prefix_lens[i]), int(batch.extend_seq_lens[i])
            else:
                start, count = int(seq_lens[i]) - 1, 1
            sequence = list(req.origin_input_ids) + list(req.output_ids)
            tokens = sequence[:start] + [int(t) for t in fed[pos : pos + count]]
            namespace = owner._namespace_of(req)
            if count:
                write_pool(
                    owner.kv_pool, out[pos : pos + count], model.kv(namespace, tokens, start, count), owner.layers
                )
            samples.append(int(model.next_token(namespace, tokens)))
            pos += count
        return GenerationBatchResult(
            logits_output=SimpleNamespace(
                next_token_logits=None,
                next_token_logprobs=None,
                input_token_logprobs=None,
                next_token_top_logprobs_val=None,
                next_token_top_logprobs_idx=None,
                next_token_token_ids_logprobs_val=None,
                next_token_token_ids_logprobs_idx=None,
                hidden_states=None,
                customized_info=None,
            ),
            next_token_ids=torch.tensor(samples, dtype=torch.int64),
            can_run_cuda_graph=False,
        )


# --------------------------------------------------------------------------- paged allocation on CPU


def _alloc_extend_torch(grid: Any) -> Any:
    """`alloc_extend_kernel[(bs,)](...)` (triton) on CPU: the engine's own `alloc_extend_naive`, same arguments."""

    def run(prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any, out: Any, bs_upper: int, ps: int) -> None:
        _allocator.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out, ps, out.device)

    return run


def _alloc_decode_torch(grid: Any) -> Any:
    """`alloc_decode_kernel[(bs,)](...)` (triton) on CPU: request i takes `last_loc + 1`, or the first slot of the
    next free page when its new token starts a page (pages handed out in batch order, as the kernel's prefix sum)."""

    def run(seq_lens: Any, last_loc: Any, free_pages: Any, out: Any, bs_upper: int, ps: int) -> None:
        taken = 0
        for i, seq_len in enumerate(seq_lens.tolist()):
            if (seq_len - 1) % ps == 0:
                out[i] = free_pages[taken] * ps
                taken += 1
            else:
                out[i] = last_loc[i] + 1

    return run


class _Launch:
    """Stands in for a triton kernel object: `kernel[grid](*args)` runs the torch version."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __getitem__(self, grid: Any) -> Any:
        return self.make(grid)


_PAGED_KERNELS = {
    "alloc_extend_kernel": _Launch(_alloc_extend_torch),
    "alloc_decode_kernel": _Launch(_alloc_decode_torch),
}


# --------------------------------------------------------------------------- the target


@dataclass
class _Tracked:
    """A request the suite submitted, and what the engine made of it."""

    request: str
    session: Optional[str]
    rid: str
    namespace: Optional[str]
    prompt: tuple[int, ...]
    priority: int
    req: Any = None
    """The engine's `Req`, once seen in one of its queues or batches."""
    ended: Optional[str] = None
    """"finished" or "aborted", once the engine's output said so."""


CLIENT_HALVES: set[str] = set()
"""Client rules this module's clients keep while a finding's API fix is applied by its client half (`kvcert certify
--with-fixes Q4`: each one-shot rid released once answered, what Q4's `keep_ref: false` would say)."""


class RefAwareRequestPath(RadixTreeAdapter):
    """The fork's `Scheduler` (its own code, one event-loop iteration per `step`) over CPU pools and its cache."""

    def __init__(self, config: CacheConfig, release_one_shot: bool = False) -> None:
        """`release_one_shot`: the client half of CLIENT_RULES `releases-one-shot` (each one-shot request's rid is
        released with `/release_ref` once its answer or abort reaches the client, taken at the next step); on too
        while `CLIENT_HALVES` holds that rule."""
        if config.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be one of {PAGE_SIZES}")
        if config.policy not in RADIX_POLICIES:
            raise ValueError(f"policy must be one of {RADIX_POLICIES}")
        self.host = config.host_capacity > 0
        if self.host and config.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        self.config = config
        self.release_one_shot = release_one_shot or "releases-one-shot" in CLIENT_HALVES
        self.page_size = config.page_size
        self.layers = config.kv_layers
        self._now = 0
        self._next_node_id = 0
        self._next_op_id = 0
        self._nodes: dict[int, Any] = {}
        self._model: Optional[Model] = None
        self._tracked: dict[str, _Tracked] = {}
        self._ended_last_step: list[str] = []
        self._bound: dict[int, Any] = {}
        self._copy_ids: dict[int, tuple[Any, int]] = {}
        self._next_copy_id = 0
        self.replies: deque[Any] = deque(maxlen=256)
        """The last things the scheduler sent back to the tokenizer besides request outputs (ReleaseRefReqOutput,
        UpdateRefReqOutput, ...), oldest first."""
        self._inbox = _TokenizerSocket()
        self._to_tokenizer, self._to_detokenizer = _OutputSocket(), _OutputSocket()
        self.kv_pool, self.allocator, _ = device_pools(config)
        self.req_to_token_pool = ReqToTokenPool(
            size=MAX_RUNNING_REQUESTS, max_context_len=CONTEXT_LEN + 4, device="cpu", enable_memory_saver=False
        )
        self.worker = _Worker(self)
        self._tp_group = _Group()
        self.server_args = self._make_server_args(config)
        if self.host:
            _start_gloo()
            install_host_cpu_shims()
        with self._in_engine():
            self.scheduler = self._make_scheduler()
        s = self.scheduler
        self.cache = c = s.tree_cache
        for name in (
            "evictable_leaves",
            "unused_evictable_leaves",
            "low_ref_evictable_leaves",
            "high_ref_evictable_leaves",
            "evictable_host_leaves",
        ):
            if hasattr(c, name):
                assert not getattr(c, name), name
                setattr(c, name, OrderedSet())
        if self.host:
            atexit.unregister(c.shutdown)  # registered by HiRadixCache.__init__: it would pin the cache for the process
            self.host_pool = c.token_to_kv_pool_host
            assert self.host_pool.size == config.host_capacity, (self.host_pool.size, config.host_capacity)
        assert s.recv_skipper is None and s.input_blocker is None, "a skipped or blocked poll would never end a step"
        self._remember(c.root_node)

    # ------------------------------------------------------------------ construction

    def _make_server_args(self, config: CacheConfig) -> Any:
        """The server arguments a launch with these flags resolves to on CPU. `model_path="dummy"` skips
        `ServerArgs.__post_init__`'s resolution, so what it would resolve is set here."""
        ps = config.page_size
        sa = ServerArgs(
            model_path="dummy",
            device="cpu",
            skip_tokenizer_init=True,  # the suite sends token ids: the tokenizer's work is done
            page_size=ps,
            enable_ref_aware_kv_buffer=True,
            enable_priority_scheduling=True,
            high_priority_threshold=config.high_priority_threshold,
            radix_eviction_policy=config.policy,
            disable_overlap_schedule=True,  # event_loop_normal: one batch at a time, results processed in the step
            attention_backend="torch_native",  # a CPU backend whose cache-index paths are torch, not triton
            sampling_backend="pytorch",  # what __post_init__ sets on CPU
            chunked_prefill_size=-(-CHUNKED_PREFILL_TOKENS // ps) * ps,
            max_running_requests=MAX_RUNNING_REQUESTS,
            context_length=CONTEXT_LEN,
            random_seed=0,
            grammar_backend="none",
        )
        if self.host:
            sa.enable_hierarchical_cache = True
            sa.hicache_ratio = host_ratio_for(config.capacity, config.host_capacity, ps)
            sa.hicache_size = 0
            sa.hicache_mem_layout = "layer_first"
            sa.hicache_io_backend = "direct"
            sa.hicache_write_policy = config.write_policy
            sa.hicache_storage_backend = None
        return sa

    def _make_scheduler(self) -> Any:
        """The fork's `Scheduler.__init__`, run for real on a `Scheduler` instance whose init steps that need a model,
        sockets or a process group are instance-level stand-ins (`init_model_config`, `init_ipc_channels`,
        `init_model_worker`), with no watchdog thread; every other init step is the fork's."""
        S = SCHED.scheduler
        sched = object.__new__(S.Scheduler)
        owner = self
        config = self.config

        def init_model_config() -> None:
            sched.model_config = SimpleNamespace(
                _resolved_model_impl=ModelImpl.SGLANG,
                model_impl=ModelImpl.SGLANG,
                is_multimodal=False,
                is_encoder_decoder=False,
                is_matryoshka=False,
                is_generation=True,
                hf_eos_token_id=None,
                vocab_size=VOCAB_SIZE,
                context_len=CONTEXT_LEN,
                think_end_id=None,
                hidden_size=2,
                hf_config=SimpleNamespace(),
                dtype=torch.float32,
            )
            sched.dllm_config = None

        def init_ipc_channels(port_args: Any) -> None:
            sched.idle_sleeper = None
            sched.recv_from_tokenizer = owner._inbox
            sched.recv_from_rpc = _RpcSocket(owner._inbox)
            sched.send_to_tokenizer = S.SenderWrapper(owner._to_tokenizer)
            sched.send_to_detokenizer = S.SenderWrapper(owner._to_detokenizer)

        def init_model_worker() -> None:
            sched.tp_worker = sched.model_worker = owner.worker
            sched.draft_worker = None
            sched.max_total_num_tokens = config.capacity
            sched.max_prefill_tokens = owner.server_args.max_prefill_tokens
            sched.max_running_requests = MAX_RUNNING_REQUESTS
            sched.max_queued_requests = owner.server_args.max_queued_requests
            sched.max_req_len = min(CONTEXT_LEN - 1, config.capacity - 1)  # TpModelWorker's bound
            sched.max_req_input_len = sched.max_req_len - 5
            sched.random_seed = 0
            sched.device = "cpu"
            sched.forward_stream = None
            if _server_args.get_global_server_args().pp_max_micro_batch_size is None:
                _server_args.get_global_server_args().pp_max_micro_batch_size = max(MAX_RUNNING_REQUESTS, 1)
            for name in ("tp_group", "attn_tp_group", "attn_cp_group", "pp_group", "world_group", "dp_tp_group"):
                setattr(sched, name, _Group())
            for name in ("tp_cpu_group", "attn_tp_cpu_group", "attn_cp_cpu_group", "dp_tp_cpu_group"):
                setattr(sched, name, None)
            sched.pad_input_ids_func = None

        stand_ins = {
            "init_model_config": init_model_config,
            "init_ipc_channels": init_ipc_channels,
            "init_model_worker": init_model_worker,
        }
        for name, fn in stand_ins.items():
            setattr(sched, name, fn)
        saved_watchdog = S.create_scheduler_watchdog
        S.create_scheduler_watchdog = lambda *args, **kwargs: None
        try:
            S.Scheduler.__init__(
                sched,
                self.server_args,
                SimpleNamespace(nccl_port=None),
                gpu_id=0,
                tp_rank=0,
                moe_ep_rank=0,
                pp_rank=0,
                attn_cp_rank=0,
                moe_dp_rank=0,
                dp_rank=None,
            )
        finally:
            S.create_scheduler_watchdog = saved_watchdog
            for name in stand_ins:
                sched.__dict__.pop(name, None)
        return sched

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _in_engine(self) -> Iterator[None]:
        """Run fork code on this target's clock, id counters, ordered RefInfo, server args and (paged) allocation."""
        node_cls, op_cls = _radix_cache.TreeNode, _cc.CacheOperation
        clock = LogicalTime(self._now)
        kernels = _PAGED_KERNELS if self.page_size > 1 else {}
        saved = (
            _radix_cache.time,
            _hiradix.time,
            node_cls.counter,
            op_cls.counter,
            _core.RefInfo,
            _server_args._global_server_args,
            _parallel_state._TP,
        )
        saved_kernels = {name: getattr(_allocator, name) for name in kernels}
        _radix_cache.time, _hiradix.time = clock, clock
        node_cls.counter, op_cls.counter, _core.RefInfo = self._next_node_id, self._next_op_id, _OrderedRefInfo
        _server_args._global_server_args = self.server_args
        if _parallel_state._TP is None:  # set_finish_with_abort asks the tensor-parallel rank
            _parallel_state._TP = self._tp_group
        for name, kernel in kernels.items():
            setattr(_allocator, name, kernel)
        try:
            yield
        finally:
            self._next_node_id, self._next_op_id = node_cls.counter, op_cls.counter
            (
                _radix_cache.time,
                _hiradix.time,
                node_cls.counter,
                op_cls.counter,
                _core.RefInfo,
                _server_args._global_server_args,
                _parallel_state._TP,
            ) = saved
            for name, kernel in saved_kernels.items():
                setattr(_allocator, name, kernel)

    def _namespace_of(self, req: Any) -> Optional[str]:
        """The namespace the client sent with the request `req` is (the model computes the client's request)."""
        for t in self._tracked.values():
            if t.req is req:
                return t.namespace
        return getattr(req, "extra_key", None)

    # ------------------------------------------------------------------ RequestPathBackend

    def attach_model(self, model: Model) -> None:
        self._model = model

    def submit(
        self,
        request: str,
        session: Optional[str],
        namespace: Optional[str],
        tokens: Sequence[int],
        priority: int,
        output: int,
    ) -> None:
        if request in self._tracked:
            raise ValueError(f"request {request!r} was submitted before")
        rid = session if session is not None else request
        # ignore_eos off, as clients leave it: the synthetic model has no EOS, so a request still ends at
        # max_new_tokens, but admission sets aside only the new-token ratio of its output and decode can retract.
        params = SamplingParams(max_new_tokens=output, ignore_eos=False)
        params.normalize(None)  # what the tokenizer manager does before it sends (no tokenizer: ids given)
        params.verify(VOCAB_SIZE)
        message = TokenizedGenerateReqInput(
            input_text="",
            input_ids=[int(t) for t in tokens],
            mm_inputs=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            rid=rid,
            priority=priority,
            extra_key=namespace,
        )
        self._tracked[request] = _Tracked(request, session, rid, namespace, tuple(int(t) for t in tokens), priority)
        self._inbox.put(message)

    def close_session(self, session: str) -> None:
        self._inbox.put(ReleaseRefReqInput(rid=session))

    def reprioritize(self, session: str, priority: int) -> None:
        self._inbox.put(UpdateRefReqInput(rid=session, new_priority=priority))

    def abort(self, request: str) -> None:
        tracked = self._tracked.get(request)
        self._inbox.put(AbortReq(rid=tracked.rid if tracked is not None else request))

    def step(self) -> None:
        for request in self._ended_last_step:
            self._tracked.pop(request, None)
        self._ended_last_step = []
        self._inbox.polls_left = 1
        try:
            with self._in_engine():
                try:
                    self.scheduler.event_loop_normal()
                except _StepDone:
                    pass
        finally:
            self._inbox.polls_left = 0
            sent = self._to_tokenizer.sent + self._to_detokenizer.sent
            self._to_tokenizer.sent, self._to_detokenizer.sent = [], []
            self._observe(sent)

    # ------------------------------------------------------------------ observation of requests

    def _engine_reqs(self) -> list[Any]:
        """Every `Req` the scheduler holds: waiting queue, running batch, chunked request, last and current batch."""
        s = self.scheduler
        out: list[Any] = list(s.waiting_queue)
        for batch in (s.running_batch, s.last_batch, s.cur_batch):
            if batch is not None:
                out.extend(batch.reqs)
        if s.chunked_req is not None:
            out.append(s.chunked_req)
        seen: set[int] = set()
        unique = []
        for req in out:
            if id(req) not in seen:
                seen.add(id(req))
                unique.append(req)
        return unique

    def _observe(self, sent: list[Any]) -> None:
        """Bind newly seen `Req`s to the suite's requests, then mark the requests the engine's output ended."""
        held = self._engine_reqs()
        present = {id(r) for r in held}
        # Every Req ever bound and still held (a finished one lingers in the running batch until the next filter):
        # a later turn of the same rid must not take it. Kept by reference, so an id is never reused meanwhile.
        self._bound = {key: req for key, req in self._bound.items() if key in present}
        for t in self._tracked.values():
            if t.req is None and t.ended is None:
                for req in held:
                    if req.rid == t.rid and id(req) not in self._bound:
                        t.req = self._bound[id(req)] = req
                        break
        for message in sent:
            for rid, how in _endings(message):
                self._end(rid, how, present)
            if not hasattr(message, "rids") and type(message).__name__ != "AbortReq":
                self.replies.append(message)

    def _end(self, rid: str, how: str, present: set[int]) -> None:
        live = [t for t in self._tracked.values() if t.rid == rid and t.ended is None]
        done = [t for t in live if t.req is not None and (t.req.finished() or id(t.req) not in present)]
        unbound = [t for t in live if t.req is None]
        pick = done[0] if done else unbound[0] if unbound else None
        if pick is None:
            return
        pick.ended = how
        self._ended_last_step.append(pick.request)
        if self.release_one_shot and pick.session is None:
            self._inbox.put(ReleaseRefReqInput(rid=pick.rid))

    def _row(self, req: Any, length: int) -> list[int]:
        if req.req_pool_idx is None or length <= 0:
            return []
        return [int(x) for x in self.req_to_token_pool.req_to_token[req.req_pool_idx, :length].tolist()]

    def _own(self, req: Any, tree: set[int]) -> list[int]:
        """Device slots `req` holds outside the tree: its row's slots the tree does not hold, and the spare slots
        of its last page (a paged allocator hands out whole pages)."""
        row = self._row(req, int(req.kv_allocated_len))
        own = [slot for slot in row if slot not in tree]
        ps = self.page_size
        if ps > 1 and row and len(row) % ps:
            last = row[-1]
            own.extend(range(last + 1, (last // ps + 1) * ps))
        return own

    def _tree_slots(self) -> set[int]:
        out: set[int] = set()
        for node, parent in self._walk():
            if parent is not None and node.value is not None:
                out.update(int(x) for x in node.value.tolist())
        return out

    def requests(self) -> tuple[RequestView, ...]:
        tree = self._tree_slots()
        waiting = {id(r) for r in self.scheduler.waiting_queue}
        out = []
        for t in self._tracked.values():
            req = t.req
            if req is None:
                state = t.ended or "waiting"
                out.append(RequestView(t.request, t.session, t.namespace, t.prompt, len(t.prompt), state, t.priority))
                continue
            tokens = tuple(int(x) for x in req.origin_input_ids) + tuple(int(x) for x in req.output_ids)
            if t.ended is not None:
                state = t.ended
            elif req.req_pool_idx is None or id(req) in waiting:
                state = "waiting"
            else:
                state = "running"
            holds = state == "running"
            computed = int(req.kv_committed_len) if holds else 0
            out.append(
                RequestView(
                    id=t.request,
                    session=t.session,
                    namespace=req.extra_key,
                    tokens=tokens,
                    prompt=len(req.origin_input_ids),
                    state=state,
                    priority=int(req.priority) if req.priority is not None else 0,
                    computed=computed,
                    row=tuple(self._row(req, computed)) if holds else (),
                    own=tuple(self._own(req, tree)) if holds else (),
                )
            )
        return tuple(out)

    # ------------------------------------------------------------------ observation of the cache

    def _sessions(self, depth: dict[int, int]) -> tuple[SessionView, ...]:
        """Each rid of `rid_to_ref_info`, in the fork's order, ending at the deepest node its refs hold (the root:
        none in the tree)."""
        return session_views(self.cache, list(self.cache.rid_to_ref_info), depth)

    def _pending(self) -> tuple[PendingCopy, ...]:
        """The host tier's copies not yet consumed: operations still queued in the controller (a load that
        `init_load_back` queued and no batch has started yet: its device slots are reserved, not written) and the
        acks of started copies (finished when their event has fired). Ids are the target's own, in the order it
        first saw each; a queued operation that starts becomes a new copy (its ack)."""
        if not self.host:
            return ()
        cc = self.cache.cache_controller
        items = [("write", op, False) for op in cc.write_queue] + [("load", op, False) for op in cc.load_queue]
        items += [("write", ack, True) for ack in cc.ack_write_queue] + [
            ("load", ack, True) for ack in cc.ack_load_queue
        ]
        out = []
        for kind, item, started in items:
            key = id(item)
            if key not in self._copy_ids or self._copy_ids[key][0] is not item:
                self._copy_ids[key] = (item, self._next_copy_id)
                self._next_copy_id += 1
            done = started and bool(item.finish_event.query())
            nodes = [int(i) for i in item.node_ids]
            if kind == "load" and not started:
                nodes = self._loading(nodes, item.device_indices)
            out.append(PendingCopy(self._copy_ids[key][1], kind, tuple(nodes), done))
        live = {id(item) for _, item, _ in items}
        self._copy_ids = {k: v for k, v in self._copy_ids.items() if k in live}
        return tuple(sorted(out, key=lambda p: p.id))

    def _loading(self, anchors: list[int], device_indices: Any) -> list[int]:
        """The nodes a queued load fills: each anchor (the node `init_load_back` names) and the ancestors whose
        device slots it reserved in the same operation (0.5.10 names only the deepest node of the path it loads)."""
        reserved = {int(x) for x in device_indices.tolist()}
        out = []
        for anchor in anchors:
            node = self._node(anchor)
            while node is not None and node is not self.cache.root_node and node.value is not None:
                if not {int(x) for x in node.value.tolist()} <= reserved:
                    break
                out.append(int(node.id))
                node = node.parent
        return out

    def snapshot(self) -> Snapshot:
        ps = self.page_size
        c = self.cache
        views: list[NodeView] = []
        depth: dict[int, int] = {}
        tree: set[int] = set()
        for node, parent in self._walk():
            nid = int(node.id)
            if parent is None:
                depth[nid] = 0
                views.append(self._root_view(node))
                continue
            depth[nid] = depth[int(parent.id)] + 1
            host_locks = int(node.host_ref_counter) if self.host else 0
            views.append(node_view(node, parent, True, host_locks))
            if node.value is not None:
                tree.update(int(x) for x in node.value.tolist())
        lent: list[int] = []
        for req in self._engine_reqs():
            if req.req_pool_idx is not None and not (req.finished() and req.kv_committed_freed):
                lent.extend(self._own(req, tree))
        host: dict[str, Any] = {}
        if self.host:
            host = dict(
                host_capacity=self.config.host_capacity,
                host_free_slots=tuple(sorted(int(x) for x in self.host_pool.free_slots.tolist())),
                write_policy=self.config.write_policy,
                pending=self._pending(),
            )
        return self._radix_snapshot(
            views,
            free_slots(self.allocator, ps),
            sessions=self._sessions(depth),
            tier_evictable=tier_counters(c),
            high_priority_threshold=self.config.high_priority_threshold,
            lent_slots=tuple(sorted(lent)),
            **host,
        )

    def bookkeeping(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The fork's per-request and per-session indexes: (entries, ids of the tree nodes its entries name)."""
        c, s = self.cache, self.scheduler

        def ids(nodes: Any) -> tuple[int, ...]:
            return tuple(sorted({int(n.id) for n in nodes if n is not None}))

        infos = list(c.rid_to_ref_info.values())
        ref_nodes = [n for info in infos for n in info.nodes]
        seen = {id(n): n for n, _ in self._walk()}
        for n in ref_nodes:
            seen.setdefault(id(n), n)
        tracked = [n for n in seen.values() if getattr(n, "tracked_rids", None)]
        waiting = list(s.waiting_queue)
        running = list(s.running_batch.reqs) if s.running_batch is not None else []
        out: dict[str, tuple[int, tuple[int, ...]]] = {
            "rid_to_ref_info": (len(infos), ids(ref_nodes)),
            "tracked_rids": (sum(len(n.tracked_rids) for n in tracked), ids(tracked)),
            "evict_scope_stack": (len(c._evict_scope_stack), ()),
            # A waiting request's last_node is its last match: the scheduler matches it again before any use
            # (SchedulePolicy._compute_prefix_matches, _init_waiting_req_for_admission), so a stale one names nothing.
            "waiting_queue": (len(waiting), ()),
            # A finished request stays in the running batch until the next filter_batch; nothing reads its last_node.
            "running_batch": (len(running), ids(r.last_node for r in running if not r.finished())),
            "chunked_req": (int(s.chunked_req is not None), ids([s.chunked_req.last_node] if s.chunked_req else [])),
            "req_to_token_pool": (self.req_to_token_pool.size - self.req_to_token_pool.available_size(), ()),
            "sessions": (len(s.session_controller.sessions), ()),
        }
        if self.host:
            cc = c.cache_controller
            acks = [*cc.write_queue, *cc.load_queue, *cc.ack_write_queue, *cc.ack_load_queue]
            out.update(
                {
                    "idle_hp_heap": (len(c._idle_hp_heap), ()),
                    "idle_hp_rids": (len(c._idle_hp_rids), ()),
                    "adaptively_demoted_rids": (len(c._adaptively_demoted_rids), ()),
                    "ongoing_write_through": (
                        len(c.ongoing_write_through),
                        tuple(sorted(map(int, c.ongoing_write_through))),
                    ),
                    "ongoing_load_back": (len(c.ongoing_load_back), tuple(sorted(map(int, c.ongoing_load_back)))),
                    "ongoing_prefetch": (len(c.ongoing_prefetch), ()),
                    "ongoing_backup": (len(c.ongoing_backup), ()),
                    "prefetch_loaded_tokens_by_reqid": (len(c.prefetch_loaded_tokens_by_reqid), ()),
                    "copy_queues": (len(acks), tuple(sorted({int(i) for a in acks for i in a.node_ids}))),
                }
            )
        return out

    # ------------------------------------------------------------------ KV bytes

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        return read_pool(self.kv_pool, slots, self.layers)

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        if not self.host:
            return []
        idx = torch.tensor(list(host_slots), dtype=torch.int64)
        return entries_of(self.host_pool.kv_buffer[:, :, idx].clone())  # layer_first: [2, L, size, H, D]

    def close(self) -> None:
        if self.host:
            with contextlib.suppress(Exception):
                self.cache.shutdown()


def _endings(message: Any) -> list[tuple[str, str]]:
    """(rid, "finished" | "aborted") for each request a scheduler output ends: a batch output's entries with a
    finished reason, or an `AbortReq` the scheduler sends back for a request it dropped from its waiting queue."""
    if type(message).__name__ == "AbortReq":
        return [(message.rid, "aborted")]
    rids, reasons = getattr(message, "rids", None), getattr(message, "finished_reasons", None)
    if not rids or reasons is None:
        return []
    out = []
    for rid, reason in zip(rids, reasons):
        if reason is not None:
            out.append((rid, "aborted" if reason.get("type") == "abort" else "finished"))
    return out


def factory(config: CacheConfig) -> RefAwareRequestPath:
    """`kvcert certify kvcert.conformance.adapters.refaware.requests:factory`: the fork's scheduler over its
    `RefAwareRadixCache` (device only) or `RefAwareHiRadixCache` (`host_capacity > 0`, write_through)."""
    return RefAwareRequestPath(config)


factory.capabilities = Capabilities(  # type: ignore[attr-defined]
    name=f"refaware.Scheduler + RefAware(Hi)RadixCache {REFAWARE_SGLANG_VERSION} ({FORK}), request path",
    kind="request-path",
    page_sizes=PAGE_SIZES,
    policies=RADIX_POLICIES,
    namespaces=False,
    write_policies=WRITE_POLICIES,
    kv_reads=True,
    priority_refs=True,
    profile="refaware-0.5.10",
    still_between_calls=True,
    notes=(
        "the fork's own Scheduler (reference scheduler files + the six other scheduler-side hunks of its diff, "
        "installed by scripts/install_refaware.sh over sglang 0.5.10 + the overlay), unpatched: step() is one "
        "iteration of its event_loop_normal (recv_requests, process_input_requests, get_next_batch_to_run, run_batch, "
        "process_batch_result or self_check_during_idle)",
        "cache: what init_cache_with_memory_pool builds with --enable-ref-aware-kv-buffer --enable-priority-scheduling: "
        "RefAwareRadixCache, or RefAwareHiRadixCache when host_capacity > 0 (direct io, layer_first, host pool sized "
        "exactly to host_capacity)",
        "submit: the TokenizedGenerateReqInput the tokenizer would send (rid = session, or the request id for a "
        "one-shot request; max_new_tokens=output, ignore_eos off, priority, extra_key=namespace), taken at the next step",
        "close_session / reprioritize / abort: ReleaseRefReqInput / UpdateRefReqInput / AbortReq through the "
        "scheduler's dispatcher at the next step; the engine aborts every request whose rid starts with the rid",
        "requests(): read off the engine's Req objects (waiting queue, running batch, chunked request, last and current "
        "batch; row from req_to_token, computed = kv_committed_len); finished / aborted when the engine's output "
        "(BatchTokenIDOutput finished_reasons, or an AbortReq back to the tokenizer) says so, listed once",
        "snapshot sessions: every rid of rid_to_ref_info, in the fork's order, ending at the deepest node its refs "
        "hold; one-shot requests' rids are there too (the fork registers every finished request)",
        "lent_slots: the row slots of every request the engine holds that the tree does not hold, plus the spare "
        "slots of a request's last page",
        "pending copies (host tier): operations still queued in the cache controller (a load init_load_back reserved "
        "and no batch has started) and unconsumed acks",
        "namespaces not declared: the fork's handle_generate_request builds Req without TokenizedGenerateReqInput."
        "extra_key (0.5.10's does too), so every request lands in the default namespace",
        "scheduler timestamps (time_stats: FCFS order within a priority, session reaping) are the real clock: they "
        "order requests by arrival, which the call sequence fixes",
    ),
    deviations=(
        "Scheduler.__init__ runs for real on a Scheduler instance with three init steps replaced on the instance: "
        "init_model_config (a synthetic ModelConfig: generation, no EOS, vocab 2**30, context 4096), "
        "init_ipc_channels (in-process sockets: messages pickled as send_pyobj does, the scheduler's sends kept), "
        "init_model_worker (the adapter's worker, one-rank stand-in process groups, no draft worker, no "
        "set_random_seed; max_req_len = min(context - 1, capacity - 1) as TpModelWorker computes it)",
        "no watchdog thread: create_scheduler_watchdog returns None while the scheduler is built (the shipped one "
        "kills the process when a batch makes no progress for 300 s, as an idle harness would)",
        "model worker: the adapter's, not TpModelWorker/ModelRunner: it writes kvcert's model KV into the "
        "out_cache_loc slots the engine allocated and returns kvcert's model's next token; no attention, no logits, "
        "no layer-wise wait on host loads (its register_hicache_layer_transfer_counter is a no-op)",
        "pools built by the adapter as ModelRunner would: MHATokenToKVPool (one float32 head of dim 2, kv_layers "
        "layers: the spec's KV geometry), TokenToKVPoolAllocator / PagedTokenToKVPoolAllocator (need_sort False), "
        "ReqToTokenPool of 8 rows x 4100",
        "paged allocation (page size > 1): the allocator's triton kernels alloc_extend_kernel / alloc_decode_kernel "
        "are torch stand-ins during each call (extend: the engine's own alloc_extend_naive; decode: the kernel's "
        "rule as a loop)",
        "stubs: triton, sgl_kernel (host transfers by a torch index copy, direct io), torchvision (_refaware_env), "
        "setproctitle and einops (empty: imported by the scheduler and layer modules, not called on this path)",
        "mm_utils._is_default_tensor_transport is preset to False, the value tokenizer_manager."
        "_determine_tensor_transport_mode gives a one-node server (tokenizer_manager needs fastapi and uvloop, not "
        "installed); unwrap_shm_features returns its input either way (skip_tokenizer_init)",
        "parallel_state._TP is a one-rank stand-in during each call when no group is initialized "
        "(Req.set_finish_with_abort asks the tensor-parallel rank)",
        "sglang's process-wide server args are this target's during each call (several targets share a process)",
        "clock: the time globals of radix_cache and hiradix_cache are the harness's logical clock, and "
        "TreeNode.counter / CacheOperation.counter per-target counters, during each call",
        "eviction ties: the fork's leaf sets (evictable_leaves, unused/low_ref/high_ref_evictable_leaves, "
        "evictable_host_leaves) and RefInfo.nodes are insertion-ordered, so equally ranked leaves leave in "
        "insertion order; as shipped a set orders them by memory address, which differs from run to run",
        "host tier: unpinned host pool (no cudaHostRegister on CPU), a one-rank gloo group for the tp world size, "
        "the cache's atexit shutdown unregistered",
        HOST_BUDGET_DEVIATION,
        "shipped defaults overridden: overlap scheduling off (event_loop_normal; the GPU default is "
        "event_loop_overlap), chunked_prefill_size 32 tokens rounded up to whole pages (shipped: 2048-16384 by GPU "
        "memory), max_running_requests 8, attention_backend torch_native (CPU's default intel_amx runs a triton "
        "get_last_loc), sampling_backend pytorch, skip_tokenizer_init, grammar_backend none, random_seed 0; "
        "model_path 'dummy' skips ServerArgs.__post_init__, so these are set explicitly",
        "a step ends when the event loop comes round to its next poll: the tokenizer socket raises out of "
        "recv_requests before it reads anything (no recv skipper or input blocker is configured)",
    ),
)


def factory_bench_clients(config: CacheConfig) -> RefAwareRequestPath:
    """`...:factory_bench_clients`: as `factory`, sent only what the fork's own benchmark's clients send
        (`bench/bench_ref_aware_multiturn.py`: one rid per client, a class changed through `/update_ref` before the
        next turn, a release once the client is done): every request a turn of a session, priority changes and closes
        between turns only, no aborts, and a turn that does not continue its conversation only after a release (no move:
    its clients' turns continue theirs). Its certificate gets past R1, R2, Q2, Q3 and Q4 to what the fork does next."""
    return RefAwareRequestPath(config)


factory_bench_clients.capabilities = replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=factory.capabilities.name + ", its benchmark's clients",  # type: ignore[attr-defined]
    client=("sessions-only", "idle-changes", "no-aborts"),
    priority_parts=tuple(p for p in factory.capabilities.priority_parts if p != "move"),  # type: ignore[attr-defined]
)


def factory_releasing_clients(config: CacheConfig) -> RefAwareRequestPath:
    """`...:factory_releasing_clients`: as `factory`, with clients that know the fork: each releases the rid of a
    one-shot request once its answer (or abort) arrives, as the fork asks of every rid it registers (what `factory`'s
    clients do too under `--with-fixes Q4`: Q4's fix is an API change, applied in-process by its client half), and ids
    never extend one another (SG-ABORT's prefix abort). Aborts, mid-turn changes, moves and bursts are sent as to
    `factory`."""
    return RefAwareRequestPath(config, release_one_shot=True)


factory_releasing_clients.capabilities = replace(  # type: ignore[attr-defined]
    factory.capabilities,  # type: ignore[attr-defined]
    name=factory.capabilities.name + ", clients that release one-shot rids",  # type: ignore[attr-defined]
    client=("distinct-ids", "releases-one-shot"),
)
