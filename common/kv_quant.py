"""Page values and compute values: what an fp8 KV page stores and how it is read back.

fp8 pages hold `value / scale`, clamped to the finite fp8 range; reads return
`page * scale`. bf16/fp16/fp32 pages hold the value cast to the page dtype. Both
attention backends, the drafter and the tests use these, so the rule lives once.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values → page dtype: fp8 stores clamp(x / scale); other dtypes store x cast."""
    if not is_fp8_dtype(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    scaled = x.float() / scale if scale != 1.0 else x.float()
    return scaled.clamp(-limit, limit).to(cache_dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Page values → compute dtype: fp8 reads page * scale; other dtypes are cast."""
    out = x.to(dtype)
    if is_fp8_dtype(x.dtype) and scale != 1.0:
        out = out * scale
    return out
