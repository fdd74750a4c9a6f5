"""Paged attention in one native call per layer on a CPU (`common/native/paged_attention.c`).

The torch backend spends a decode layer's attention in about fifteen op dispatches (slot
arithmetic, two page writes, two page gathers, the query fold, SDPA, the unfold), which on a
small model cost more than the arithmetic. Here the write is one call and the attention
another: each (sequence, KV head) reads its keys and values straight from the pages, on the
caller's OpenMP threads (torch's libgomp, loaded first). Every row is computed alone in a fixed
order, so a row has the same bits in a decode, a verify and any batch: the backend is
batch-invariant by construction.

The C source is built and loaded by `common/native_build.py`; where it cannot be, `select_backend`
falls back to the torch backend, saying why. Figures: docs/performance.md#paged-attention-in-one-native-call.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from common.attention import BATCHED_QUERY_MAX, TorchAttentionBackend
from common.attention_metadata import AttentionMetadata
from common.kv_layout import KVLayout, LayerSpec
from common.kv_quant import dequantize, quantize
from common.native_build import NativeKernelUnavailable, load_library

log = logging.getLogger(__name__)

KV_F32, KV_BF16, KV_BYTE_TABLE = 0, 1, 2  # the C enum
STATUS = {1: "a page id outside the pool", 2: "a key count or row range that does not fit its page table",
          3: "out of memory", 4: "an unsupported page dtype"}

_P, _I64, _I32, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_float
_ATTENTION_ARGS = [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _INT, _P, _P, _P, _I64, _I64, _P, _P, _I64,
                   _INT, _INT, _INT, _F, _INT]
_WRITE_ARGS = [_P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I32, _INT, _I64]


@dataclass(frozen=True)
class NativeKernels:
    """The two entry points of the loaded library."""

    attention: ctypes._CFuncPtr
    write_kv: ctypes._CFuncPtr

    @classmethod
    def load(cls, cache_dir: Path | None = None) -> NativeKernels:
        """Build (or find) and load the library; NativeKernelUnavailable if that fails."""
        lib = load_library("paged_attention", cache_dir)
        lib.splitspec_paged_attention.argtypes, lib.splitspec_paged_attention.restype = _ATTENTION_ARGS, _INT
        lib.splitspec_write_kv.argtypes, lib.splitspec_write_kv.restype = _WRITE_ARGS, _INT
        return cls(lib.splitspec_paged_attention, lib.splitspec_write_kv)


def native_unavailable_reason() -> str | None:
    """Why the native backend cannot run here, or None."""
    try:
        NativeKernels.load()
    except NativeKernelUnavailable as exc:
        return str(exc)
    return None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"native {what}: {STATUS.get(status, f'status {status}')}")


@dataclass
class _RowPlan:
    """One step's rows for the C kernel."""

    row_start: torch.Tensor  # [B + 1] int32: sequence b owns rows row_start[b]..row_start[b+1]-1
    row_keys: torch.Tensor  # [T] int32: the keys row t sees
    page_table: torch.Tensor  # [B, P] int32
    slot_mapping: torch.Tensor  # [T] int64
    threads: int


