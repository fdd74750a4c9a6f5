"""The accept/reject rule: greedy prefix, and rejection sampling that keeps p exactly."""


import pytest
import torch

from target_service.sampling import SamplingSpec, make_generator
from target_service.spec_decode import accept_greedy, rejection_sample, verify_tokens

# chi-square critical values at significance 0.001
CHI2_CRIT = {4: 18.467, 24: 51.179}


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_acceptance():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted + bonus
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_greedy_verify_uses_argmax():
    logits = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    assert verify_tokens([1, 2], logits, SamplingSpec(), None) == [1, 0]


P = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
Q = torch.tensor([0.50, 0.05, 0.05, 0.10, 0.30])  # a badly mismatched drafter


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_keeps_target_distribution_first_token(one_hot):
    gen = make_generator(1234, torch.device("cpu"))
    target = torch.stack([P, P])  # K=1: [2, V]
    counts = torch.zeros(5)
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(Q, 1, generator=gen))
        out = rejection_sample([d], target, None if one_hot else Q[None], gen)
        counts[out[0]] += 1
    assert _chi_square(counts, P) < CHI2_CRIT[4]


def test_rejection_sampling_keeps_joint_of_two_positions():
    """K=2 drafts from q; the (first, second) emitted tokens follow p ⊗ p."""
    gen = make_generator(7, torch.device("cpu"))
    target = torch.stack([P, P, P])
    joint = torch.zeros(5, 5)
    n = 30000
    for _ in range(n):
        drafts = [int(t) for t in torch.multinomial(Q, 2, replacement=True, generator=gen)]
        out = rejection_sample(drafts, target, torch.stack([Q, Q]), gen)
        if len(out) >= 2:
            joint[out[0], out[1]] += 1
        else:  # a rejection at position 0: the next token would come from p at the next step
            joint[out[0], int(torch.multinomial(P, 1, generator=gen))] += 1
    expected = torch.outer(P, P).flatten()
    assert _chi_square(joint.flatten(), expected) < CHI2_CRIT[24]


def test_acceptance_rate_matches_theory():
    """With one-hot q at d ~ q, P(accept) = sum_d q(d) p(d)."""
    gen = make_generator(3, torch.device("cpu"))
    target = torch.stack([P, P])
    accepted = 0
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(Q, 1, generator=gen))
        out = rejection_sample([d], target, None, gen)
        accepted += len(out) == 2
    assert accepted / n == pytest.approx(float((P * Q).sum()), abs=0.015)
