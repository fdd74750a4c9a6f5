"""A model's compute dtype: the names an operator may type, and the one rule for `auto`.

Both services load models (the target, a draft LM, DFlash and the target heads it borrows),
so both read `--dtype` the same way: an explicit name wins; `auto` is float32 on a CPU
(reduced-precision matmuls are slow or missing on most), except for DFlash on a CPU
with native bfloat16 dot products (see `draft_service/drafters/__init__.py`), else the
checkpoint's own dtype when it is one of these, else float32.
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
