"""bfloat16 linear layers through one native call (`common/native/amx_linear.c`): on AMX tiles
where the CPU has them, else with AVX512-BF16's VDPBF16PS on the same packed weight, else with
AVX2's float32 FMAs on it (each bfloat16 widened as read).

oneDNN's packed bfloat16 product costs ~22 µs a call at the demo's sizes whatever the row
count (measured on an Intel Xeon with AMX, 2 threads: 384→384 at 1 row 21.5 µs, at 16 rows
21.2), most of it outside the arithmetic; the C kernel runs the same shapes in 4-8 µs and
the 384→4096 head in 20 µs (oneDNN 55.5). On an AMD EPYC with AVX512-BF16 and no AMX (2
threads) the VDPBF16PS kernel runs 384→384 in 5.5 µs at 1 row and 10.1 at 9, against 12.0 and
43.8 for float32 `F.linear` and 26.5 and 30.8 for bfloat16 `F.linear` (docs/performance.md).
Its weight is packed once into the tile layout, and every output element is one chain of
products over the inputs in a fixed order, so a row's bits do not depend on how many rows
share the call: the layer is batch-invariant by construction, which the lossless bfloat16
mode needs, at no cost to a decode.

Used where one of the kernels runs (AMX-BF16, whose tile state Linux grants on request;
AVX512-BF16; AVX2 with FMA), the shape fits whole tiles (inputs a multiple of 32, outputs of 16)
and a probe agrees with `F.linear`; `common/cpu_linear.py` times it against oneDNN's packed
product per shape at load and keeps the faster. Which native kernel runs is the CPU's (the first
of AMX, AVX512-BF16, AVX2-FMA that runs), or `$SPLITSPEC_CPU_KERNEL`'s: they round differently,
and outputs must not change from one start to the next with a noisy timing.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from common.native_build import NativeKernelUnavailable, load_library

TILE_K, TILE_N = 32, 16  # inputs per tile row pair block, outputs per tile
STATUS = {1: "this CPU runs none of the kernels (AMX-BF16 tiles granted by the kernel, AVX512-BF16, AVX2 "
              "with FMA)",
          2: "a shape that does not fit whole tiles",
          3: "out of memory for the product's widened inputs"}
KERNEL_AMX, KERNEL_DPBF16, KERNEL_FMA256 = 1, 2, 4  # amx_linear.c: splitspec_bf16_kernels' bits, a call's `kernel`
KERNEL_NAMES = {KERNEL_AMX: "AMX", KERNEL_DPBF16: "AVX512-BF16", KERNEL_FMA256: "AVX2-FMA"}
PREFERENCE = (KERNEL_AMX, KERNEL_DPBF16, KERNEL_FMA256)  # the default: the first that runs here
KERNEL_ENV = "SPLITSPEC_CPU_KERNEL"  # auto, or one of KERNEL_NAMES' names (case-insensitive)

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LINEAR_ARGS = [_P, _I64, _I64, _P, _I64, _P, _INT, _INT, _INT]


@dataclass(frozen=True)
class TileKernels:
    linear: ctypes._CFuncPtr
    available: frozenset[int]  # KERNEL_AMX and/or KERNEL_DPBF16

    @classmethod
    def load(cls) -> TileKernels:
        """Build and load the library (requesting the AMX tile state where the CPU has tiles);
        NativeKernelUnavailable if it fails or no kernel runs here."""
        return _load_tile_kernels()

    @property
    def default(self) -> int:
        """`$SPLITSPEC_CPU_KERNEL` where set (and not auto), else AMX where it runs, else
        VDPBF16PS, else the AVX2 FMAs: the hardware's rule, not a timing (the kernels round
        differently, and outputs must not change from one start to the next)."""
        return chosen_kernel(os.environ.get(KERNEL_ENV, "auto"), self.available)


def chosen_kernel(name: str, available: frozenset[int]) -> int:
    """The kernel `name` asks for (auto: the first of PREFERENCE that runs here); a ValueError
    naming the problem for an unknown name or a kernel that does not run here."""
    if name.strip().lower() in ("", "auto"):
        return next(kernel for kernel in PREFERENCE if kernel in available)
    by_name = {label.lower(): kernel for kernel, label in KERNEL_NAMES.items()}
    kernel = by_name.get(name.strip().lower())
    runs_here = ", ".join(KERNEL_NAMES[k] for k in PREFERENCE if k in available)
    if kernel is None:
        raise ValueError(f"{KERNEL_ENV}={name!r}: not a product kernel (auto, {', '.join(KERNEL_NAMES.values())})")
    if kernel not in available:
        raise ValueError(f"{KERNEL_ENV}={name!r}: that kernel does not run on this CPU (here: {runs_here})")
    return kernel


@functools.cache
def _load_tile_kernels() -> TileKernels:
    lib = load_library("amx_linear")
    lib.splitspec_tiled_linear.argtypes, lib.splitspec_tiled_linear.restype = _LINEAR_ARGS, _INT
    lib.splitspec_bf16_kernels.argtypes, lib.splitspec_bf16_kernels.restype = [], _INT
    bits = lib.splitspec_bf16_kernels()
    available = frozenset(kernel for kernel in KERNEL_NAMES if bits & kernel)
    if not available:
        raise NativeKernelUnavailable(f"bfloat16 products: {STATUS[1]} (the compiler built none of the kernels "
                                      "for this CPU)")
    return TileKernels(lib.splitspec_tiled_linear, available)


def tile_kernel_name() -> str:
    """What the tile-packed products run on here by default; NativeKernelUnavailable where nothing does."""
    return KERNEL_NAMES[TileKernels.load().default]


def tile_kernels_unavailable_reason() -> str | None:
    """Why the tile-packed bfloat16 products cannot run here, or None."""
    try:
        TileKernels.load()
    except NativeKernelUnavailable as exc:
        return str(exc)
    return None


def shape_fits_tiles(in_features: int, out_features: int) -> bool:
    return in_features % TILE_K == 0 and out_features % TILE_N == 0


def fits_tiles(linear: nn.Linear) -> bool:
    return linear.weight.dtype == torch.bfloat16 and shape_fits_tiles(linear.in_features, linear.out_features)


def pack_for_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 → [out/16, in/32, 16, 16, 2]: for each block of 16 outputs, its tiles of
    32 inputs with each pair of inputs side by side per output (the order TDPBF16PS reads; VDPBF16PS
    and the FMA kernel read a tile row at a time)."""
    out_features, in_features = weight.shape
    blocks = weight.detach().reshape(out_features // TILE_N, TILE_N, in_features // TILE_K, TILE_K // 2, 2)
    return blocks.permute(0, 2, 3, 1, 4).contiguous()


class TiledLinear(nn.Module):
    """`nn.Linear` in bfloat16 through the tile-packed kernel (AMX, AVX512-BF16 or AVX2). The weight
    (and bias) stay the layer's own parameters (tied weights stay tied, the state dict is unchanged);
    the tile-packed copy is not part of it."""

    def __init__(self, linear: nn.Linear, kernel: int | None = None) -> None:
        super().__init__()
        kernels = TileKernels.load()
        if kernel is not None and kernel not in kernels.available:
            raise ValueError(f"the {KERNEL_NAMES.get(kernel, kernel)} product kernel does not run here")
        if not fits_tiles(linear):
            raise ValueError(f"a tiled linear needs a bfloat16 weight of a multiple of {TILE_K} inputs and {TILE_N} "
                             f"outputs, got {linear.in_features}->{linear.out_features} {linear.weight.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._linear = kernels.linear
        self.kernel = kernels.default if kernel is None else kernel
        self._packed = pack_for_tiles(linear.weight)
        self._packed_address = self._packed.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        # Kept lean: at the demo's sizes the kernel takes 4-15 µs, and every op here adds ~1.
        if x.shape[-1] != self.in_features:
            raise ValueError(f"linear: input of {x.shape[-1]} features for a {self.in_features}->{self.out_features} "
                             "layer")
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.to(torch.bfloat16).contiguous()
        out = x.new_empty(x.shape[:-1] + (self.out_features,))  # [..., out]
        status = self._linear(x.data_ptr(), x.numel() // self.in_features, self.in_features, self._packed_address,
                              self.out_features, out.data_ptr(), 0, torch.get_num_threads(), self.kernel)
        if status != 0:
            raise RuntimeError(f"tiled linear: {STATUS.get(status, f'status {status}')}")
        if self.bias is not None:
            out += self.bias
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={KERNEL_NAMES[self.kernel]}")

