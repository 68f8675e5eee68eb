# Over 600 lines: SGLang's scheduler built and stepped on CPU; much of it is the request view and the declared deviations.
"""SGLang 0.5.23 driven through its own scheduler: a request-path target (SPEC.md §12).

    kvcert certify kvcert.conformance.adapters.sglang.requests:factory           # UnifiedRadixCache, Python core
    kvcert certify kvcert.conformance.adapters.sglang.requests:factory_rust      # UnifiedRadixCache, Rust core
    kvcert certify kvcert.conformance.adapters.sglang.requests:factory_radix     # plain RadixCache
    kvcert certify kvcert.conformance.adapters.sglang.requests:factory_sessions  # radix-native sessions

What runs is SGLang's own. `managers/scheduler.py`'s `Scheduler`, unpatched: every `step()` is one iteration
of its `event_loop_normal` (`ingest_requests` -> `process_input_requests` -> `get_next_batch_to_run` ->
`run_batch` -> `process_batch_result`, or `on_idle` with SGLang's own invariant checker), with its
`PrefillAdder`, `ScheduleBatch`, `Req`, `SchedulerBatchResultProcessor`, `SessionController`, request dispatcher
(`handle_generate_request`, `abort_request`, `close_session`) and cache calls (`match_kv_cache`,
`alloc_for_extend`, `checkpoint_kv_cache`, `release_kv_cache`, `check_hicache_events`, `init_load_back`). The
cache, pools and allocator are the ones kvcert's API adapters build (`sglang.hicache_backend`, `sglang.radix`,
`sglang.session`), and their snapshot code reads them.

The Scheduler is a stand-in `self = object.__new__(Scheduler)`: `Scheduler.__init__` loads a model, builds
process groups, ZMQ sockets and threads. The stand-in runs `__init__`'s own `init_*` methods in its order
wherever they run on CPU, and replaces the rest (each a line of the capabilities' deviations): a model config read
from a tiny local
`config.json` (no weights), a scripted model worker (the harness's `Model`: KV bytes and next tokens), one-rank
process-group stand-ins, in-memory sockets carrying SGLang's own IPC encoding, no watchdog thread.
`managers/scheduler.py` imports four packages this venv does not have and no code the CPU run calls:
`setproctitle`, `einops`, `uvicorn`, `fastapi` are inert stub modules (`_stub_http_modules`).

One iteration per `step()`. The loop is SGLang's `while True`; it is left at the top of the next iteration by
an exception raised from SGLang's scripted-runtime hook (`scripted_scheduler_hook.step`, the first thing
`recv_requests` calls: sglang/test/scripted_runtime drives its own tests by the same hook).

Determinism. Each call runs inside the adapter's own SGLang runtime context (`runtime_context.use_context`;
config and parallel state per adapter, not process-wide) and the cache driver's counter swaps (node ids,
access stamps, lock uuids, copy ids; `time` in radix_cache for the plain RadixCache), so the same calls give
the same tree, slots and ids in any process. Request ids are the harness's.

What SGLang does on this path (tests/test_sglang_requests.py asserts the first): `abort_request` matches
`rid.startswith(abort.rid)`, so aborting "r1" aborts "r10" too; a prompt over the input limit is refused at
arrival, yet `set_finish_with_abort` replaces its input with token 0 and runs a one-token prefill whose KV is
cached as a prefix [0] the client never sent (and, with sessions, the session is opened and stays open); with
sessions a turn that does not extend its session's last turn leaves the session two frontiers (INV-TIER-1,
docs/calibration/session.md S4), and a turn that finishes after its session's close registers nothing (S7).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import json
import os
import pickle
import sys
import tempfile
import types
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from kvcert.conformance.adapters.kit.kv import HEAD_DIM, HEAD_NUM, write_pool
from kvcert.conformance.adapters.sglang import env as _env

__all__ = [
    "SGLangRequestPath",
    "factory",
    "factory_radix",
    "factory_rust",
    "factory_sessions",
]

STUBBED = ("setproctitle", "einops", "uvicorn", "fastapi")
"""Modules `managers/scheduler.py` imports that the CPU request path never calls (stubbed where missing)."""


# --------------------------------------------------------------------------- import stubs


def _passthrough(*args: Any, **kwargs: Any) -> Any:
    """A decorator or decorator factory that changes nothing (`@router.get(...)`, `@app.post(...)`)."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


class _Inert:
    """A stub class: instances take any arguments, every attribute is a pass-through decorator (FastAPI's
    `APIRouter().get("/path")` runs at import time of sglang's HTTP entry points)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _passthrough


def _stub_http_modules() -> None:
    """Stub `STUBBED` where they are not installed: SGLang's `_MockModule` (the `triton` stub's kind), whose
    capitalised names are `_Inert` classes. Import-time only: `setproctitle` names the process, `einops` reshapes
    tensors in vision/MoE models, `uvicorn`/`fastapi` serve HTTP; the scheduler's request path calls none."""
    stubs = _env.platform_stubs()

    class _HttpMock(stubs._MockModule):  # type: ignore[misc,name-defined]
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            if name[:1].isupper() and f"{self.__name__}.{name}" not in sys.modules:
                cls = type(name, (_Inert,), {"__module__": self.__name__})
                setattr(self, name, cls)
                return cls
            return super().__getattr__(name)

    def make(name: str) -> Any:
        mod = _HttpMock(name)
        sys.modules[name] = mod
        return mod

    for name in STUBBED:
        if name in sys.modules or _importable(name):
            continue
        _env.install_finder(name, make)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


_env.install_shims()
_stub_http_modules()

from kvcert.conformance.adapters.sglang._events import Replay  # noqa: E402
from kvcert.conformance.adapters.sglang.hicache import HOST_BUDGET_DEVIATION  # noqa: E402
from kvcert.conformance.adapters.sglang.hicache_backend import SGLangHiCacheBackend, host_ratio_for  # noqa: E402
from kvcert.conformance.adapters.sglang.radix import SGLangRadixBackend  # noqa: E402
from kvcert.conformance.adapters.sglang.session import SGLangSessionBackend  # noqa: E402
from kvcert.spec.invariants import Violation  # noqa: E402
from kvcert.spec.requests import RequestView, kv_namespace  # noqa: E402
from kvcert.spec.types import CacheConfig, Capabilities, Snapshot  # noqa: E402

with _env.quiet_imports():
    import zmq
    from sglang.srt import runtime_context as _rc
    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.managers import scheduler as _sched
    from sglang.srt.managers.io_struct import (
        AbortReq,
        BatchTokenIDOutput,
        CloseSessionReqInput,
        TokenizedGenerateReqInput,
        sock_recv,
        sock_send,
    )
    from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels
    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache import kv_cache_builder
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import NgramEmbeddingManager
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

Scheduler = _sched.Scheduler

