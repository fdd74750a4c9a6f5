"""The target engine: a synchronous core that steps the batch, and an asyncio front.

`EngineCore` owns the scheduler, the block manager and the model runner and is only
ever touched by one thread at a time. `AsyncEngine` queues admissions and aborts from
the event loop and applies them between steps, so new requests join the next step and a
cancelled request's pages are free within one step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from common.attention import select_backend
from common.kv_layout import (
    KV_DTYPES,
    CacheConfig,
    KVLayout,
    StagingSpec,
    build_layout,
    bytes_per_page,
    canonical_kv_dtype,
    resolve_order,
)
from common.kv_pool import PagePool, remove_stale_shm_files
from common.layout_proto import kv_dtype_to_proto, kv_layout_to_proto, order_to_proto
from common.pool_transport import PoolExports, check_ipc_allocator, device_uuid, write_canary
from common.sampling import SamplingSpec, make_generator
from common.threads import apply_threads
from common.weights import resolve_model_path
from splitspec.v1 import drafter_pb2 as dpb
from target_service.api_types import (
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    QueueFullError,
    RequestOutput,
    ShuttingDownError,
    StopParams,
)
from target_service.block_manager import BlockManager
from target_service.detokenizer import IncrementalDetokenizer
from target_service.drafter_link import (
    DrafterFacts,
    DrafterLink,
    DrafterLinkConfig,
    DrafterRejected,
    describe_rpc_error,
)
from target_service.metrics import TargetMetrics
from target_service.model_runner import ModelRunner
from target_service.scheduler import Scheduler, SchedulerConfig
from target_service.sequence import Sequence
from target_service.speculation import Speculator

log = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "__warmup__"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_waiting: int = 1024
    attention_backend: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    seed: int = 0
    hf_cache_dir: str | None = None
    drafter: str | None = None  # address of splitspec-draft; None → no speculation
    internal_token: str | None = None  # shared token for the internal channel
    num_speculative_tokens: int = 8  # the server's K: requests may ask for fewer
    drafter_timeout_s: float = 2.0  # per-step Propose deadline
    drafter_startup_wait_s: float = 30.0  # how long the first handshake may wait for the drafter
    speculative_disable_batch_size: int | None = None  # no drafts while this many sequences or more run
    threads: int | None = None  # torch CPU threads of the engine thread; None → torch's default

    def __post_init__(self) -> None:
        if self.drafter and not self.internal_token:
            raise ValueError("a drafter needs the internal token (SPLITSPEC_INTERNAL_TOKEN or --internal-token-file)")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.drafter_timeout_s <= 0 or self.drafter_startup_wait_s < 0:
            raise ValueError("drafter timeouts must be positive")
        if not self.model:
            raise ValueError("model must name a local folder or a Hugging Face id")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_model_len", "speculative_disable_batch_size", "threads"):  # None: unset
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"attention_backend must be auto, torch or flashinfer, got {self.attention_backend!r}")

    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def model_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device().type == "cpu" or checkpoint_dtype not in DTYPES.values():
            return torch.float32  # reduced-precision matmuls are slow or missing on CPUs
        return checkpoint_dtype


def _eos_token_ids(model_path, tokenizer) -> tuple[int, ...]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    return tuple(sorted(ids))


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_num_pages(cache: CacheConfig, per_page: int, device: torch.device, max_num_seqs: int, max_model_len: int) -> int:
    """Pages from the explicit count, or the memory budget capped at what the limits can use."""
    if cache.num_pages is not None:
        return cache.num_pages
    budget = cache.memory_bytes or int(_available_memory(device) * cache.memory_fraction)
    useful = max_num_seqs * -(-max_model_len // cache.page_size) + 1
    return max(1, min(budget // per_page, useful))


@dataclass
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer
    spec: SamplingSpec
    generator: torch.Generator | None


class EngineCore:
    """Synchronous engine: add, abort, step. One thread at a time."""

    def __init__(self, config: EngineConfig, model, tokenizer, runner: ModelRunner, pool: PagePool,
                 model_info: ModelInfo, link: DrafterLink | None = None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner
        self.pool = pool
        self.model_info = model_info
        self.block_manager = BlockManager(pool.layout.num_pages, pool.layout.page_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, model_info.max_model_len),
            self.block_manager,
        )
        self.speculator = (Speculator(link, config.num_speculative_tokens, model_info.max_model_len,
                                      model_info.vocab_size, config.speculative_disable_batch_size)
                           if link is not None else None)
        self._tracked: dict[str, _Tracked] = {}
        self._next_seq_id = 0
        self._epoch = pool.layout.epoch
        self.exports = PoolExports()  # keeps exported CUDA pools alive until the drafter moves on
        self.metrics = TargetMetrics()
        self.metrics.watch(self)
        if self.speculator is not None:
            self.speculator.metrics = self.metrics
            self.speculator.device = runner.device

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    @property
    def link(self) -> DrafterLink | None:
        return self.speculator.link if self.speculator else None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: EngineRequest) -> None:
        seq = Sequence.from_request(request, self._next_seq_id)
        self._next_seq_id += 1
        sampling = request.sampling
        spec = SamplingSpec(sampling.temperature, sampling.top_p, sampling.top_k)
        generator = None if spec.greedy else make_generator(sampling.seed, self.runner.device)
        detok = IncrementalDetokenizer(self.tokenizer, list(request.prompt_token_ids), request.stop.stop)
        self._tracked[request.request_id] = _Tracked(seq, detok, spec, generator)
        self.scheduler.add(seq)
        self.metrics.on_admitted(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self._remove(tracked.seq)
        return self._finish_output(tracked, FinishReason.ABORT, ())

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self._tracked) if (out := self.abort(rid)) is not None]

    def _remove(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def step(self) -> list[RequestOutput]:
        """Schedule, propose, run (prefill + decode + verify), accept, emit."""
        spec = self.speculator
        if spec is not None and spec.link.due_for_handshake():
            self.handshake()
        plan = self.scheduler.schedule(spec.lookahead(self.scheduler.running) if spec else None)
        if spec is not None:
            for seq in plan.preempted:
                spec.release(seq)
        self.metrics.preemptions.inc(len(plan.preempted))
        if plan.is_empty:
            return []
        self._note_first_scheduling(plan.scheduled)
        drafts = spec.propose(plan.scheduled) if spec else {}
        if spec is not None and not spec.link.ready:
            self.metrics.fallback_steps.inc()
        sampling = [s for s in plan.scheduled if s.samples]
        tracked = [self._tracked[s.seq.request_id] for s in sampling]
        emitted, row_starts = self.runner.execute(plan.scheduled, drafts, [t.spec for t in tracked],
                                                  [t.generator for t in tracked])
        computed_before = [s.seq.num_computed_tokens for s in plan.scheduled]
        for s in plan.scheduled:
            s.seq.num_computed_tokens += s.num_query_tokens
        outputs = []
        for t, tokens in zip(tracked, emitted):
            draft = drafts.get(t.seq.seq_id)
            if draft:
                self._count_speculation(t.seq, draft, tokens)
            if (out := self._append_tokens(t, tokens)) is not None:
                outputs.append(out)
        if spec is not None:
            spec.record_step(plan.scheduled, drafts, computed_before, row_starts)
        return outputs

    def _note_first_scheduling(self, scheduled) -> None:
        now = time.monotonic()
        for s in scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
                self.metrics.on_scheduled(s.seq, now)

    def _count_speculation(self, seq: Sequence, draft: list[int], emitted: list[int]) -> None:
        accepted = len(emitted) - 1
        self.metrics.on_verified(len(draft), accepted)
        seq.spec.record(len(draft), accepted)
        seq.num_computed_tokens += accepted  # the accepted drafts' KV was written by the verify

    def _append_tokens(self, tracked: _Tracked, tokens: list[int]) -> RequestOutput | None:
        """Append emitted tokens, check stops, return the stream's increment."""
        seq, detok = tracked.seq, tracked.detok
        emitted: list[int] = []
        reason = None
        for token in tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            detok.add_token(token)
            reason = self._stop_reason(seq, token, detok)
            if reason is not None:
                break
        self._note_tokens(seq, len(emitted))
        if reason is None:
            text = detok.take(final=False)
            return RequestOutput(seq.request_id, tuple(emitted), text) if emitted or text else None
        del self._tracked[seq.request_id]
        self._remove(seq)
        return self._finish_output(tracked, reason, tuple(emitted))

    def _note_tokens(self, seq: Sequence, n: int) -> None:
        now = time.monotonic()
        first = seq.first_token_time is None
        self.metrics.on_tokens(seq, n, now, first, seq.last_token_time)
        if first:
            seq.first_token_time = now
        seq.last_token_time = now

    def _stop_reason(self, seq: Sequence, token: int, detok: IncrementalDetokenizer) -> FinishReason | None:
        stop: StopParams = seq.request.stop
        if token in stop.stop_token_ids:
            return FinishReason.STOP
        if not stop.ignore_eos and token in self.model_info.eos_token_ids:
            return FinishReason.STOP
        if detok.find_stop():
            return FinishReason.STOP
        if seq.num_output_tokens >= stop.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.model_info.max_model_len:
            return FinishReason.MODEL_LENGTH
        return None

    def _finish_output(self, tracked: _Tracked, reason: FinishReason, tokens: tuple[int, ...]) -> RequestOutput:
        self.metrics.on_finished(tracked.seq, reason.name.lower(), time.monotonic())
        text = tracked.detok.take(final=True)
        return RequestOutput(tracked.seq.request_id, tokens, text, reason, tracked.seq.usage())

    # --- the drafter handshake (DESIGN.md §3) -------------------------------------------

    def negotiate_request(self) -> dpb.NegotiateRequest:
        backend_cls = type(self.runner.backend)
        device = self.runner.device
        info = self.model_info
        facts = dpb.TargetFacts(
            architecture=info.architecture, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
            num_layers=info.num_layers, fingerprint=self.model.fingerprint(),
            supported_orders=[order_to_proto(o) for o in backend_cls.supported_orders(device)],
            preferred_order=order_to_proto(backend_cls.preferred_order(device)),
            kv_dtype=kv_dtype_to_proto(self.layout.kv_dtype), page_size=self.layout.page_size,
            max_num_seqs=self.config.max_num_seqs, max_tokens_per_step=self.config.max_num_batched_tokens,
            device_type=device.type, device_uuid=device_uuid(device), max_model_len=info.max_model_len,
        )
        return dpb.NegotiateRequest(target_id=self.layout.target_id, target=facts,
                                    requested_order=self.config.cache.kv_layout)

    def handshake(self) -> bool:
        """Negotiate, (re)plan the pool if the drafter's layers are not in it, attach."""
        link = self.link
        try:
            facts = link.negotiate(self.negotiate_request())
            layout = plan_layout(self.config, self.model, type(self.runner.backend), self.runner.device,
                                 self.model_info.max_model_len, facts, self.layout.target_id, self._epoch + 1)
            if not same_regions(layout, self.layout):
                if self.scheduler.has_work:
                    link.mark_failed("the drafter's layers are not in the KV pool; re-planning it when idle")
                    return False
                self._install_pool(layout)
            self._epoch += 1
            self.pool.layout = dataclasses.replace(self.pool.layout, epoch=self._epoch)
            self.config.cache.resolve_layout(self.pool.layout)
            canary = write_canary(self.pool)
            link.attach(dpb.AttachRequest(layout=kv_layout_to_proto(self.pool.layout),
                                          pool=self.exports.export(self.pool),
                                          canary=dpb.Canary(offset=canary.offset, value=canary.value)))
            self.exports.attached(self.layout.target_id, self._epoch)  # older exports may go now
        except Exception as exc:  # rejected, unreachable, or no common layout: serve without it
            rejected = isinstance(exc, (DrafterRejected, ValueError))
            self.metrics.handshakes.labels(result="rejected" if rejected else "error").inc()
            link.mark_failed(describe_rpc_error(exc), rejected=rejected)
            return False
        self.metrics.handshakes.labels(result="ok").inc()
        link.mark_ready(facts, self.layout.target_id, self._epoch)
        self.speculator.reset()
        return True

    def _install_pool(self, layout: KVLayout) -> None:
        """Replace the (idle) pool with one planned for `layout`."""
        self.pool.close()
        self.pool = PagePool.create(layout, self.runner.device, self.config.cache.shm_dir)
        self.block_manager = BlockManager(layout.num_pages, layout.page_size)
        self.scheduler.block_manager = self.block_manager
        install_runner_pool(self.runner, self.pool, self.model.num_layers)

    def warmup(self) -> None:
        """One prefill and a few decodes through every code path, then free everything."""
        n = min(32, self.config.max_num_batched_tokens, self.model_info.max_model_len - 4)
        request = EngineRequest(WARMUP_REQUEST_ID, tuple([0] * max(1, n)), stop=StopParams(max_tokens=3, ignore_eos=True))
        real, self.metrics = self.metrics, TargetMetrics()  # warmup traffic is not served traffic
        try:
            self.add(request)
            while request.request_id in self._tracked:
                self.step()
        finally:
            self.metrics = real

    def close(self) -> None:
        if self.link is not None:
            self.link.detach()
            self.link.close()
        self.exports.close()
        self.pool.close()


