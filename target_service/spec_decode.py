"""The accept/reject rule of speculative decoding, in one place (cf. gpt-fast).

Given K draft tokens and the target's K+1 rows of logits over `[last, d1..dK]`:
- greedy: keep the longest prefix where draft == target argmax, then the target's
  token at the first mismatch (or the bonus token after all K);
- sampled: accept d_i with probability min(1, p(d_i) / q(d_i)); on the first rejection
  draw from norm(max(p - q, 0)); after K acceptances draw the bonus from p. A greedy
  drafter has one-hot q. The output is distributed exactly as the target's samples.
"""

from __future__ import annotations

import torch

from common.row_argmax import argmax_last
from target_service.sampling import SamplingSpec, sample_from_probs, sampling_probs


def accept_greedy(draft: list[int], target_argmax: list[int]) -> list[int]:
    """target_argmax: K+1 ids. Returns the accepted drafts plus one target token."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return draft[:n] + [target_argmax[n]]


def rejection_sample(
    draft: list[int],
    target_probs: torch.Tensor,  # [K+1, V]
    draft_probs: torch.Tensor | None,  # [K, V]; None → one-hot at each draft token
    generator: torch.Generator | None,
) -> list[int]:
    """Speculative rejection sampling; returns accepted drafts plus one sampled token."""
    uniforms = torch.rand(len(draft), generator=generator, device=target_probs.device).tolist()
    # p(d_i) and q(d_i) for every position in one gather and one host copy each (not one sync per token)
    index = torch.tensor(draft, dtype=torch.long, device=target_probs.device).unsqueeze(1)  # [K, 1]
    ps = target_probs[: len(draft)].gather(1, index).squeeze(1).tolist()
    qs = [1.0] * len(draft) if draft_probs is None else draft_probs.gather(1, index).squeeze(1).tolist()
    for i, token in enumerate(draft):
        if uniforms[i] * qs[i] < ps[i]:
            continue
        residual = _residual(target_probs[i], draft_probs[i] if draft_probs is not None else None, token)
        return draft[:i] + [sample_from_probs(residual, generator)]
    return list(draft) + [sample_from_probs(target_probs[len(draft)], generator)]


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(p - q, 0)) for a [V] row; q None means one-hot at `token`."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def verify_tokens(
    draft: list[int],
    logits: torch.Tensor,  # [K+1, V] target logits over [last, d1..dK]
    spec: SamplingSpec,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The tokens a verify step emits for one sequence (1..K+1 of them)."""
    if spec.greedy:
        return accept_greedy(draft, argmax_last(logits).tolist())
    return rejection_sample(draft, sampling_probs(logits, spec), draft_probs, generator)


def verify_batch(
    spans: list[tuple[int, int, list[int]]],  # per sequence: its rows [lo, hi) of `logits` and its draft
    logits: torch.Tensor,  # [N, V] the rows of every sampling sequence, in order
    specs: list[SamplingSpec],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """verify_tokens for a whole step: the greedy sequences share one argmax and one host copy
    (one device sync per step, not one per sequence); sampled ones go one by one."""
    argmax = argmax_last(logits).tolist() if any(spec.greedy for spec in specs) else []  # [N]
    return [accept_greedy(draft, argmax[lo:hi]) if spec.greedy else verify_tokens(draft, logits[lo:hi], spec, gen)
            for (lo, hi, draft), spec, gen in zip(spans, specs, generators, strict=True)]
