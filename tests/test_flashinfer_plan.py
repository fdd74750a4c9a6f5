"""The FlashInfer backend on a CPU: its plan inputs, and its orchestration over a model of the kernels.

FlashInfer itself needs CUDA (tests/gpu/run_gpu_checks.py runs it). Here:
- the plan inputs built from page tables (indptr, indices, last page lengths, append
  positions) name exactly the slots the torch backend writes and reads, query by query,
  for prefill, chunked prefill, K+1 verify, decode, mixed batches and non-causal blocks;
- the backend, driving `ReferenceKernels` (a pure-torch model of the FlashInfer calls it
  makes, with their 0.7.2 signatures), gives the torch backend's outputs and leaves the
  same pages, for NHD and HND, float32, bf16 and fp8 pages (scaled), through a whole model;
- one plan per step shared by every layer, wrappers and workspace built once;
- selection (`--attention-backend`), page-order preference, and clear errors.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from common.attention import TorchAttentionBackend, build_plan
from common.attention_backends import select_backend
from common.attention_metadata import AttentionMetadata
from common.flashinfer_backend import FlashInferAttentionBackend, build_plan_inputs, flashinfer_import_error
from common.kv_layout import LayerSpec, build_layout
from common.native_attention import NativeCpuAttentionBackend
from tests.flashinfer_reference import ReferenceKernels, append_slots, kv_slots, visible_keys

ORDERS = ["NHD", "HND"]
PAGE_SIZE = 4
HEAD_DIM = 64


class CpuFlashInfer(FlashInferAttentionBackend):
    """The backend with float32 allowed, so that the model of the kernels can be exact."""

    SUPPORTED_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    SUPPORTED_KV_DTYPES = (torch.float32, *FlashInferAttentionBackend.SUPPORTED_KV_DTYPES)


def shuffled_tables(seq_lens: list[int], seed: int, spare: int = 1) -> tuple[list[list[int]], int]:
    """Non-contiguous page ids (page 0 unused), sometimes one page more than needed."""
    need = [math.ceil(n / PAGE_SIZE) + (spare if i % 2 else 0) for i, n in enumerate(seq_lens)]
    ids = list(range(1, sum(need) + 1))
    random.Random(seed).shuffle(ids)
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    return tables, sum(need) + 1


def meta_for(spans: list[tuple[int, int]], tables: list[list[int]], causal: bool = True) -> AttentionMetadata:
    return AttentionMetadata.build(
        query_lens=[e - s for s, e in spans], seq_lens=[e for _, e in spans], page_tables=tables,
        page_size=PAGE_SIZE, device=torch.device("cpu"), causal=causal,
    )


# Steps as (start, end) per sequence; partial last pages everywhere (PAGE_SIZE 4).
SCENARIOS = {
    "prefill": ([(0, 13), (0, 5), (0, 1), (0, 40), (0, 9)], True),
    "chunked_prefill": ([(8, 13), (0, 5), (37, 40)], True),
    "verify_k_plus_1": ([(12, 17), (4, 9), (30, 35)], True),
    "decode": ([(12, 13), (4, 5), (0, 1), (39, 40)], True),
    "mixed": ([(0, 13), (4, 5), (30, 35), (0, 40)], True),
    "non_causal_block": ([(9, 17), (1, 9), (0, 8)], False),
    "non_causal_single": ([(9, 17)], False),
    "causal_single_prefill": ([(0, 11)], True),
}


# ---------------------------------------------------------------------------------------
# Plan inputs


def test_plan_inputs_by_hand():
    meta = meta_for([(0, 5), (8, 9), (5, 8)], [[7, 2], [3, 8, 1, 6], [4, 5]])
    inputs = build_plan_inputs(meta)
    assert inputs.qo_indptr.tolist() == [0, 5, 6, 9]
    assert inputs.kv_indptr.tolist() == [0, 2, 5, 7]  # ceil(5/4), ceil(9/4), ceil(8/4) pages
    assert inputs.kv_indices.tolist() == [7, 2, 3, 8, 1, 4, 5]  # the unused 4th page of seq 1 is left out
    assert inputs.kv_last_page_len.tolist() == [1, 1, 4]
    assert inputs.batch_indices.tolist() == [0, 0, 0, 0, 0, 1, 2, 2, 2]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 8, 5, 6, 7]
    assert inputs.kv_lens().tolist() == [5, 9, 8]
    assert all(t.dtype == torch.int32 for t in (inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices,
                                                 inputs.kv_last_page_len, inputs.batch_indices, inputs.positions))
    assert inputs.max_query_len == 5 and not inputs.is_decode and inputs.causal
    decode = build_plan_inputs(meta_for([(4, 5), (8, 9)], [[7, 2], [3, 8, 1]]))
    assert decode.is_decode and decode.qo_indptr.tolist() == [0, 1, 2]


def torch_backend_walk(meta: AttentionMetadata) -> dict[int, list[int]]:
    """For each query row, the slots the torch backend's plan attends to, in key order."""
    plan = build_plan(meta, meta.page_size)
    seen: dict[int, list[int]] = {}
    for group in plan.groups:
        for bi in range(group.num_seqs):
            table = group.page_table[bi].tolist()
            for qi in range(group.max_query):
                row = int(group.query_rows[bi, qi])
                if row in seen or (qi > 0 and row == int(group.query_rows[bi, qi - 1])):
                    continue  # padding repeats the last real row
                if group.mask is not None:
                    positions = torch.nonzero(group.mask[bi, 0, qi]).squeeze(1).tolist()
                elif group.is_causal:
                    positions = list(range(qi + 1))
                else:
                    positions = list(range(group.kv_len))
                seen[row] = [table[p // meta.page_size] * meta.page_size + p % meta.page_size for p in positions]
    return seen


def flashinfer_walk(meta: AttentionMetadata) -> dict[int, list[int]]:
    inputs = build_plan_inputs(meta)
    seen = {}
    for row in range(inputs.num_tokens):
        b = int(inputs.batch_indices[row])
        query = row - int(inputs.qo_indptr[b])
        seen[row] = kv_slots(inputs, b)[: visible_keys(inputs, b, query)]
    return seen


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_inputs_walk_the_torch_backends_slots(name, seed):
    spans, causal = SCENARIOS[name]
    tables, _ = shuffled_tables([e for _, e in spans], seed)
    meta = meta_for(spans, tables, causal)
    inputs = build_plan_inputs(meta)
    assert append_slots(inputs).tolist() == meta.slot_mapping.tolist()  # the append writes the torch slots
    assert flashinfer_walk(meta) == torch_backend_walk(meta)  # every query reads the torch keys


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_append_writes_the_torch_backends_pages(order, kv_dtype):
    from common.attention import write_kv_to_pages
    from common.kv_quant import quantize
    from tests.flashinfer_reference import reference_append

    spans, _ = SCENARIOS["mixed"]
    tables, num_pages = shuffled_tables([e for _, e in spans], 3)
    meta = meta_for(spans, tables)
    spec = LayerSpec("target", 0, 2, HEAD_DIM, k_scale=0.5, v_scale=2.0)
    layout = build_layout(order=order, page_size=PAGE_SIZE, kv_dtype=kv_dtype, num_pages=num_pages, layers=[spec])
    spec = layout.layers[0]
    ours = torch.zeros(layout.region_shape(spec), dtype=layout.torch_dtype)
    theirs = torch.zeros_like(ours)
    k, v = torch.randn(2, meta.num_tokens, 2, HEAD_DIM).unbind(0)
    write_kv_to_pages(ours, k, v, meta.slot_mapping, order=order, page_size=PAGE_SIZE,
                      k_scale=spec.k_scale, v_scale=spec.v_scale)
    kq, vq = quantize(k, ours.dtype, spec.k_scale), quantize(v, ours.dtype, spec.v_scale)
    reference_append(kq, vq, theirs, build_plan_inputs(meta), order)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


# ---------------------------------------------------------------------------------------
# The backend over the model of the kernels vs the torch backend


class Pair:
    """One layer's pages twice: one driven by the torch backend, one by FlashInfer's."""

    def __init__(self, order: str, kv_dtype: str, *, q_heads: int = 8, kv_heads: int = 2, scales=(1.0, 1.0),
                 max_len: int = 48, num_seqs: int = 5, seed: int = 0) -> None:
        self.tables, num_pages = shuffled_tables([max_len] * num_seqs, seed)
        spec = LayerSpec("target", 0, kv_heads, HEAD_DIM, k_scale=scales[0], v_scale=scales[1])
        self.layout = build_layout(order=order, page_size=PAGE_SIZE, kv_dtype=kv_dtype, num_pages=num_pages,
                                   layers=[spec])
        self.spec = self.layout.layers[0]
        self.torch_cache = torch.zeros(self.layout.region_shape(self.spec), dtype=self.layout.torch_dtype)
        self.fi_cache = torch.zeros_like(self.torch_cache)
        self.kernels = ReferenceKernels()
        self.torch_backend = TorchAttentionBackend(self.layout)
        self.fi_backend = CpuFlashInfer(self.layout, kernels=self.kernels, workspace_bytes=1024)
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(num_seqs, max_len, q_heads, HEAD_DIM, generator=gen)
        self.k = torch.randn(num_seqs, max_len, kv_heads, HEAD_DIM, generator=gen)
        self.v = torch.randn(num_seqs, max_len, kv_heads, HEAD_DIM, generator=gen)

    def step(self, spans, causal=True, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = range(len(spans))
        meta = meta_for(spans, [self.tables[b] for b in seqs], causal)
        q, k, v = (torch.cat([x[b, s:e] for b, (s, e) in zip(seqs, spans)]).to(dtype) for x in (self.q, self.k, self.v))
        scale = HEAD_DIM**-0.5
        self.torch_backend.plan(meta)
        self.fi_backend.plan(meta)
        expected = self.torch_backend.forward(q, k, v, self.torch_cache, self.spec, scale)
        got = self.fi_backend.forward(q, k, v, self.fi_cache, self.spec, scale)
        assert torch.equal(self.torch_cache.view(torch.uint8), self.fi_cache.view(torch.uint8)), "pages differ"
        return got, expected


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kv_dtype,q_dtype,atol", [
    ("float32", torch.float32, 1e-5),
    ("bfloat16", torch.bfloat16, 2e-2),
    ("fp8_e4m3", torch.float32, 1e-5),
    ("fp8_e4m3", torch.bfloat16, 2e-2),
])
def test_backend_matches_the_torch_backend_step_by_step(order, kv_dtype, q_dtype, atol):
    pair = Pair(order, kv_dtype, scales=(0.5, 2.0) if kv_dtype.startswith("fp8") else (1.0, 1.0))
    steps = [
        ([(0, 13), (0, 5), (0, 1), (0, 40), (0, 9)], True),  # prefill (one > 32 queries)
        ([(13, 14), (5, 6), (1, 2), (40, 41), (9, 10)], True),  # decode: the decode wrapper
        ([(14, 19), (6, 11), (2, 7), (41, 46), (10, 15)], True),  # K+1 = 5 verify
        ([(19, 27), (11, 19), (7, 15)], False),  # DFlash-like non-causal blocks
        ([(27, 28), (19, 24), (15, 16), (46, 48)], True),  # mixed
    ]
    for spans, causal in steps:
        got, expected = pair.step(spans, causal, q_dtype)
        assert got.dtype == expected.dtype == q_dtype
        diff = (got.float() - expected.float()).abs().max().item()
        assert diff <= atol, f"{spans}: max abs diff {diff:.3g}"


def test_one_plan_per_step_shared_by_every_layer_and_buffers_built_once():
    pair = Pair("HND", "fp8_e4m3")
    backend, kernels = pair.fi_backend, pair.kernels
    meta = meta_for([(0, 9), (0, 3)], pair.tables[:2])
    q, k, v = torch.randn(12, 8, HEAD_DIM), torch.randn(12, 2, HEAD_DIM), torch.randn(12, 2, HEAD_DIM)
    backend.plan(meta)
    for _ in range(4):  # four layers
        backend.forward(q, k, v, pair.fi_cache, pair.spec, 0.125)
    assert kernels.calls == ["append", "new_prefill", "plan_prefill", "run_prefill"] + ["append", "run_prefill"] * 3
    kernels.calls.clear()
    for spans in ([(9, 10), (3, 4)], [(10, 11), (4, 5)]):  # two decode steps
        backend.plan(meta_for(spans, pair.tables[:2]))
        for _ in range(3):
            backend.forward(q[:2], k[:2], v[:2], pair.fi_cache, pair.spec, 0.125)
    assert kernels.calls.count("new_decode") == 1 and kernels.calls.count("plan_decode") == 2
    assert kernels.calls.count("run_decode") == 6 and "new_prefill" not in kernels.calls
    assert backend.num_plans == 3
    backend.plan(meta_for([(11, 16), (5, 10)], pair.tables[:2]))  # a verify step: prefill wrapper again
    backend.forward(q[:10], k[:10], v[:10], pair.fi_cache, pair.spec, 0.125)
    assert kernels.calls[-3:] == ["append", "plan_prefill", "run_prefill"]
    assert kernels.calls.count("new_prefill") == 0
    prefill_workspace, decode_workspace = kernels.workspaces  # one buffer, allocated once, shared by every wrapper
    assert decode_workspace is prefill_workspace


def test_layers_of_another_shape_get_their_own_plan_in_the_same_step():
    pair = Pair("NHD", "bfloat16")
    backend = pair.fi_backend
    meta = meta_for([(0, 6)], pair.tables[:1])
    backend.plan(meta)
    q8, q4 = torch.randn(6, 8, HEAD_DIM, dtype=torch.bfloat16), torch.randn(6, 4, HEAD_DIM, dtype=torch.bfloat16)
    k, v = torch.randn(2, 6, 2, HEAD_DIM, dtype=torch.bfloat16).unbind(0)
    backend.forward(q8, k, v, pair.fi_cache, pair.spec, 0.125)
    backend.forward(q4, k, v, pair.fi_cache, pair.spec, 0.125)
    backend.forward(q8, k, v, pair.fi_cache, pair.spec, 0.125)
    assert pair.kernels.calls.count("plan_prefill") == 2 and backend.num_plans == 2


def test_whole_model_matches_the_torch_backend():
    """A two-layer Qwen3 (head_dim 64) through prefill, decode and a verify step."""
    from common.qwen3 import Qwen3ForCausalLM
    from tests.tiny_models import qwen3_config

    torch.manual_seed(0)
    config = qwen3_config(97, head_dim=HEAD_DIM, num_attention_heads=4, num_key_value_heads=2)
    model = Qwen3ForCausalLM(config).eval()
    for order in ORDERS:
        logits = {}
        for name in ("torch", "flashinfer"):
            tables, num_pages = shuffled_tables([40, 40], 5)
            layout = build_layout(order=order, page_size=PAGE_SIZE, kv_dtype="float32", num_pages=num_pages,
                                  layers=model.kv_layer_specs())
            caches = [torch.zeros(layout.region_shape(s), dtype=layout.torch_dtype) for s in layout.layers]
            backend = TorchAttentionBackend(layout) if name == "torch" else CpuFlashInfer(
                layout, kernels=ReferenceKernels(), workspace_bytes=1024)
            ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
            outs = []
            for spans in ([(0, 17), (0, 9)], [(17, 18), (9, 10)], [(18, 23), (10, 15)]):
                meta = meta_for(spans, tables)
                flat = torch.cat([ids[b, s:e] for b, (s, e) in enumerate(spans)])
                pos = torch.cat([torch.arange(s, e) for s, e in spans])
                backend.plan(meta)
                with torch.inference_mode():
                    hidden, _ = model(flat, pos, meta, caches, backend)
                    outs.append(model.compute_logits(hidden))
            logits[name] = torch.cat(outs)
        assert (logits["torch"] - logits["flashinfer"]).abs().max().item() < 1e-4, order


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kv_dtype", ["float32", "fp8_e4m3"])
def test_dflash_blocks_match_the_torch_backend(order, kv_dtype):
    """The DFlash drafter's context writes and non-causal query blocks, batched, both backends."""
    from transformers import Qwen3Config

    from common.qwen3 import Qwen3ForCausalLM
    from draft_service.dflash_model import DFlashDraftModel, TargetHeads
    from tests.tiny_models import qwen3_config

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(qwen3_config(97, head_dim=HEAD_DIM)).eval()
    config = Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=HEAD_DIM, architectures=["DFlashDraftModel"], num_target_layers=2,
        dflash_config={"mask_token_id": 96, "target_layer_ids": [0, 1], "block_size": 5},
    )
    draft = DFlashDraftModel(config, TargetHeads(embed=target.embed, lm_head=target.lm_head)).eval()
    context_lens = [11, 6]
    tables, num_pages = shuffled_tables([n + 5 for n in context_lens], 7)
    layout = build_layout(order=order, page_size=PAGE_SIZE, kv_dtype=kv_dtype, num_pages=num_pages,
                          layers=draft.kv_layer_specs())
    features = torch.randn(sum(context_lens), draft.feature_width)
    positions = torch.cat([torch.arange(n) for n in context_lens])
    last = torch.tensor([3, 40])
    proposals = {}
    for name in ("torch", "flashinfer"):
        backend = TorchAttentionBackend(layout) if name == "torch" else CpuFlashInfer(
            layout, kernels=ReferenceKernels(), workspace_bytes=1024)
        caches = {s.index: torch.zeros(layout.region_shape(s), dtype=layout.torch_dtype) for s in layout.layers}
        meta = AttentionMetadata.build(query_lens=context_lens, seq_lens=context_lens, page_tables=tables,
                                       page_size=PAGE_SIZE, device=torch.device("cpu"))
        draft.write_context(features, positions, meta, caches, backend)
        proposals[name] = draft.propose(last, context_lens, tables, caches, backend, num_tokens=4)
    assert torch.equal(proposals["torch"].token_ids, proposals["flashinfer"].token_ids)
    assert (proposals["torch"].logits - proposals["flashinfer"].logits).abs().max().item() < 1e-3