def same_regions(a: KVLayout, b: KVLayout) -> bool:
    """Same storage plan (an epoch bump may reuse the pool)."""
    return (a.order, a.page_size, a.kv_dtype, a.layers, a.staging) == (b.order, b.page_size, b.kv_dtype,
                                                                         b.layers, b.staging) and \
        a.num_pages == b.num_pages


def install_runner_pool(runner: ModelRunner, pool: PagePool, num_layers: int) -> None:
    layout = pool.layout
    kv_caches = [pool.region(layout.layer("target", i)) for i in range(num_layers)]
    staging = pool.staging() if layout.staging is not None else None
    capture = layout.staging.layer_ids if layout.staging is not None else ()
    runner.install_pool(type(runner.backend)(layout), kv_caches, layout.page_size, staging, capture)


def choose_backend(config: EngineConfig, model, device: torch.device) -> type:
    """The attention backend class for this model, KV dtype and device (once, at start)."""
    model_dtype = next(model.parameters()).dtype
    kv_dtype = KV_DTYPES[canonical_kv_dtype(config.cache.cache_dtype, model_dtype)]
    head_dims = tuple(sorted({spec.head_dim for spec in model.kv_layer_specs()}))
    return select_backend(config.attention_backend, device, head_dims=head_dims, model_dtype=model_dtype,
                          kv_dtype=kv_dtype)


