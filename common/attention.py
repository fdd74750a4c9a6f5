"""The attention backend boundary, and the portable torch backend.

A backend is built once the KV layout is resolved. Each step the model runner calls
`plan(meta)` once; every layer then calls `forward(q, k, v, kv_cache, spec, scale)`,
which writes this step's K/V into the pages at `meta.slot_mapping` and attends over
each sequence's pages.

Page formats (one layer region, see `common.kv_layout`):
  NHD: [num_pages, 2, page_size, H, D]      HND: [num_pages, 2, H, page_size, D]
fp8 pages hold `value / scale` (clamped to the finite fp8 range); reads return
`page * scale`. bf16/fp16/fp32 pages hold the value cast to the page dtype.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from common.attention_metadata import AttentionMetadata
from common.kv_layout import KVLayout, LayerSpec

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Sequences with at most this many queries in a step share one padded SDPA call;
# longer ones (prefill chunks) run alone so that padding never multiplies their cost.
BATCHED_QUERY_MAX = 32
BACKEND_CHOICES = ("auto", "torch", "flashinfer")


class AttentionBackend(Protocol):
    name: str

    @classmethod
    def supported_orders(cls, device: torch.device) -> tuple[str, ...]: ...

    @classmethod
    def preferred_order(cls, device: torch.device) -> str: ...

    def plan(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # one layer region
        spec: LayerSpec,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]


# ---------------------------------------------------------------------------------------
# Quantization and page access: small functions, shared with the drafter and the tests.


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


def _key_value_planes(kv_cache: torch.Tensor, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V planes as [P, ps, H, D] views (NHD) or [P, H, ps, D] views (HND)."""
    if order not in ("NHD", "HND"):
        raise ValueError(f"page order must be NHD or HND, got {order!r}")
    return kv_cache[:, 0], kv_cache[:, 1]


def write_kv_to_pages(
    kv_cache: torch.Tensor,
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, D]
    slot_mapping: torch.Tensor,  # [T] int64: page * page_size + offset
    *,
    order: str,
    page_size: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K/V at its slot (quantized for fp8 pages)."""
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")  # [T]
    offsets = slot_mapping - pages * page_size  # [T]
    k_plane, v_plane = _key_value_planes(kv_cache, order)
    for plane, x, scale in ((k_plane, k, k_scale), (v_plane, v, v_scale)):
        values = quantize(x, kv_cache.dtype, scale)  # [T, H, D]
        if order == "NHD":
            plane[pages, offsets] = values
        else:  # advanced indices around a slice put the token dim first: [T, H, D]
            plane[pages, :, offsets] = values


def read_kv_slots(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64
    *,
    order: str,
    page_size: int,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of individual slots, dequantized: ([N, H, D], [N, H, D])."""
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - pages * page_size
    k_plane, v_plane = _key_value_planes(kv_cache, order)
    if order == "NHD":
        k_raw, v_raw = k_plane[pages, offsets], v_plane[pages, offsets]
    else:
        k_raw, v_raw = k_plane[pages, :, offsets], v_plane[pages, :, offsets]
    return dequantize(k_raw, dtype, k_scale), dequantize(v_raw, dtype, v_scale)


