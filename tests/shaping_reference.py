"""Independent references for logit shaping: OpenAI's penalty formula and Hugging Face's
logits processors, composed in splitspec's public order."""

from __future__ import annotations

import torch

from target_service.api_types import SamplingParams


class OpenAIPenalties:
    """OpenAI's formula (platform docs, "frequency and presence penalties"), over the tokens
    generated after the prompt; Hugging Face has no processor for it."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def hf_processors(sampling: SamplingParams, prompt_len: int, min_tokens: int, eos: int):
    """The same rules as Hugging Face's processors, in splitspec's order."""
    from transformers import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    processors = []
    if sampling.banned_token_ids:
        processors.append(NoBadWordsLogitsProcessor([[t] for t in sampling.banned_token_ids], eos_token_id=None))
    if sampling.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in sampling.logit_bias}))
    if min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, min_tokens, eos))
    if sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.frequency_penalty or sampling.presence_penalty:
        processors.append(OpenAIPenalties(prompt_len, sampling.frequency_penalty, sampling.presence_penalty))
    return LogitsProcessorList(processors)
