"""A model's compute dtype: the names an operator may type, and the one rule for `auto`.

Both services load models (the target, a draft LM, DFlash and the target heads it borrows),
so both read `--dtype` the same way: an explicit name wins; `auto` is the checkpoint's own
dtype off a CPU (when it is one of these, else float32) and `cpu_dtype` on a CPU.

The target's `cpu_dtype` is float32. `--dtype bfloat16` is lossless too where the CPU's
kernels allow a batch-invariant forward (docs/design.md#lossless-in-bfloat16, checked at
load), but on the demo target with 2 threads its decode step is slower than float32's (the
invariant attention costs more ops, and a 1-row packed bfloat16 product costs more than
MKL's float32 one at these sizes), while its verify is cheaper: `bench/target_dtype.py`
measures both. Drafters take bfloat16 there (`draft_service/drafters/cpu_drafter_dtype`):
their drafts only propose. Off a CPU `auto` follows the checkpoint (bfloat16 for most), as
vLLM does; a reduced-precision verify there is lossless up to rounding, not bit for bit.
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
