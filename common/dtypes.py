"""A model's compute dtype: the names an operator may type, and the one rule for `auto`.

Both services load models (the target, a draft LM, DFlash and the target heads it borrows),
so both read `--dtype` the same way: an explicit name wins; `auto` is the checkpoint's own
dtype off a CPU (when it is one of these, else float32) and `cpu_dtype` on a CPU.

The target's `cpu_dtype` is float32 even where the CPU multiplies bfloat16 natively and a
bfloat16 target decodes 1.7× faster (the demo target on this project's VM): in bfloat16 a
token's logits depend on how many rows the forward that computed them had, so greedy
output one request at a time, in a batch, and through a verify of K+1 rows differs (2 and
1 of 16 held-out prompts within 128 tokens; none in float32; `bench/target_dtype.py`).
Speculative decoding is lossless only as far as a verify computes what decodes would, and
the tests hold it token for token. Drafters take bfloat16 there
(`draft_service/drafters/cpu_drafter_dtype`): their drafts only propose. Off a CPU `auto`
follows the checkpoint (bfloat16 for most), as vLLM does, and the same caveat applies: a
reduced-precision verify is lossless up to rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *MODEL_DTYPES)


def check_dtype_name(name: str) -> None:
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be auto or one of {', '.join(MODEL_DTYPES)}, got {name!r}")


def resolve_model_dtype(name: str, device: torch.device, checkpoint_dtype: Callable[[], torch.dtype | None],
                        cpu_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The compute dtype for `--dtype name` on `device`; `checkpoint_dtype` is only asked off a CPU."""
    if name != "auto":
        return MODEL_DTYPES[name]
    if device.type == "cpu":
        return cpu_dtype
    dtype = checkpoint_dtype()
    return dtype if dtype in MODEL_DTYPES.values() else torch.float32


def config_dtype(hf_config) -> torch.dtype | None:
    """The dtype a transformers config declares (`dtype`, or the older `torch_dtype`)."""
    return getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