def plan_layout(config: EngineConfig, model, backend_cls: type, device: torch.device, max_model_len: int,
                facts: DrafterFacts | None, target_id: str, epoch: int) -> KVLayout:
    """Every layer (target and draft) and the staging buffer in one pool, sized by the budget."""
    cache = config.cache
    order = resolve_order(
        cache.kv_layout,
        target_supported=backend_cls.supported_orders(device),
        target_preferred=backend_cls.preferred_order(device),
        drafter_supported=facts.supported_orders if facts else None,
    )
    model_dtype = next(model.parameters()).dtype
    kv_dtype = canonical_kv_dtype(cache.cache_dtype, model_dtype)
    specs = model.kv_layer_specs() + (list(facts.layers) if facts else [])
    staging = None
    if facts and facts.target_layer_ids:
        staging = StagingSpec(rows=config.max_num_batched_tokens, width=len(facts.target_layer_ids) * model.hidden_size,
                              dtype=str(model_dtype).removeprefix("torch."), layer_ids=tuple(facts.target_layer_ids))
    num_pages = plan_num_pages(cache, bytes_per_page(cache.page_size, kv_dtype, specs), device,
                               config.max_num_seqs, max_model_len)
    return build_layout(order=order, page_size=cache.page_size, kv_dtype=kv_dtype, num_pages=num_pages,
                        layers=specs, staging=staging, target_id=target_id, epoch=epoch)