class NativeCpuAttentionBackend(TorchAttentionBackend):
    """`AttentionBackend` on a CPU through the C kernels; steps holding a long query (a prefill
    chunk) run the torch backend's SDPA unless `batch_invariant` (then every row runs here: SDPA
    would give a prefill row other bits than its decode)."""

    name = "cpu-native"
    DTYPE_KINDS = {torch.float32: KV_F32, torch.bfloat16: KV_BF16, torch.float8_e4m3fn: KV_BYTE_TABLE,
                   torch.float8_e5m2: KV_BYTE_TABLE}

    def __init__(self, layout: KVLayout) -> None:
        super().__init__(layout)
        self.kernels = NativeKernels.load()
        self._rows: _RowPlan | None = None
        self._tables: dict[tuple[torch.dtype, float], torch.Tensor] = {}  # fp8 byte → float32 value

    def plan(self, meta: AttentionMetadata) -> None:
        long_query = max(meta.query_lens, default=0) > BATCHED_QUERY_MAX
        if self.layout.torch_dtype not in self.DTYPE_KINDS or (long_query and not self.batch_invariant):
            self._rows = None
            super().plan(meta)
            return
        meta.check_page_size(self.layout.page_size)
        num_seqs, num_tokens = meta.page_table_tensor.shape[0], meta.num_tokens
        if meta.query_start_loc.numel() != num_seqs + 1 or meta.slot_mapping.numel() != num_tokens:
            raise ValueError(f"attention metadata: {meta.query_start_loc.numel()} row starts and "
                             f"{meta.slot_mapping.numel()} slots for {num_seqs} sequences of {num_tokens} tokens")
        self._plan = None
        if meta.causal:
            keys = [s - q + i + 1 for q, s in zip(meta.query_lens, meta.seq_lens, strict=True) for i in range(q)]
        else:
            keys = [s for q, s in zip(meta.query_lens, meta.seq_lens, strict=True) for _ in range(q)]
        self._rows = _RowPlan(meta.query_start_loc.to(torch.int32).contiguous(), torch.tensor(keys, dtype=torch.int32),
                              meta.page_table_tensor.to(torch.int32).contiguous(),
                              meta.slot_mapping.to(torch.int64).contiguous(), torch.get_num_threads())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, spec: LayerSpec,
                scale: float) -> torch.Tensor:  # q [T, Hq, D], k and v [T, Hkv, D] → [T, Hq, D]
        rows = self._rows
        if rows is None:
            return super().forward(q, k, v, kv_cache, spec, scale)
        if rows.row_keys.shape[0] != q.shape[0]:
            raise RuntimeError(f"attention backend: planned for {rows.row_keys.shape[0]} tokens, got {q.shape[0]} "
                               "(was plan(meta) called for this step?)")
        if not q.shape[0] == k.shape[0] == v.shape[0] or k.shape != v.shape:
            raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
        strides, heads_and_dim = self._region_geometry(kv_cache)
        if tuple(k.shape[1:]) != heads_and_dim or q.shape[2] != k.shape[2]:
            raise ValueError(f"attention: k {tuple(k.shape)} does not fit pages of {heads_and_dim} (heads, dim)")
        num_pages, page_size = kv_cache.shape[0], self.layout.page_size
        keys = quantize(k, kv_cache.dtype, spec.k_scale).contiguous()
        values = quantize(v, kv_cache.dtype, spec.v_scale).contiguous()
        _check(self.kernels.write_kv(keys.data_ptr(), values.data_ptr(), rows.slot_mapping.data_ptr(), q.shape[0],
                                     kv_cache.data_ptr(), *strides, num_pages, page_size, k.shape[1],
                                     k.shape[2] * kv_cache.element_size()), "KV write")
        queries = q.to(torch.float32).contiguous()
        out = torch.empty_like(queries)
        kind = self.DTYPE_KINDS[kv_cache.dtype]
        k_table = self._byte_table(kv_cache.dtype, spec.k_scale) if kind == KV_BYTE_TABLE else None
        v_table = self._byte_table(kv_cache.dtype, spec.v_scale) if kind == KV_BYTE_TABLE else None
        _check(self.kernels.attention(
            queries.data_ptr(), out.data_ptr(), kv_cache.data_ptr(), *strides, num_pages, page_size, kind,
            None if k_table is None else k_table.data_ptr(), None if v_table is None else v_table.data_ptr(),
            rows.page_table.data_ptr(), rows.page_table.shape[1], rows.page_table.shape[0], rows.row_start.data_ptr(),
            rows.row_keys.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2], scale, rows.threads), "attention")
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _region_geometry(self, kv_cache: torch.Tensor) -> tuple[tuple[int, int, int, int], tuple[int, int]]:
        """One layer region's (page, plane, token, head) strides in bytes, and its (heads, head dim)."""
        if kv_cache.dim() != 5 or kv_cache.stride(4) != 1:
            raise ValueError(f"native attention needs [pages, 2, ...] regions with contiguous head vectors, got "
                             f"shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
        token_dim, head_dim = (2, 3) if self.layout.order == "NHD" else (3, 2)  # [P, 2, ps, H, D] / [P, 2, H, ps, D]
        size = kv_cache.element_size()
        strides = tuple(kv_cache.stride(d) * size for d in (0, 1, token_dim, head_dim))
        return strides, (kv_cache.shape[head_dim], kv_cache.shape[4])

    def _byte_table(self, dtype: torch.dtype, scale: float) -> torch.Tensor:  # [256] float32
        """What each fp8 byte reads as, scaled (`common.kv_quant.dequantize` of every code)."""
        if (dtype, scale) not in self._tables:
            codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
            self._tables[(dtype, scale)] = dequantize(codes, torch.float32, scale).contiguous()
        return self._tables[(dtype, scale)]



class BatchInvariantNativeBackend(NativeCpuAttentionBackend):
    """Every row through the C kernel, prefill chunks included: for a reduced-precision target,
    whose speculative output must equal its target-only output bit for bit."""

    name = "cpu-native-invariant"
    batch_invariant = True
