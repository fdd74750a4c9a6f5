"""bfloat16 linear layers on AMX tiles through one native call (`common/native/amx_linear.c`).

oneDNN's packed bfloat16 product costs ~22 µs a call at the demo's sizes whatever the row
count (measured on an Intel Xeon with AMX, 2 threads: 384→384 at 1 row 21.5 µs, at 16 rows
21.2), most of it outside the arithmetic; the C kernel runs the same shapes in 4-8 µs and
the 384→4096 head in 20 µs (oneDNN 55.5). Its weight is packed once into the tile layout,
and every output element is one chain of tile products over the inputs in a fixed order, so
a row's bits do not depend on how many rows share the call: the layer is batch-invariant by
construction, which the lossless bfloat16 mode needs, at no cost to a decode.

Used where the CPU has AMX-BF16 (Linux grants the tile state on request), the kernel builds,
the shape fits whole tiles (inputs a multiple of 32, outputs of 16) and a probe agrees with
`F.linear`; `common/cpu_linear.py` times it against oneDNN's packed product per shape at load
and keeps the faster.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import nn

from common.native_build import NativeKernelUnavailable, load_library

TILE_K, TILE_N = 32, 16  # inputs per tile row pair block, outputs per tile
STATUS = {1: "this CPU or kernel has no AMX-BF16 tiles", 2: "a shape that does not fit whole tiles"}

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LINEAR_ARGS = [_P, _I64, _I64, _P, _I64, _P, _INT, _INT]


@dataclass(frozen=True)
class AmxKernels:
    linear: ctypes._CFuncPtr

    @classmethod
    def load(cls) -> AmxKernels:
        """Build and load the library and request the tile state; NativeKernelUnavailable if any fails."""
        return _load_amx()


@functools.cache
def _load_amx() -> AmxKernels:
    if not _cpu_has_amx_bf16():
        raise NativeKernelUnavailable("this CPU has no AMX-BF16 tiles")
    lib = load_library("amx_linear")
    lib.splitspec_amx_init.argtypes, lib.splitspec_amx_init.restype = [], _INT
    lib.splitspec_amx_linear.argtypes, lib.splitspec_amx_linear.restype = _LINEAR_ARGS, _INT
    status = lib.splitspec_amx_init()
    if status != 0:
        raise NativeKernelUnavailable(f"AMX tiles: {STATUS.get(status, f'status {status}')} "
                                      "(the kernel refused the tile state, or the compiler lacks -mamx-bf16)")
    return AmxKernels(lib.splitspec_amx_linear)


def _cpu_has_amx_bf16() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check is not None and check() and bf16 is not None and bf16())


def amx_unavailable_reason() -> str | None:
    """Why the AMX products cannot run here, or None."""
    try:
        AmxKernels.load()
    except NativeKernelUnavailable as exc:
        return str(exc)
    return None


def shape_fits_tiles(in_features: int, out_features: int) -> bool:
    return in_features % TILE_K == 0 and out_features % TILE_N == 0


def fits_tiles(linear: nn.Linear) -> bool:
    return linear.weight.dtype == torch.bfloat16 and shape_fits_tiles(linear.in_features, linear.out_features)


def pack_for_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 → [out/16, in/32, 16, 16, 2]: for each block of 16 outputs, its tiles of
    32 inputs with each pair of inputs side by side per output (the order TDPBF16PS reads)."""
    out_features, in_features = weight.shape
    blocks = weight.detach().reshape(out_features // TILE_N, TILE_N, in_features // TILE_K, TILE_K // 2, 2)
    return blocks.permute(0, 2, 3, 1, 4).contiguous()


class AmxLinear(nn.Module):
    """`nn.Linear` in bfloat16 through the AMX kernel. The weight (and bias) stay the layer's own
    parameters (tied weights stay tied, the state dict is unchanged); the tile-packed copy is not
    part of it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not fits_tiles(linear):
            raise ValueError(f"AMX linear needs a bfloat16 weight of a multiple of {TILE_K} inputs and {TILE_N} "
                             f"outputs, got {linear.in_features}->{linear.out_features} {linear.weight.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._linear = AmxKernels.load().linear
        self._packed = pack_for_tiles(linear.weight)
        self._packed_address = self._packed.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        # Kept lean: at the demo's sizes the kernel takes 4-8 µs, and every op here adds ~1.
        if x.shape[-1] != self.in_features:
            raise ValueError(f"linear: input of {x.shape[-1]} features for a {self.in_features}->{self.out_features} "
                             "layer")
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.to(torch.bfloat16).contiguous()
        out = x.new_empty(x.shape[:-1] + (self.out_features,))  # [..., out]
        status = self._linear(x.data_ptr(), x.numel() // self.in_features, self.in_features, self._packed_address,
                              self.out_features, out.data_ptr(), 0, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"AMX linear: {STATUS.get(status, f'status {status}')}")
        if self.bias is not None:
            out += self.bias
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

