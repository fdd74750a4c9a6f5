"""Lossless in bfloat16: the batch-invariant attention and linears (common/invariant_attention.py).

A verify must give each row the bits a decode of it would, and so must a batch and a
prefill chunk; `make_batch_invariant` measures at load whether this machine's kernels allow
it (and cuts packed products into chunks where they do). These tests check the attention
against SDPA, the rows bit for bit through a real paged forward, that the choices follow
the measurements, and greedy speculative decoding through the engine in bfloat16."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

import common.invariant_attention as invariant
from common.attention import attend_group, build_plan
from common.attention_metadata import AttentionMetadata
from common.cpu_linear import PackedLinear, invariant_chunk_rows, native_cpu_bf16, pack_cpu_linears
from common.invariant_attention import (
    BatchInvariantTorchBackend,
    attend_group_invariant,
    make_batch_invariant,
)
from common.qwen3 import Qwen3ForCausalLM
from tests.paged_runner import CPU, PagedRunner, Seq
from tests.tiny_models import make_qwen3

needs_bf16 = pytest.mark.skipif(not native_cpu_bf16(), reason="oneDNN packs bfloat16 only where the CPU has it natively")


def _group_and_inputs(query_lens: list[int], seq_lens: list[int], causal: bool = True, heads=(6, 2), dim=32):
    generator = torch.Generator().manual_seed(sum(query_lens) + sum(seq_lens))
    page_size = 8
    tables = [list(range(i * 64, i * 64 + 64)) for i in range(len(seq_lens))]
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, page_tables=tables, page_size=page_size,
                                   device=CPU, causal=causal)
    group = build_plan(meta, page_size).groups[0]
    q = torch.randn(sum(query_lens), heads[0], dim, generator=generator)
    length = 64 * page_size
    k = torch.randn(len(seq_lens), heads[1], length, dim, generator=generator)
    v = torch.randn(len(seq_lens), heads[1], length, dim, generator=generator)
    return group, q, k, v


@pytest.mark.parametrize("query_lens, seq_lens, causal", [
    ([1], [37], True),  # a decode
    ([9], [130], True),  # a verify
    ([40], [40], True),  # a prefill (SDPA's own causal mask)
    ([9, 1, 5, 1], [100, 7, 64, 200], True),  # a padded batch
    ([8], [90], False),  # a DFlash-style block: no causal mask
])
def test_the_invariant_attention_computes_what_sdpa_does(query_lens, seq_lens, causal):
    group, q, k, v = _group_and_inputs(query_lens, seq_lens, causal)
    expected = attend_group(group, q, k, v, 0.2)
    got = attend_group_invariant(group, q, k, v, 0.2)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Qwen3ForCausalLM:
    path = make_qwen3(tmp_path_factory.mktemp("bf16"), num_hidden_layers=3, hidden_size=96, intermediate_size=224,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device=CPU)
    pack_cpu_linears(model, logging.getLogger(__name__))
    problem = make_batch_invariant(model)
    if problem is not None:
        pytest.skip(f"this CPU's kernels are not batch-invariant: {problem}")
    return model


@needs_bf16
def test_a_row_gets_the_same_bits_in_a_decode_a_verify_a_batch_and_a_prefill_chunk(bf16_model, shm_dir):
    rng = random.Random(0)
    vocab = bf16_model.vocab_size
    prompt, tail = [rng.randrange(vocab) for _ in range(45)], [rng.randrange(vocab) for _ in range(20)]
    others = [[rng.randrange(vocab) for _ in range(rng.randrange(5, 300))] for _ in range(6)]
    runner = PagedRunner(bf16_model, shm_dir, kv_dtype="fp8_e4m3", num_pages=1024)
    runner.backend = BatchInvariantTorchBackend(runner.backend.layout)
    try:
        decoded = Seq(prompt + tail)
        runner.step([decoded], [len(prompt)])
        decodes = [runner.step([decoded], [1])[0][0][0] for _ in tail]  # logits at positions 45..64

        verified = Seq(prompt + tail)
        runner.step([verified], [len(prompt)])
        verifies = [row for n in (9, 9, 2) for row in runner.step([verified], [n])[0][0]]

        batched = Seq(prompt + tail)
        crowd = [Seq(o + [1] * 30) for o in others]  # a prefill of 700+ rows, then decodes beside it
        runner.step([batched, *crowd], [len(prompt)] + [len(o) for o in others])
        in_batch = [runner.step([batched, *crowd], [1] * (1 + len(crowd)))[0][0][0] for _ in tail]

        chunked, rows = Seq(prompt + tail), []
        for start in range(0, len(prompt) + len(tail), 13):
            rows += runner.step([chunked], [min(13, len(prompt) + len(tail) - start)])[0][0]
        in_chunks = rows[len(prompt):]
    finally:
        runner.close()
    for way, got in (("a verify", verifies), ("a batch", in_batch), ("prefill chunks", in_chunks)):
        differing = [i for i, (a, b) in enumerate(zip(got, decodes, strict=True)) if not torch.equal(a, b)]
        assert not differing, f"positions {differing} of {way} differ from their decodes"


class _RoundsPastRows(nn.Module):
    """A stand-in packed layer whose product rounds each row differently from `bad_from` rows on."""

    def __init__(self, bad_from: int) -> None:
        super().__init__()
        self.in_features, self.weight, self.bad_from = 8, nn.Parameter(torch.ones(4, 8)), bad_from

    def _packed_product(self, flat: torch.Tensor) -> torch.Tensor:  # exact per row, unlike any real product
        out = flat[:, :4] * 3.0
        return out + 1e-3 if flat.shape[0] >= self.bad_from else out


@pytest.mark.parametrize("bad_from, expected", [(10**9, 512), (300, 256), (48, 32), (20, 16), (9, None), (2, None)])
def test_the_chunk_length_follows_the_measurement(bad_from, expected):
    """Padded row counts are 1-16, 24, 32, 48, ...: the longest chunk whose counts all agree."""
    assert invariant_chunk_rows(_RoundsPastRows(bad_from)) == expected


def test_a_chunked_packed_product_is_the_whole_product(monkeypatch):
    layer = PackedLinear(nn.Linear(64, 48))
    x = torch.randn(700, 64)
    expected = layer(x)
    layer.chunk_rows = 32
    torch.testing.assert_close(layer(x), expected)


def test_an_attention_that_is_not_invariant_is_refused(monkeypatch, tmp_path):
    """The probe runs the real attention: SDPA in its place (batch-dependent rounding) is caught."""
    path = make_qwen3(tmp_path, num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, device=CPU)
    monkeypatch.setattr(invariant, "attend_group_invariant", attend_group)
    problem = invariant._attention_problem(6, 3, 64, torch.Generator().manual_seed(0))
    assert problem is not None and "attention gives a row other bits" in problem
    assert make_batch_invariant(model) is not None


@needs_bf16
@pytest.mark.parametrize("native_forward", [True, False])
def test_speculative_greedy_in_bfloat16_equals_target_only(target_model, draft_lm, shm_dir, speculative_engine,
                                                           native_forward):
    """Through the engine: the bfloat16 target picks an invariant attention backend (and, where
    its products run tile-packed, the native forward), and speculative greedy output (an
    in-process draft model, K=4, one request and four at once) is token for token what the
    target gives alone."""
    from common.compiled_forward import decoder_stack
    from common.kv_layout import CacheConfig
    from common.native_forward import native_forward_problem
    from target_service.api_types import EngineRequest, SpeculationParams, StopParams
    from target_service.config import EngineConfig
    from target_service.engine import build_engine_core
    from tests.tiny_models import PROMPTS

    cache = CacheConfig(shm_dir=str(shm_dir), num_pages=512, page_size=8)

    def generate(core, prompts: list[str], speculate: bool) -> list[list[int]]:
        ids = [f"{speculate}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            core.add(EngineRequest(request_id, tuple(core.tokenizer.encode(prompt)),
                                   stop=StopParams(max_tokens=40, ignore_eos=True),
                                   speculation=SpeculationParams(disable=not speculate)))
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while any(core.in_flight(request_id) for request_id in ids):
            for out in core.step():
                tokens[out.request_id].extend(out.token_ids)
        return [tokens[request_id] for request_id in ids]

    plain = build_engine_core(EngineConfig(model=str(target_model), cache=cache, dtype="bfloat16",
                                           native_forward=native_forward))
    try:
        if not getattr(plain.runner.backend_cls, "batch_invariant", False):
            pytest.skip("this CPU's kernels are not batch-invariant (the engine logged why)")
        can_run = native_forward_problem(decoder_stack(plain.model), plain.runner.backend.layout.torch_dtype,
                                         plain.runner.backend_cls) is None
        assert (plain.runner.native_forward is not None) == (native_forward and can_run)
        expected = [generate(plain, [p], speculate=False)[0] for p in PROMPTS[:4]]
        assert all(len(tokens) == 40 for tokens in expected)  # each ran to max_tokens
        assert generate(plain, PROMPTS[:4], speculate=False) == expected  # a batch: the same tokens
    finally:
        plain.close()
    core = speculative_engine(target_model, draft_lm, cache=cache, dtype="bfloat16", num_speculative_tokens=4,
                              speculative_policy="fixed", native_forward=native_forward)
    try:
        assert [generate(core, [p], speculate=True)[0] for p in PROMPTS[:4]] == expected
        assert generate(core, PROMPTS[:4], speculate=True) == expected
        assert core.metrics.registry.get_sample_value("splitspec_spec_decode_num_accepted_tokens_total") > 0
    finally:
        core.close()
