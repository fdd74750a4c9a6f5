"""A model's compute dtype: the names an operator may type, and the one rule for `auto`.

Both services load models (the target, a draft LM, DFlash and the target heads it borrows),
so both read `--dtype` the same way: an explicit name wins; `auto` is the checkpoint's own
dtype off a CPU (when it is one of these, else float32), and on a CPU what the caller
measures or rules there.

The target's CPU rule (`common.cpu_linear.cpu_target_dtype`): bfloat16 where every product
runs tile-packed (AMX tiles, else AVX512-BF16's VDPBF16PS, else AVX2's FMAs), float32 elsewhere.
Tile-packed, each row's bits are independent of the row count, and with the native attention
(invariant by construction) speculative output stays token-identical to bfloat16 target-only
(docs/design.md#lossless-in-bfloat16); against a float32 forward it is the same up to
rounding, as vLLM's CPU backend, which also computes in bfloat16, states it. Drafters take
bfloat16 wherever the CPU multiplies it natively (`draft_service/drafters/cpu_drafter_dtype`):
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
                        cpu_dtype: Callable[[], torch.dtype]) -> torch.dtype:
    """The compute dtype for `--dtype name` on `device`; `checkpoint_dtype` is only asked off a
    CPU, `cpu_dtype` only on one."""
    if name != "auto":
        return MODEL_DTYPES[name]
    if device.type == "cpu":
        return cpu_dtype()
    dtype = checkpoint_dtype()
    return dtype if dtype in MODEL_DTYPES.values() else torch.float32


def config_dtype(hf_config) -> torch.dtype | None:
    """The dtype a transformers config declares (`dtype`, or the older `torch_dtype`)."""
    return getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