# ---------------------------------------------------------------------------------------
# Selection, order preference, errors


def test_import_works_without_flashinfer():
    error = flashinfer_import_error()
    if error is None:
        pytest.skip("flashinfer imports here")
    assert "flashinfer" in error


def test_select_backend(monkeypatch):
    import common.flashinfer_backend as fib
    import common.flashinfer_probe as probe

    monkeypatch.setattr(probe, "flashinfer_runnable_reason", lambda *args: None)  # its kernels can run here
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_backend("torch", cuda) is TorchAttentionBackend
    assert select_backend("auto", cpu) is NativeCpuAttentionBackend  # the C kernels build on this machine
    with pytest.raises(ValueError, match="'native' is not available: the native kernels run on a CPU"):
        select_backend("native", cuda)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("flashinfer", cpu)
    monkeypatch.setattr(fib, "flashinfer_import_error", lambda: "flashinfer-python is not installed")
    assert select_backend("auto", cuda) is TorchAttentionBackend  # falls back, with a warning
    with pytest.raises(ValueError, match="not available: flashinfer-python is not installed"):
        select_backend("flashinfer", cuda)
    monkeypatch.setattr(fib, "flashinfer_import_error", lambda: None)
    assert select_backend("auto", cuda) is FlashInferAttentionBackend
    assert select_backend("flashinfer", cuda) is FlashInferAttentionBackend
    with pytest.raises(ValueError, match="must be one of"):
        select_backend("xformers", cuda)
    # the model's facts: auto falls back, an explicit choice says what to change
    fits = {"head_dims": (128,), "model_dtype": torch.bfloat16, "kv_dtype": torch.float8_e4m3fn}
    assert select_backend("flashinfer", cuda, **fits) is FlashInferAttentionBackend
    for misfit, message in (({"head_dims": (32, 128)}, "head_dim 32 is not one of"),
                            ({"model_dtype": torch.float32}, "computes in torch.float32"),
                            ({"kv_dtype": torch.float32}, "KV pages of torch.float32")):
        assert select_backend("auto", cuda, **{**fits, **misfit}) is TorchAttentionBackend
        with pytest.raises(ValueError, match=message):
            select_backend("flashinfer", cuda, **{**fits, **misfit})