def build_engine_core(config: EngineConfig, drafter_stub=None) -> EngineCore:
    """Load the model, negotiate with the drafter, resolve the layout, allocate the pool.

    `drafter_stub` replaces the gRPC stub to `config.drafter` (an in-process drafter)."""
    from transformers import AutoTokenizer

    from common.qwen3 import Qwen3ForCausalLM
    from common.weights import load_config

    device = config.torch_device()
    torch.manual_seed(config.seed)
    model_path = resolve_model_path(config.model, config.hf_cache_dir)
    hf_config = load_config(model_path)
    dtype = config.model_dtype(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None))
    tokenizer_path = resolve_model_path(config.tokenizer, config.hf_cache_dir) if config.tokenizer else model_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = Qwen3ForCausalLM.from_pretrained(model_path, dtype=dtype, device=device)

    max_model_len = _max_model_len(config, hf_config)
    target_id = uuid.uuid4().hex[:16]
    backend_cls = choose_backend(config, model, device)
    if device.type == "cuda" and config.drafter:
        check_ipc_allocator()  # fail at start, not at the first handshake
    layout = plan_layout(config, model, backend_cls, device, max_model_len, None, target_id, 0)
    if layout.num_pages * layout.page_size < max_model_len:
        log.warning("KV pool holds %d tokens; capping max_model_len from %d", layout.num_pages * layout.page_size,
                    max_model_len)
        max_model_len = layout.num_pages * layout.page_size
    if device.type == "cpu":
        remove_stale_shm_files(config.cache.shm_dir)
    pool = PagePool.create(layout, device, config.cache.shm_dir)
    config.cache.resolve_layout(layout)
    kv_caches = [pool.region(layout.layer("target", i)) for i in range(model.num_layers)]
    runner = ModelRunner(model, backend_cls(layout), kv_caches, layout.page_size, device)
    info = ModelInfo(
        model_id=config.model,
        architecture=(hf_config.architectures or ["unknown"])[0],
        vocab_size=model.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=_eos_token_ids(model_path, tokenizer),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
    )
    link = None
    if config.drafter:
        link = DrafterLink(DrafterLinkConfig(config.drafter, config.internal_token or "",
                                             propose_timeout_s=config.drafter_timeout_s), _stub=drafter_stub)
    core = EngineCore(config, model, tokenizer, runner, pool, info, link)
    if link is not None:
        _first_handshake(core, config.drafter_startup_wait_s)
        link.serving = True  # from now on a handshake must not stall the streams for long
    log.info("target ready: %s, %s KV, %s pages of %d tokens, order %s, drafter %s", info.architecture,
             core.layout.kv_dtype, core.layout.num_pages, core.layout.page_size, core.layout.order,
             link.describe() if link else "none")
    return core