def gather_kv_from_pages(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, P] page ids
    *,
    order: str,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pages, dequantized, as [B, H, P * ps, D] views of one gathered copy per
    plane (the gather lays pages out so the token axis is contiguous; SDPA takes the view)."""
    num_seqs, num_pages = block_table.shape
    flat = block_table.reshape(-1).long()  # [B*P]
    k_plane, v_plane = _key_value_planes(kv_cache, order)
    return tuple(
        dequantize(_gather_plane(plane, flat, num_seqs, num_pages, order), dtype, scale)
        for plane, scale in ((k_plane, k_scale), (v_plane, v_scale))
    )


def _gather_plane(plane: torch.Tensor, flat: torch.Tensor, num_seqs: int, num_pages: int, order: str) -> torch.Tensor:
    if order == "NHD":  # [N, ps, H, D] → [B*P, ps, H, D] → [B, S, H, D] → [B, H, S, D]
        page_size, heads, head_dim = plane.shape[1:]
        rows = plane.index_select(0, flat).view(num_seqs, num_pages * page_size, heads, head_dim)
        return rows.transpose(1, 2)
    heads, page_size, head_dim = plane.shape[1:]  # HND: [N, H, ps, D] → [H, B*P, ps, D] → [B, H, S, D]
    rows = plane.transpose(0, 1).index_select(1, flat).view(heads, num_seqs, num_pages * page_size, head_dim)
    return rows.transpose(0, 1)


# ---------------------------------------------------------------------------------------
# The per-step plan: sequences grouped into padded SDPA calls.


@dataclass
class _Group:
    """Sequences attended in one SDPA call, padded to the longest query and key span."""

    block_table: torch.Tensor  # [B, P] page ids
    query_rows: torch.Tensor  # [B, Qmax] rows of the flat batch (pads repeat a real row)
    valid_rows: torch.Tensor  # [N] real rows of the flattened [B * Qmax] output
    token_rows: torch.Tensor  # [N] where those rows go in the flat output
    kv_len: int  # keys kept after the gather (the longest seq_len)
    mask: torch.Tensor | None  # [B, 1, Qmax, kv_len] bool, True = attend
    is_causal: bool  # one sequence whose queries are all its keys: SDPA's own causal mask
    _gqa_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.query_rows.shape[0]

    @property
    def max_query(self) -> int:
        return self.query_rows.shape[1]

    def mask_for(self, group_size: int) -> torch.Tensor | None:
        """The mask for queries folded as [B, Hkv, G * Qmax, D] (GQA without repeating K/V)."""
        if self.mask is None or group_size == 1:
            return self.mask
        if group_size not in self._gqa_masks:
            self._gqa_masks[group_size] = self.mask.repeat(1, 1, group_size, 1)
        return self._gqa_masks[group_size]


@dataclass
class _Plan:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T]
    groups: list[_Group]
    covers_in_order: bool  # one group whose rows are exactly 0..T-1 in order


def _group_sequences(meta: AttentionMetadata) -> list[list[int]]:
    """Short queries (decode, verify, draft blocks) share a call; long ones run alone."""
    short = [b for b, q in enumerate(meta.query_lens) if 0 < q <= BATCHED_QUERY_MAX]
    long = [[b] for b, q in enumerate(meta.query_lens) if q > BATCHED_QUERY_MAX]
    return ([short] if short else []) + long


def _build_group(meta: AttentionMetadata, seqs: list[int], device: torch.device) -> _Group:
    page_size = meta.page_size
    all_starts = [0, *itertools.accumulate(meta.query_lens)]
    q_lens = torch.tensor([meta.query_lens[b] for b in seqs], dtype=torch.long)  # [B]
    s_lens = torch.tensor([meta.seq_lens[b] for b in seqs], dtype=torch.long)  # [B]
    starts = torch.tensor([all_starts[b] for b in seqs], dtype=torch.long)  # [B] first flat row
    max_q, kv_len = int(q_lens.max()), int(s_lens.max())
    num_pages = (kv_len + page_size - 1) // page_size
    table = [meta.block_tables[b][:num_pages] for b in seqs]
    table = [t + [0] * (num_pages - len(t)) for t in table]

    q_idx = torch.arange(max_q)  # [Qmax]
    is_real = q_idx[None, :] < q_lens[:, None]  # [B, Qmax]
    rows = starts[:, None] + torch.minimum(q_idx[None, :], q_lens[:, None] - 1)  # [B, Qmax]
    valid = torch.nonzero(is_real.reshape(-1)).squeeze(1)  # [N]

    single = len(seqs) == 1
    q_pos = (s_lens - q_lens)[:, None] + q_idx[None, :]  # [B, Qmax] position of each query
    key_pos = torch.arange(kv_len)  # [S]
    if single and (not meta.causal or max_q == 1):
        mask = None
    elif single and max_q == kv_len:
        mask = None  # plain causal prefill: SDPA's is_causal
    else:
        mask = key_pos[None, None, :] < s_lens[:, None, None]  # [B, 1, S]
        if meta.causal:
            mask = mask & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Qmax, S]
        else:
            mask = mask.expand(len(seqs), max_q, kv_len)
        mask = mask.unsqueeze(1).to(device)  # [B, 1, Qmax, S]
    return _Group(
        block_table=torch.tensor(table, dtype=torch.long, device=device).view(len(seqs), num_pages),
        query_rows=rows.to(device),
        valid_rows=valid.to(device),
        token_rows=rows.reshape(-1)[valid].to(device),
        kv_len=kv_len,
        mask=mask,
        is_causal=single and meta.causal and max_q == kv_len and max_q > 1,
    )


def build_plan(meta: AttentionMetadata, page_size: int) -> _Plan:
    meta.check_page_size(page_size)
    device = meta.slot_mapping.device
    groups = [_build_group(meta, seqs, device) for seqs in _group_sequences(meta)]
    # One group without query padding that holds every token: its rows are 0..T-1 in order.
    in_order = len(groups) == 1 and groups[0].max_query * groups[0].num_seqs == meta.num_tokens
    return _Plan(meta.num_tokens, meta.slot_mapping, groups, in_order)


def attend_group(
    group: _Group,
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [B, Hkv, S', D] dequantized, S' >= kv_len
    v_cache: torch.Tensor,  # [B, Hkv, S', D]
    scale: float,
) -> torch.Tensor:  # [N, Hq, D] the group's real query rows
    num_seqs, max_q = group.num_seqs, group.max_query
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    g = q_heads // kv_heads
    k_cache, v_cache = k_cache[:, :, : group.kv_len], v_cache[:, :, : group.kv_len]
    queries = q.index_select(0, group.query_rows.reshape(-1))  # [B*Qmax, Hq, D]
    if group.is_causal:  # one sequence, no padding; GQA through SDPA itself
        out = F.scaled_dot_product_attention(
            queries.transpose(0, 1).unsqueeze(0),
            k_cache,
            v_cache,
            is_causal=True,
            scale=scale,
            enable_gqa=g > 1,
        )  # [1, Hq, Q, D]
        return out[0].transpose(0, 1)  # [Q, Hq, D]
    # Fold the query heads that share a KV head into the query axis: [B, Hkv, G*Qmax, D].
    folded = queries.view(num_seqs, max_q, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(num_seqs, kv_heads, g * max_q, head_dim)
    out = F.scaled_dot_product_attention(folded, k_cache, v_cache, attn_mask=group.mask_for(g), scale=scale)
    out = out.view(num_seqs, kv_heads, g, max_q, head_dim).permute(0, 3, 1, 2, 4)  # [B, Qmax, Hkv, G, D]
    out = out.reshape(num_seqs * max_q, q_heads, head_dim)
    return out if out.shape[0] == group.valid_rows.numel() else out.index_select(0, group.valid_rows)


# ---------------------------------------------------------------------------------------


class TorchAttentionBackend:
    """Portable paged attention with torch ops (CPU and CUDA, NHD and HND pages)."""

    name = "torch"

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._plan: _Plan | None = None

    @classmethod
    def supported_orders(cls, device: torch.device) -> tuple[str, ...]:
        return ("NHD", "HND")

    @classmethod
    def preferred_order(cls, device: torch.device) -> str:
        return "NHD"

    def plan(self, meta: AttentionMetadata) -> None:
        self._plan = build_plan(meta, self.layout.page_size)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        spec: LayerSpec,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        plan = self._require_plan(q.shape[0])
        order, page_size = self.layout.order, self.layout.page_size
        write_kv_to_pages(
            kv_cache,
            k,
            v,
            plan.slot_mapping,
            order=order,
            page_size=page_size,
            k_scale=spec.k_scale,
            v_scale=spec.v_scale,
        )
        if plan.covers_in_order:
            return self._attend(plan.groups[0], q, kv_cache, spec, scale)
        out = q.new_empty(q.shape)  # [T, Hq, D]
        for group in plan.groups:
            out.index_copy_(0, group.token_rows, self._attend(group, q, kv_cache, spec, scale))
        return out

    def _attend(
        self, group: _Group, q: torch.Tensor, kv_cache: torch.Tensor, spec: LayerSpec, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = gather_kv_from_pages(
            kv_cache,
            group.block_table,
            order=self.layout.order,
            dtype=q.dtype,
            k_scale=spec.k_scale,
            v_scale=spec.v_scale,
        )  # [B, Hkv, S', D] each
        return attend_group(group, q, k_cache, v_cache, scale)

    def _require_plan(self, num_tokens: int) -> _Plan:
        if self._plan is None:
            raise RuntimeError("attention backend: plan(meta) must be called before forward()")
        if self._plan.num_tokens != num_tokens:
            raise RuntimeError(
                f"attention backend: planned for {self._plan.num_tokens} tokens, got {num_tokens} "
                "(was plan(meta) called for this step?)"
            )
        return self._plan


def select_backend(
    name: str,
    device: torch.device,
    *,
    head_dims: tuple[int, ...] = (),
    model_dtype: torch.dtype | None = None,
    kv_dtype: torch.dtype | None = None,
) -> type:
    """The backend class for `--attention-backend` (auto | torch | flashinfer).

    auto: FlashInfer on a CUDA device where `import flashinfer` works, its kernels fit the
    model (head dims, model and KV dtypes, when given) and can be loaded or built here
    (common/flashinfer_probe.py: prebuilt kernels, or nvcc and ninja), else torch, with one
    warning saying why. flashinfer: the same conditions, as a ValueError naming what to change."""
    if name not in BACKEND_CHOICES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_CHOICES)}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend
    from common.flashinfer_backend import FlashInferAttentionBackend, flashinfer_import_error

    if device.type != "cuda":
        raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device}")
    from common import flashinfer_probe

    reason = flashinfer_import_error() or FlashInferAttentionBackend.unsupported_reason(
        head_dims=tuple(head_dims), model_dtype=model_dtype, kv_dtype=kv_dtype
    ) or flashinfer_probe.flashinfer_runnable_reason(tuple(head_dims), model_dtype, kv_dtype)
    if reason is None:
        return FlashInferAttentionBackend
    if name == "auto":
        logging.getLogger(__name__).warning("attention backend auto: %s; using the torch backend", reason)
        return TorchAttentionBackend
    raise ValueError(f"attention backend 'flashinfer' is not available: {reason}")
