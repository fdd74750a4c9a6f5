"""Linear layers on a CPU with oneDNN's prepacked float32 weights.

A verify forward multiplies K+1 rows per sequence by every weight matrix. With torch's
default CPU path (MKL sgemm on the weight as stored) a 9-row product costs five times a
1-row one on the demo target (57 against 11 µs for 256→768 on one core); with the weight
reordered once into oneDNN's blocked layout it costs 2-2.5 times less from 4 rows up
(prefills and batched decodes gain the same), and about the same below. So each linear
keeps its weight and a packed copy, and takes the packed path from `MIN_PACKED_ROWS`
rows on. This is what torch's own inductor does when it freezes a CPU model
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`).

oneDNN JIT-compiles (and caches) one primitive per input shape, about 0.5 MB each:
prompts of every length would keep adding them, and memory (+40 MB over a flood of mixed
requests). So row counts past `EXACT_ROWS` are padded up to one of a few sizes (×1.5 or
×4/3 apart: 24, 32, 48, ..., 512), at most a third more work on a prefill; past
`MAX_PACKED_ROWS` the plain product runs; and every shape that can occur is built once,
when the model is packed (~0.1 s, and on the demo target ~75 MB up front instead of a
slow climb).

Float32 on a CPU only; anywhere else, or where this torch build lacks the ops or its
result disagrees with `F.linear` on a probe, models keep their `nn.Linear` layers.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

MIN_PACKED_ROWS = 4  # below this, the plain sgemm is as fast or faster (measured on the demo shapes)
PACKING_BATCH_HINT = 16  # the row count oneDNN tunes the packed layout for
EXACT_ROWS = 16  # up to here (decodes and verifies of small batches) every row count runs as it is
MAX_PACKED_ROWS = 512  # past this, F.linear: a chunk that large is compute-bound either way


def padded_rows(rows: int) -> int:
    """The row count a product of `rows` rows runs at: itself up to EXACT_ROWS, else the next of
    EXACT_ROWS × 1.5, × 2, × 3, × 4, × 6, ... (each step ×1.5 from a power of two, ×4/3 to one)."""
    if rows <= EXACT_ROWS:
        return rows
    size = EXACT_ROWS
    while size < rows:
        size = size + size // 2 if size & (size - 1) == 0 else size // 3 * 4
    return size


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`nn.Linear` with a oneDNN-packed copy of its weight for products of many rows.

    The weight (and bias) stay the same parameters as the layer's, so tied weights stay
    tied and the state dict is unchanged; the packed copy is not part of it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        rows = x.numel() // self.in_features
        if not MIN_PACKED_ROWS <= rows <= MAX_PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        padded = padded_rows(rows)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])  # [padded, in]
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")  # [padded, out]
        return out[:rows].view(*x.shape[:-1], self.out_features)


def _agrees_with_f_linear(linear: nn.Linear) -> bool:
    """The packed path computes what `F.linear` does (up to float32 rounding) on random rows."""
    packed = PackedLinear(linear)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * PACKING_BATCH_HINT, linear.in_features, generator=generator)  # [rows, in]
    with torch.inference_mode():
        expected, got = F.linear(x, linear.weight, linear.bias), packed(x)
    scale = expected.abs().max().item() or 1.0
    return bool(((got - expected).abs().max() / scale) < 1e-4)


def pack_cpu_linears(model: nn.Module, log: logging.Logger) -> int:
    """Swap every float32 CPU `nn.Linear` of a model for a `PackedLinear`; how many were.
    (Layers elsewhere, on "meta" for instance, are left as they are.)"""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype == torch.float32]
    if not linears:
        return 0
    if not _ops_available():
        log.info("CPU linears: this torch build has no oneDNN linear ops; using torch's default")
        return 0
    if not _agrees_with_f_linear(linears[0][2]):
        log.warning("CPU linears: oneDNN's packed product disagreed with F.linear on a probe; using torch's default")
        return 0
    packed = []
    for parent, name, child in linears:
        packed.append(PackedLinear(child))
        setattr(parent, name, packed[-1])
    _build_every_shape(packed)
    log.info("CPU linears: %d packed for oneDNN (products of %d to %d rows)", len(linears), MIN_PACKED_ROWS,
             MAX_PACKED_ROWS)
    return len(linears)


def packed_row_counts() -> list[int]:
    """Every row count a packed product runs at."""
    return sorted({padded_rows(rows) for rows in range(MIN_PACKED_ROWS, MAX_PACKED_ROWS + 1)})


def _build_every_shape(packed: list[PackedLinear]) -> None:
    """Run each distinct layer shape once at every row count, so that oneDNN builds all its
    primitives now: memory is spent at load, not a little more with each new prompt length."""
    shapes = {(layer.in_features, layer.out_features, layer.bias is not None): layer for layer in packed}
    with torch.inference_mode():
        for layer in shapes.values():
            for rows in packed_row_counts():
                layer(torch.zeros(rows, layer.in_features))
