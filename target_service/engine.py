"""The target engine: a synchronous core that steps the batch, and an asyncio front.

`EngineCore` owns the scheduler, the block manager and the model runner and is only
ever touched by one thread at a time. `AsyncEngine` queues admissions and aborts from
the event loop and applies them between steps, so new requests join the next step and a
cancelled request's pages are free within one step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from common.attention import select_backend
from common.kv_layout import CacheConfig, KVLayout, build_layout, bytes_per_page, canonical_kv_dtype, resolve_order
from common.kv_pool import PagePool, remove_stale_shm_files
from common.sampling import SamplingSpec, make_generator
from common.weights import resolve_model_path
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
from target_service.model_runner import ModelRunner
from target_service.scheduler import Scheduler, SchedulerConfig, ScheduledSeq
from target_service.sequence import Sequence

log = logging.getLogger(__name__)

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

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a local folder or a Hugging Face id")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
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
                 model_info: ModelInfo) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner
        self.pool = pool
        self.model_info = model_info
        layout = pool.layout
        self.block_manager = BlockManager(layout.num_pages, layout.page_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, model_info.max_model_len),
            self.block_manager,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._next_seq_id = 0

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

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

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.remove(tracked.seq)
        return self._finish_output(tracked, FinishReason.ABORT, ())

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self._tracked) if (out := self.abort(rid)) is not None]

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampling = [s for s in plan.scheduled if s.samples]
        tracked = [self._tracked[s.seq.request_id] for s in sampling]
        tokens = self.runner.execute(plan.scheduled, [t.spec for t in tracked], [t.generator for t in tracked])
        for s in plan.scheduled:
            s.seq.num_computed_tokens += s.num_query_tokens
        return [out for t, tok in zip(tracked, tokens) if (out := self._append_tokens(t, [tok])) is not None]

    def _append_tokens(self, tracked: _Tracked, tokens: list[int]) -> RequestOutput | None:
        """Append accepted tokens, check stops, return the stream's increment."""
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
        if reason is None:
            text = detok.take(final=False)
            return RequestOutput(seq.request_id, tuple(emitted), text) if emitted or text else None
        del self._tracked[seq.request_id]
        self.scheduler.remove(seq)
        return self._finish_output(tracked, reason, tuple(emitted))

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
        text = tracked.detok.take(final=True)
        return RequestOutput(tracked.seq.request_id, tokens, text, reason, tracked.seq.usage())

    def warmup(self) -> None:
        """One prefill and a few decodes through every code path, then free everything."""
        n = min(32, self.config.max_num_batched_tokens, self.model_info.max_model_len - 4)
        request = EngineRequest("__warmup__", tuple([0] * max(1, n)), stop=StopParams(max_tokens=3, ignore_eos=True))
        self.add(request)
        while request.request_id in self._tracked:
            self.step()

    def close(self) -> None:
        self.pool.close()


def build_engine_core(config: EngineConfig) -> EngineCore:
    """Load the model, resolve the KV layout from the backend, allocate the pool."""
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
    backend_cls = select_backend(config.attention_backend, device)
    cache = config.cache
    order = resolve_order(
        cache.kv_layout,
        target_supported=backend_cls.supported_orders(device),
        target_preferred=backend_cls.preferred_order(device),
    )
    kv_dtype = canonical_kv_dtype(cache.cache_dtype, dtype)
    specs = model.kv_layer_specs()
    num_pages = plan_num_pages(cache, bytes_per_page(cache.page_size, kv_dtype, specs), device,
                               config.max_num_seqs, max_model_len)
    if num_pages * cache.page_size < max_model_len:
        log.warning("KV pool holds %d tokens; capping max_model_len from %d", num_pages * cache.page_size, max_model_len)
        max_model_len = num_pages * cache.page_size
    layout = build_layout(order=order, page_size=cache.page_size, kv_dtype=kv_dtype, num_pages=num_pages,
                          layers=specs, target_id=uuid.uuid4().hex[:16])
    if device.type == "cpu":
        remove_stale_shm_files(cache.shm_dir)
    pool = PagePool.create(layout, device, cache.shm_dir)
    cache.resolve_layout(layout)
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
    log.info("target ready: %s, %s KV, %s pages of %d tokens, order %s", info.architecture, kv_dtype,
             num_pages, cache.page_size, order)
    return EngineCore(config, model, tokenizer, runner, pool, info)


def _max_model_len(config: EngineConfig, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {limit}")
    return config.max_model_len


class AsyncEngine:
    """asyncio front of an `EngineCore`; implements `EngineClient`."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.model_info = core.model_info
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending_adds: list[EngineRequest] = []
        self._pending_aborts: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._admitting = True

    @classmethod
    def build(cls, config: EngineConfig) -> AsyncEngine:
        return cls(build_engine_core(config))

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

    def stop_admitting(self) -> None:
        self._admitting = False

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate and admit now (raising on bad input); stream outputs lazily."""
        self._check_admission(request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._pending_adds.append(request)
        self._notify()
        return self._stream(request.request_id, queue)

    def _check_admission(self, request: EngineRequest) -> None:
        if not self._admitting or self._loop_task is None:
            raise ShuttingDownError("the server is not admitting requests")
        if request.request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in flight")
        validate_prompt(request, self.model_info)
        if self._core.num_waiting + len(self._pending_adds) >= self._core.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self._core.config.max_waiting} requests)")

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
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
                    await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._core.step)
            except Exception as exc:  # a failed step must not take the server down
                log.exception("engine step failed; aborting the affected requests")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)

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
            "drafter": {"state": "none", "address": ""},
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
        self._core.close()


def validate_prompt(request: EngineRequest, info: ModelInfo) -> None:
    ids = request.prompt_token_ids
    if not ids:
        raise InvalidRequestError("input", "the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("input.token_ids", f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    total = len(ids) + request.stop.max_tokens
    if total > info.max_model_len:
        raise InvalidRequestError(
            "stop.max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({request.stop.max_tokens}) = {total} exceeds the "
            f"model length {info.max_model_len}",
        )