def _max_model_len(config: EngineConfig, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {limit}")
    return config.max_model_len


def _first_handshake(core: EngineCore, wait_s: float) -> None:
    """The drafter usually starts beside the target: give it a moment before serving without it."""
    deadline = time.monotonic() + wait_s
    while not core.handshake():
        if time.monotonic() >= deadline or core.link.rejected:
            return
        core.link.wait_for_drafter(min(0.5, max(0.0, deadline - time.monotonic())))


class AsyncEngine:
    """asyncio front of an `EngineCore`; implements `EngineClient`."""

    def __init__(self, core: EngineCore, threads: int | None = None) -> None:
        self._core = core
        self.model_info = core.model_info
        # torch's thread count is per thread (MKL's is thread-local): size it where steps run
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine", initializer=apply_threads, initargs=(threads, log))
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending_adds: list[EngineRequest] = []
        self._pending_aborts: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._admitting = True

    @classmethod
    def build(cls, config: EngineConfig) -> AsyncEngine:
        return cls(build_engine_core(config), config.threads)

    def tokenizer(self):
        return self._core.tokenizer

    @property
    def core(self) -> EngineCore:
        return self._core

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._core.warmup)
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name="engine-loop")
        if (link := self._core.link) is not None and link.health is not None:  # handshake when it turns SERVING
            link.health.on_news = lambda: loop.call_soon_threadsafe(self._notify)

    def stop_admitting(self) -> None:
        self._admitting = False

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate and admit now (raising on bad input); stream outputs lazily."""
        self._check_admission(request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._pending_adds.append(request)
        self._notify()
        return RequestStream(self, request.request_id, queue)

    def _check_admission(self, request: EngineRequest) -> None:
        if not self._admitting or self._loop_task is None:
            raise ShuttingDownError("the server is not admitting requests")
        if request.request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in flight")
        validate_prompt(request, self.model_info)
        if self._core.num_waiting + len(self._pending_adds) >= self._core.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self._core.config.max_waiting} requests)")

    def _close_stream(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.abort(request_id)
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self._pending_aborts.add(request_id)
        self._notify()
        return True

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _drain_pending(self) -> None:
        """Apply admissions and aborts; only ever between steps."""
        adds, self._pending_adds = self._pending_adds, []
        aborts, self._pending_aborts = self._pending_aborts, set()
        for request in adds:
            if request.request_id in aborts:
                self._deliver(self._aborted_output(request))
                continue
            self._core.add(request)
        for request_id in aborts:
            if (out := self._core.abort(request_id)) is not None:
                self._deliver(out)

    @staticmethod
    def _aborted_output(request: EngineRequest) -> RequestOutput:
        from target_service.api_types import Usage

        usage = Usage(prompt_tokens=len(request.prompt_token_ids))
        return RequestOutput(request.request_id, (), "", FinishReason.ABORT, usage)

    def _deliver(self, output: RequestOutput | BaseException, request_id: str | None = None) -> None:
        rid = request_id or output.request_id  # type: ignore[union-attr]
        if (queue := self._streams.get(rid)) is not None:
            queue.put_nowait(output)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drain_pending()
            if not self._core.has_work():
                self._wake.clear()
                if not (self._pending_adds or self._pending_aborts):
                    await self._idle(loop)
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._core.step)
            except Exception as exc:  # a failed step must not take the server down
                log.exception("engine step failed; aborting the affected requests")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sleep until work arrives; meanwhile keep re-handshaking with a lost drafter."""
        link = self._core.link
        if link is None or link.ready:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.05, link.seconds_until_retry()))
        except asyncio.TimeoutError:
            if link.due_for_handshake():
                await loop.run_in_executor(self._executor, self._core.handshake)

    def _fail_all(self, exc: Exception) -> None:
        for out in self._core.abort_all():
            self._deliver(RuntimeError(f"engine step failed: {exc}"), out.request_id)

    def server_info(self) -> dict:
        core = self._core
        return {
            "kv_layout": core.layout,
            "num_pages": core.block_manager.num_pages,
            "free_pages": core.block_manager.num_free_pages,
            "running": core.num_running,
            "waiting": core.num_waiting + len(self._pending_adds),
            "drafter": core.link.describe() if core.link else {"state": "none", "address": ""},
        }

    async def shutdown(self, grace_s: float) -> None:
        """Finish in-flight requests within `grace_s`, abort the rest, free the pool."""
        self.stop_admitting()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        for _ in range(100):  # let the loop deliver the aborts
            if not self._streams:
                break
            await asyncio.sleep(0.01)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        await asyncio.to_thread(self._core.close)  # it may wait (briefly) on the drafter: not on the loop


