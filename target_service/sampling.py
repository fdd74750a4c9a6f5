"""Token sampling: greedy, temperature, min-p, top-k, top-p, with per-request generators.

`sampling_probs` is the one place logits become a distribution: the speculative rejection
sampler (target_service/spec_decode.py) uses it for verified tokens and for the plain,
draft-free token alike, so both follow the same "target's distribution".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from target_service.api_types import GREEDY_TEMPERATURE


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def sampling_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """[N, V] float logits → [N, V] probabilities after temperature, min-p, top-k and top-p
    (vLLM's order)."""
    scores = logits.float() / spec.temperature
    vocab = scores.shape[-1]
    if spec.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        floor = spec.min_p * probs.amax(dim=-1, keepdim=True)  # [N, 1]
        scores = scores.masked_fill(probs < floor, float("-inf"))
    if 0 < spec.top_k < vocab:
        kth = torch.topk(scores, spec.top_k, dim=-1).values[..., -1:]  # [N, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= spec.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
