"""The accept/reject rule: greedy prefix, and rejection sampling that keeps p exactly."""


from collections import Counter

import pytest
import torch

from target_service.sampling import SamplingSpec, make_generator
from target_service.spec_decode import accept_greedy, rejection_sample, verify_tokens

# chi-square critical values at significance 0.001
CHI2_CRIT = {4: 18.467, 24: 51.179}


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _counts(outcomes, size: int) -> torch.Tensor:
    """How often each of 0 .. size - 1 occurred, as a float tensor."""
    found = Counter(outcomes)
    return torch.tensor([float(found[i]) for i in range(size)])


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


def _one_draft_trials(one_hot: bool, n: int = 20000) -> list[list[int]]:
    """n verifies of one draft d ~ q against target rows [p, p] (K=1): what each emitted."""
    gen = make_generator(1234, torch.device("cpu"))
    target = torch.stack([P, P])  # K=1: [2, V]
    drafts = torch.multinomial(Q, n, replacement=True, generator=gen).tolist()  # d ~ q, one at a time below
    draft_probs = None if one_hot else Q[None]
    return [rejection_sample([d], target, draft_probs, gen) for d in drafts]


@pytest.fixture(scope="module")
def one_hot_trials() -> list[list[int]]:
    """The one-hot q trials, which the first-token and the acceptance-rate tests both read."""
    return _one_draft_trials(one_hot=True)


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_keeps_target_distribution_first_token(one_hot, request):
    trials = request.getfixturevalue("one_hot_trials") if one_hot else _one_draft_trials(one_hot=False)
    counts = _counts((out[0] for out in trials), 5)
    assert _chi_square(counts, P) < CHI2_CRIT[4]


def test_rejection_sampling_keeps_joint_of_two_positions():
    """K=2 drafts from q; the (first, second) emitted tokens follow p ⊗ p."""
    gen = make_generator(7, torch.device("cpu"))
    target = torch.stack([P, P, P])
    draft_probs = torch.stack([Q, Q])
    n = 30000
    drafts = torch.multinomial(Q, 2 * n, replacement=True, generator=gen).view(n, 2).tolist()  # [n, K=2] ~ q
    # a rejection at position 0: the next token would come from p at the next step
    next_steps = torch.multinomial(P, n, replacement=True, generator=gen).tolist()
    pairs = []
    for draft, next_step in zip(drafts, next_steps):
        out = rejection_sample(draft, target, draft_probs, gen)
        pairs.append(5 * out[0] + (out[1] if len(out) >= 2 else next_step))
    expected = torch.outer(P, P).flatten()
    assert _chi_square(_counts(pairs, 25), expected) < CHI2_CRIT[24]


def test_acceptance_rate_matches_theory(one_hot_trials):
    """With one-hot q at d ~ q, P(accept) = sum_d q(d) p(d)."""
    n = len(one_hot_trials)
    accepted = sum(len(out) == 2 for out in one_hot_trials)
    assert n == 20000 and accepted / n == pytest.approx(float((P * Q).sum()), abs=0.015)


def _rejection_sample_per_token(draft, target_probs, draft_probs, generator):
    """The rule as it was written before its gathers were batched: one host read per token."""
    from target_service.sampling import sample_from_probs
    from target_service.spec_decode import _residual

    uniforms = torch.rand(len(draft), generator=generator).tolist()
    for i, token in enumerate(draft):
        p = float(target_probs[i, token])
        q = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if uniforms[i] * q < p:
            continue
        residual = _residual(target_probs[i], draft_probs[i] if draft_probs is not None else None, token)
        return draft[:i] + [sample_from_probs(residual, generator)]
    return list(draft) + [sample_from_probs(target_probs[len(draft)], generator)]


@pytest.mark.parametrize("one_hot", [False, True])
def test_batched_gathers_draw_exactly_what_the_per_token_rule_drew(one_hot):
    """Same seed, same tokens: batching the p/q reads changes no draw."""
    source = torch.Generator().manual_seed(7)
    for trial in range(200):
        k = 1 + trial % 5
        target = torch.softmax(3 * torch.randn(k + 1, 12, generator=source), dim=-1)
        draft_probs = None if one_hot else torch.softmax(3 * torch.randn(k, 12, generator=source), dim=-1)
        draft = torch.randint(0, 12, (k,), generator=source).tolist()
        got = rejection_sample(draft, target, draft_probs, make_generator(trial, torch.device("cpu")))
        want = _rejection_sample_per_token(draft, target, draft_probs, make_generator(trial, torch.device("cpu")))
        assert got == want, trial


def test_verify_batch_equals_verify_tokens_per_sequence():
    """Greedy and sampled sequences in one step: the shared argmax changes nothing."""
    from target_service.spec_decode import verify_batch

    source = torch.Generator().manual_seed(3)
    drafts = [[1, 2, 3], [], [4, 4], [0], [5, 6, 7, 8]]
    specs = [SamplingSpec(), SamplingSpec(temperature=0.8, top_p=0.9), SamplingSpec(),
             SamplingSpec(temperature=1.2), SamplingSpec()]
    spans, lo = [], 0
    for draft in drafts:
        spans.append((lo, lo + len(draft) + 1, draft))
        lo += len(draft) + 1
    logits = 4 * torch.randn(lo, 10, generator=source)
    for draft, (a, b, _) in zip(drafts, spans):  # make some greedy drafts right, so acceptance varies
        argmax = logits[a:b].argmax(dim=-1).tolist()
        draft[: len(draft) // 2 + 1] = argmax[: min(len(draft), len(draft) // 2 + 1)]

    def generators():
        return [None if spec.greedy else make_generator(i, torch.device("cpu")) for i, spec in enumerate(specs)]

    got = verify_batch(spans, logits, specs, generators())
    want = [verify_tokens(draft, logits[a:b], spec, gen)
            for (a, b, draft), spec, gen in zip(spans, specs, generators())]
    assert got == want
    assert got[0][:2] == drafts[0][:2] and len(got[4]) >= 3  # accepted prefixes were exercised