MAX_RUNNING = 8
"""--max-running-requests (and the ReqToTokenPool's rows): SGLang derives it from GPU memory by default."""
VOCAB = 32000
"""The model config's vocabulary (a Llama's); token ids the suite sends are far below it."""
RETAIN_PARAM = "kvcert_retain_seconds"
"""The `custom_params` key a client's retention hint travels under (docs/sglang-plugin.md, "Retention"): what the
client sends, named here as a client names it; kvcert's plugin reads it on its side."""


# --------------------------------------------------------------------------- the model config


_MODEL_DIR: list[tempfile.TemporaryDirectory[str]] = []


def _model_dir(layers: int) -> str:
    """A directory holding only a tiny Llama `config.json` (no weights, no tokenizer), for `ModelConfig`."""
    if not _MODEL_DIR:
        _MODEL_DIR.append(tempfile.TemporaryDirectory(prefix="kvcert-sglang-model-"))
    path = f"{_MODEL_DIR[0].name}/layers{layers}"
    if not os.path.exists(f"{path}/config.json"):
        os.makedirs(path, exist_ok=True)
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": HEAD_NUM * HEAD_DIM,
            "intermediate_size": 4,
            "num_attention_heads": HEAD_NUM,
            "num_key_value_heads": HEAD_NUM,
            "head_dim": HEAD_DIM,
            "num_hidden_layers": layers,
            "max_position_embeddings": 1 << 16,
            "torch_dtype": "float32",
            "bos_token_id": VOCAB - 2,
            "eos_token_id": VOCAB - 1,
        }
        with open(f"{path}/config.json", "w") as f:
            json.dump(config, f)
    return path


# --------------------------------------------------------------------------- IPC, hook and model worker


