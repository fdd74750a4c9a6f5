"""The bfloat16 decoder forward in one native call (common/native_forward.py): the values of the
torch forward up to rounding, each row's bits independent of the step's other rows, KV pages
written as the attention reads them, and crafted slots or page ids refused."""

from __future__ import annotations

import logging

import pytest
import torch

from common.attention_metadata import AttentionMetadata
from common.compiled_forward import decoder_stack
from common.cpu_linear import pack_cpu_linears
from common.kv_layout import build_layout
from common.native_attention import BatchInvariantNativeBackend, NativeCpuAttentionBackend
from common.native_forward import NativeForward, native_forward_problem, rounded_to_bf16
from common.native_linear import (
    KERNEL_ENV,
    KERNEL_NAMES,
    TileKernels,
    chosen_kernel,
    tile_kernels_unavailable_reason,
)
from common.qwen3 import Qwen3ForCausalLM
from tests.tiny_models import make_qwen3

log = logging.getLogger(__name__)
TILES_MISSING = tile_kernels_unavailable_reason()
pytestmark = pytest.mark.skipif(TILES_MISSING is not None, reason=f"no tile-packed bfloat16 products here: {TILES_MISSING}")
PAGE_SIZE = 16
# q rounded to bfloat16 (2^-9 relative) through two layers; 2.7-3.6e-3 measured
TILED_TOLERANCE = 1e-2
ALL = frozenset(KERNEL_NAMES)


def _on_tiles(kernel: str, rows: int, call) -> float:
    call()
    return 1e-6 if kernel == "tiles" else 2e-6  # seconds: the tiled kernel "measures" faster


def _packed_model(path):
    model = Qwen3ForCausalLM.from_pretrained(path, torch.bfloat16, "cpu")
    pack_cpu_linears(model, log, timer=_on_tiles)
    return model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _packed_model(make_qwen3(tmp_path_factory.mktemp("native-forward") / "m"))


# Head shapes whose attention over bfloat16 pages of 16 runs on AMX tiles (tile_attention.c): two
# and four query heads a KV head, 1-4 tiles of 32 dimensions
TILED_HEADS = {"dim64-group2": {"head_dim": 64}, "dim128-group2": {"head_dim": 128},
               "dim32-group4": {"head_dim": 32, "num_key_value_heads": 1}, "dim64-group4": {"head_dim": 64, "num_key_value_heads": 1}}


@pytest.fixture(scope="module")
def models_by_heads(tmp_path_factory):
    """A packed model per entry of TILED_HEADS ("dim16" for the plain tiny one), built once."""
    built = {}

    def model_for(heads: str):
        if heads not in built:
            path = make_qwen3(tmp_path_factory.mktemp("native-forward") / heads, **TILED_HEADS.get(heads, {}))
            built[heads] = _packed_model(path)
        return built[heads]
    return model_for


@pytest.fixture(params=list(TILED_HEADS))
def tiled_model(request, models_by_heads):
    return models_by_heads(request.param)


