"""Paged attention whose every query row is computed the same way whatever else is in the step.

Speculative decoding is lossless only as far as a verify of K+1 rows computes, for each
row, what a decode of that one token would. In bfloat16 that has to hold bit for bit: a
last-bit difference in one activation rounds to a different bfloat16 half the time it
lands near a boundary, and greedy text then parts ways within a few hundred tokens (2 of
16 held-out prompts on the demo target with SDPA). SDPA is not batch-invariant: its
blocking, its softmax sums and its P·V reductions follow the query count, the key count
and the mask of the call.

Here the sums run on fixed tiles (the approach of "batch-invariant" kernels): keys in tiles
of `KEY_TILE` aligned to position 0, in float32. Each score is one dot product over the head
dimension, which MKL computes the same way for any number of query rows from `MIN_ROWS` on
(measured at load by `make_batch_invariant`); the row maximum is exact in any order; a row's denominator sums each key tile (always
`KEY_TILE` wide, masked keys adding exact zeros) and then the tiles in order (`cumsum`
over the tile axis, whose CPU kernel accumulates sequentially); P·V likewise. A key
beyond a row's own position only ever adds +0.0 after its real keys, so a decode (keys
0..t) and the verify row for the same position (keys 0..t+K, masked past t) produce the
same bits. tests/test_invariant_attention.py checks it against decodes, verifies,
batches and prefill chunks of every width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.attention import TorchAttentionBackend, _Group, build_plan
from common.attention_metadata import AttentionMetadata
from common.cpu_linear import PackedLinear, invariant_chunk_rows
from common.kv_layout import KVLayout, LayerSpec
from common.kv_quant import dequantize, is_fp8_dtype
from common.native_linear import TiledLinear

KEY_TILE = 64  # keys are summed in tiles of this many, aligned to position 0
MIN_ROWS = 2  # a 1-row matmul takes BLAS's matrix-vector path, whose sums are ordered differently


def _ceil_to(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def _full_mask(group: _Group, device: torch.device) -> torch.Tensor:  # [B, 1, Qmax, kv_len] bool
    if group.mask is not None:
        return group.mask
    q, s = group.max_query, group.kv_len
    if group.is_causal:  # one sequence whose queries are all its keys
        return torch.ones(q, s, dtype=torch.bool, device=device).tril()[None, None]
    return torch.ones(1, 1, q, s, dtype=torch.bool, device=device)  # keys the plan kept are all visible


def key_bias(group: _Group, device: torch.device) -> torch.Tensor:  # [B, 1, 1, Qmax, S_pad] float32
    """0 where a query sees a key, -inf elsewhere (keys padded to whole tiles); built once per
    step and shared by every layer."""
    if group.tile_mask is None:
        mask = F.pad(_full_mask(group, device), (0, _ceil_to(group.kv_len, KEY_TILE) - group.kv_len), value=False)
        zero = torch.zeros((), device=device)
        group.tile_mask = torch.where(mask, zero, torch.full_like(zero, float("-inf"))).unsqueeze(2)
    return group.tile_mask


def attend_group_invariant(
    group: _Group,
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [B, Hkv, S', D] dequantized, S' >= kv_len
    v_cache: torch.Tensor,  # [B, Hkv, S', D]
    scale: float,
) -> torch.Tensor:  # [N, Hq, D] the group's real query rows, in q's dtype
    """`attend_tiles` over caches laid out as SDPA takes them (the backend gathers pages straight
    into the tile layout instead)."""
    s_pad = _ceil_to(group.kv_len, KEY_TILE)
    batch, kv_heads, _, head_dim = k_cache.shape
    padded = [cache[:, :, :s_pad] if cache.shape[2] >= s_pad
              else F.pad(cache[:, :, : group.kv_len], (0, 0, 0, s_pad - group.kv_len)) for cache in (k_cache, v_cache)]
    keys_t = padded[0].float().transpose(2, 3).contiguous().view(batch * kv_heads, head_dim, s_pad)
    values = padded[1].float().contiguous().view(batch * kv_heads, s_pad, head_dim)
    return attend_tiles(group, q, keys_t, values, scale)


def attend_tiles(
    group: _Group,
    q: torch.Tensor,  # [T, Hq, D]
    keys_t: torch.Tensor,  # [B*Hkv, D, S_pad] float32, contiguous, S_pad = kv_len rounded up to KEY_TILE
    values: torch.Tensor,  # [B*Hkv, S_pad, D] float32, contiguous
    scale: float,
) -> torch.Tensor:  # [N, Hq, D] the group's real query rows, in q's dtype
    batch, max_q = group.num_seqs, group.max_query
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = keys_t.shape[0] // batch
    g = q_heads // kv_heads
    s_pad = keys_t.shape[2]
    n_k = s_pad // KEY_TILE

    queries = q.index_select(0, group.query_rows.reshape(-1)).float()  # [B*Qmax, Hq, D]
    queries = queries.view(batch, max_q, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Qmax, D]
    rows = g * max_q
    queries = queries.reshape(batch * kv_heads, rows, head_dim)  # [B*Hkv, G*Qmax, D]
    if rows < MIN_ROWS:
        queries = F.pad(queries, (0, 0, 0, MIN_ROWS - rows))

    # Each score is one dot product over D: the same bits for any number of rows (>= MIN_ROWS) and
    # keys, with the keys a contiguous [D, S_pad] per head (as a transposed view, MKL's 2-row
    # product rounded differently from 3 rows and up).
    scores = torch.bmm(queries * scale, keys_t)[:, :rows]  # [B*Hkv, G*Qmax, S_pad]
    scores = scores.view(batch, kv_heads, g, max_q, s_pad) + key_bias(group, q.device)
    row_max = scores.amax(dim=-1, keepdim=True)  # exact in any order; finite: every query sees itself
    probs = torch.exp(scores - row_max).view(batch * kv_heads, rows, n_k, KEY_TILE)  # masked keys: exactly 0
    denominator = probs.sum(dim=-1).cumsum(dim=-1)[..., -1]  # [B*Hkv, G*Qmax]: tiles summed in order
    tiles = probs.permute(0, 2, 1, 3)  # [B*Hkv, nK, G*Qmax, KT]
    if rows < MIN_ROWS:
        tiles = F.pad(tiles, (0, 0, 0, MIN_ROWS - rows))
    tiles = tiles.reshape(batch * kv_heads * n_k, -1, KEY_TILE)
    value_tiles = values.view(batch * kv_heads * n_k, KEY_TILE, head_dim)
    out = torch.bmm(tiles, value_tiles).view(batch * kv_heads, n_k, -1, head_dim)[:, :, :rows]
    out = out.cumsum(dim=1)[:, -1]  # [B*Hkv, G*Qmax, D]: tiles summed in order
    out = out / denominator.unsqueeze(-1)
    out = out.view(batch, kv_heads, g, max_q, head_dim).permute(0, 3, 1, 2, 4)  # [B, Qmax, Hkv, G, D]
    out = out.reshape(batch * max_q, q_heads, head_dim).to(q.dtype)
    return out if out.shape[0] == group.valid_rows.numel() else out.index_select(0, group.valid_rows)


class BatchInvariantTorchBackend(TorchAttentionBackend):
    """The torch backend with `attend_group_invariant`: K/V gathered straight to float32, over
    page tables extended (with page 0, masked) to whole key tiles so that nothing is padded
    per layer."""

    name = "torch-invariant"
    batch_invariant = True

    def __init__(self, layout: KVLayout) -> None:
        super().__init__(layout)
        self._scales: dict[tuple[float, float], torch.Tensor] = {}

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        page_size = self.layout.page_size
        for group in self._plan.groups:
            pages = -(-_ceil_to(group.kv_len, KEY_TILE) // page_size)
            if pages > group.page_table.shape[1]:
                group.page_table = F.pad(group.page_table, (0, pages - group.page_table.shape[1]))

    def _attend(self, group: _Group, q: torch.Tensor, kv_cache: torch.Tensor, spec: LayerSpec,
                scale: float) -> torch.Tensor:
        keys_t, values = self._gather_tiles(group, kv_cache, spec)
        return attend_tiles(group, q, keys_t, values, scale)

    def _gather_tiles(self, group: _Group, kv_cache: torch.Tensor,
                      spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor]:  # [B*Hkv, D, S_pad], [B*Hkv, S_pad, D]
        """Both planes of the group's pages in one gather and one dequantization, then each
        copied once into its tile layout (a third of the ops of gathering K and V apart)."""
        batch, num_pages = group.page_table.shape
        s_pad = _ceil_to(group.kv_len, KEY_TILE)
        pages = kv_cache.index_select(0, group.page_table.reshape(-1))  # [B*P, 2, ps, H, D] (NHD) / [B*P, 2, H, ps, D]
        scaled = is_fp8_dtype(pages.dtype) and (spec.k_scale != 1.0 or spec.v_scale != 1.0)  # as dequantize reads
        pages = dequantize(pages, torch.float32)
        if scaled:
            pages = pages * self._plane_scales(spec)
        if self.layout.order == "NHD":
            _, _, page_size, heads, head_dim = pages.shape
            by_seq = pages.view(batch, num_pages, 2, page_size, heads, head_dim).permute(2, 0, 4, 1, 3, 5)
        else:
            _, _, heads, page_size, head_dim = pages.shape
            by_seq = pages.view(batch, num_pages, 2, heads, page_size, head_dim).permute(2, 0, 3, 1, 4, 5)
        by_seq = by_seq.reshape(2, batch * heads, num_pages * page_size, head_dim)[:, :, :s_pad]  # [2, B*H, S_pad, D]
        return by_seq[0].transpose(1, 2).contiguous(), by_seq[1].contiguous()

    def _plane_scales(self, spec: LayerSpec) -> torch.Tensor:  # [1, 2, 1, 1, 1]
        key = (spec.k_scale, spec.v_scale)
        if key not in self._scales:
            self._scales[key] = torch.tensor(key, dtype=torch.float32).view(1, 2, 1, 1, 1)
        return self._scales[key]


def make_batch_invariant(model: torch.nn.Module, torch_attention: bool = True) -> str | None:
    """Set up this model's forward to be batch-invariant on this machine; why it cannot be, or None.

    Measured here, not assumed (BLAS and oneDNN choose kernels per shape and per CPU):
    every packed linear gets the longest chunk within which each row rounds as it would
    alone (`invariant_chunk_rows`), any other linear must already be invariant up to 512
    rows, and, where the model will attend through torch (`torch_attention`; the native C
    kernels are invariant by construction), `attend_group_invariant` must give a row the same
    bits in a decode, a verify, a batch and a prefill chunk. (On an AMD EPYC the torch path
    failed that probe, MKL's batched product rounding a row by the row count, while the
    native kernels passed: the probe is the torch path's alone.)"""
    generator = torch.Generator().manual_seed(0)
    packed: dict[tuple, list[PackedLinear]] = {}
    others = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            packed.setdefault((module.in_features, module.out_features, module.weight.dtype), []).append(module)
        elif isinstance(module, torch.nn.Linear | TiledLinear):  # tiled: invariant by construction, checked all the same
            others.setdefault((module.in_features, module.out_features, module.weight.dtype), module)
    for (in_features, out_features, dtype), layers in packed.items():
        chunk = invariant_chunk_rows(layers[0])
        if chunk is None:
            return f"oneDNN's packed {in_features}->{out_features} ({dtype}) product rounds a row by the row count"
        for layer in layers:
            layer.chunk_rows = chunk
            layer.plain_rows = frozenset()  # one kernel at every row count
    with torch.inference_mode():
        for (in_features, out_features, dtype), module in others.items():
            x = torch.randn(512, in_features, generator=generator).to(dtype)
            alone = torch.cat([module(x[r : r + 1]) for r in range(x.shape[0])])
            if not all(torch.equal(module(x[:rows]), alone[:rows]) for rows in (2, 9, 16, 64, 512)):
                return f"a {in_features}->{out_features} ({dtype}) linear rounds a row by the row count"
        attention = next((m for m in model.modules() if hasattr(m, "num_kv_heads") and hasattr(m, "head_dim")), None)
        if attention is None or not torch_attention:
            return None
        return _attention_problem(attention.num_heads, attention.num_kv_heads, attention.head_dim, generator)


def _attention_problem(q_heads: int, kv_heads: int, head_dim: int, generator: torch.Generator) -> str | None:
    """Run `attend_group_invariant` on random pages the ways a step can see one row: a decode,
    a verify of 9, a batch of decodes, a prefill chunk. Any other bits for the same row: why."""
    page_size, length = 16, 200
    cpu = torch.device("cpu")
    k_cache = torch.randn(3, kv_heads, 512, head_dim, generator=generator)  # [B, Hkv, S, D]: 3 sequences' keys
    v_cache = torch.randn(3, kv_heads, 512, head_dim, generator=generator)
    queries = torch.randn(length, q_heads, head_dim, generator=generator)  # the first sequence's queries by position
    tables = [list(range(32))] * 3

    def rows(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:  # the first sequence's output rows
        meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, page_tables=tables[:len(seq_lens)],
                                       page_size=page_size, device=cpu)
        group = build_plan(meta, page_size).groups[0]
        q = [queries[seq_lens[0] - query_lens[0]: seq_lens[0]]]
        q += [torch.randn(n, q_heads, head_dim, generator=generator) for n in query_lens[1:]]
        out = attend_group_invariant(group, torch.cat(q), k_cache[: len(seq_lens)], v_cache[: len(seq_lens)], 0.125)
        return out[: query_lens[0]]

    decodes = torch.cat([rows([1], [p + 1]) for p in range(150, 159)])
    ways = {"a verify of 9": rows([9], [159]), "a batch of 3 decodes and verifies": rows([9, 1, 5], [159, 97, 180]),
            "a prefill chunk": rows([40], [159])[-9:]}
    for way, got in ways.items():
        if not torch.equal(got, decodes):
            return f"attention gives a row other bits in {way} than in its decode"
    return None