class RequestStream:
    """The outputs of one admitted request, as an async iterator.

    Closing it before the last output aborts the request (its pages are free at the next
    step), whether or not it was ever iterated: a handler cancelled between admission and
    its first read (a client cancel, a deadline, a failed metadata write) must not leave
    the request running with nobody reading it. An async generator cannot promise that:
    `aclose()` on one that never started skips its `finally`.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self._engine = engine
        self._request_id = request_id
        self._queue = queue
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed or self._finished:
            await self.aclose()
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        self._finished = item.finish_reason is not None
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._close_stream(self._request_id, self._finished)


def validate_prompt(request: EngineRequest, info: ModelInfo) -> None:
    ids = request.prompt_token_ids
    if not ids:
        raise InvalidRequestError("input", "the prompt is empty")
    if len(ids) >= info.max_model_len:  # the prompt alone cannot fit: its field, not max_tokens, is at fault
        raise InvalidRequestError("input.token_ids", f"the prompt is {len(ids)} tokens; the model length is "
                                  f"{info.max_model_len}, including at least one token to generate")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("input.token_ids", f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    bad = next((t for t in request.stop.stop_token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("stop.stop_token_ids",
                                  f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    total = len(ids) + request.stop.max_tokens
    if total > info.max_model_len:
        raise InvalidRequestError(
            "stop.max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({request.stop.max_tokens}) = {total} exceeds the "
            f"model length {info.max_model_len}",
        )
