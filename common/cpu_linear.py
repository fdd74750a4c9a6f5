"""Linear layers on a CPU with oneDNN's prepacked weights (float32, and bfloat16 where the CPU
has native bfloat16 dot products), and the kernel for each product chosen by measuring it.

A verify forward multiplies K+1 rows per sequence by every weight matrix. MKL's sgemm on
the weight as stored (`F.linear`) and oneDNN's product on a weight reordered once into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what
inductor does when it freezes a CPU model) win at different row counts, and where the
line falls depends on the CPU: on an AMD EPYC the packed product won from 2 rows, on an
Intel Xeon with AMX it lost at 2-4 rows for most demo shapes. So each linear keeps its
weight and a packed copy, and `select_kernels` times both at every row count a product
runs at when the model is loaded (within about a second, logged as one table per shape),
and each layer takes the faster one per count.

oneDNN JIT-compiles (and caches) one primitive per input shape, about 0.5 MB each:
prompts of every length would keep adding them, and memory (+40 MB over a flood of mixed
requests). So row counts past `EXACT_ROWS` are padded up to one of a few sizes (×1.5 or
×4/3 apart: 24, 32, 48, ..., 512), at most a third more work on a prefill; past
`MAX_PACKED_ROWS` the product runs in chunks; and every shape that can occur is built once,
when the model is packed.

Bfloat16 layers are packed only on a CPU with native bfloat16 dot products (AVX512-BF16 or
AMX; `native_cpu_bf16()`), and run packed at every row count: one kernel keeps each row's
bits independent of the row count, which lossless bfloat16 needs
(common/invariant_attention.py, which also sets how long a chunk may be). Anywhere else
(another dtype, another device), or where this torch build lacks the ops or its result
disagrees with `F.linear` on a probe, models keep their `nn.Linear` layers.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from common.native_linear import (
    TiledLinear,
    fits_tiles,
    shape_fits_tiles,
    tile_kernel_name,
    tile_kernels_unavailable_reason,
)

MIN_PACKED_ROWS = 2  # float32: a single row runs faster through the plain sgemm (measured on the demo shapes)
MIN_PACKED_ROWS_BF16 = 1  # bfloat16: the packed product is faster from one row (torch's own is slower than float32)
PACKING_BATCH_HINT = 16  # the row count oneDNN tunes the packed layout for
EXACT_ROWS = 16  # up to here (decodes and verifies of small batches) every row count runs as it is
MAX_PACKED_ROWS = 512  # longer products run in chunks of this many rows


def padded_rows(rows: int) -> int:
    """The row count a product of `rows` rows runs at: itself up to EXACT_ROWS, else the next of
    EXACT_ROWS × 1.5, × 2, × 3, × 4, × 6, ... (each step ×1.5 from a power of two, ×4/3 to one)."""
    if rows <= EXACT_ROWS:
        return rows
    size = EXACT_ROWS
    while size < rows:
        size = size + size // 2 if size & (size - 1) == 0 else size // 3 * 4
    return size


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), as torch reports it."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is not None and check() for check in checks)


def min_packed_rows(dtype: torch.dtype) -> int:
    return MIN_PACKED_ROWS_BF16 if dtype == torch.bfloat16 else MIN_PACKED_ROWS


def packable_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16) if native_cpu_bf16() else (torch.float32,)


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
        # Padded row counts that take F.linear instead (select_kernels measures them for float32;
        # bfloat16 stays packed at every count: one kernel keeps its rows batch-invariant).
        self.plain_rows: frozenset[int] = frozenset(range(1, min_packed_rows(linear.weight.dtype)))
        self.chunk_rows = MAX_PACKED_ROWS  # longer products run in chunks of this many rows (see invariant_chunk_rows)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        rows = x.numel() // self.in_features
        if padded_rows(min(rows, self.chunk_rows)) in self.plain_rows:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        if rows > self.chunk_rows:
            chunks = [self._packed_product(chunk) for chunk in flat.split(self.chunk_rows)]
            return torch.cat(chunks).view(*x.shape[:-1], self.out_features)
        return self._packed_product(flat).view(*x.shape[:-1], self.out_features)

    def _packed_product(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] → [rows, out]
        rows = flat.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])  # [padded, in]
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")  # [padded, out]
        return out[:rows]


# Largest relative difference from `F.linear` a probe accepts: rounding of a different
# summation order (bfloat16 keeps 8 significant bits; both sum in float32).
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _agrees_with_f_linear(packed: nn.Module) -> bool:
    """A packed layer computes what `F.linear` does with its weight (up to rounding) on random rows."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * PACKING_BATCH_HINT, packed.in_features, generator=generator)  # [rows, in]
    x = x.to(packed.weight.dtype)
    with torch.inference_mode():
        expected, got = F.linear(x, packed.weight, packed.bias).float(), packed(x).float()
    scale = expected.abs().max().item() or 1.0
    return bool(((got - expected).abs().max() / scale) < PROBE_TOLERANCE[packed.weight.dtype])