@pytest.mark.parametrize("capability,order", [((8, 0), "NHD"), ((8, 9), "NHD"), ((9, 0), "HND"), ((10, 0), "HND")])
def test_preferred_order_follows_the_device(monkeypatch, capability, order):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    assert FlashInferAttentionBackend.preferred_order(cuda) == order
    assert set(FlashInferAttentionBackend.supported_orders(cuda)) == {"NHD", "HND"}
    assert FlashInferAttentionBackend.preferred_order(torch.device("cpu")) == "NHD"


def test_clear_errors():
    spec = LayerSpec("draft", 1, 1, 32)
    layout = build_layout(order="NHD", page_size=PAGE_SIZE, kv_dtype="float32", num_pages=4, layers=[spec])
    backend = FlashInferAttentionBackend(layout, kernels=ReferenceKernels(), workspace_bytes=64)
    cache = torch.zeros(layout.region_shape(layout.layers[0]))
    q, kv = torch.zeros(3, 4, 32), torch.zeros(3, 1, 32)
    with pytest.raises(RuntimeError, match="plan\\(meta\\) must be called"):
        backend.forward(q, kv, kv, cache, layout.layers[0], 1.0)
    backend.plan(meta_for([(0, 3)], [[1]]))
    with pytest.raises(RuntimeError, match="planned for 3 tokens, got 2"):
        backend.forward(q[:2], kv[:2], kv[:2], cache, layout.layers[0], 1.0)
    with pytest.raises(ValueError) as info:
        backend.forward(q, kv, kv, cache, layout.layers[0], 1.0)
    message = str(info.value)
    for part in ("draft layer 1", "--dtype bfloat16", "float32 are not supported", "head_dim 32 is not one of",
                 "--attention-backend torch"):
        assert part in message
    with pytest.raises(ValueError, match="page_size"):
        backend.plan(AttentionMetadata.build(query_lens=[1], seq_lens=[1], page_tables=[[1]], page_size=8,
                                             device=torch.device("cpu")))
