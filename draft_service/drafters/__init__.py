"""The drafters: DFlash (block diffusion), a small draft LM, and n-gram prompt lookup.

`DrafterConfig` is what the command line asks for; `load_drafter` builds it (models
load here, so call it off the event loop).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from common.kv_layout import CACHE_DTYPE_CHOICES, CacheConfig
from draft_service.drafters.base import (
    KINDS,
    DraftSequence,
    Drafter,
    IncompatibleTargetError,
    TargetInfo,
    Update,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_NUM_SPECULATIVE_TOKENS = 8

__all__ = [
    "KINDS", "DTYPES", "DraftSequence", "Drafter", "DrafterConfig", "IncompatibleTargetError", "TargetInfo", "Update",
    "load_drafter", "resolve_kind",
]


@dataclass(frozen=True)
class DrafterConfig:
    kind: str = "auto"  # auto | dflash | draft_model | ngram
    model: str | None = None
    target_model: str | None = None
    num_speculative_tokens: int | None = None  # None: 8, or block_size - 1 for DFlash
    device: str = "cpu"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    ngram_min: int = 1
    ngram_max: int = 4
    attention_backend: str = "auto"  # auto | torch | flashinfer
    shm_dir: str = "/dev/shm"  # the only folder a CPU pool file is mapped from (the target's --shm-dir)

    def __post_init__(self) -> None:
        if self.kind not in ("auto", *KINDS):
            raise ValueError(f"kind must be auto or one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind in ("dflash", "draft_model") and not self.model:
            raise ValueError(f"--model is required for kind {self.kind}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in CACHE_DTYPE_CHOICES:
            choices = ", ".join(CACHE_DTYPE_CHOICES)
            raise ValueError(f"kv cache dtype must be one of {choices}, got {self.kv_cache_dtype!r}")
        if not self.shm_dir:
            raise ValueError("shm_dir must name a folder")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes need 1 <= min <= max, got min {self.ngram_min}, max {self.ngram_max}")


def resolve_kind(kind: str, model: str | None) -> str:
    """`auto`: ngram without a model, else from the checkpoint's config.json architectures."""
    if kind != "auto":
        return kind
    if not model:
        return "ngram"
    from common.weights import resolve_model_path

    config_file = resolve_model_path(model) / "config.json"
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    if "DFlashDraftModel" in architectures:
        return "dflash"
    if any(name.endswith("ForCausalLM") for name in architectures):
        return "draft_model"
    raise ValueError(f"cannot tell the drafter kind of {model} from its architectures {architectures}; pass --kind")


def _model_dtype(config: DrafterConfig, path: str) -> torch.dtype:
    """--dtype, or auto: float32 on a CPU, the checkpoint's dtype on a GPU."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if torch.device(config.device).type == "cpu":
        return torch.float32
    from common.weights import load_config

    hf_config = load_config(path)
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return dtype if dtype in DTYPES.values() else torch.float32


def load_drafter(config: DrafterConfig) -> Drafter:
    kind = resolve_kind(config.kind, config.model)
    cache = CacheConfig(cache_dtype=config.kv_cache_dtype, shm_dir=config.shm_dir)
    k = config.num_speculative_tokens
    if kind == "ngram":
        from draft_service.drafters.ngram import NgramDrafter

        return NgramDrafter(cache, k or DEFAULT_NUM_SPECULATIVE_TOKENS, config.ngram_min, config.ngram_max)
    dtype = _model_dtype(config, config.model)
    if kind == "draft_model":
        from draft_service.drafters.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter.load(config.model, cache, dtype, config.device,
                                         k or DEFAULT_NUM_SPECULATIVE_TOKENS)
        return _with_backend(drafter, config, dtype)
    if not config.target_model:
        raise ValueError("the DFlash drafter needs --target-model (it borrows the target's embedding and lm_head)")
    from draft_service.drafters.dflash import DFlashDrafter

    drafter = DFlashDrafter.load(config.model, config.target_model, cache, dtype, config.device, None)
    limit = drafter.num_speculative_tokens  # block_size - 1
    if k is not None and k > limit:
        log.warning("--num-speculative-tokens %d exceeds DFlash block_size - 1; using %d", k, limit)
    drafter.num_speculative_tokens = min(k or limit, limit)
    return _with_backend(drafter, config, dtype)


def _with_backend(drafter, config: DrafterConfig, dtype: torch.dtype):
    drafter.attention_backend, drafter.model_dtype = config.attention_backend, dtype
    drafter.backend_class()  # fail at start, naming what to change, when the backend cannot serve
    return drafter
