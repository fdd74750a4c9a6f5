"""Log-probabilities of chosen tokens and their top alternatives, from the target's raw logits.

Raw means log_softmax of the logits the model computed, before any shaping, temperature or
truncation (vLLM's default, "raw_logprobs"): what lm-evaluation-harness's loglikelihood
wants, and the same whether a token came from a draft or from a plain step.
"""

from __future__ import annotations

import torch

from target_service.api_types import PositionLogprobs, TokenLogprob

PROMPT_ROWS_PER_BLOCK = 128  # prompt rows turned into logits at once ([128, V] float32, not [chunk, V])


def position_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[PositionLogprobs]:
    """logits: [M, V] raw rows; tokens: the M tokens chosen at them; top: alternatives per row."""
    if not tokens:
        return []
    logsm = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    index = torch.tensor(tokens, dtype=torch.long, device=logsm.device).unsqueeze(1)  # [M, 1]
    chosen = logsm.gather(1, index)  # [M, 1]
    ranks = ((logsm > chosen).sum(dim=-1) + 1).tolist()  # [M]
    chosen_values = chosen.squeeze(1).tolist()
    if top > 0:
        values, ids = torch.topk(logsm, min(top, logsm.shape[1]), dim=-1)  # [M, top]
        top_values, top_ids = values.tolist(), ids.tolist()
    else:
        top_values = top_ids = [[] for _ in tokens]
    return [PositionLogprobs(TokenLogprob(token, value, rank),
                             tuple(TokenLogprob(i, v, j + 1) for j, (i, v) in enumerate(zip(row_ids, row_values))))
            for token, value, rank, row_ids, row_values in zip(tokens, chosen_values, ranks, top_ids, top_values)]


def prompt_logprobs(model, hidden: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[PositionLogprobs]:
    """Logprobs of `tokens`, each predicted by the hidden state at the same index of `rows`,
    computed in blocks so a long prompt chunk never holds [chunk, V] logits at once."""
    out: list[PositionLogprobs] = []
    for start in range(0, len(rows), PROMPT_ROWS_PER_BLOCK):
        block = torch.tensor(rows[start : start + PROMPT_ROWS_PER_BLOCK], dtype=torch.long, device=hidden.device)
        logits = model.compute_logits(hidden[block])  # [B, V]
        out.extend(position_logprobs(logits, tokens[start : start + PROMPT_ROWS_PER_BLOCK], top))
    return out
