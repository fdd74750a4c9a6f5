"""Per-sequence logit shaping: the one seam between the target's logits and the sampler.

A verify step gives a speculated sequence K+1 rows of logits over `[last, d1..dK]`; row i
predicts the token after draft[:i]. Every row is shaped exactly as a plain decode step
would shape it if draft[:i] had been generated: a penalty at row i counts the drafts before
i, min_tokens counts them too. Greedy argmax and rejection sampling then read the shaped
rows, so speculation changes nothing (target_service/spec_decode.py).

A `LogitsProcessor` is one shaping rule; a sequence's `LogitsShaper` runs its processors in
order over its rows. A processor that keeps state across steps (a grammar matcher, say)
reads `RowContext.output_ids`, which holds exactly the tokens emitted so far, so it can
catch up on what the last step accepted; whatever it advances through the drafts to mask
rows 1..K it must roll back before returning (the drafts may be rejected).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from target_service.api_types import SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowContext:
    """What precedes a sequence's rows: row i follows prompt + output + draft[:i]."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # emitted before this step
    draft: Sequence[int]  # row i follows draft[:i]; len(draft) + 1 rows


class LogitsProcessor(Protocol):
    def __call__(self, rows: torch.Tensor, context: RowContext) -> torch.Tensor:
        """rows: [R, V] float32 logits, R = len(context.draft) + 1; returns the shaped [R, V]
        (it may write into `rows`, which the caller owns)."""
        ...


def context_counts(base_ids: Sequence[int], draft: Sequence[int], num_rows: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct tokens of base_ids + draft ([U] long) and how often each occurs in the
    context of each row ([R, U] float32: base_ids, then draft[:i] for row i). Shaping touches
    only these U columns, not the whole vocabulary."""
    drafted = list(draft[: num_rows - 1])
    ids, inverse = torch.tensor([*base_ids, *drafted], dtype=torch.long).unique(return_inverse=True)  # [U], [B+D]
    counts = torch.zeros(num_rows, len(ids), dtype=torch.float32)  # [R, U]
    split = len(base_ids)
    counts += torch.bincount(inverse[:split], minlength=len(ids)).to(torch.float32)
    for i, column in enumerate(inverse[split:].tolist()):
        counts[i + 1 :, column] += 1
    return ids.to(device), counts.to(device)


@dataclass(frozen=True)
class BanTokens:
    """Banned token ids never come out."""

    token_ids: torch.Tensor  # [B] long

    def __call__(self, rows: torch.Tensor, context: RowContext) -> torch.Tensor:
        rows[:, self.token_ids] = NEG_INF
        return rows


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's logit_bias: a fixed number added to a token's logit."""

    token_ids: torch.Tensor  # [B] long
    biases: torch.Tensor  # [B] float32

    def __call__(self, rows: torch.Tensor, context: RowContext) -> torch.Tensor:
        rows[:, self.token_ids] += self.biases
        return rows


@dataclass(frozen=True)
class MinTokens:
    """EOS and the stop token ids cannot come out before `min_tokens` tokens were generated."""

    min_tokens: int
    stop_ids: torch.Tensor  # [S] long

    def __call__(self, rows: torch.Tensor, context: RowContext) -> torch.Tensor:
        masked = min(rows.shape[0], self.min_tokens - len(context.output_ids))  # rows i with len(output) + i < min
        if masked > 0:
            rows[:masked, self.stop_ids] = NEG_INF
        return rows


@dataclass(frozen=True)
class RepetitionPenalty:
    """Hugging Face's and vLLM's rule: a token of the prompt or generated so far has its logit
    divided by `penalty` when positive, multiplied when negative."""

    penalty: float

    def __call__(self, rows: torch.Tensor, context: RowContext) -> torch.Tensor:
        ids, counts = context_counts([*context.prompt_ids, *context.output_ids], context.draft, rows.shape[0],
                                     rows.device)  # [U], [R, U]
        values = rows[:, ids]  # [R, U]
        penalized = torch.where(values > 0, values / self.penalty, values * self.penalty)
        rows[:, ids] = torch.where(counts > 0, penalized, values)
        return rows


@dataclass(frozen=True)
class FrequencyPresencePenalty:
    """OpenAI's rule over the generated tokens (not the prompt): logit − frequency × count −
    presence × [count > 0]."""

    frequency: float
    presence: float

    def __call__(self, rows: torch.Tensor, context: RowContext) -> torch.Tensor:
        ids, counts = context_counts(context.output_ids, context.draft, rows.shape[0], rows.device)  # [U], [R, U]
        rows[:, ids] -= self.frequency * counts + self.presence * (counts > 0).to(rows.dtype)
        return rows


@dataclass
class LogitsShaper:
    """A sequence's processors, applied in order to its rows."""

    processors: list[LogitsProcessor]

    def __call__(self, rows: torch.Tensor, context: RowContext) -> torch.Tensor:
        for processor in self.processors:
            rows = processor(rows, context)
        return rows

    @classmethod
    def for_request(cls, sampling: SamplingParams, min_tokens: int, stop_ids: Sequence[int],
                    device: torch.device) -> LogitsShaper | None:
        """The processors a request's parameters ask for, in the public order; None when none."""
        processors: list[LogitsProcessor] = []
        if sampling.banned_token_ids:
            processors.append(BanTokens(_ids(sampling.banned_token_ids, device)))
        if sampling.logit_bias:
            ids, biases = zip(*sampling.logit_bias)
            processors.append(LogitBias(_ids(ids, device), torch.tensor(biases, dtype=torch.float32, device=device)))
        if min_tokens > 0 and stop_ids:
            processors.append(MinTokens(min_tokens, _ids(stop_ids, device)))
        if sampling.repetition_penalty != 1.0:
            processors.append(RepetitionPenalty(sampling.repetition_penalty))
        if sampling.frequency_penalty or sampling.presence_penalty:
            processors.append(FrequencyPresencePenalty(sampling.frequency_penalty, sampling.presence_penalty))
        return cls(processors) if processors else None


def _ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)


def shape_rows(logits: torch.Tensor, spans: list[tuple[int, int, list[int]]],
               shapers: list[tuple[LogitsShaper, RowContext] | None]) -> torch.Tensor:
    """[N, V] logits of a step's sampling sequences → the same rows shaped per sequence (a copy
    when any sequence shapes: the raw rows stay for logprobs)."""
    if all(s is None for s in shapers):
        return logits
    shaped = logits.float().clone()  # [N, V]
    for (lo, hi, _), entry in zip(spans, shapers, strict=True):
        if entry is not None:
            shaper, context = entry
            rows = shaped[lo:hi]  # [R, V], a view the processors may write into
            if (out := shaper(rows, context)) is not rows:
                shaped[lo:hi] = out
    return shaped