class _Socket:
    """An in-memory ZMQ socket: what SGLang's `sock_send` puts in, its `sock_recv` takes out (pickle or msgpack,
    as SGLang's own SGLANG_USE_PICKLE_IPC chooses), non-blocking receives raising EAGAIN when empty."""

    def __init__(self) -> None:
        self.frames: collections.deque[bytes] = collections.deque()

    def send(self, data: Any, flags: int = 0) -> None:
        self.frames.append(bytes(data))

    def send_pyobj(self, obj: Any, flags: int = 0, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
        self.frames.append(pickle.dumps(obj, protocol))

    def recv(self, flags: int = 0) -> bytes:
        if not self.frames:
            raise zmq.ZMQError(zmq.EAGAIN, "Resource temporarily unavailable")
        return self.frames.popleft()

    def recv_pyobj(self, flags: int = 0) -> Any:
        return pickle.loads(self.recv(flags))

    def drain(self) -> list[Any]:
        out = []
        while self.frames:
            out.append(sock_recv(self))
        return out


class _IterationDone(Exception):
    """Raised at the top of the loop's next iteration: one `step()` is one iteration."""


class _OneIteration:
    """Sits where SGLang's `ScriptedSchedulerHook` sits (`Scheduler.scripted_scheduler_hook`): `step()` runs at
    the top of every `recv_requests`, `on_run_batch` before every forward. The second `step()` of a call ends it."""

    def __init__(self) -> None:
        self.calls = 0

    def step(self) -> None:
        self.calls += 1
        if self.calls > 1:
            raise _IterationDone

    def on_run_batch(self, batch: Any) -> None:
        pass


class _ModelWorker:
    """Stands in for `TpModelWorker`: `forward_batch_generation(batch)` is the harness's model.

    For every request of the batch it writes `model.kv(...)` of the tokens the engine fed (`batch.input_ids`,
    after the request's first `prefix_len` tokens) into the slots the engine allocated (`batch.out_cache_loc`), and
    samples `model.next_token(...)` of the same sequence: an engine that feeds wrong tokens or slots stores wrong
    bytes, and the suite's byte checks see them."""

    def __init__(self, owner: SGLangRequestPath) -> None:
        self.owner = owner

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        model = self.owner._model
        if model is None:
            raise RuntimeError("attach_model() before step(): the engine has a batch to run")
        fed = [int(t) for t in batch.input_ids.tolist()]
        slots = [int(s) for s in batch.out_cache_loc.tolist()]
        pool, layers = self.owner._kv_pool, self.owner.config.kv_layers
        nexts: list[int] = []
        if batch.forward_mode.is_extend():
            at = 0
            for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
                tokens = _tokens(req)[:pre] + fed[at : at + ext]
                ns = self.owner.content_of(req)
                write_pool(pool, slots[at : at + ext], model.kv(ns, tokens, pre, ext), layers)
                nexts.append(model.next_token(ns, tokens))
                at += ext
        elif batch.forward_mode.is_decode():
            for i, req in enumerate(batch.reqs):
                seq = int(batch.seq_lens[i])
                tokens = _tokens(req)[: seq - 1] + [fed[i]]
                ns = self.owner.content_of(req)
                write_pool(pool, [slots[i]], model.kv(ns, tokens, seq - 1, 1), layers)
                nexts.append(model.next_token(ns, tokens))
        else:
            raise RuntimeError(f"unexpected forward mode {batch.forward_mode!r}")
        self.owner._forwards += 1
        return GenerationBatchResult(next_token_ids=torch.tensor(nexts, dtype=torch.int64), can_run_cuda_graph=False)


def _tokens(req: Any) -> list[int]:
    return [int(t) for t in req.origin_input_ids] + [int(t) for t in req.output_ids]


class _OneRankGroup:
    """A process-group handle for a world of one rank (what `GroupCoordinator` reports for tp_size 1)."""

    world_size = 1
    rank = rank_in_group = local_rank = first_rank = last_rank = 0
    ranks = (0,)
    is_first_rank = is_last_rank = True
    cpu_group = device_group = None

    def __repr__(self) -> str:
        return "_OneRankGroup()"


# --------------------------------------------------------------------------- the target


@dataclass
class _Submitted:
    """What the adapter knows of a request: what was sent, SGLang's `Req` once created, and how it ended."""

    rid: str
    session: Optional[str]
    namespace: Optional[str]
    prompt: tuple[int, ...]
    priority: int
    req: Any = None
    ended: Optional[str] = None
    """"finished" or "aborted", as SGLang reported it to the tokenizer side."""
    ended_at: int = -1
    """The step in which it ended."""


class SGLangRequestPath:
    """SGLang's Scheduler over one cache; the RequestPathBackend protocol (conformance/backend.py)."""

    def __init__(
        self,
        config: CacheConfig,
        kind: str = "unified",
        core: str = "python",
        pools: Any = None,
        kv_events: bool = False,
    ) -> None:
        """`kind` kvcert: the cache is the one SGLang's registry builds for `--radix-cache-backend kvcert` over
        `pools` (`sglang_kvcert.KvcertPools`). `kv_events`: SGLang's cache is built as with --kv-events-config, and
        its events are judged after every op (INV-EVENT-1, `observed`)."""
        if kind not in ("unified", "radix", "sessions", "kvcert"):
            raise ValueError(f"kind must be unified, radix, sessions or kvcert, not {kind!r}")
        if (kind == "kvcert") != (pools is not None):
            raise ValueError("pools come with kind kvcert, and only with it")
        if config.capacity % config.page_size:
            raise ValueError("capacity must be whole pages")
        self.config, self.kind, self.core = config, kind, core
        self.page_size = config.page_size
        self.host = kind != "radix" and config.host_capacity > 0
        self.sessions = kind == "sessions" or (kind == "kvcert" and pools.sessions)
        """Requests carry their session (--enable-session-radix-cache) and a close reaches SGLang."""
        self._model: Any = None
        self._now = 0
        self._step = 0
        self._forwards = 0
        self._submitted: dict[str, _Submitted] = {}
        self._content: dict[Optional[str], Optional[str]] = {}
        """SGLang's key of a request's KV -> the namespace its content is computed under (the first request's)."""
        self._loras_sent = False
        self._noop_closes: list[str] = []
        """Sessions closed on a factory without SGLang sessions: nothing reaches SGLang."""
        self._inbox, self._rpc = _Socket(), _Socket()
        self._to_tokenizer, self._to_detokenizer = _Socket(), _Socket()
        self._hook = _OneIteration()
        self._router: Optional[Replay] = Replay() if kv_events and kind != "kvcert" else None
        """A router's view of the cache from its KV events; None: they are not judged here."""
        self._salted = False
        """A request carried a `cache_salt` (the partition probe's): the snapshot's namespaces do not show salts."""

        # The cache, built by kvcert's API adapter for it, in a throwaway context (the HiCache driver publishes
        # its own ServerArgs into whichever context is active).
        with _rc.use_context(_rc.RuntimeContext(parallel=_rc.ParallelContext())):
            if kind == "kvcert":
                self.backend: Any = pools
            elif kind == "radix":
                self.backend = SGLangRadixBackend(config, kv_events=kv_events)
            elif kind == "sessions":
                self.backend = SGLangSessionBackend(config, kv_events=kv_events)
            else:
                self.backend = SGLangHiCacheBackend(config, core=core, kv_events=kv_events)
        self._driver: Any = None if kind in ("radix", "kvcert") else self.backend.h
        if self._driver is not None and self.host:
            self._release_copies_at_submission()

        self.args = ServerArgs(**self._server_args())
        self.context = _rc.create_context(self.args, role="scheduler", ranks=_rc.SpawnRanks(world_rank=0))
        group = _OneRankGroup()
        self.context.parallel.override_permanently(
            **{name: group for name in ("world_group", "tp_group", "pp_group", "attn_tp_group", "attn_cp_group")},
            **{name: group for name in ("moe_ep_group", "moe_dp_group", "moe_tp_group", "dcp_group")},
        )
        with self._engine():
            self.scheduler = self._build_scheduler()

    # ------------------------------------------------------------------ construction

    def _server_args(self) -> dict[str, Any]:
        c, ps = self.config, self.page_size
        args: dict[str, Any] = {
            "model_path": _model_dir(c.kv_layers),
            "device": "cpu",
            "dtype": "float32",
            "page_size": ps,
            "chunked_prefill_size": 2 * ps,
            "max_running_requests": MAX_RUNNING,
            "disable_overlap_schedule": True,
            "skip_tokenizer_init": True,
            "skip_server_warmup": True,
            "radix_eviction_policy": c.policy,
            "radix_eviction_policy_config": c.policy_params() or None,
            "context_length": max(4 * c.capacity, 64),
        }
        if self.sessions:
            args["enable_session_radix_cache"] = True
        if self.kind == "kvcert":
            args["radix_cache_backend"] = "kvcert"
        if self.host:
            args |= {
                "enable_hierarchical_cache": True,
                "hicache_ratio": host_ratio_for(c.capacity, c.host_capacity, ps),
                "hicache_io_backend": "direct",
                "hicache_mem_layout": "layer_first",
                "hicache_write_policy": c.write_policy,
            }
        return args

    def _release_copies_at_submission(self) -> None:
        """On CPU every host copy finishes inside its submission; SGLang's own `check_hicache_events` (at the top of
        each iteration) consumes the acks. The driver holds acks for the API adapter's `complete`: here each is
        released as it is made, so SGLang sees what the CPU does."""
        driver = self._driver
        new_op = driver._new_op

        def released(kind: str, node_ids: Sequence[int]) -> Any:
            op = new_op(kind, node_ids)
            driver._release(op)
            return op

        driver._new_op = released

    def _build_scheduler(self) -> Any:
        """`Scheduler.__init__` on a stand-in `self`: its own init_* methods in its order where they run on CPU."""
        g = _rc
        s = object.__new__(Scheduler)
        s.init_startup_timing_begin()
        s.is_initializing = True
        s.forward_ct = 0
        s.processed_tokens_counter = 0
        s.cur_batch_for_debug = None
        s.init_soft_watchdog()
        # "Parse args" (scheduler.py, __init__): the same reads of the published config.
        s.server_args, s.nccl_port = self.args, None
        sched, memory, disagg = g.get_schedule(), g.get_memory(), g.get_disagg()
        s.schedule_policy = sched.schedule_policy
        s.enable_priority_scheduling = sched.enable_priority_scheduling
        s.abort_on_priority_when_disabled = sched.abort_on_priority_when_disabled
        s.schedule_low_priority_values_first = sched.schedule_low_priority_values_first
        s.priority_scheduling_preemption_threshold = sched.priority_scheduling_preemption_threshold
        s.enable_lora = g.get_lora().enable_lora
        s.enable_lora_overlap_loading = g.get_lora().enable_lora_overlap_loading
        s.max_loras_per_batch = g.get_lora().max_loras_per_batch
        s.enable_overlap = not sched.disable_overlap_schedule
        s.enable_overlap_mlx = False
        s.enable_pdmux = disagg.enable_pdmux
        s.skip_tokenizer_init = g.get_serving().skip_tokenizer_init
        s.stream_interval = g.get_serving().stream_interval
        s.spec_algorithm = SpeculativeAlgorithm.from_string(g.get_spec().speculative_algorithm)
        s.page_size = sched.page_size
        s.enable_hierarchical_cache = memory.enable_hierarchical_cache
        s.enable_lmcache = memory.enable_lmcache
        s.enable_session_radix_cache = memory.enable_session_radix_cache
        s.enable_hicache_storage = memory.hicache_storage_backend is not None
        s.enable_unified_cache_external_linker = memory.enable_unified_cache_external_linker
        s.enable_decode_hicache = disagg.disaggregation_decode_enable_radix_cache and s.enable_hierarchical_cache
        s.max_recv_per_poll = _sched.envs.SGLANG_SCHEDULER_MAX_RECV_PER_POLL.get()
        s.max_new_tokens_limit = _sched.envs.SGLANG_MAX_NEW_TOKENS_LIMIT.get()
        s.enable_hisparse = memory.enable_hisparse
        s.attn_dp_enabled = g.get_parallel().attn_dp_enabled
        s.enable_unified_memory = memory.enable_unified_memory
        s.init_model_config()
        s.init_metrics_collector()
        # init_ipc_channels: in-memory sockets instead of ZMQ ones.
        s.ipc_channels = SchedulerIpcChannels(
            recv_from_tokenizer=self._inbox,
            recv_from_rpc=self._rpc,
            send_to_tokenizer=SenderWrapper(self._to_tokenizer),
            send_to_detokenizer=SenderWrapper(self._to_detokenizer),
            send_metrics_from_scheduler=None,
        )
        s.load_snapshot_writer = None
        s.recv_from_tokenizer = self._inbox
        s.init_idle_sleeper()
        s.init_tokenizer()
        s.init_moe_gemm_config()
        s.init_mamba_backend()
        self._init_model_worker(s)
        # kv_cache_builder.build_kv_cache: the pools and cache kvcert's API adapter built.
        s.init_kv_event_lora_names()
        s.is_hybrid_swa = s.is_hybrid_ssm = False
        s.sliding_window_size = s.full_tokens_per_layer = s.swa_tokens_per_layer = None
        s.req_to_token_pool = self._req_pool
        s.token_to_kv_pool_allocator = self._allocator
        s.kv_shard_widening = 1
        s.disable_radix_cache = False
        s.tree_cache = self.cache
        if s.enable_hierarchical_cache and self.cache.cache_controller is not None:  # as init_kv_cache guards it
            controller = self.cache.cache_controller
            controller.load_fence_stream = controller.write_fence_stream = s.tp_worker.model_runner.forward_stream
        s.emit_metrics_constants()
        s.init_hisparse_coordinator()
        s.decode_offload_manager = None
        s.init_running_status()
        s.init_chunked_prefill()
        s.maybe_init_dynamic_chunk_sizer()
        s.init_diffusion_llm()
        s.init_metrics_reporter()
        s.scheduler_stage_metrics = s.metrics_reporter.scheduler_stage_metrics
        s.init_kv_events_publisher()
        s.init_schedule_policy()
        # init_watch_dog_memory_saver_input_blocker without the watchdog thread.
        s.memory_saver_adapter = _sched.TorchMemorySaverAdapter.create(enable=False)
        s.recv_skipper = _sched.SchedulerRecvSkipper.maybe_create()
        s.input_blocker = None
        s.init_profiler()
        s.maybe_init_rust_server()
        s.init_disaggregation()
        s.init_overlap()
        s.maybe_init_ngram_embedding()
        s.init_deterministic_inference_config()
        s.init_dsa_kpool_truncation_align()
        s.init_mamba_truncation_align()
        s.check_truncation_align_fits_chunk()
        s.init_weight_updater()
        s.init_request_dispatcher()
        s.init_lora_drainer()
        s.init_lora_overlap_loader()
        s.init_grammar_manager()
        s.scripted_scheduler_hook = self._hook  # maybe_init_scripted_scheduler_hook's slot
        s.init_request_receiver()
        s.init_dp_attn_adapter()
        s.init_pool_stats_observer()
        s.init_invariant_checker()
        s.init_load_publisher()
        s.init_load_inquirer()
        s.init_output_streamer()
        s.init_batch_result_processor()
        s.init_internal_state()
        s.is_initializing = False
        # run_event_loop's CPU set-up (scheduler.py): a no-op schedule-stream sync, no WAR barrier.
        s.schedule_stream.synchronize = lambda: None
        s._war_barrier_enabled = False
        # Observe every Req SGLang creates (the Req is the return value; nothing else changes).
        create = s._create_generation_req

        def create_generation_req(recv_req: Any, *args: Any, **kwargs: Any) -> Any:
            req = create(recv_req, *args, **kwargs)
            record = self._submitted.get(req.rid)
            if record is not None and record.req is None:
                record.req = req
            return req

        s._create_generation_req = create_generation_req
        return s

    def _init_model_worker(self, s: Any) -> None:
        """init_model_worker without a model: the pools come from kvcert's cache adapter, the worker is scripted,
        the worker info is what `TpModelWorker.get_worker_info` reports for them."""
        g = _rc
        self._allocator = self._driver.allocator if self._driver is not None else self.backend.allocator
        self._kv_pool = self._allocator.get_kvcache()
        self.cache = self._driver.cache if self._driver is not None else self.backend.cache
        self._req_pool = ReqToTokenPool(
            size=MAX_RUNNING,
            max_context_len=s.model_config.context_len + get_req_to_token_extra_context_len(),
            device="cpu",
            enable_memory_saver=False,
        )
        if self.kind != "kvcert":
            self.cache.req_to_token_pool = self._req_pool  # CacheInitParams(req_to_token_pool=...) in build_kv_cache
        runner = types.SimpleNamespace(
            attn_backend=types.SimpleNamespace(),
            prefill_aware_swa=False,
            ngram_embedding_manager=NgramEmbeddingManager(enabled=False, table=None, n=0),
            forward_stream=None,
            token_to_kv_pool=self._kv_pool,
            token_to_kv_pool_allocator=self._allocator,
            req_to_token_pool=self._req_pool,
            canary_manager=None,
            mtp_draft_device_pools=(),
            mtp_draft_mamba_pools=(),
            spec_algorithm=s.spec_algorithm,
            model_config=s.model_config,
            lora_manager=None,
            hisparse_coordinator=None,
            hybrid_gdn_config=None,
            mamba2_config=None,
        )
        s.tp_worker = types.SimpleNamespace(
            model_runner=runner,
            model_config=types.SimpleNamespace(use_ngram_embedding=False),
            is_hybrid_swa=False,
            get_memory_pool=lambda: (self._req_pool, self._allocator),
            get_pad_input_ids_func=lambda: None,
            register_hicache_layer_transfer_counter=lambda counter: None,
        )
        if self.kind == "kvcert":  # built by SGLang's registry now that the row pool exists, as build_kv_cache does
            self.cache = self.backend.build_cache(self._req_pool, s.tp_worker, s.model_config, self.args)
        s.maybe_init_draft_worker()
        kv_cache_builder.resolve_decode_retraction_backup(tp_worker=s.tp_worker)
        s.schedule_stream = torch.get_device_module("cpu").Stream(priority=0)
        s.model_worker = _ModelWorker(self)
        capacity = self.config.capacity
        s.max_total_num_tokens = capacity
        s.max_prefill_tokens = g.get_schedule().max_prefill_tokens
        s.max_running_requests = MAX_RUNNING
        s.max_queued_requests = g.get_schedule().max_queued_requests
        s.max_req_len = min(s.model_config.context_len - 1, capacity - 1)
        s.max_req_input_len = s.max_req_len - 5
        s.random_seed = self.args.random_seed
        s.device = "cpu"
        s.forward_stream = None
        s.min_free_slots_delayer = None
        if not g.get_parallel().pp_max_micro_batch_size:
            g.get_context().override(
                "scheduler.pp_max_micro_batch_size_default",
                pp_max_micro_batch_size=max(MAX_RUNNING // g.get_parallel().pp_size, 1),
            )
        par = g.get_parallel()
        s.tp_group, s.attn_tp_group, s.attn_cp_group = par.tp_group, par.attn_tp_group, par.attn_cp_group
        s.tp_cpu_group = s.attn_tp_cpu_group = s.attn_cp_cpu_group = None
        s.pp_group, s.world_group = par.pp_group, par.world_group
        s.dp_tp_group = get_dp_tp_group()
        s.dp_tp_cpu_group = s.dp_tp_group.cpu_group
        s.pad_input_ids_func = None

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _engine(self) -> Iterator[None]:
        """SGLang code runs in this adapter's runtime context, on its cache's clocks and counters."""
        with _rc.use_context(self.context):
            if self._driver is not None:
                with self._driver._in_sglang():
                    yield
            else:
                self.backend.set_clock(self._now)
                with self.backend._in_engine():
                    yield

    def _send(self, message: Any) -> None:
        with self._engine():
            sock_send(self._inbox, message)

    # ------------------------------------------------------------------ RequestPathBackend

    def set_clock(self, now: int) -> None:
        self._now = now
        self.backend.set_clock(now)

    def attach_model(self, model: Any) -> None:
        self._model = model

    def submit(
        self,
        request: str,
        session: Optional[str],
        namespace: Optional[str],
        tokens: Sequence[int],
        priority: int,
        output: int,
        lora: Optional[tuple[str, str]] = None,
        cache_salt: Optional[str] = None,
        retain: Optional[float] = None,
    ) -> None:
        """What the tokenizer sends for a generate request (`TokenizerManager._create_tokenized_object`):
        normalized and verified sampling params, `max_new_tokens=output`, `ignore_eos` off as clients leave it (the
        model never samples the EOS id, so the request still ends at `max_new_tokens`). `lora`: the adapter (name,
        path) it runs under; the tokenized request carries the id SGLang's tokenizer resolves it to for an adapter
        loaded at launch (`--lora-paths`: `LoRARef.deterministic_id(name, path)`). This scheduler has no LoRA manager;
        the model the harness plays computes each request's KV under its own adapter (`kv_namespace`). `cache_salt`:
        the generate request's own `cache_salt` (SGLang keys the radix tree by it beside `extra_key`); the suite's
        request ops do not send one, the key-partitioning probe (`sglang.partition`) does. `retain`: the client's
        retention hint in seconds, sent as `sampling_params.custom_params` carries it (`RETAIN_PARAM`): SGLang
        has no request field of its own for one, and passes `custom_params` to the scheduler's `Req` unchanged."""
        if request in self._submitted:
            raise ValueError(f"request id {request!r} was submitted before")
        custom = {RETAIN_PARAM: retain} if retain is not None else None
        sampling = SamplingParams(max_new_tokens=output, ignore_eos=False, custom_params=custom)
        sampling.normalize(None)
        sampling.verify(VOCAB)
        message = TokenizedGenerateReqInput(
            input_text="",
            input_ids=array("q", [int(t) for t in tokens]),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=sampling,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            rid=request,
            priority=priority,
            extra_key=namespace,
            session_id=session if self.sessions else None,
            lora_id=LoRARef.deterministic_id(*lora) if lora is not None else None,
            cache_salt=cache_salt,
        )
        self._salted = self._salted or bool(cache_salt)
        content = kv_namespace(namespace, lora)
        self._submitted[request] = _Submitted(request, session, content, tuple(int(t) for t in tokens), priority)
        # the key SGLang files the request's KV under (Req.__init__: extra_key + lora_id) -> its content's namespace
        self._content.setdefault((namespace or "") + message.lora_id if lora is not None else namespace, content)
        self._loras_sent = self._loras_sent or lora is not None
        if self.kind == "sessions" and session is not None:
            self.backend._priority[session] = priority  # SessionView.priority: SGLang keeps no session priority
        self._send(message)

    def content_of(self, req: Any) -> Optional[str]:
        """The namespace the model computes `req`'s KV under: the client's, with its adapter folded in
        (`kv_namespace`), as sent; SGLang's own key for a request the adapter did not send."""
        record = self._submitted.get(req.rid)
        return record.namespace if record is not None else req.extra_key

    def req(self, request: str) -> Any:
        """SGLang's own `Req` for a submitted request (None before the scheduler made one): what it recorded."""
        return self._submitted[request].req

    def step(self) -> None:
        """One iteration of SGLang's `event_loop_normal`, then the outputs the tokenizer side receives."""
        self._step += 1
        self._hook.calls = 0
        with self._engine():
            try:
                self.scheduler.event_loop_normal()
            except _IterationDone:
                pass
            else:  # pragma: no cover - the loop only returns on a ShutdownReq
                raise RuntimeError("SGLang's event loop returned")
        for message in self._to_detokenizer.drain() + self._to_tokenizer.drain():
            self._receive(message)
        if self.kind == "unified" and self.core == "rust":
            self._teach_rust_reader()

    def _receive(self, message: Any) -> None:
        """What the tokenizer side learns: a finished or aborted request, by the reason SGLang sent."""
        if isinstance(message, BatchTokenIDOutput):
            for rid, reason in zip(message.rids, message.finished_reasons, strict=False):
                if reason is not None:
                    kind = reason.get("type") if isinstance(reason, dict) else getattr(reason, "type", None)
                    self._end(rid, "aborted" if kind == "abort" else "finished")
        elif isinstance(message, AbortReq) and message.rid is not None:
            self._end(message.rid, "aborted")

    def _end(self, rid: str, how: str) -> None:
        record = self._submitted.get(rid)
        if record is None:
            return
        if record.ended is None:
            record.ended, record.ended_at = how, self._step

    def _teach_rust_reader(self) -> None:
        """The Rust core's snapshot reader learns node tokens from candidate keys, checked by the core's own
        read-only match (`SGLangHiCache._snapshot_interface`): every request's tokens are candidates."""
        known = self._driver._inserted
        for record in self._submitted.values():
            if record.req is not None:
                known.setdefault(record.req.extra_key, set()).add(tuple(_tokens(record.req)))

    def close_session(self, session: str) -> None:
        """Sessions factory: SGLang's CloseSessionReqInput (`Scheduler.close_session` -> `release_radix_session`),
        processed at the next step. Elsewhere SGLang has no session: nothing is sent, the call is recorded."""
        if not self.sessions:
            self._noop_closes.append(session)
            return
        self._send(CloseSessionReqInput(session_id=session))

    def reprioritize(self, session: str, priority: int) -> None:
        raise NotImplementedError("SGLang 0.5.23 has no call that changes a session's or a request's priority")

    def abort(self, request: str) -> None:
        """SGLang's AbortReq (`Scheduler.abort_request`), processed at the next step. As the tokenizer side sends it
        (`TokenizerManager.abort_request`, one tokenizer worker): only for a request it tracks, one not yet ended."""
        record = self._submitted.get(request)
        if record is None or record.ended is not None:
            return
        self._send(AbortReq(rid=request))

    # ------------------------------------------------------------------ observation

    def _live_reqs(self) -> list[Any]:
        """SGLang's requests the scheduler holds: waiting, chunked, last batch, running batch."""
        s = self.scheduler
        out: list[Any] = []
        seen: set[int] = set()
        batches = [s.running_batch, s.last_batch]
        for req in [*s.waiting_queue, s.chunked_req, *(r for b in batches if b is not None for r in b.reqs)]:
            if req is not None and id(req) not in seen:
                seen.add(id(req))
                out.append(req)
        return out

    def requests(self) -> tuple[RequestView, ...]:
        waiting = {id(r) for r in self.scheduler.waiting_queue}
        views = []
        for record in self._submitted.values():
            if record.ended is not None and record.ended_at < self._step:
                continue
            views.append(self._view(record, waiting))
        return tuple(views)

    def _view(self, record: _Submitted, waiting: set[int]) -> RequestView:
        req = record.req
        if req is None:  # not received yet (or refused before SGLang made a Req)
            state = record.ended or "waiting"
            return RequestView(
                record.rid, record.session, record.namespace, record.prompt, len(record.prompt), state, record.priority
            )
        tokens, prompt = tuple(_tokens(req)), len(req.origin_input_ids)
        if tuple(int(t) for t in req.origin_input_ids) != record.prompt:
            # SGLang replaces the input of a request it refuses at arrival (one token, so that the abort's prefill
            # is cheap, Req.set_finish_with_abort): the client's prompt, nothing decoded.
            tokens, prompt = record.prompt, len(record.prompt)
        priority = int(req.priority) if req.priority is not None else 0
        # The output SGLang will decode: init_req_max_new_tokens clips the client's to what the pool can hold.
        most = req.sampling_params.max_new_tokens
        base = dict(
            id=record.rid,
            session=record.session,
            namespace=record.namespace,
            tokens=tokens,
            prompt=prompt,
            priority=priority,
            max_output=int(most) if most is not None else None,
        )
        if record.ended is not None:
            return RequestView(state=record.ended, **base)  # type: ignore[arg-type]
        if not req.kv.holds_kv:
            state = "waiting" if id(req) in waiting or not req.finished() else "running"
            return RequestView(state=state, **base)  # type: ignore[arg-type]
        row, own = self._row(req)
        return RequestView(state="running", computed=len(row), row=row, own=own, **base)  # type: ignore[arg-type]

    def _row(self, req: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(slots of tokens[:kv_committed_len], the slots it holds outside the tree: [cache_protected_len,
        kv_allocated_len) of its row, and the rest of that range's last page)."""
        kv, ps = req.kv, self.page_size
        line = self._req_pool.req_to_token[kv.req_pool_idx]
        row = tuple(int(x) for x in line[: kv.kv_committed_len].tolist())
        mine = [int(x) for x in line[kv.cache_protected_len : kv.kv_allocated_len].tolist()]
        pages = sorted({x // ps for x in mine})
        return row, tuple(p * ps + i for p in pages for i in range(ps))

    def snapshot(self) -> Snapshot:
        with self._engine():
            base = self.backend.snapshot()
        lent: set[int] = set()
        for req in self._live_reqs():
            if req.kv.holds_kv:
                lent.update(self._row(req)[1])
        nodes = base.nodes
        if self._driver is not None and self._driver.is_rust:
            # The Rust core lists children in its hash maps' order, seeded per process: parents first, by id.
            depth: dict[int, int] = {}
            for node in nodes:  # pretty_print's preorder: a parent before its children
                depth[node.id] = 0 if node.parent is None else depth[node.parent] + 1
            nodes = tuple(sorted(nodes, key=lambda n: (depth[n.id], n.id)))
        if self._loras_sent:  # a LoRA request's nodes are filed under SGLang's key: name them by their content
            nodes = tuple(replace(n, namespace=self._content.get(n.namespace, n.namespace)) for n in nodes)
        return replace(base, nodes=nodes, lent_slots=tuple(sorted(lent)))

    def bookkeeping(self) -> dict[str, tuple[Any, ...]]:
        """SGLang's per-request and per-session structures: name -> (entries, ids of the tree nodes they name).

        Scheduler queues and batches (a batch keeps a finished request until the next iteration filters it), rows
        in use, the cache's in-flight write-through / load-back / backup / prefetch maps, streaming-session slots,
        session generations and close tombstones, sessions' frontier leaves, the HiCache controller's queues. The
        tree's own indexes (evictable leaf sets, `full_host_duplicates`) are not per request and are left out:
        SGLang's `sanity_check` checks them against the tree."""
        s, cache = self.scheduler, self.cache
        out: dict[str, tuple[Any, ...]] = {}

        def put(name: str, entries: int, nodes: Sequence[Any] = (), cap: Optional[int] = None) -> None:
            out[name] = (int(entries), tuple(sorted({_node_id(n) for n in nodes})), cap)

        put("scheduler.waiting_queue", len(s.waiting_queue), _locked(s.waiting_queue))
        running = list(s.running_batch.reqs) if s.running_batch is not None else []
        put("scheduler.running_batch", len(running), _locked(running))
        put("scheduler.chunked_req", int(s.chunked_req is not None), _locked([s.chunked_req]))
        last = list(s.last_batch.reqs) if s.last_batch is not None else []
        put("scheduler.last_batch", len(last), _locked(last))
        put("scheduler._pending_chunked_abort_req", int(s._pending_chunked_abort_req is not None))
        put("scheduler._deferred_input_requests", len(s._deferred_input_requests))
        put("scheduler.result_queue", len(s.result_queue))
        put("scheduler.session_controller", len(s.session_controller.sessions))
        put("scheduler.grammar_manager.grammar_queue", len(s.grammar_manager.grammar_queue))
        held = [r for r in self._live_reqs() if r.kv.holds_kv]
        put("req_to_token_pool.rows_in_use", MAX_RUNNING - self._req_pool.available_size(), _locked(held))
        if self.kind in ("radix", "kvcert"):
            return out
        put(
            "cache.ongoing_write_through",
            len(cache.ongoing_write_through),
            [n for wt in cache.ongoing_write_through.values() for n in (wt.node_id, *wt.publish_node_ids)],
        )
        put("cache.ongoing_load_back", len(cache.ongoing_load_back), list(cache.ongoing_load_back))
        put("cache.ongoing_backup", len(cache.ongoing_backup), [n for n, _ in cache.ongoing_backup.values()])
        put("cache.ongoing_prefetch", len(cache.ongoing_prefetch))
        put("cache.prefetch_loaded_tokens_by_reqid", len(cache.prefetch_loaded_tokens_by_reqid))
        put("cache._storage_prefetch_wait", len(cache._storage_prefetch_wait))
        put("cache.session.slots", len(cache.session.slots))
        refs = cache.session_refs
        put("session_refs._session_generations", len(refs._session_generations))
        put("session_refs._closed_session_ids", len(refs._closed_session_ids), cap=_tracker_module(refs).CLOSED_LIMIT)
        if self.kind == "sessions":
            leaves = self.backend._full._session_leaves
            put("full._session_leaves", sum(len(v) for v in leaves.values()), [n for v in leaves.values() for n in v])
        if self.host:
            cc = cache.cache_controller
            for name in ("write_queue", "load_queue", "ack_write_queue", "ack_load_queue"):
                queue = getattr(cc, name)
                put(f"cache_controller.{name}", len(queue), [n for item in queue for n in item.node_ids])
        return out

    # ------------------------------------------------------------------ KV

    def read_kv(self, slots: Sequence[int]) -> list[bytes]:
        return self.backend.read_kv(slots)

    def read_host_kv(self, host_slots: Sequence[int]) -> list[bytes]:
        return self.backend.read_host_kv(host_slots)

    # ------------------------------------------------------------------ extras

    # ------------------------------------------------------------------ KV events (INV-EVENT-1)

    def observed(self, profile: str) -> list[Violation]:
        """INV-EVENT-1 (`sglang._events`): the events published since the last op, replayed, give what the cache
        holds (namespaces are extra keys). Not judged once a request carried a cache salt, which the snapshot's
        namespaces do not show (the suite's ops send none; the partition probe does, and judges keys itself)."""
        if self._router is None or self._salted:
            return []
        self._router.apply(self.cache.take_events())
        return self._router.agree(self.backend.snapshot(), lambda ns: (ns, None))

    def close(self) -> None:
        """Free the host pools (HiCache); the adapter is unusable afterwards."""
        if hasattr(self.backend, "close"):
            self.backend.close()

    def sanity_check(self) -> None:
        """SGLang's own `UnifiedRadixCache.sanity_check` (the plain RadixCache has none)."""
        if self._driver is not None:
            with self._engine():
                self.cache.sanity_check()


def _node_id(node: Any) -> int:
    return int(node.id) if hasattr(node, "id") else int(node)


def _locked(reqs: Sequence[Any]) -> list[Any]:
    """The tree nodes the requests' locks sit on (`req.last_node` while `req.lock` is held)."""
    return [r.last_node for r in reqs if r is not None and getattr(r, "lock", None) is not None]


# --------------------------------------------------------------------------- factories

_NOTES = (
    "SGLang's Scheduler.event_loop_normal, one iteration per step(), on a stand-in Scheduler built by its own "
    "init_* methods; requests arrive as TokenizedGenerateReqInput through its recv_requests/handle_generate_request",
    "the model is the harness's: the scripted worker writes model.kv() of the tokens SGLang fed into the slots it "
    "allocated (out_cache_loc) and returns model.next_token(), never the EOS id; max_new_tokens = output and "
    "ignore_eos as clients leave it (off): a request ends at max_new_tokens, while admission sets aside only the "
    "new-token ratio of a running request's remaining output, so decode can run short and SGLang retracts",
    "server args: --chunked-prefill-size 2 pages (so prompts are chunked), --max-running-requests 8 (SGLang sizes it "
    "from GPU memory), --context-length 4 x capacity; schedule policy fcfs and priority scheduling off (defaults): "
    "a request's priority reaches the cache's insert only",
    "abort(request) = AbortReq(rid) to abort_request, processed at the next step; SGLang matches rids by prefix "
    "(rid.startswith), so aborting r1 also aborts r10",
    "reprioritize: SGLang 0.5.23 has no priority update path (raises NotImplementedError)",
    "finished/aborted: as SGLang reports them to the tokenizer side (BatchTokenIDOutput finished_reasons, AbortReq); "
    "a prompt over the input limit is refused at arrival (aborted), as SGLang does",
)

_DEVIATIONS = (
    "stand-in Scheduler: object.__new__(Scheduler) with __init__'s init_* methods run in its order; replaced: "
    "init_model_worker (no TpModelWorker; worker info computed as get_worker_info would for the given pools), "
    "kv_cache_builder.build_kv_cache (the cache, pools and allocator kvcert's API adapter builds, with the same "
    "CacheInitParams fields; req_to_token_pool set on the cache), init_ipc_channels, the watchdog thread (none), "
    "init_rank_consensus_checker (not run)",
    "model: ModelConfig from a local config.json of a tiny Llama (head_num 1, head_dim 2, kv_layers layers), no "
    "weights and no tokenizer (--skip-tokenizer-init); the forward is scripted (the harness's Model)",
    "process groups: one-rank stand-ins (world_size 1) stated in the adapter's runtime context; no torch.distributed",
    "IPC: in-memory sockets carry SGLang's own sock_send/sock_recv encoding; the adapter plays the tokenizer "
    "(TokenizedGenerateReqInput built as TokenizerManager._create_tokenized_object builds it; an abort forwarded "
    "only for a request it tracks, as TokenizerManager.abort_request does with one tokenizer worker)",
    "loop: --disable-overlap-schedule (event_loop_normal; the shipped CPU default is event_loop_overlap, whose result "
    "processing runs one iteration late); left after each iteration by an exception from the scripted-runtime hook "
    "at the top of the next recv_requests, after that iteration's _poll_timeout_aborts (timeouts off: reads only)",
    "imports: setproctitle, einops, uvicorn, fastapi are inert stub modules (none is on the path a CPU step runs)",
    "clock: SGLang's tree counters (node ids, access stamps, lock uuids, copy ids; RadixCache's time module) are "
    "per adapter during each call; the scheduler's own wall-clock reads (metrics, time stats) are real",
    "eviction ties: SGLang's sets of candidate leaves are insertion-ordered (as shipped they order by address, F-9)",
    "observation: Scheduler._create_generation_req (SGLang's extension point) is wrapped to record the Req it returns; "
    "nothing else of the Scheduler is replaced after construction",
)

KV_EVENTS_DEVIATION = (
    "KV events: the cache is built with CacheInitParams.enable_kv_cache_events (what --kv-events-config sets); the "
    "harness takes its events after each op (take_events, as SGLang's publisher does each scheduler loop; the "
    "publisher itself, a ZMQ socket, is not started) and replays them (INV-EVENT-1) in SGLang's default format, "
    "with no LoRA name registered"
)

_HOST_DEVIATIONS = (
    "host tier: io backend direct with torch index-copy stand-ins for sgl_kernel's transfer kernels, layout "
    "layer_first (shipped CPU defaults: kernel, page_first), host pools unpinned; host pool sized to host_capacity "
    "through hicache_ratio; copies complete at submission (the CPU's truth), acks consumed by SGLang's own "
    "check_hicache_events at the next iteration",
    "host tier: load_back_threshold is CacheConfig.load_back_threshold (SGLang hard-codes 10, URC:576)",
    HOST_BUDGET_DEVIATION,
)


_LORA_DEVIATION = (
    "LoRA: a request under an adapter carries the id SGLang's tokenizer resolves it to (--lora-paths: "
    "LoRARef.deterministic_id) to a scheduler started without --enable-lora: no LoRA manager loads an adapter, and "
    "what --enable-lora adds to admission (at most max_loras_per_batch adapters a batch) is not run",
)


def _make(kind: str, core: str = "python") -> Any:
    def factory(config: CacheConfig) -> SGLangRequestPath:
        return SGLangRequestPath(config, kind=kind, core=core, kv_events=True)

    factory.__name__ = factory.__qualname__ = {
        ("unified", "python"): "factory",
        ("unified", "rust"): "factory_rust",
        ("radix", "python"): "factory_radix",
        ("sessions", "python"): "factory_sessions",
    }[kind, core]
    version = _env.SGLANG_VERSION
    if kind == "radix":
        name = f"sglang {version} request path, RadixCache"
        notes: tuple[str, ...] = _NOTES + (
            "plain RadixCache: 0.5.23 builds only its subclasses, for all-sliding-window models (PureSWARadixCache) and "
            "--enable-flexkv (FlexKVRadixCache); its default is UnifiedRadixCache (factory); device only",
        )
        extra: tuple[str, ...] = ()
        write_policies: tuple[str, ...] = ()
        policies: tuple[str, ...] = ("lru", "lfu", "fifo", "mru", "priority", "slru")  # not tlru: Unified only
    else:
        core_note = (
            "Python tree core (tree_core_backend=python)"
            if kind == "sessions" or core == "python"
            else "the compiled Rust tree core (SGLang's default)"
        )
        name = f"sglang {version} request path, UnifiedRadixCache ({core_note})"
        notes = _NOTES + (
            f"UnifiedRadixCache, SGLang's default tree cache; {core_note}; device only when host_capacity is 0, "
            "else HiCache (--enable-hierarchical-cache) with the cell's write policy",
        )
        extra = _HOST_DEVIATIONS
        if core == "python":
            extra += ("tree core: Python (tree_core_backend=python); SGLang's default is the Rust core (factory_rust)",)
        write_policies = ("write_through", "write_through_selective", "write_back")
        policies = ("lru",) if kind == "sessions" else ("lru", "slru", "tlru")
        if kind == "sessions":
            name = f"sglang {version} request path, UnifiedRadixCache radix-native sessions (Python tree core)"
            notes += (
                "--enable-session-radix-cache: requests carry session_id (ensure_session_generation at arrival, "
                "register_session_ref at finish); close_session = CloseSessionReqInput -> release_radix_session",
                "one class of session ref, no scoped eviction, no priority update: priority_parts (); a turn that does "
                "not extend its session's last turn adds a second frontier (docs/calibration/session.md S4, INV-TIER-1); "
                "a request finishing after its session's close registers nothing (S7, generation fencing)",
                "the Rust core asked for with sessions falls back to the Python core in SGLang itself (S1)",
            )
        else:
            notes += (
                "no session refs in this build: a session is the client's conversation only; close_session "
                "sends nothing",
            )
        if core == "rust":
            extra += (
                "snapshot: the Rust core is read through its interface (node tokens matched against the requests' "
                "token sequences by the core's own read-only match; host_lock_ref from the ledger of SGLang's own "
                "inc/dec_host_lock_ref calls); nodes listed parents first by id (the core's hash-map order is "
                "seeded per process)",
            )
    extra += (KV_EVENTS_DEVIATION,)
    factory.capabilities = Capabilities(  # type: ignore[attr-defined]
        name=name,
        page_sizes=(1, 4),
        policies=policies,
        namespaces=True,
        strict_input=False,
        write_policies=write_policies,
        kv_reads=True,
        priority_refs=kind == "sessions",
        priority_parts=(),
        profile="sglang-0.5.23",
        notes=notes,
        deviations=_DEVIATIONS + extra + _LORA_DEVIATION,
        kind="request-path",
        loras=True,
    )
    factory.__doc__ = f"{name}: SGLang's own scheduler request path."
    return factory


factory = _make("unified", "python")
"""`kvcert certify kvcert.conformance.adapters.sglang.requests:factory`: UnifiedRadixCache, Python tree core."""
factory_rust = _make("unified", "rust")
"""`...:factory_rust`: UnifiedRadixCache on the compiled Rust tree core (SGLang's default core)."""
factory_radix = _make("radix")
"""`...:factory_radix`: the plain RadixCache."""
factory_sessions = _make("sessions")
"""`...:factory_sessions`: UnifiedRadixCache with --enable-session-radix-cache (radix-native sessions)."""


def _with_engine_ids(base: Any, name: str) -> Any:
    """`base` with clients that leave request ids to SGLang (its uuid4 hex rids: none starts with another), so the
    walk goes on past SG-ABORT, which needs a client-chosen id that extends one in flight."""

    def factory(config: CacheConfig) -> SGLangRequestPath:
        return base(config)  # type: ignore[no-any-return]

    factory.__name__ = factory.__qualname__ = name
    factory.capabilities = dataclasses.replace(  # type: ignore[attr-defined]
        base.capabilities,
        client=("distinct-ids",),
        loras=False,
        deviations=tuple(d for d in base.capabilities.deviations if d not in _LORA_DEVIATION),
        notes=base.capabilities.notes
        + (
            "clients leave request ids to SGLang: no id starts with another (CLIENT_RULES distinct-ids)",
            "clients send no LoRA requests, so the walk goes on past SG-LORA too (factory sends them)",
        ),
    )
    factory.__doc__ = f"{base.__doc__} Clients leave request ids to the engine."
    return factory


factory_engine_ids = _with_engine_ids(factory, "factory_engine_ids")
"""`...:factory_engine_ids`: `factory` whose clients leave request ids to SGLang (the walk goes on past SG-ABORT)."""
factory_sessions_engine_ids = _with_engine_ids(factory_sessions, "factory_sessions_engine_ids")
"""`...:factory_sessions_engine_ids`: `factory_sessions` whose clients leave request ids to SGLang."""
factory_rust_engine_ids = _with_engine_ids(factory_rust, "factory_rust_engine_ids")
"""`...:factory_rust_engine_ids`: `factory_rust` (SGLang's default, compiled tree core) whose clients leave request
ids to SGLang."""


def _tracker_module(refs: Any) -> Any:
    """The cap SGLang puts on its close tombstones (`session_ref_tracker._CLOSED_SESSION_TOMBSTONE_LIMIT`), read off
    the module of the tracker in use."""
    module = sys.modules[type(refs).__module__]
    return types.SimpleNamespace(CLOSED_LIMIT=int(module._CLOSED_SESSION_TOMBSTONE_LIMIT))
