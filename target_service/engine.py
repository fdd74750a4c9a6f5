"""The target engine, assembled: load the model, plan the pool, handshake, hand back a core.

The engine's rooms, in the order a step passes through them:
  config.py         EngineConfig, the settings (validated once)
  async_engine.py   AsyncEngine: admission from the event loop, the step loop, streams
  engine_core.py    EngineCore: add, abort, step (schedule → propose → run → accept → emit)
  scheduler.py      continuous batching, chunked prefill, preemption (page_manager.py: page ids)
  speculation.py    what the drafter is told and asked each step (drafter_link.py: the RPCs;
                    draft_policy.py: how many drafts a step asks for)
  model_runner.py   lists → tensors → forward → verified tokens (spec_decode.py: the accept rule)
  pool_planning.py  what the KV pool holds and how many pages
  handshake.py      SharedPool: the pool, its layout and epoch, Negotiate → re-plan → Attach
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import torch

from common.cpu_linear import cpu_target_dtype, pack_cpu_linears
from common.dtypes import config_dtype, resolve_model_dtype
from common.invariant_attention import make_batch_invariant
from common.kv_pool import PagePool, remove_stale_shm_files
from common.native_attention import NativeCpuAttentionBackend
from common.native_linear import tile_kernel_name
from common.pool_transport import check_ipc_allocator
from common.weights import load_config, resolve_model_path
from target_service.api_types import ModelInfo
from target_service.config import EngineConfig
from target_service.drafter_link import DrafterLink, DrafterLinkConfig
from target_service.engine_core import EngineCore
from target_service.handshake import SharedPool, negotiate_request
from target_service.model_runner import ModelRunner
from target_service.pool_planning import PoolPlanner, choose_backend

log = logging.getLogger(__name__)


def build_engine_core(config: EngineConfig, drafter_stub=None) -> EngineCore:
    """Load the model, plan and allocate the pool, handshake with the drafter.

    `drafter_stub` replaces the gRPC stub to `config.drafter` (an in-process drafter)."""
    from transformers import AutoTokenizer

    from common.qwen3 import ModelArgs, Qwen3ForCausalLM

    device = config.torch_device()
    torch.manual_seed(config.seed)
    model_path = resolve_model_path(config.model, config.hf_cache_dir)
    hf_config = load_config(model_path)
    dtype = resolve_model_dtype(config.dtype, device, lambda: config_dtype(hf_config),
                                lambda: cpu_target_dtype(ModelArgs.from_config(hf_config).product_shapes(), log))
    tokenizer_path = resolve_model_path(config.tokenizer, config.hf_cache_dir) if config.tokenizer else model_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = Qwen3ForCausalLM.from_pretrained(model_path, dtype=dtype, device=device)
    # the native forward needs every product on tiles (the step is one call; see pack_cpu_linears)
    pack_cpu_linears(model, log, whole_forward_on_tiles=config.native_forward and dtype == torch.bfloat16)
    batch_invariant = _batch_invariant(config, model, dtype, device)
    compile_config = config.compile
    if batch_invariant and compile_config.enabled:
        log.warning("--compile is off for this %s target: its compiled segments differ by bucket, and a verify "
                    "must compute each row as a decode would, bit for bit", dtype)
        compile_config = dataclasses.replace(compile_config, enabled=False)

    target_id = uuid.uuid4().hex[:16]
    backend_cls = choose_backend(config, model, device, batch_invariant)
    if device.type == "cuda" and config.drafter:
        check_ipc_allocator()  # fail at start, not at the first handshake
    planner = PoolPlanner(config, model, backend_cls, device, _max_model_len(config, hf_config))
    layout = planner.plan(None, target_id, 0)
    if layout.num_pages * layout.page_size < planner.max_model_len:
        log.warning("KV pool holds %d tokens; capping max_model_len from %d", layout.num_pages * layout.page_size,
                    planner.max_model_len)
        planner = PoolPlanner(config, model, backend_cls, device, layout.num_pages * layout.page_size)
    if device.type == "cpu":
        remove_stale_shm_files(config.cache.shm_dir)
    pool = PagePool.create(layout, device, config.cache.shm_dir)
    # compile_config is off already where the native forward runs: it needs a batch-invariant target
    runner = ModelRunner(model, backend_cls, pool, device, compile_config,
                         native_forward=_native_forward(config, model, layout, backend_cls))
    info = ModelInfo(
        model_id=config.model,
        architecture=(hf_config.architectures or ["unknown"])[0],
        vocab_size=model.vocab_size,
        max_model_len=planner.max_model_len,
        eos_token_ids=_eos_token_ids(model_path, tokenizer),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
    )
    link = None
    if config.drafter:
        link = DrafterLink(DrafterLinkConfig(config.drafter, config.internal_token or "",
                                             propose_timeout_s=config.drafter_timeout_s), _stub=drafter_stub)
    shared = SharedPool(pool, planner, negotiate_request(config, model, backend_cls, device, info, layout), link)
    core = EngineCore(config, model, tokenizer, runner, shared, info)
    if link is not None:
        _first_handshake(core, config.drafter_startup_wait_s)
        link.start_serving()
    log.info("target ready: %s, %s KV, %s pages of %d tokens, order %s, drafter %s", info.architecture,
             core.layout.kv_dtype, core.layout.num_pages, core.layout.page_size, core.layout.order,
             shared.describe_drafter() if link else "none")
    return core


def _native_forward(config: EngineConfig, model, layout, backend_cls: type) -> bool:
    """Whether every step runs `common.native_forward.NativeForward`: asked for, and possible."""
    if not config.native_forward or model.model.embed_tokens.weight.dtype != torch.bfloat16:
        return False
    from common.compiled_forward import decoder_stack
    from common.native_forward import native_forward_problem

    problem = native_forward_problem(decoder_stack(model), layout.torch_dtype, backend_cls)
    if problem is not None:
        log.info("native forward off: %s", problem)
        return False
    log.info("native forward on: each step is one call (products on %s, attention, norms, RoPE in C)",
             tile_kernel_name())
    return True


def _batch_invariant(config: EngineConfig, model, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this target runs the batch-invariant attention: in a reduced precision on a CPU,
    where its rows would otherwise round differently in a verify than in a decode
    (docs/design.md#lossless-in-bfloat16), if the probe finds its products (and, where it
    attends through torch, torch's attention) invariant here."""
    if device.type != "cpu" or dtype == torch.float32:
        return False
    native_attention = issubclass(choose_backend(config, model, device, True), NativeCpuAttentionBackend)
    problem = make_batch_invariant(model, torch_attention=not native_attention)
    if problem is not None:
        log.warning("batch-invariant attention off: %s on this CPU; speculative output equals target-only "
                    "up to %s rounding, not bit for bit", problem, dtype)
        return False
    log.info("batch-invariant attention on: each row of a %s verify or batch computes what its decode would", dtype)
    return True


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
