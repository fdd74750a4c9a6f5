"""The CPU attention backends (torch, torch batch-invariant, native C, native invariant) against
dense attention over contiguous K/V.

Each test gives every sequence random q/k/v for all its positions, feeds them to the
backend in steps (prefill, chunks, decode, K+1 verify, non-causal blocks) through
non-contiguous shuffled pages, and compares each step's output with plain SDPA over
the sequence's full K/V.

Tolerances: float32 pages 1e-5 abs. fp8 pages are compared two ways: with a reference
over the same quantize→dequantize round trip (1e-5 abs: the paging is exact), and with
the float32 reference (inputs ~N(0, 1)): e4m3 (3 mantissa bits) within
0.25 abs, e5m2 (2 mantissa bits) within 0.5 abs; the maxima measured over 10 seeds are
0.16 and 0.23.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from common.attention import TorchAttentionBackend, gather_kv_from_pages, read_kv_slots, write_kv_to_pages
from common.attention_backends import select_backend
from common.attention_metadata import AttentionMetadata
from common.invariant_attention import BatchInvariantTorchBackend
from common.kv_layout import LayerSpec, build_layout
from common.kv_quant import dequantize, quantize
from common.native_attention import BatchInvariantNativeBackend, NativeCpuAttentionBackend

PAGE_SIZE = 4
HEAD_DIM = 8


class Harness:
    """One layer's pages, random per-sequence q/k/v, and a dense reference."""

    backend_cls: type = TorchAttentionBackend

    def __init__(
        self,
        seq_lens: list[int],
        *,
        order: str = "NHD",
        kv_dtype: str = "float32",
        q_heads: int = 4,
        kv_heads: int = 2,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_needed = [math.ceil(n / PAGE_SIZE) for n in seq_lens]
        num_pages = sum(pages_needed) + 3
        spec = LayerSpec("target", 0, kv_heads, HEAD_DIM, k_scale=k_scale, v_scale=v_scale)
        self.layout = build_layout(
            order=order, page_size=PAGE_SIZE, kv_dtype=kv_dtype, num_pages=num_pages, layers=[spec]
        )
        self.spec = self.layout.layers[0]
        self.cache = torch.zeros(self.layout.region_shape(self.spec), dtype=self.layout.torch_dtype)
        ids = list(range(1, num_pages))  # page 0 stays unused, as padding
        random.Random(seed).shuffle(ids)
        self.tables: list[list[int]] = []
        for n in pages_needed:
            self.tables.append(ids[:n])
            ids = ids[n:]
        self.q = [torch.randn(n, q_heads, HEAD_DIM, generator=gen) for n in seq_lens]
        self.k = [torch.randn(n, kv_heads, HEAD_DIM, generator=gen) for n in seq_lens]
        self.v = [torch.randn(n, kv_heads, HEAD_DIM, generator=gen) for n in seq_lens]
        self.backend = self.backend_cls(self.layout)
        self.scale = HEAD_DIM**-0.5

    def step(self, spans: list[tuple[int, int]], causal: bool = True) -> list[torch.Tensor]:
        """Run positions [start, end) of each sequence as one batch; per-sequence outputs."""
        meta = AttentionMetadata.build(
            query_lens=[e - s for s, e in spans],
            seq_lens=[e for _, e in spans],
            page_tables=self.tables,
            page_size=PAGE_SIZE,
            device=torch.device("cpu"),
            causal=causal,
        )
        self.backend.plan(meta)
        q = torch.cat([self.q[b][s:e] for b, (s, e) in enumerate(spans)])  # [T, Hq, D]
        k = torch.cat([self.k[b][s:e] for b, (s, e) in enumerate(spans)])
        v = torch.cat([self.v[b][s:e] for b, (s, e) in enumerate(spans)])
        out = self.backend.forward(q, k, v, self.cache, self.spec, self.scale)
        return list(out.split([e - s for s, e in spans]))

    def reference(
        self, b: int, start: int, end: int, causal: bool = True, round_trip: bool = False
    ) -> torch.Tensor:
        k, v = self.k[b][:end], self.v[b][:end]  # [S, Hkv, D]
        if round_trip:
            dtype = self.layout.torch_dtype
            k = dequantize(quantize(k, dtype, self.spec.k_scale), torch.float32, self.spec.k_scale)
            v = dequantize(quantize(v, dtype, self.spec.v_scale), torch.float32, self.spec.v_scale)
        return dense_attention(self.q[b][start:end], k, v, start, causal, self.scale)


def dense_attention(q, k, v, q_start: int, causal: bool, scale: float) -> torch.Tensor:
    """q [Q, Hq, D] at positions q_start.., k/v [S, Hkv, D] → [Q, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = None
    if causal:
        q_pos = torch.arange(q_start, q_start + q.shape[0])
        mask = torch.arange(k.shape[1])[None, :] <= q_pos[:, None]  # [Q, S]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def check(h: Harness, outs, spans, causal=True, atol=1e-5, round_trip=False) -> float:
    worst = 0.0
    for b, ((s, e), out) in enumerate(zip(spans, outs)):
        if e == s:
            continue
        ref = h.reference(b, s, e, causal, round_trip)
        diff = (out - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff <= atol, f"sequence {b} positions {s}:{e}: max abs diff {diff:.3g} > {atol}"
    return worst


@pytest.fixture(autouse=True, params=[TorchAttentionBackend, BatchInvariantTorchBackend, NativeCpuAttentionBackend,
                                      BatchInvariantNativeBackend], ids=["sdpa", "invariant", "native", "native-invariant"])
def backend_cls(request, monkeypatch):
    """Every test runs through every CPU backend: the batch-invariant one (common/invariant_attention.py)
    and the native C kernels (common/native_attention.py) read the same pages their own way and must
    compute the same attention."""
    monkeypatch.setattr(Harness, "backend_cls", request.param)
    return request.param


ORDERS = ["NHD", "HND"]
LENS = [13, 5, 1, 40, 9]  # 40 > BATCHED_QUERY_MAX: a prefill that runs alone


@pytest.mark.parametrize("order", ORDERS)
def test_prefill_batch(order):
    h = Harness(LENS, order=order)
    spans = [(0, n) for n in LENS]
    check(h, h.step(spans), spans)


@pytest.mark.parametrize("order", ORDERS)
def test_chunked_prefill_then_decode(order):
    lens = [13, 5, 3, 40, 9]
    h = Harness(lens, order=order)
    steps = [
        [(0, 6), (0, 2), (0, 1), (0, 20), (0, 4)],
        [(6, 11), (2, 4), (1, 2), (20, 38), (4, 8)],  # chunks over KV already in pages
        [(11, 12), (4, 5), (2, 3), (38, 39), (8, 9)],  # decode
        [(12, 13), (5, 5), (3, 3), (39, 40), (9, 9)],  # some sequences have no query
    ]
    for spans in steps:
        check(h, h.step(spans), spans)


@pytest.mark.parametrize("order", ORDERS)
def test_decode_steps(order):
    lens = [9, 17, 4]
    total = [n + 3 for n in lens]
    h = Harness(total, order=order, seed=1)
    spans = [(0, n) for n in lens]
    check(h, h.step(spans), spans)
    for i in range(3):
        spans = [(n + i, n + i + 1) for n in lens]
        check(h, h.step(spans), spans)


@pytest.mark.parametrize("order", ORDERS)
def test_verify_k_plus_one(order):
    k = 4
    lens = [11, 6, 22]
    h = Harness([n + k + 1 for n in lens], order=order, seed=2)
    spans = [(0, n) for n in lens]
    check(h, h.step(spans), spans)
    spans = [(n, n + k + 1) for n in lens]
    check(h, h.step(spans), spans)


@pytest.mark.parametrize("order", ORDERS)
def test_mixed_prefill_and_decode_in_one_step(order):
    lens = [10, 50, 3]
    h = Harness(lens, order=order, seed=3)
    first = [(0, 9), (0, 10), (0, 3)]
    check(h, h.step(first), first)
    second = [(9, 10), (10, 50), (3, 3)]  # decode, a long chunk after a prefix, no query
    check(h, h.step(second), second)


@pytest.mark.parametrize("order", ORDERS)
def test_non_causal_block(order):
    """A DFlash-style block: each query sees every key of its sequence, itself included."""
    ctx, block = [7, 12], 5
    h = Harness([n + block for n in ctx], order=order, seed=4)
    spans = [(0, n) for n in ctx]
    check(h, h.step(spans), spans)
    spans = [(n, n + block) for n in ctx]
    check(h, h.step(spans, causal=False), spans, causal=False)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_gqa(q_heads, kv_heads):
    lens = [6, 35]
    h = Harness(lens, q_heads=q_heads, kv_heads=kv_heads, seed=5)
    spans = [(0, n) for n in lens]
    check(h, h.step(spans), spans)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kv_dtype,atol", [("fp8_e4m3", 0.25), ("fp8_e5m2", 0.5)])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
def test_fp8_pages(order, kv_dtype, atol, scales):
    lens = [12, 40, 3]
    total = [n + 2 for n in lens]
    h = Harness(total, order=order, kv_dtype=kv_dtype, k_scale=scales[0], v_scale=scales[1], seed=6)
    assert h.cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    spans = [(0, n) for n in lens]
    outs = h.step(spans)
    check(h, outs, spans, round_trip=True)
    check(h, outs, spans, atol=atol)
    spans = [(n, n + 2) for n in lens]
    outs = h.step(spans)
    check(h, outs, spans, round_trip=True)
    check(h, outs, spans, atol=atol)


@pytest.mark.parametrize("kv_dtype,rtol", [("bfloat16", 1 / 128), ("float16", 1 / 1024)])
def test_half_precision_pages(kv_dtype, rtol):
    lens = [10, 4]
    h = Harness(lens, kv_dtype=kv_dtype, k_scale=2.0, v_scale=3.0, seed=7)
    spans = [(0, n) for n in lens]
    outs = h.step(spans)
    check(h, outs, spans, round_trip=True)  # scales do not apply to non-fp8 pages
    check(h, outs, spans, atol=0.05)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float32])
def test_write_read_round_trip_with_scales(order, dtype):
    cache = torch.zeros(
        6, 2, *((PAGE_SIZE, 2, HEAD_DIM) if order == "NHD" else (2, PAGE_SIZE, HEAD_DIM)), dtype=dtype
    )
    k = torch.randn(5, 2, HEAD_DIM) * 30  # wide values: scales matter
    v = torch.randn(5, 2, HEAD_DIM) * 0.01
    slots = torch.tensor([5 * PAGE_SIZE + 3, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1, 0, 3 * PAGE_SIZE + 2])
    k_scale, v_scale = 4.0, 1 / 64
    write_kv_to_pages(cache, k, v, slots, order=order, page_size=PAGE_SIZE, k_scale=k_scale, v_scale=v_scale)
    k_out, v_out = read_kv_slots(
        cache, slots, order=order, page_size=PAGE_SIZE, dtype=torch.float32, k_scale=k_scale, v_scale=v_scale
    )
    rtol = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3, torch.float32: 1e-6}[dtype]
    fp8 = dtype != torch.float32  # fp8 subnormals are spaced 2**-9 (e4m3) / 2**-16 (e5m2) apart
    torch.testing.assert_close(k_out, k, rtol=rtol, atol=k_scale * 2**-8 if fp8 else 1e-5)
    torch.testing.assert_close(v_out, v, rtol=rtol, atol=v_scale * 2**-8 if fp8 else 1e-6)
    # The pages hold value / scale for fp8.
    raw = cache[5, 0, 3] if order == "NHD" else cache[5, 0, :, 3]
    expected = k[0] / k_scale if dtype != torch.float32 else k[0]
    torch.testing.assert_close(raw.float(), expected, rtol=rtol, atol=2**-8 if fp8 else 1e-6)
    # gather_kv_from_pages returns whole pages in sequence order.
    k_all, _ = gather_kv_from_pages(
        cache, torch.tensor([[2, 3]]), order=order, dtype=torch.float32, k_scale=k_scale, v_scale=v_scale
    )
    assert k_all.shape == (1, 2, 2 * PAGE_SIZE, HEAD_DIM)
    torch.testing.assert_close(k_all[0, :, 1], k[2], rtol=rtol, atol=k_scale * 2**-8 if fp8 else 1e-5)
    torch.testing.assert_close(
        k_all[0, :, PAGE_SIZE + 2], k[4], rtol=rtol, atol=k_scale * 2**-8 if fp8 else 1e-5
    )


def test_quantize_clamps_to_finite_fp8_range():
    x = torch.tensor([1e6, -1e6, float("inf"), 3.0])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = quantize(x, dtype)
        assert torch.isfinite(q.float()).all()
        assert q.float()[0] == torch.finfo(dtype).max and q.float()[1] == -torch.finfo(dtype).max
    assert (
        dequantize(quantize(torch.tensor([8.0]), torch.float8_e4m3fn, 4.0), torch.float32, 4.0).item() == 8.0
    )


def test_forward_without_plan_is_a_clear_error():
    h = Harness([4])
    with pytest.raises(RuntimeError, match="plan"):
        h.backend.forward(h.q[0], h.k[0], h.v[0], h.cache, h.spec, h.scale)
    h.step([(0, 4)])
    with pytest.raises(RuntimeError, match="planned for 4 tokens"):
        h.backend.forward(h.q[0][:2], h.k[0][:2], h.v[0][:2], h.cache, h.spec, h.scale)


def test_select_backend():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) is NativeCpuAttentionBackend  # this machine has a C compiler
    assert select_backend("auto", cpu, batch_invariant=True) is BatchInvariantNativeBackend
    assert select_backend("auto", cpu, kv_dtype=torch.float16) is TorchAttentionBackend  # pages it does not read
    assert select_backend("native", cpu) is NativeCpuAttentionBackend
    assert select_backend("torch", cpu) is TorchAttentionBackend
    assert TorchAttentionBackend.preferred_order(cpu) in TorchAttentionBackend.supported_orders(cpu)
    with pytest.raises(ValueError, match="flashinfer"):
        select_backend("flashinfer", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        select_backend("xformers", cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 4.0])
def test_fp8_e4m3_reads_what_torchs_own_conversion_gives_for_every_finite_code(dtype, scale):
    """kv_quant reads e4m3 pages through float16 (torch's own conversion is a scalar loop
    on a CPU): every finite code, subnormals and both zeros included, reads bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # [256]
    finite = ~torch.isnan(codes.float())
    expected = (codes.float() * scale if scale != 1.0 else codes.float()).to(dtype)
    got = dequantize(codes, dtype, scale)
    assert got.dtype == dtype
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(got[finite].signbit(), expected[finite].signbit())  # -0 stays -0
    assert (got[~finite].float().abs() > torch.finfo(torch.float8_e4m3fn).max * scale).all()
    # a strided view of pages (the gather hands over [B, H, S, D] views) reads the same
    pages = codes[torch.randperm(256, generator=torch.Generator().manual_seed(0))].view(4, 8, 2, 4)
    view = pages.transpose(1, 2)  # [4, 2, 8, 4], not contiguous
    torch.testing.assert_close(dequantize(view, dtype, scale), dequantize(view.contiguous(), dtype, scale),
                               equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_a_lone_sequence_plans_as_the_padded_path_would(causal):
    """The one-sequence plan (its rows a range, few ops) equals the general padded plan of
    that sequence, field by field: decodes, verifies, blocks, chunked and whole prefills,
    the sequence first or after others in the batch."""
    from common.attention import _build_padded_group, _build_single_group

    page_size = 4
    for query_lens, seq_lens, b in [([1], [1], 0), ([1], [9], 0), ([9], [40], 0), ([7], [7], 0), ([5], [13], 0),
                                    ([3, 9], [3, 30], 1), ([40, 2], [40, 17], 1), ([2, 6, 1], [9, 11, 5], 2)]:
        tables = [list(range(10 * i, 10 * i + -(-n // page_size))) for i, n in enumerate(seq_lens)]
        meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, page_tables=tables,
                                       page_size=page_size, device=torch.device("cpu"), causal=causal)
        fast, padded = _build_single_group(meta, b, meta.slot_mapping.device), _build_padded_group(
            meta, [b], meta.slot_mapping.device)
        case = (query_lens, seq_lens, b, causal)
        for name in ("page_table", "query_rows", "valid_rows", "token_rows"):
            assert torch.equal(getattr(fast, name), getattr(padded, name)), (name, case)
        assert (fast.kv_len, fast.is_causal) == (padded.kv_len, padded.is_causal), case
        assert (fast.mask is None) == (padded.mask is None), case
        if fast.mask is not None:
            assert torch.equal(fast.mask, padded.mask), case