class Pool:
    """Every layer's pages, the invariant native backend, and steps run through a forward."""

    def __init__(self, model, kv_dtype: str = "bfloat16", order: str = "NHD", num_pages: int = 64,
                 page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self.layout = build_layout(order=order, page_size=page_size, kv_dtype=kv_dtype, num_pages=num_pages,
                                   layers=model.kv_layer_specs())
        self.caches = [torch.zeros(self.layout.region_shape(spec), dtype=self.layout.torch_dtype)
                       for spec in self.layout.layers]
        self.backend = BatchInvariantNativeBackend(self.layout)

    def step(self, forward, ids: list[int], query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
             capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, page_tables=tables,
                                       page_size=self.page_size, device=torch.device("cpu"))
        positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
        self.backend.plan(meta)
        with torch.inference_mode():
            return forward(torch.tensor(ids), torch.tensor(positions), meta, self.caches, self.backend, capture)


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_the_native_forward_computes_what_the_torch_forward_does(model, order, kv_dtype):
    """A prefill of two sequences then a decode of each, through both forwards on their own pages:
    the same hidden states up to bfloat16 rounding (the native one keeps float32 activations)."""
    native, torch_pool, native_pool = NativeForward(decoder_stack(model)), Pool(model, kv_dtype, order), Pool(model, kv_dtype, order)
    tables = [[3, 7, 9], [12, 4]]
    a, b = _tokens(30, 1), _tokens(20, 2)
    steps = [(a + b, [30, 20], [30, 20]), (_tokens(2, 3), [1, 1], [31, 21])]
    for ids, query_lens, seq_lens in steps:
        expected, _ = torch_pool.step(model, ids, query_lens, seq_lens, tables)
        got, _ = native_pool.step(native, ids, query_lens, seq_lens, tables)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        scale = expected.float().abs().max()
        assert ((got - expected.float()).abs().max() / scale) < 0.05
        logits_expected, logits_got = model.compute_logits(expected), model.compute_logits(got)
        assert (logits_got.argmax(-1) == logits_expected.argmax(-1)).float().mean() >= 0.9


def test_attention_on_tiles_computes_what_the_vector_kernel_does(tiled_model):
    """The same steps over pages of 16 (scores on AMX tiles) and of 8 (the vector kernel, which
    keeps q in float32): the same hidden states up to q's rounding to bfloat16, and the same
    greedy tokens but for near-ties. Two sequences' prefills, then a verify of 9 beside a decode."""
    native = NativeForward(decoder_stack(tiled_model))
    tiled, vector = Pool(tiled_model), Pool(tiled_model, page_size=8)
    a, b = _tokens(40, 1), _tokens(20, 2)
    steps = [(a + b, [40, 20], [40, 20]), (_tokens(9, 3) + _tokens(1, 4), [9, 1], [49, 21])]
    for ids, query_lens, seq_lens in steps:
        got, _ = tiled.step(native, ids, query_lens, seq_lens, [[1, 2, 3, 4], [5, 6]])
        expected, _ = vector.step(native, ids, query_lens, seq_lens, [list(range(1, 8)), list(range(8, 12))])
        error = ((got - expected).abs().max() / expected.abs().max()).item()
        log.info("tiled against vector attention: largest difference %.2e of the largest value", error)
        assert error < TILED_TOLERANCE
        logits_got, logits_expected = tiled_model.compute_logits(got), tiled_model.compute_logits(expected)
        assert (logits_got.argmax(-1) == logits_expected.argmax(-1)).float().mean() >= 0.95


@pytest.fixture(params=["dim16-group2", *TILED_HEADS])
def rows_four_ways(request, models_by_heads):
    return _rows_four_ways(models_by_heads(request.param))


def _rows_four_ways(model) -> dict:
    native = NativeForward(decoder_stack(model))
    tokens, other = _tokens(49, 5), _tokens(25, 6)
    table, other_table = [1, 2, 3, 4], [5, 6]
    capture = (0, model.num_layers - 1)
    results = {}

    pool = Pool(model)
    pool.step(native, tokens[:40], [40], [40], [table])
    decodes = [pool.step(native, [tokens[p]], [1], [p + 1], [table], capture) for p in range(40, 49)]
    results["decodes"] = (torch.cat([h for h, _ in decodes]), {i: torch.cat([c[i] for _, c in decodes]) for i in capture})

    pool = Pool(model)
    pool.step(native, tokens[:40], [40], [40], [table])
    results["verify"] = pool.step(native, tokens[40:49], [9], [49], [table], capture)

    pool = Pool(model)
    pool.step(native, tokens[:40], [40], [40], [table])
    hidden, captured = pool.step(native, other + tokens[40:49], [25, 9], [25, 49], [other_table, table], capture)
    results["batch"] = (hidden[25:], {i: c[25:] for i, c in captured.items()})

    pool = Pool(model)
    hidden, captured = pool.step(native, tokens, [49], [49], [table], capture)
    results["prefill"] = (hidden[40:], {i: c[40:] for i, c in captured.items()})
    return results


def test_a_row_has_the_same_bits_in_a_decode_a_verify_a_batch_and_a_prefill(rows_four_ways):
    """What lossless bfloat16 speculation needs: rows 40-48 of one sequence computed one decode at a
    time, as one verify of 9, as a verify beside another sequence's prefill, and inside one prefill
    of 49 tokens, bit for bit; captured layers too."""
    _assert_four_ways_agree(rows_four_ways)


@pytest.mark.parametrize("kernel", [] if TILES_MISSING is not None
                         else [KERNEL_NAMES[k] for k in sorted(TileKernels.load().available)])
def test_every_product_kernel_keeps_a_row_s_bits_and_torch_s_values(kernel, tmp_path, monkeypatch):
    """The same four ways on each product kernel this CPU runs (`$SPLITSPEC_CPU_KERNEL` names it),
    and each forward's values those of the torch forward up to bfloat16 rounding."""
    monkeypatch.setenv(KERNEL_ENV, kernel)
    model = _packed_model(make_qwen3(tmp_path / "m", head_dim=64))
    assert {layer.self_attn.qkv_proj.kernel for layer in model.model.layers} == {chosen_kernel(kernel, ALL)}
    _assert_four_ways_agree(_rows_four_ways(model))
    native, torch_pool, native_pool = NativeForward(decoder_stack(model)), Pool(model), Pool(model)
    ids = _tokens(30, 1)
    expected, _ = torch_pool.step(model, ids, [30], [30], [[3, 7]])
    got, _ = native_pool.step(native, ids, [30], [30], [[3, 7]])
    assert ((got - expected.float()).abs().max() / expected.float().abs().max()) < 0.05


def _assert_four_ways_agree(rows_four_ways: dict) -> None:
    expected_hidden, expected_captured = rows_four_ways["decodes"]
    for way in ("verify", "batch", "prefill"):
        hidden, captured = rows_four_ways[way]
        assert torch.equal(hidden, expected_hidden), way
        for layer, values in expected_captured.items():
            assert torch.equal(captured[layer], values), (way, layer)


def test_the_last_capture_is_after_the_final_norm(model):
    native, pool = NativeForward(decoder_stack(model)), Pool(model)
    hidden, captured = pool.step(native, _tokens(12, 7), [12], [12], [[1]], capture=(0, model.num_layers - 1))
    assert torch.equal(captured[model.num_layers - 1], hidden)
    assert not torch.equal(captured[0], hidden)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_captures_go_straight_into_staging_rows_as_a_copy_would_put_them(model, dtype):
    """`capture_into` (rows of a staging buffer, its row stride wider than the captures): each layer's
    hidden states side by side in the order asked, rounded to the buffer's dtype as torch's copy
    rounds; the rows around them untouched; a layer asked twice refused."""
    native = NativeForward(decoder_stack(model))
    layers, hidden_size = (model.num_layers - 1, 0), model.config.hidden_size
    ids = _tokens(12, 9)
    _, expected = Pool(model).step(native, ids, [12], [12], [[1]], capture=layers)
    staging = torch.full((20, 3 * hidden_size), 7.0, dtype=dtype)  # a third slot the captures leave alone
    rows = staging[5:17, : 2 * hidden_size]
    pool = Pool(model)
    meta = AttentionMetadata.build(query_lens=[12], seq_lens=[12], page_tables=[[1]], page_size=PAGE_SIZE,
                                   device=torch.device("cpu"))
    pool.backend.plan(meta)
    with torch.inference_mode():
        _, captured = native(torch.tensor(ids), torch.arange(12), meta, pool.caches, pool.backend, layers, rows)
    assert captured == {}
    for slot, layer in enumerate(layers):
        assert torch.equal(rows[:, slot * hidden_size : (slot + 1) * hidden_size], expected[layer].to(dtype))
    assert bool((staging[:5] == 7).all() and (staging[17:] == 7).all() and (staging[:, 2 * hidden_size :] == 7).all())
    pool.backend.plan(meta)
    with pytest.raises(ValueError, match="each layer once"), torch.inference_mode():
        native(torch.tensor(ids), torch.arange(12), meta, pool.caches, pool.backend, (0, 0), rows)


def test_crafted_slots_and_page_ids_are_refused_and_nothing_is_written(model):
    native, pool = NativeForward(decoder_stack(model)), Pool(model, num_pages=8)
    before = [cache.clone() for cache in pool.caches]
    meta = AttentionMetadata.build(query_lens=[4], seq_lens=[20], page_tables=[[3, 5]], page_size=PAGE_SIZE,
                                   device=torch.device("cpu"))
    meta.page_table_tensor[0, 0] = 99  # the keys of an earlier page, claimed to live past the pool
    pool.backend.plan(meta)
    with pytest.raises(ValueError, match="a page id outside the pool"), torch.inference_mode():
        native(torch.tensor(_tokens(4, 8)), torch.arange(16, 20), meta, pool.caches, pool.backend)
    meta = AttentionMetadata.build(query_lens=[1], seq_lens=[1], page_tables=[[2]], page_size=PAGE_SIZE,
                                   device=torch.device("cpu"))
    meta.slot_mapping[0] = 8 * PAGE_SIZE + 3  # a slot past the pool
    pool.backend.plan(meta)
    with pytest.raises(ValueError, match="a slot outside the pool"), torch.inference_mode():
        native(torch.tensor([1]), torch.tensor([0]), meta, pool.caches, pool.backend)
    with pytest.raises(ValueError, match="capture_layers"):
        pool.step(native, [1], [1], [1], [[2]], capture=(model.num_layers,))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.caches))


