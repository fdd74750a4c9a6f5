"""The drafters: DFlash (block diffusion), EAGLE-3 heads, a small draft LM, and n-gram prompt lookup.

`DrafterConfig` is what the command line asks for; `load_drafter` builds it (models
load here, so call it off the event loop).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from common.attention_backends import check_backend_name
from common.compiled_forward import CompileConfig
from common.dtypes import check_dtype_name, config_dtype, resolve_model_dtype
from common.kv_layout import CacheConfig, check_cache_dtype
from draft_service.drafters.base import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    KINDS,
    Drafter,
    DraftSequence,
    IncompatibleTargetError,
    TargetInfo,
    Update,
    check_num_speculative_tokens,
)
from splitspec.cli_args import DEFAULT_SHM_DIR

__all__ = [
    "KINDS", "DraftSequence", "Drafter", "DrafterConfig", "IncompatibleTargetError", "TargetInfo", "Update",
    "load_drafter", "resolve_kind",
]


@dataclass(frozen=True)
class DrafterConfig:
    kind: str = "auto"  # auto | dflash | eagle3 | draft_model | ngram
    model: str | None = None
    target_model: str | None = None
    num_speculative_tokens: int | None = None  # None: 8, or block_size - 1 for DFlash
    device: str = "cpu"
    dtype: str = "auto"  # common.dtypes: auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"
    ngram_min: int = 1
    ngram_max: int = 4
    attention_backend: str = "auto"  # common.attention_backends.BACKEND_CHOICES
    shm_dir: str = DEFAULT_SHM_DIR  # the only folder a CPU pool file is mapped from (the target's --shm-dir)
    compile: bool = False  # the model drafter's steps through common/compiled_forward.py

    def __post_init__(self) -> None:
        if self.kind not in ("auto", *KINDS):
            raise ValueError(f"kind must be auto or one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind in ("dflash", "eagle3", "draft_model") and not self.model:
            raise ValueError(f"--model is required for kind {self.kind}")
        if self.num_speculative_tokens is not None:
            check_num_speculative_tokens(self.num_speculative_tokens)
        check_dtype_name(self.dtype)
        check_cache_dtype(self.kv_cache_dtype)
        if not self.shm_dir:
            raise ValueError("shm_dir must name a folder")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes need 1 <= min <= max, got min {self.ngram_min}, max {self.ngram_max}")
        check_backend_name(self.attention_backend)


def resolve_kind(kind: str, model: str | None) -> str:
    """`auto`: ngram without a model, else from the checkpoint's config.json (its architectures,
    or speculators' `speculators_model_type`)."""
    if kind != "auto":
        return kind
    if not model:
        return "ngram"
    from common.weights import resolve_model_path
    from draft_service.eagle3_model import eagle3_layout

    raw = json.loads((resolve_model_path(model) / "config.json").read_text())
    architectures = raw.get("architectures") or []
    if "DFlashDraftModel" in architectures:
        return "dflash"
    if eagle3_layout(raw) is not None:
        return "eagle3"
    if any(name.endswith("ForCausalLM") for name in architectures):
        return "draft_model"
    raise ValueError(f"cannot tell the drafter kind of {model} from its architectures {architectures}; pass --kind")


def cpu_drafter_dtype() -> torch.dtype:
    """`--dtype auto` for a drafter on a CPU: bfloat16 where its products run tile-packed (AMX,
    AVX512-BF16, or AVX2 through the FMA kernel) or oneDNN multiplies it natively, else float32.
    The drafts only propose: the target's verify decides every token, so the output is the same
    either way, and bfloat16 is the cheaper (figures: docs/performance.md#the-adaptive-policys-rules;
    on an AMD EPYC with AVX2 alone, docs/performance.md#bfloat16-on-a-cpu-with-avx2-alone)."""
    from common.cpu_linear import native_cpu_bf16
    from common.native_linear import tile_kernels_unavailable_reason

    return torch.bfloat16 if native_cpu_bf16() or tile_kernels_unavailable_reason() is None else torch.float32


def _model_config(kind: str, model: str):
    """The transformers config of the drafter's layers (an EAGLE-3 head keeps it inside its own)."""
    from common.weights import load_config, resolve_model_path

    if kind == "eagle3":
        from draft_service.eagle3_model import read_eagle3_config

        return read_eagle3_config(resolve_model_path(model)).layer_config
    return load_config(model)


def load_drafter(config: DrafterConfig) -> Drafter:
    kind = resolve_kind(config.kind, config.model)
    cache = CacheConfig(cache_dtype=config.kv_cache_dtype, shm_dir=config.shm_dir)
    k = config.num_speculative_tokens
    if kind == "ngram":
        from draft_service.drafters.ngram import NgramDrafter

        return NgramDrafter(cache, k or DEFAULT_NUM_SPECULATIVE_TOKENS, config.ngram_min, config.ngram_max)
    dtype = resolve_model_dtype(config.dtype, torch.device(config.device),
                                lambda: config_dtype(_model_config(kind, config.model)), cpu_drafter_dtype)
    if kind == "eagle3":
        from draft_service.drafters.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter.load(config.model, config.target_model, cache, dtype, config.device,
                                     k or DEFAULT_NUM_SPECULATIVE_TOKENS, config.attention_backend)
    elif kind == "draft_model":
        from draft_service.drafters.draft_model import DraftModelDrafter

        k = k or DEFAULT_NUM_SPECULATIVE_TOKENS
        drafter = DraftModelDrafter.load(config.model, cache, dtype, config.device, k, config.attention_backend,
                                         CompileConfig(enabled=config.compile))
    elif not config.target_model:
        raise ValueError("the DFlash drafter needs --target-model (it borrows the target's embedding and lm_head)")
    else:
        from draft_service.drafters.dflash import DFlashDrafter

        drafter = DFlashDrafter.load(config.model, config.target_model, cache, dtype, config.device, k,
                                     config.attention_backend, config.compile)
    drafter.backend_class()  # fail at start, naming what to change, when the backend cannot serve
    drafter.compile_ahead()
    return drafter
