"""The portable torch attention backend, and the page access it is built from.

It implements `common.attention_backends.AttentionBackend`: `plan(meta)` once per step
groups the sequences into padded SDPA calls; `forward` (per layer) writes this step's
K/V into the pages at `meta.slot_mapping` and attends over each sequence's pages.

Page formats (one layer region, see `common.kv_layout`):
  NHD: [num_pages, 2, page_size, H, D]      HND: [num_pages, 2, H, page_size, D]
Page values follow `common.kv_quant` (fp8 pages hold `value / scale`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.attention_metadata import AttentionMetadata
from common.kv_layout import KVLayout, LayerSpec
from common.kv_quant import dequantize, quantize

# Sequences with at most this many queries in a step share one padded SDPA call;
# longer ones (prefill chunks) run alone so that padding never multiplies their cost.
BATCHED_QUERY_MAX = 32


# ---------------------------------------------------------------------------------------
# Page access: small functions, shared with the drafter and the tests.


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
    page_table: torch.Tensor,  # [B, P] page ids
    *,
    order: str,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pages, dequantized, as [B, H, P * ps, D] views of one gathered copy per
    plane (the gather lays pages out so the token axis is contiguous; SDPA takes the view)."""
    num_seqs, num_pages = page_table.shape
    flat = page_table.reshape(-1).long()  # [B*P]
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

    page_table: torch.Tensor  # [B, P] page ids
    query_rows: torch.Tensor  # [B, Qmax] rows of the flat batch (pads repeat a real row)
    valid_rows: torch.Tensor  # [N] real rows of the flattened [B * Qmax] output
    token_rows: torch.Tensor  # [N] where those rows go in the flat output
    kv_len: int  # keys kept after the gather (the longest seq_len)
    mask: torch.Tensor | None  # [B, 1, Qmax, kv_len] bool, True = attend
    is_causal: bool  # one sequence whose queries are all its keys: SDPA's own causal mask
    _gqa_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    tile_mask: torch.Tensor | None = None  # the batch-invariant backend's mask in tiles, built once per step

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
    if len(seqs) == 1:
        return _build_single_group(meta, seqs[0], device)
    return _build_padded_group(meta, seqs, device)


def _build_single_group(meta: AttentionMetadata, b: int, device: torch.device) -> _Group:
    """`_build_padded_group` for one sequence, in a few ops: nothing to pad, so its rows are a
    range and it needs a mask only when causal with keys before its queries. Every decode
    and verify at batch 1, and every DFlash block, plans this way (it was 7% of a Propose)."""
    q, s = meta.query_lens[b], meta.seq_lens[b]
    start = sum(meta.query_lens[:b])
    num_pages = -(-s // meta.page_size)
    table = list(meta.page_tables[b][:num_pages])
    table += [0] * (num_pages - len(table))
    rows = torch.arange(start, start + q, device=device)  # [Q]
    mask = None
    if meta.causal and 1 < q < s:
        q_pos = torch.arange(s - q, s, device=device)  # [Q] position of each query
        mask = (torch.arange(s, device=device)[None, :] <= q_pos[:, None])[None, None]  # [1, 1, Q, S]
    return _Group(
        page_table=torch.tensor(table, dtype=torch.long, device=device).view(1, num_pages),
        query_rows=rows.view(1, q),
        valid_rows=torch.arange(q, device=device),
        token_rows=rows,
        kv_len=s,
        mask=mask,
        is_causal=meta.causal and q == s and q > 1,
    )


def _build_padded_group(meta: AttentionMetadata, seqs: list[int], device: torch.device) -> _Group:
    page_size = meta.page_size
    all_starts = [0, *itertools.accumulate(meta.query_lens)]
    q_lens = torch.tensor([meta.query_lens[b] for b in seqs], dtype=torch.long)  # [B]
    s_lens = torch.tensor([meta.seq_lens[b] for b in seqs], dtype=torch.long)  # [B]
    starts = torch.tensor([all_starts[b] for b in seqs], dtype=torch.long)  # [B] first flat row
    max_q, kv_len = int(q_lens.max()), int(s_lens.max())
    num_pages = (kv_len + page_size - 1) // page_size
    table = [meta.page_tables[b][:num_pages] for b in seqs]
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
        page_table=torch.tensor(table, dtype=torch.long, device=device).view(len(seqs), num_pages),
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
    batch_invariant = False  # whether a row's output has the same bits whatever else the step holds

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
        k_cache, v_cache = self._gather(group, q, kv_cache, spec)
        return attend_group(group, q, k_cache, v_cache, scale)

    def _gather(
        self, group: _Group, q: torch.Tensor, kv_cache: torch.Tensor, spec: LayerSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hkv, S', D] each
        return gather_kv_from_pages(
            kv_cache,
            group.page_table,
            order=self.layout.order,
            dtype=q.dtype,
            k_scale=spec.k_scale,
            v_scale=spec.v_scale,
        )

    def _require_plan(self, num_tokens: int) -> _Plan:
        if self._plan is None:
            raise RuntimeError("attention backend: plan(meta) must be called before forward()")
        if self._plan.num_tokens != num_tokens:
            raise RuntimeError(
                f"attention backend: planned for {self._plan.num_tokens} tokens, got {num_tokens} "
                "(was plan(meta) called for this step?)"
            )
        return self._plan