def test_where_the_native_forward_cannot_run_it_says_why(model, tmp_path):
    assert native_forward_problem(decoder_stack(model), torch.bfloat16, BatchInvariantNativeBackend) is None
    assert "float8" in native_forward_problem(decoder_stack(model), torch.float8_e4m3fn, BatchInvariantNativeBackend)
    assert "batch-invariant native" in native_forward_problem(decoder_stack(model), torch.bfloat16, NativeCpuAttentionBackend)
    float32 = Qwen3ForCausalLM.from_pretrained(make_qwen3(tmp_path / "f"), torch.float32, "cpu")
    pack_cpu_linears(float32, log)
    assert "tile-packed" in native_forward_problem(decoder_stack(float32), torch.float32, BatchInvariantNativeBackend)


def _native_dflash(spec_models):
    """The spec pair's DFlash drafter, bfloat16, its block on the native forward."""
    from draft_service.dflash_model import DFlashDraftModel, TargetHeads
    from draft_service.target_heads import load_target_heads

    heads = load_target_heads(str(spec_models.target), torch.bfloat16, "cpu")
    pack_cpu_linears(heads, log)
    model = DFlashDraftModel.from_pretrained(spec_models.dflash, TargetHeads(embed=heads.embed, lm_head=heads.lm_head),
                                             torch.bfloat16, "cpu")
    pack_cpu_linears(model, log, whole_forward_on_tiles=True)
    assert model.use_native(heads.model.embed_tokens.weight) is None
    return model


