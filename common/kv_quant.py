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
    if x.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        return _e4m3_to_float32(x, scale).to(dtype)
    out = x.to(dtype)
    if is_fp8_dtype(x.dtype) and scale != 1.0:
        out = out * scale
    return out


# A float16 holding the e4m3 bits s eeee mmm at bits 15 and 13..7 reads 2^-8 times the
# e4m3 value, subnormals included (both formats' subnormals sit under their smallest
# exponent, and the exponent biases differ by 8). Sign-extending the byte to int16 and
# shifting by 7 puts the sign at bit 15 (and at bit 14, which the mask clears).
_E4M3_TO_F16_FACTOR = 256.0
_E4M3_IN_F16_MASK = -16512  # 0xBF80 as int16: bit 15 and bits 13..7


def _e4m3_to_float32(x: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's own fp8 e4m3 → float32 conversion, bit for bit for every finite code, without
    its per-element scalar loop on a CPU: five times faster through float16's vectorised one
    (a 224-token K plane of the demo drafter: 79 → 16 µs), which decode, verify and the
    drafter run for every layer's keys and values each step. The two NaN codes read as ±480
    (past e4m3's largest finite 448, so still unmistakable); pages hold them only when the
    model itself produced a NaN key or value, and restoring them costs twice the conversion."""
    half = (x.view(torch.int8).to(torch.int16) << 7) & _E4M3_IN_F16_MASK
    return half.view(torch.float16).to(torch.float32).mul_(_E4M3_TO_F16_FACTOR * scale)
