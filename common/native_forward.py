"""A bfloat16 decoder's forward in one native call per step (`common/native/decoder_forward.c`).

Eager, a decode step of the demo target made ~200 op dispatches (about fifteen per layer
around four products, plus the paged attention's), each a few µs of Python and dispatcher
around a few µs of arithmetic; with the products on native bfloat16 kernels the dispatch was
most of the step. Here the products (AMX tiles or AVX512-BF16), the paged attention and KV writes
(the native attention's
code) and the glue between them (RMSNorm, q/k norms, RoPE, SiLU, residuals) run in C, and a
step is one call: what llama.cpp does with its graph, for one architecture.

Every op computes a row from that row alone in a fixed order, so a row's bits do not depend
on the step's other rows: the forward is batch-invariant by construction, and speculative
output stays token-identical to target-only in bfloat16 (tests/test_native_forward.py).
Activations stay float32 between products (the products round their inputs to bfloat16 and
sum in float32), so the values differ from the eager bfloat16 forward's by rounding; a model
runs one forward or the other for all its steps, never both.

Used for a target whose every product runs tile-packed (`common/native_linear.py`), with
float32 or bfloat16 pages, the native attention backend, and no biases; `native_forward_problem`
says why not otherwise, and the model keeps its eager (or compiled) forward.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.attention_metadata import AttentionMetadata, padded_page_tables
from common.compiled_forward import DecoderStack
from common.native_attention import KV_BF16, KV_F32, NativeCpuAttentionBackend
from common.native_attention import STATUS as ATTENTION_STATUS
from common.native_build import NativeKernelUnavailable, load_library
from common.native_linear import STATUS as PRODUCT_STATUS
from common.native_linear import TiledLinear, tile_kernels_unavailable_reason
from common.qwen3 import checked_capture_layers

PAGE_KINDS = {torch.float32: KV_F32, torch.bfloat16: KV_BF16}
PRODUCT_OFFSET = 20  # decoder_forward.c: a product's status, offset
BAD_POSITION = 12  # decoder_forward.c: a position past the rotary table (grown, then the call is made again)
STATUS = {**ATTENTION_STATUS, 11: "a slot outside the pool", BAD_POSITION: "a position outside the rotary table",
          13: "out of memory", 15: "no native bfloat16 products in this build",
          16: "a shape the forward does not support", 17: "a token id outside the vocabulary",
          **{PRODUCT_OFFSET + code: f"bfloat16 product: {text}" for code, text in PRODUCT_STATUS.items()}}

_P, _I64, _INT, _F, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int32


class LayerArgs(ctypes.Structure):
    _fields_ = [("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P), ("input_norm", _P), ("post_norm", _P),
                ("q_norm", _P), ("k_norm", _P), ("kv", _P), ("capture", _P)]


class DecoderArgs(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("intermediate", _I64), ("q_heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("layers", _I64), ("eps", _F), ("scale", _F), ("final_norm", _P), ("page_stride", _I64),
                ("plane_stride", _I64), ("token_stride", _I64), ("head_stride", _I64), ("num_pages", _I64),
                ("page_size", _I32), ("kv_kind", _I32), ("capture_stride", _I64), ("capture_kind", _I32),
                ("product_kernel", _I32)]


class ContextArgs(ctypes.Structure):  # decoder_forward.c's ContextRows
    _fields_ = [("features", _P), ("width", _I64), ("fc", _P), ("hidden_norm", _P), ("rows", _I64),
                ("positions", _P), ("slots", _P)]


class DraftBlockArgs(ctypes.Structure):  # decoder_forward.c's DraftBlock
    _fields_ = [("embed", _P), ("embed_scale", _F), ("vocab", _I64), ("head", _P), ("mask_id", _I64),
                ("causal", _I32)]


_FORWARD_ARGS = [_P, _P, _P, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _P, _P, _P, _INT, _P]
_CONTEXT_ARGS = [_P, _P, _P, _I64, _P, _P, _I64, _P, _I64, _P, _P, _INT]
_PROPOSE_ARGS = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _INT, _P, _P]
ROPE_POSITIONS_MIN = 1024  # the rotary table's first size; it doubles past the largest position asked


@dataclass(frozen=True)
class _Entries:
    forward: ctypes._CFuncPtr
    context_kv: ctypes._CFuncPtr
    propose: ctypes._CFuncPtr
    to_bf16: ctypes._CFuncPtr  # the forward's float32 → bfloat16 rounding (`rounded_to_bf16`)


@functools.cache
def _load_forward() -> _Entries:
    reason = tile_kernels_unavailable_reason()
    if reason is not None:
        raise NativeKernelUnavailable(reason)
    lib = load_library("decoder_forward")
    lib.splitspec_decoder_forward.argtypes, lib.splitspec_decoder_forward.restype = _FORWARD_ARGS, _INT
    lib.splitspec_context_kv.argtypes, lib.splitspec_context_kv.restype = _CONTEXT_ARGS, _INT
    lib.splitspec_dflash_propose.argtypes, lib.splitspec_dflash_propose.restype = _PROPOSE_ARGS, _INT
    lib.splitspec_floats_to_bf16.argtypes, lib.splitspec_floats_to_bf16.restype = [_P, _P, _I64], None
    return _Entries(lib.splitspec_decoder_forward, lib.splitspec_context_kv, lib.splitspec_dflash_propose,
                    lib.splitspec_floats_to_bf16)


def rounded_to_bf16(values: torch.Tensor) -> torch.Tensor:  # float32 [N] → bfloat16 [N]
    """What the native forward rounds a float32 to, where it stores bfloat16 (product inputs,
    captures): torch's nearest-even rounding, denormals and NaNs included (tested)."""
    source = values.detach().float().contiguous().reshape(-1)
    out = torch.empty(source.shape, dtype=torch.bfloat16)
    _load_forward().to_bf16(source.data_ptr(), out.data_ptr(), source.numel())
    return out.reshape(values.shape)


