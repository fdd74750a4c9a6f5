"""Logit shaping and min-p row by row against Hugging Face's logits processors and warpers:
every verify row i is shaped as a plain decode step after draft[:i] would be."""

from __future__ import annotations

import pytest
import torch

from target_service.api_types import InvalidRequestError, SamplingParams, StopParams
from target_service.logits_shaping import LogitsShaper, RowContext, shape_rows
from target_service.sampling import SamplingSpec, sampling_probs
from tests.shaping_reference import hf_processors

VOCAB = 40
EOS = 3


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=1.1, presence_penalty=0.4),
    SamplingParams(frequency_penalty=-0.7, presence_penalty=-1.5),
    SamplingParams(logit_bias=((5, 3.0), (7, -100.0), (11, 0.5)), banned_token_ids=(1, 2, 9)),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, logit_bias=((4, 2.0),),
                   banned_token_ids=(8,)),
]


@pytest.mark.parametrize("sampling", CASES)
@pytest.mark.parametrize("min_tokens", [0, 6])
def test_verify_rows_equal_transformers_after_each_draft_prefix(sampling, min_tokens):
    source = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, VOCAB, (7,), generator=source).tolist()
    output = torch.randint(0, VOCAB, (3,), generator=source).tolist() + [prompt[2]]
    draft = [output[0], prompt[1], 21, 21, EOS]  # repeats within the draft, of the output and of the prompt
    rows = 4 * torch.randn(len(draft) + 1, VOCAB, generator=source)  # [K+1, V]
    shaper = LogitsShaper.for_request(sampling, min_tokens, [EOS], torch.device("cpu"))
    got = shaper(rows.clone(), RowContext(prompt, output, draft))
    processors = hf_processors(sampling, len(prompt), min_tokens, EOS)
    for i in range(len(draft) + 1):
        input_ids = torch.tensor([prompt + output + draft[:i]])
        want = processors(input_ids, rows[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6, msg=f"row {i}")


def test_shape_rows_keeps_raw_rows_and_touches_only_shaping_sequences():
    source = torch.Generator().manual_seed(2)
    logits = torch.randn(5, VOCAB, generator=source)  # two sequences: rows [0, 3) and [3, 5)
    spans = [(0, 3, [4, 4]), (3, 5, [6])]
    shaper = LogitsShaper.for_request(SamplingParams(banned_token_ids=(0,)), 0, [], torch.device("cpu"))
    shaped = shape_rows(logits, spans, [None, (shaper, RowContext([1], [], [6]))])
    assert torch.equal(shaped[:3], logits[:3]) and torch.isinf(shaped[3:, 0]).all()
    assert not torch.isinf(logits).any()
    assert shape_rows(logits, spans, [None, None]) is logits


@pytest.mark.parametrize("min_p", [0.05, 0.3])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_min_p_equals_transformers_warper(min_p, temperature):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = 3 * torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    scores = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    want = torch.softmax(scores, dim=-1)
    got = sampling_probs(logits, SamplingSpec(temperature=temperature, min_p=min_p))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got == 0).any()


@pytest.mark.parametrize("fields, name", [
    (dict(presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(repetition_penalty=11.0), "sampling.repetition_penalty"),
    (dict(min_p=1.5), "sampling.min_p"),
    (dict(logit_bias=((1, 101.0),)), "sampling.logit_bias"),
    (dict(logit_bias=((1, 1.0), (1, 2.0))), "sampling.logit_bias"),
    (dict(logit_bias=tuple((i, 1.0) for i in range(1025))), "sampling.logit_bias"),
    (dict(banned_token_ids=tuple(range(1025))), "sampling.banned_token_ids"),
])
def test_out_of_range_shaping_is_refused_by_name(fields, name):
    with pytest.raises(InvalidRequestError) as exc_info:
        SamplingParams(**fields)
    assert exc_info.value.field_name == name


def test_min_tokens_past_max_tokens_is_refused():
    with pytest.raises(InvalidRequestError) as exc_info:
        StopParams(max_tokens=4, min_tokens=5)
    assert exc_info.value.field_name == "stop.min_tokens"