def test_dflash_context_and_block_in_native_calls_compute_what_torch_does(spec_models):
    """DFlash's `Propose` with held context rows: the rows' K/V (`NativeForward.context_kv`) and the
    block through the draft layers, natively and eagerly on pools of their own: the same pages and
    logits up to bfloat16 rounding."""
    from draft_service.dflash_model import NewContext

    model = _native_dflash(spec_models)
    layout = build_layout(order="HND", page_size=PAGE_SIZE, kv_dtype="bfloat16", num_pages=8,
                          layers=model.kv_layer_specs())
    features = torch.randn(20, model.feature_width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    slots = torch.tensor([PAGE_SIZE + i for i in range(16)] + [2 * PAGE_SIZE + i for i in range(4)])

    def propose(native: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [torch.zeros(layout.region_shape(spec), dtype=layout.torch_dtype) for spec in layout.layers]
        native_block, model.native_block = model.native_block, model.native_block if native else None
        try:
            proposal = model.propose(torch.tensor([5]), [20], [[1, 2]], caches, NativeCpuAttentionBackend(layout),
                                     num_tokens=4, new_context=NewContext(features, torch.arange(20), slots))
        finally:
            model.native_block = native_block
        return proposal.logits, caches

    (eager_logits, eager_pages), (native_logits, native_pages) = propose(False), propose(True)
    assert not torch.equal(native_logits, eager_logits)  # two paths ran (float32 activations natively)
    for eager, native in zip(eager_pages, native_pages, strict=True):
        scale = eager.float().abs().max()
        assert scale > 0 and ((native.float() - eager.float()).abs().max() / scale) < 0.05
    scale = eager_logits.abs().max()
    assert ((native_logits - eager_logits).abs().max() / scale) < 0.05


def test_context_rows_inside_the_block_forward_are_context_kv_then_the_block_to_the_bit(spec_models):
    """The block's forward with DFlash's context rows (`context=`: one pass over each layer's weights)
    writes the pages and returns the rows that `context_kv` then the forward do, bit for bit; a
    crafted context slot is refused before anything is written."""
    from draft_service.dflash_model import block_metadata, block_positions

    model = _native_dflash(spec_models)
    native = model.native_block
    layout = build_layout(order="NHD", page_size=PAGE_SIZE, kv_dtype="bfloat16", num_pages=8,
                          layers=model.kv_layer_specs())
    features = torch.randn(20, model.feature_width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    context_slots = torch.tensor([PAGE_SIZE + i for i in range(16)] + [2 * PAGE_SIZE + i for i in range(4)])
    ids = torch.tensor([5, 9, 9, 9, 9])
    meta = block_metadata([20], [[1, 2]], 4, PAGE_SIZE, torch.device("cpu"))
    positions = block_positions([20], 4, torch.device("cpu"))

    def run(fused: bool, slots: torch.Tensor = context_slots,
            caches: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if caches is None:
            caches = [torch.zeros(layout.region_shape(spec), dtype=layout.torch_dtype) for spec in layout.layers]
        backend = NativeCpuAttentionBackend(layout)
        backend.plan(meta)
        args = (features, model.fc, model.hidden_norm.weight, torch.arange(20), slots)
        with torch.inference_mode():
            if fused:
                hidden, _ = native(ids, positions, meta, caches, backend, context=native.context_rows(*args))
            else:
                native.context_kv(*args, caches, backend)
                hidden, _ = native(ids, positions, meta, caches, backend)
        return hidden, caches

    (apart, apart_pages), (fused, fused_pages) = run(False), run(True)
    assert torch.equal(fused, apart)
    assert all(torch.equal(a, b) for a, b in zip(apart_pages, fused_pages, strict=True))
    assert any(bool(page.float().abs().sum() > 0) for page in fused_pages)
    crafted = context_slots.clone()
    crafted[3] = 8 * PAGE_SIZE  # past the pool
    untouched = [torch.zeros(layout.region_shape(spec), dtype=layout.torch_dtype) for spec in layout.layers]
    with pytest.raises(ValueError, match="a slot outside the pool"):
        run(True, crafted, untouched)
    assert all(not page.float().abs().sum() for page in untouched)


def test_positions_past_the_rotary_table_grow_it_and_negative_ones_are_refused(model):
    """The rotary table starts empty and doubles past the largest position asked: a token at position
    2,500 gets the rotation the torch forward gives it. A negative position is refused before
    anything is written."""
    native, native_pool, torch_pool = NativeForward(decoder_stack(model)), Pool(model), Pool(model)
    meta = AttentionMetadata.build(query_lens=[1], seq_lens=[1], page_tables=[[1]], page_size=PAGE_SIZE,
                                   device=torch.device("cpu"))
    ids = torch.tensor(_tokens(1, 9))
    with torch.inference_mode():
        for pool, forward in ((native_pool, native), (torch_pool, model)):
            pool.backend.plan(meta)
            hidden, _ = forward(ids, torch.tensor([2500]), meta, pool.caches, pool.backend)
            pool.hidden = hidden
        assert native._rope.shape[0] == 4096
        scale = torch_pool.hidden.float().abs().max()
        assert ((native_pool.hidden - torch_pool.hidden.float()).abs().max() / scale) < 0.05
        before = [c.clone() for c in native_pool.caches]
        native_pool.backend.plan(meta)
        with pytest.raises(ValueError, match="a position outside the rotary table"):
            native(ids, torch.tensor([-1]), meta, native_pool.caches, native_pool.backend)
        assert all(torch.equal(a, b) for a, b in zip(before, native_pool.caches))


def test_the_forwards_bfloat16_rounding_is_torchs_to_the_bit():
    """The 16-lane rounding the forward stores bfloat16 with (product inputs, captures): torch's
    nearest-even, ties both ways, denormals kept (the CPU's own conversion flushes them), overflow
    to infinity, NaN kept a NaN; whole vectors and the scalar tail."""
    special = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 1e-39, -3e-40, 1e-45, 3.4e38, -3.4e38,
                            float("inf"), float("-inf"), float("nan"), 65504.0, 1.0 / 3.0])
    values = torch.cat([special, torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 100,
                        torch.randn(37) * 1e-38])
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7FA00001, 0xFFC00001], dtype=torch.int64)
    values = torch.cat([values, ties.to(torch.int32).view(torch.float32)])
    got, expected = rounded_to_bf16(values), values.to(torch.bfloat16)
    nan = values.isnan()  # a NaN stays a NaN (its payload is torch's business: its paths differ)
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("causal", [False, True])
def test_a_whole_propose_in_one_native_call_drafts_what_the_forward_head_and_argmax_do(spec_models, causal):
    """`propose_greedy`'s one native call (block, layers with the held context rows, head, argmax) gives
    the drafts and pages of `propose`'s planned native forward, bfloat16 head and `argmax_last`, bit for
    bit, for two sequences of different lengths; crafted page ids and token ids are refused before
    anything is written."""
    import dataclasses

    from draft_service.dflash_model import NewContext

    model = _native_dflash(spec_models)
    model.dflash = dataclasses.replace(model.dflash, causal=causal)
    model.native_draft_block = model._native_draft_block()
    assert model.native_draft_block is not None
    layout = build_layout(order="NHD", page_size=PAGE_SIZE, kv_dtype="bfloat16", num_pages=8,
                          layers=model.kv_layer_specs())
    features = torch.randn(6, model.feature_width, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    positions = torch.tensor([16, 17, 18, 19, 5, 6])  # sequence 0's new rows, then sequence 1's
    slots = torch.tensor([2 * PAGE_SIZE + i for i in range(4)] + [3 * PAGE_SIZE + 5, 3 * PAGE_SIZE + 6])
    tables = [[1, 2], [3]]

    def run(one_call: bool, ids=(5, 11), tables=tables, caches=None) -> tuple[list[list[int]], list[torch.Tensor]]:
        if caches is None:
            caches = [torch.zeros(layout.region_shape(spec), dtype=layout.torch_dtype) for spec in layout.layers]
        backend = NativeCpuAttentionBackend(layout)
        context = NewContext(features, positions, slots)
        if one_call:
            drafts = model.propose_greedy(list(ids), [20, 7], tables, caches, backend, num_tokens=4,
                                          new_context=context, num_drafts=3)
        else:
            drafts = model.propose(torch.tensor(ids), [20, 7], tables, caches, backend, num_tokens=4,
                                   new_context=context, num_drafts=3).token_ids.tolist()
        return drafts, caches

    (planned, planned_pages), (one_call, one_call_pages) = run(False), run(True)
    assert one_call == planned and len(one_call) == 2 and all(len(d) == 3 for d in one_call)
    assert all(torch.equal(a, b) for a, b in zip(planned_pages, one_call_pages, strict=True))
    assert any(bool(page.float().abs().sum() > 0) for page in one_call_pages)
    for crafted, error in (({"tables": [[1, 2], [9]]}, "outside the pool"),
                           ({"ids": (5, model.native_draft_block.vocab)}, "a token id outside the vocabulary")):
        untouched = [torch.zeros(layout.region_shape(spec), dtype=layout.torch_dtype) for spec in layout.layers]
        with pytest.raises(ValueError, match=error):
            run(True, caches=untouched, **crafted)
        assert all(not page.float().abs().sum() for page in untouched)