def native_forward_problem(stack: DecoderStack, kv_dtype: torch.dtype, backend_cls: type,
                           batch_invariant: bool = True) -> str | None:
    """Why this decoder stack cannot run the native forward here, or None. `batch_invariant`:
    the caller needs every row invariant (a target): the backend must be the invariant native
    one; otherwise (a drafter) the plain native one does, for steps whose queries it plans."""
    args = stack.args
    if stack.embed.device.type != "cpu":
        return "not on a CPU"
    if args.qkv_bias or args.o_bias or args.mlp_bias:
        return "its linears have biases"
    if kv_dtype not in PAGE_KINDS:
        return f"{kv_dtype} pages (float32 or bfloat16 only)"
    if not issubclass(backend_cls, NativeCpuAttentionBackend) or (
            batch_invariant and not getattr(backend_cls, "batch_invariant", False)):
        return (f"the {backend_cls.name} attention backend (it needs the "
                f"{'batch-invariant ' if batch_invariant else ''}native one)")
    products = [p for layer in stack.layers
                for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if not all(isinstance(p, TiledLinear) for p in products):
        return "not every product runs tile-packed (bfloat16 on AMX, AVX512-BF16 or AVX2)"
    if len({p.kernel for p in products}) > 1:
        return "its products run on different kernels (one call runs one)"
    try:
        _load_forward()
    except NativeKernelUnavailable as exc:
        return str(exc)
    return None


class NativeForward:
    """A decoder stack's forward with `CompiledForward`'s call signature: final-normed hidden
    states [T, hidden] float32, and {layer: hidden state after it} (the last layer's after the
    final norm, as Hugging Face reports it). The pool layer each layer attends over is
    `stack.layer_spec`'s; the step's rows are what `backend.plan(meta)` planned."""

    def __init__(self, stack: DecoderStack) -> None:
        self.stack = stack
        self._entries = _load_forward()
        args = stack.args
        self._float32: list[torch.Tensor] = []  # float32 copies of the norm weights, kept alive
        self._layers = (LayerArgs * args.num_layers)()
        for i, layer in enumerate(stack.layers):
            attention, mlp = layer.self_attn, layer.mlp
            entry = self._layers[i]
            entry.qkv, entry.o = attention.qkv_proj._packed_address, attention.o_proj._packed_address
            entry.gate_up, entry.down = mlp.gate_up_proj._packed_address, mlp.down_proj._packed_address
            entry.input_norm = self._keep(layer.input_layernorm.weight)
            entry.post_norm = self._keep(layer.post_attention_layernorm.weight)
            entry.q_norm = self._keep(attention.q_norm.weight) if attention.qk_norm else None
            entry.k_norm = self._keep(attention.k_norm.weight) if attention.qk_norm else None
        self._decoder = DecoderArgs(hidden=args.hidden_size, intermediate=args.intermediate_size,
                                    q_heads=args.num_heads, kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                                    layers=args.num_layers, eps=args.rms_norm_eps, scale=args.head_dim**-0.5,
                                    final_norm=self._keep(stack.final_norm), capture_stride=args.hidden_size,
                                    capture_kind=KV_F32,
                                    product_kernel=stack.layers[0].self_attn.qkv_proj.kernel)
        self._pool_key: tuple | None = None
        self._rope = torch.empty(0, 2, args.head_dim)  # [positions, 2, D]: cos and signed sin, grown as asked
        self._context_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, float32 copy): _norm_copy

    def _keep(self, weight: torch.Tensor) -> int:
        copy = weight.detach().float().contiguous()
        self._float32.append(copy)
        return copy.data_ptr()

    def runs(self, backend, kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]) -> bool:
        """Whether this planned step can run here: on the native backend, which planned its rows
        (the plain one leaves a long prefill to SDPA), over float32 or bfloat16 pages."""
        return self.writes(backend, kv_caches) and backend._rows is not None

    def writes(self, backend, kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]) -> bool:
        """Whether `context_kv` can write these pages (the native backend's geometry, float32 or bfloat16)."""
        return isinstance(backend, NativeCpuAttentionBackend) and kv_caches[0].dtype in PAGE_KINDS

    def context_kv(self, features: torch.Tensor, fc: TiledLinear, hidden_norm: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
                   backend: NativeCpuAttentionBackend) -> None:
        """DFlash's context rows in one call: features [Tc, F] → rms_norm(fc(features)) · hidden_norm →
        every layer's K/V, written at `slot_mapping` [Tc]. (A block's forward takes them itself:
        `__call__`'s `context`.)"""
        context = self.context_rows(features, fc, hidden_norm, positions, slot_mapping)
        if context.rows == 0:
            return
        self._point_at_pool(kv_caches, backend)

        def call() -> int:
            return self._entries.context_kv(ctypes.byref(self._decoder), self._layers, context.features, context.width,
                                            context.fc, context.hidden_norm, context.rows, self._rope.data_ptr(),
                                            self._rope.shape[0], context.positions, context.slots,
                                            torch.get_num_threads())
        status = self._with_rope_for(call, context.kept[1])
        if status != 0:
            raise ValueError(f"native context K/V: {STATUS.get(status, f'status {status}')}")

    def draft_block(self, head: TiledLinear, mask_id: int, causal: bool) -> DraftBlockArgs | None:
        """What `propose` needs besides the layers (DFlash's block), or None where it cannot run: the
        stack's embedding in bfloat16, and a head on the layers' product kernel over that vocabulary."""
        embed = self.stack.embed
        if (embed.dtype != torch.bfloat16 or not embed.is_contiguous() or head.bias is not None
                or head.kernel != self._decoder.product_kernel or head.in_features != self._decoder.hidden
                or head.out_features != embed.shape[0] or not 0 <= mask_id < embed.shape[0]):
            return None
        block = DraftBlockArgs(embed.data_ptr(), self.stack.embed_scale, embed.shape[0], head._packed_address, mask_id,
                               int(causal))
        block.kept = (embed, head._packed)
        return block

    def propose(self, block: DraftBlockArgs, last_ids: Sequence[int], context_lens: Sequence[int],
                page_tables: Sequence[Sequence[int]], num_tokens: int, num_drafts: int,
                kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], backend: NativeCpuAttentionBackend,
                context: ContextArgs | None = None) -> list[list[int]]:
        """DFlash's greedy drafts in one call: each sequence's block [last id, mask x num_tokens] at
        positions p .. p + num_tokens (p its context length) through the layers (`context`'s K/V
        written first), the head over the block's rows 1 .. num_drafts, and their argmax: what the
        planned forward, the head and `argmax_last` give, bit for bit (tests/test_native_forward.py)."""
        self._point_at_pool(kv_caches, backend)
        for entry in self._layers:
            entry.capture = None
        count = len(last_ids)
        sequences = torch.tensor([list(last_ids), list(context_lens)], dtype=torch.int64)  # [2, B]
        tables = padded_page_tables(page_tables)  # [B, P]
        drafts = torch.empty(count, num_drafts, dtype=torch.int64)  # [B, n]

        def call() -> int:
            return self._entries.propose(ctypes.byref(self._decoder), self._layers, ctypes.byref(block),
                                         sequences[0].data_ptr(), sequences[1].data_ptr(), count, num_tokens,
                                         num_drafts, tables.data_ptr(), tables.shape[1], self._rope.data_ptr(),
                                         self._rope.shape[0], torch.get_num_threads(),
                                         None if context is None or context.rows == 0 else ctypes.byref(context),
                                         drafts.data_ptr())
        status = self._with_rope_for(call, sequences[1] + num_tokens, *(() if context is None else (context.kept[1],)))
        if status != 0:
            raise ValueError(f"native DFlash propose: {STATUS.get(status, f'status {status}')}")
        return drafts.tolist()

    def context_rows(self, features: torch.Tensor, fc: TiledLinear, hidden_norm: torch.Tensor,
                     positions: torch.Tensor, slot_mapping: torch.Tensor) -> ContextArgs:
        """DFlash's context rows checked and pointed at (features [Tc, F], positions and slots [Tc]); the
        tensors they point into are kept on the result (`.kept`) for as long as it is used."""
        rows = features.shape[0]
        if features.shape != (rows, fc.in_features) or fc.out_features != self._decoder.hidden:
            raise ValueError(f"context rows {tuple(features.shape)} for an fc of {fc.in_features}->{fc.out_features}")
        if positions.shape != (rows,) or slot_mapping.shape != (rows,):
            raise ValueError(f"{rows} context rows with {positions.shape[0]} positions and {slot_mapping.shape[0]} slots")
        if fc.kernel != self._decoder.product_kernel:
            raise ValueError("the context fc runs on another product kernel than the draft layers")
        features = features.to(torch.bfloat16).contiguous()
        norm = self._norm_copy(hidden_norm)
        slots, positions = slot_mapping.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        context = ContextArgs(features.data_ptr(), fc.in_features, fc._packed_address, norm.data_ptr(), rows,
                              positions.data_ptr(), slots.data_ptr())
        context.kept = (features, positions, slots, norm)
        return context

    def _norm_copy(self, weight: torch.Tensor) -> torch.Tensor:
        """A float32 copy of a norm weight outside the stack (DFlash's hidden norm), made once."""
        if self._context_norm is None or self._context_norm[0] is not weight:
            self._context_norm = (weight, weight.detach().float().contiguous())
        return self._context_norm[1]

    def _point_at_pool(self, kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
                       backend: NativeCpuAttentionBackend) -> None:
        """Each layer's region base and their shared geometry, refreshed when the pool changes."""
        regions = [kv_caches[i] for i in range(len(self._layers))]
        key = tuple((r.data_ptr(), r.dtype) + tuple(r.shape) for r in regions)
        if key == self._pool_key:
            return
        geometry = {backend._region_geometry(r) for r in regions}
        if len(geometry) != 1:
            raise ValueError("native forward: the layers' pool regions differ in geometry")
        (strides, heads_and_dim), = geometry
        if heads_and_dim != (self._decoder.kv_heads, self._decoder.head_dim):
            raise ValueError(f"native forward: pages of {heads_and_dim} (heads, dim) for a model of "
                             f"{(self._decoder.kv_heads, self._decoder.head_dim)}")
        d = self._decoder
        d.page_stride, d.plane_stride, d.token_stride, d.head_stride = strides
        d.num_pages, d.page_size = regions[0].shape[0], backend.layout.page_size
        d.kv_kind = PAGE_KINDS[regions[0].dtype]
        for entry, region in zip(self._layers, regions, strict=True):
            entry.kv = region.data_ptr()
        self._pool_key = key

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
        backend: NativeCpuAttentionBackend,
        capture_layers: Sequence[int] = (),
        capture_into: torch.Tensor | None = None,  # [T, len(capture_layers) * hidden] float32 or bfloat16
        context: ContextArgs | None = None,  # DFlash's new context rows (`context_rows`), K/V written first
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """With `capture_into` (a staging buffer's rows), the captured layers are written there side
        by side in `capture_layers`' order, rounded to its dtype, and the returned dict is empty.
        With `context`, each layer's qkv product takes those rows ahead of the step's and writes
        their K/V before the step attends (what `context_kv` then this call would do, in one pass
        over the weights)."""
        tokens = input_ids.shape[0]
        rows = backend._rows
        if rows is None or rows.row_keys.shape[0] != tokens or positions.shape[0] != tokens:
            raise RuntimeError(f"native forward: {tokens} ids and {positions.shape[0]} positions for a step planned "
                               f"for {None if rows is None else rows.row_keys.shape[0]} rows (was plan(meta) called?)")
        count = len(self._layers)
        wanted = checked_capture_layers(capture_layers, count)
        self._point_at_pool(kv_caches, backend)
        x = F.embedding(input_ids, self.stack.embed).float()  # [T, hidden]
        if self.stack.embed_scale != 1.0:
            x *= self.stack.embed_scale
        positions = positions.to(torch.int64).contiguous()
        out = torch.empty_like(x)  # [T, hidden]
        captured = self._point_captures(capture_layers, wanted, capture_into, x)

        def call() -> int:
            return self._entries.forward(ctypes.byref(self._decoder), self._layers, x.data_ptr(), out.data_ptr(),
                                         tokens, self._rope.data_ptr(), self._rope.shape[0], positions.data_ptr(),
                                         rows.page_table.data_ptr(), rows.page_table.shape[1],
                                         rows.page_table.shape[0], rows.row_start.data_ptr(), rows.row_keys.data_ptr(),
                                         rows.slot_mapping.data_ptr(), rows.threads,
                                         None if context is None or context.rows == 0 else ctypes.byref(context))
        status = self._with_rope_for(call, positions, *(() if context is None else (context.kept[1],)))
        if status != 0:
            raise ValueError(f"native forward: {STATUS.get(status, f'status {status}')}")
        return out, captured

    def _with_rope_for(self, call, *positions: torch.Tensor) -> int:
        """`call()`'s status, the rotary table grown first when a position lies past it (the C side
        checks every position before it writes anything, so a refused call changed nothing)."""
        status = call()
        if status != BAD_POSITION:
            return status
        largest = max(int(p.max()) for p in positions if p.numel())
        if min(int(p.min()) for p in positions if p.numel()) < 0:
            return status
        size = max(ROPE_POSITIONS_MIN, self._rope.shape[0])
        while size <= largest:
            size *= 2
        cos, sin = self.stack.rotary(torch.arange(size), torch.float32)  # [size, D] each
        self._rope = torch.stack((cos, sin), dim=1).contiguous()  # [size, 2, D]
        return call()

    def _point_captures(self, capture_layers: Sequence[int], wanted: set[int] | Sequence[int],
                        capture_into: torch.Tensor | None, x: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each layer's capture pointer: into `capture_into`'s columns, or fresh float32 tensors (returned)."""
        d, hidden = self._decoder, self._decoder.hidden
        captured: dict[int, torch.Tensor] = {}
        targets: dict[int, int] = {}
        if capture_into is None:
            captured = {i: torch.empty_like(x) for i in wanted}
            targets = {i: t.data_ptr() for i, t in captured.items()}
            d.capture_stride, d.capture_kind = hidden, KV_F32
        elif wanted:
            layers = list(capture_layers)
            if len(wanted) != len(layers):
                raise ValueError(f"capture_into takes each layer once, got {layers}")
            if (capture_into.dim() != 2 or capture_into.shape != (x.shape[0], len(layers) * hidden)
                    or capture_into.stride(1) != 1 or capture_into.dtype not in PAGE_KINDS):
                raise ValueError(f"capture rows {tuple(capture_into.shape)} {capture_into.dtype} for {x.shape[0]} "
                                 f"rows of {len(layers)} layers of {hidden} (float32 or bfloat16, rows contiguous)")
            size = capture_into.element_size()
            targets = {layer: capture_into.data_ptr() + slot * hidden * size for slot, layer in enumerate(layers)}
            d.capture_stride, d.capture_kind = capture_into.stride(0), PAGE_KINDS[capture_into.dtype]
        for i in range(len(self._layers)):
            self._layers[i].capture = targets.get(i)
        return captured