def pack_cpu_linears(model: nn.Module, log: logging.Logger, timer: Timer | None = None,
                     whole_forward_on_tiles: bool = False) -> int:
    """Swap every CPU `nn.Linear` (StackedLinear included) of a packable dtype for a `PackedLinear`,
    or for a `TiledLinear` where that measures faster (bfloat16 on a CPU with AMX, AVX512-BF16 or AVX2); how
    many were.
    (Layers elsewhere, on "meta" for instance, or of another dtype, are left as they are.)
    `timer` replaces the clock in the kernel choices (tests).

    `whole_forward_on_tiles`: the caller will run the model's forward in one native call, which
    needs every product on tiles (common/native_forward.py): then a shape that fits takes the tiled
    kernel without a product-by-product race, which times a call with the Python around it, not
    the forward's cost, and on a busy machine once handed a layer to oneDNN and with it the
    whole step back to torch (4x slower)."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
               and child.weight.dtype in (torch.float32, torch.bfloat16)]
    # bfloat16 reaches the tiled kernel on any CPU it runs on (AVX2 included), but oneDNN's packed
    # product only where the CPU multiplies bfloat16 natively
    packable = set(packable_dtypes()) if _ops_available() else set()
    if linears and not _ops_available():
        log.info("CPU linears: this torch build has no oneDNN linear ops; only tile-packed bfloat16 leaves torch's "
                 "default")
    probes = {child.weight.dtype: child for _, _, child in linears if child.weight.dtype in packable}
    refused = {dtype for dtype, child in probes.items() if not _agrees_with_f_linear(PackedLinear(child))}
    if refused:
        log.warning("CPU linears: oneDNN's packed product disagreed with F.linear on a probe (%s); "
                    "using torch's default", ", ".join(sorted(map(str, refused))))
        packable -= refused
    tile_choices = choose_tile_kernels([child for _, _, child in linears], log, timer, whole_forward_on_tiles)
    packed, tiled = [], 0
    for parent, name, child in linears:
        choice = tile_choices.get(shape_key(child))
        if choice is not None and choice.kernel == "tiles":
            setattr(parent, name, TiledLinear(child))
            tiled += 1
        elif child.weight.dtype in packable:
            packed.append(PackedLinear(child))
            setattr(parent, name, packed[-1])
    _build_every_shape(packed)
    if packed:
        log.info("CPU linears: %d packed for oneDNN (%s; products of up to %d rows)", len(packed),
                 ", ".join(sorted({str(layer.weight.dtype) for layer in packed})), MAX_PACKED_ROWS)
    if tiled:
        log.info("CPU linears: %d tile-packed (bfloat16, %s)", tiled, tile_kernel_name())
    choices = select_kernels(packed, timer)
    if choices:
        log.info("CPU linears, the faster kernel measured per float32 shape and row count (%d threads):\n  %s",
                 torch.get_num_threads(), "\n  ".join(choice.describe() for choice in choices))
    return len(packed) + tiled


def shape_key(layer: nn.Module) -> tuple[int, int, bool, torch.dtype]:
    return layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype


TILE_ROWS = (1, 9, 16)  # a decode, a K=8 verify, a full tile: what the bfloat16 choice is timed at


@dataclass
class TileChoice:
    """One bfloat16 shape's product timed through the tiled kernel (AMX, AVX512-BF16 or AVX2) and
    oneDNN's packed product, in µs
    by row count; the layer runs the one faster over those counts at every row count (one kernel
    for all keeps a row's bits independent of the row count)."""

    in_features: int
    out_features: int
    tiled_us: dict[int, float] = field(default_factory=dict)
    packed_us: dict[int, float] = field(default_factory=dict)  # the other kernel's (`other`)
    chosen: str | None = None  # set without timing (`choose_tile_kernels(untimed=True)`)
    other: str = "packed"  # what the tiles race: oneDNN's packed product, or F.linear where bf16 does not pack

    @property
    def kernel(self) -> str:
        if self.chosen is not None:
            return self.chosen
        return "tiles" if sum(self.tiled_us.values()) < sum(self.packed_us.values()) else self.other

    def describe(self) -> str:
        rows = "/".join(map(str, self.tiled_us))
        tiled = "/".join(f"{us:.1f}" for us in self.tiled_us.values())
        other = "/".join(f"{us:.1f}" for us in self.packed_us.values())
        label = "oneDNN packed" if self.other == "packed" else self.other
        return f"{self.in_features}->{self.out_features}: tiles {tiled} µs, {label} {other} µs at {rows} rows: {self.kernel}"


def choose_tile_kernels(linears: list[nn.Linear], log: logging.Logger, timer: Timer | None = None,
                        untimed: bool = False) -> dict[tuple, TileChoice]:
    """For each bfloat16 shape that fits whole tiles, where the tiled kernel runs here and agrees with
    `F.linear` on a probe: the tiled product timed against oneDNN's packed one (`TileChoice`), or,
    `untimed`, the tiled product."""
    shapes = {shape_key(layer): layer for layer in linears if fits_tiles(layer)}
    if not shapes:
        return {}
    reason = tile_kernels_unavailable_reason()
    if reason is not None:
        log.info("CPU linears: bfloat16 products stay with oneDNN: %s", reason)
        return {}
    choices = {}
    for key, layer in shapes.items():
        if not _agrees_with_f_linear(TiledLinear(layer)):
            log.warning("CPU linears: the tiled %d->%d product disagreed with F.linear on a probe; using oneDNN's",
                        layer.in_features, layer.out_features)
            continue
        if untimed:
            choices[key] = TileChoice(layer.in_features, layer.out_features, chosen="tiles")
            continue
        choices[key] = (_measured_tiles(*key, torch.get_num_threads()) if timer is None
                        else measure_tiles(layer, timer))
    if untimed and choices:
        log.info("CPU linears: every bfloat16 product that fits whole tiles (%d shapes, on %s): the forward runs in one "
                 "native call", len(choices), tile_kernel_name())
    elif choices:
        log.info("CPU linears, bfloat16 kernel measured per shape (%d threads):\n  %s", torch.get_num_threads(),
                 "\n  ".join(choice.describe() for choice in choices.values()))
    return choices


def measure_tiles(layer: nn.Linear, timer: Timer | None = None) -> TileChoice:
    """The tiled product timed against oneDNN's packed one, or against `F.linear` where this CPU
    does not multiply bfloat16 natively (oneDNN does not pack it there)."""
    packs = _ops_available() and layer.weight.dtype in packable_dtypes()
    tiled, other = TiledLinear(layer), (PackedLinear(layer) if packs else layer)
    choice = TileChoice(layer.in_features, layer.out_features, other="packed" if packs else "F.linear")
    x = torch.randn(max(TILE_ROWS), layer.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        for rows in TILE_ROWS:
            flat = x[:rows]
            calls = {"tiles": lambda: tiled(flat), choice.other: lambda: other(flat)}
            seconds = time_pair(calls) if timer is None else {name: timer(name, rows, call)
                                                               for name, call in calls.items()}
            choice.tiled_us[rows], choice.packed_us[rows] = 1e6 * seconds["tiles"], 1e6 * seconds[choice.other]
    return choice


@functools.cache
def _measured_tiles(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, threads: int) -> TileChoice:
    """One measurement per shape and thread count in a process (as `_measured`)."""
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return measure_tiles(linear)


CHUNK_CANDIDATES = (512, 256, 128, 64, 32, 16)


def invariant_chunk_rows(layer: PackedLinear) -> int | None:
    """The longest chunk (of CHUNK_CANDIDATES) within which every row of this layer's packed
    product gets the bits it gets alone, whatever the row count, or None if not even 16.

    oneDNN picks its kernel and blocking per shape: on the CPU this was written on, a bfloat16
    896→384 product rounded rows differently at 48-256 rows than alone, and agreed at 1-32 and
    at 384-512. Cut into chunks no longer than the answer, a prefill, a batch and a verify
    give each row what a decode of it would (common/invariant_attention.py)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(CHUNK_CANDIDATES[0], layer.in_features, generator=generator).to(layer.weight.dtype)  # [R, in]
    with torch.inference_mode():
        alone = torch.cat([layer._packed_product(x[r : r + 1]) for r in range(x.shape[0])])  # [R, out]
        for chunk in CHUNK_CANDIDATES:
            counts = sorted({padded_rows(rows) for rows in range(1, chunk + 1)})
            if all(torch.equal(layer._packed_product(x[:rows]), alone[:rows]) for rows in counts):
                return chunk
    return None


Timer = Callable[[str, int, Callable[[], object]], float]  # (kernel, rows, call) → seconds per call
SHAPE_BUDGET_S = 0.2  # timing one shape at every row count stops here (a model has 4-7 shapes)
KERNELS = ("F.linear", "packed")


def time_pair(calls: dict[str, Callable[[], object]], repeat: int = 5) -> dict[str, float]:
    """Seconds per call of each candidate: the least of `repeat` timed calls, taken in turns after a
    warm one. Another process's work only ever adds time, so the least is the closest to the
    kernel's own cost, and taking turns spreads a busy moment over both."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@dataclass
class KernelChoice:
    """What was measured for one float32 layer shape, in µs per product by row count, and the
    kernel each row count runs: the faster one where timed, the last timed count's choice past
    the budget (the default rule, F.linear for 1 row and packed from 2, if none was)."""

    in_features: int
    out_features: int
    plain_us: dict[int, float] = field(default_factory=dict)
    packed_us: dict[int, float] = field(default_factory=dict)

    @property
    def plain_rows(self) -> frozenset[int]:
        plain, previous = set(), None
        for rows in packed_row_counts():
            if rows in self.plain_us and rows in self.packed_us:
                previous = self.plain_us[rows] < self.packed_us[rows]
            if (rows < MIN_PACKED_ROWS) if previous is None else previous:
                plain.add(rows)
        return frozenset(plain)

    def describe(self) -> str:
        return describe_rows(self.in_features, self.out_features, self.plain_rows, packed_row_counts())


def describe_rows(in_features: int, out_features: int, plain_rows: frozenset[int], counts: tuple[int, ...]) -> str:
    """`384->768: F.linear at 1-3, 24; packed at 4-16, 32-512`"""
    ranges = {kind: _ranges([r for r in counts if (r in plain_rows) == (kind == "F.linear")]) for kind in KERNELS}
    return f"{in_features}->{out_features}: " + "; ".join(f"{kind} at {text}" for kind, text in ranges.items() if text)


def describe_kernels(model: nn.Module) -> list[str]:
    """The kernel each packed layer shape of `model` runs at each row count, one line per shape."""
    shapes = {(m.in_features, m.out_features, m.weight.dtype): m for m in model.modules()
              if isinstance(m, PackedLinear | TiledLinear)}
    return [f"{i}->{o}: tiles ({tile_kernel_name()}) at every row count ({str(dtype).removeprefix('torch.')})"
            if isinstance(layer, TiledLinear)
            else f"{describe_rows(i, o, layer.plain_rows, packed_row_counts())} ({str(dtype).removeprefix('torch.')})"
            for (i, o, dtype), layer in shapes.items()]


def _ranges(rows: list[int]) -> str:
    counts = packed_row_counts()
    parts: list[list[int]] = []
    for r in rows:
        if parts and counts.index(r) == counts.index(parts[-1][-1]) + 1:
            parts[-1].append(r)
        else:
            parts.append([r])
    return ", ".join(str(p[0]) if len(p) == 1 else f"{p[0]}-{p[-1]}" for p in parts)


def measure_shape(layer: PackedLinear, timer: Timer | None = None, budget_s: float = SHAPE_BUDGET_S) -> KernelChoice:
    """Time `F.linear` against the packed product for this layer's shape at every row count a
    product runs at, in order of use (1 row, the verify and batch sizes, then prefill chunks)
    until `budget_s` is spent."""
    choice = KernelChoice(layer.in_features, layer.out_features)
    x = torch.randn(MAX_PACKED_ROWS, layer.in_features, generator=torch.Generator().manual_seed(0))  # [R, in]
    deadline = time.perf_counter() + budget_s
    with torch.inference_mode():
        for rows in packed_row_counts():
            if time.perf_counter() > deadline:
                break
            flat = x[:rows]
            calls = {"F.linear": lambda: F.linear(flat, layer.weight, layer.bias),
                     "packed": lambda: layer._packed_product(flat)}
            if timer is None:
                seconds = time_pair(calls)
            else:
                seconds = {name: timer(name, rows, call) for name, call in calls.items()}
            choice.plain_us[rows], choice.packed_us[rows] = 1e6 * seconds["F.linear"], 1e6 * seconds["packed"]
    return choice


@functools.cache
def _measured(in_features: int, out_features: int, bias: bool, threads: int) -> KernelChoice:
    """One measurement per shape and thread count in a process, whatever loads it (the target, an
    in-process drafter, the engines of a benchmark): the same machine gives the same answer, and
    a model loaded beside a busy one is not misled by it."""
    return measure_shape(PackedLinear(nn.Linear(in_features, out_features, bias=bias)))


def select_kernels(layers: list[PackedLinear], timer: Timer | None = None,
                   budget_s: float = SHAPE_BUDGET_S) -> list[KernelChoice]:
    """For each float32 layer shape, the faster of `F.linear` and the packed product at every row
    count (`measure_shape`), given to each layer of that shape.

    Which wins depends on the CPU, not only the shape (on one Xeon the packed product lost at
    2-4 rows where on an EPYC it won from 2): so it is measured at load, once per shape in a
    process (an injected `timer` measures afresh, within `budget_s` per shape)."""
    shapes: dict[tuple, list[PackedLinear]] = {}
    for layer in layers:
        if layer.weight.dtype == torch.float32:
            shapes.setdefault((layer.in_features, layer.out_features, layer.bias is not None), []).append(layer)
    choices = []
    for (in_features, out_features, bias), same in shapes.items():
        if timer is None:
            choice = _measured(in_features, out_features, bias, torch.get_num_threads())
        else:
            choice = measure_shape(same[0], timer, budget_s)
        plain_rows = choice.plain_rows
        for layer in same:
            layer.plain_rows = plain_rows
        choices.append(choice)
    return choices


@functools.cache
def packed_row_counts() -> tuple[int, ...]:
    """Every row count a packed product runs at."""
    return tuple(sorted({padded_rows(rows) for rows in range(1, MAX_PACKED_ROWS + 1)}))


def _build_every_shape(packed: list[PackedLinear]) -> None:
    """Run each distinct layer shape once at every row count, so that oneDNN builds all its
    primitives now: memory is spent at load, not a little more with each new prompt length."""
    shapes = {(layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype): layer
              for layer in packed}
    with torch.inference_mode():
        for layer in shapes.values():
            for rows in packed_row_counts():
                layer._packed_product(torch.zeros(rows, layer.in_features, dtype=layer.weight.dtype))


def cpu_target_dtype(shapes: list[tuple[int, int, int, bool]], log: logging.Logger) -> torch.dtype:
    """`--dtype auto` for a target on a CPU: bfloat16 where every product of its forward
    (`shapes`: in, out, count per token, bias) runs tile-packed (AMX, AVX512-BF16 or AVX2), float32
    anywhere else.

    Tile-packed, a row's bits do not depend on the row count (`common/native_linear.py`), so
    speculative output stays bit for bit the bfloat16 target-only output: on an Intel Xeon with
    AMX the demo target, its step in one native call, decoded 3.9x faster than in float32
    (`bench/target_dtype.py`, docs/performance.md#the-targets-dtype-on-a-cpu), and on an AMD
    EPYC with AVX512-BF16 and no AMX the same call decodes ~5x faster than float32 eager. A rule, not
    a timing at each start: the native multiply's advantage is the hardware's, and a dtype that
    flipped with a noisy measurement would change a deployment's outputs from one start to the next."""
    reason = tile_kernels_unavailable_reason()
    if reason is None and not all(shape_fits_tiles(i, o) for i, o, _, _ in shapes):
        reason = "a product of this model does not fit whole tiles"
    dtype = torch.float32 if reason is not None else torch.bfloat16
    log.info("target dtype auto on this CPU: %s (%s; --dtype float32 or bfloat16 to choose)",
             str(dtype).removeprefix("torch."), reason or f"every product runs tile-packed, on {tile_kernel_name()}")
    return dtype
