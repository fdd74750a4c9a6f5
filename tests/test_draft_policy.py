"""The adaptive speculation policy as a pure function: deterministic inputs → the expected k.

Costs are injected tables (seconds by width), never timed."""

from __future__ import annotations

import pytest

from target_service.config import EngineConfig
from target_service.draft_policy import (AcceptanceEstimate, CostTable, DraftPolicy, choose_num_drafts,
                                         expected_tokens, isotonic)

K = 8
DECODE = 0.006  # seconds of a one-token forward


def affine(per_token: float, fixed: float = DECODE):
    """forward(T) = fixed + per_token · (T - 1)."""
    return lambda tokens: fixed + per_token * (tokens - 1)


def constant(seconds: float):
    return lambda width: seconds


def test_expected_tokens_is_one_plus_the_sum_of_running_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * K, K) == K + 1
    assert expected_tokens([0.9, 0.0, 1.0], 3) == pytest.approx(1.9)  # nothing survives a certain rejection


def test_drafts_that_are_never_accepted_are_never_asked_for():
    # even with a free drafter and a verify that costs as much as a decode: no gain, so k = 0
    assert choose_num_drafts([0.0] * K, K, 1, 1, affine(0.0), constant(0.0)) == 0
    assert choose_num_drafts([0.0] * K, K, 16, 16, affine(1e-4, 0.02), constant(0.001)) == 0


def test_a_verify_that_costs_more_than_the_acceptance_saves_gets_no_drafts():
    # p = 0.5: k=1 yields 1.5 tokens; a verify token costing 60% of a decode makes 1.5/1.6 < 1
    assert choose_num_drafts([0.5] * K, K, 1, 1, affine(0.6 * DECODE), constant(0.0)) == 0
    # the same acceptance with a slow drafter round trip (a whole decode per Propose)
    assert choose_num_drafts([0.5] * K, K, 1, 1, affine(0.0), lambda w: 0 if w <= 1 else DECODE) == 0


def test_cheap_drafts_that_are_always_accepted_get_all_k():
    assert choose_num_drafts([1.0] * K, K, 1, 1, affine(0.05 * DECODE), constant(0.001)) == K
    assert choose_num_drafts([1.0] * K, K, 8, 8, affine(0.01 * DECODE), constant(0.001)) == K


def test_the_batch_size_moves_the_choice():
    # each query token costs 1/6 of a one-token decode: one sequence gains from drafts (its
    # decode is mostly fixed cost), sixteen pay 16 tokens per draft position and do not
    forward = affine(DECODE / 6)
    acceptance = [0.7] * K
    assert choose_num_drafts(acceptance, K, 1, 1, forward, constant(0.0)) > 0
    assert choose_num_drafts(acceptance, K, 16, 16, forward, constant(0.0)) == 0


def test_falling_acceptance_shortens_the_draft():
    # p_1..p_3 high, then nothing: drafting past position 3 only costs
    acceptance = [0.95, 0.95, 0.95] + [0.0] * (K - 3)
    assert choose_num_drafts(acceptance, K, 1, 1, affine(0.02 * DECODE), constant(0.0)) == 3


def test_the_choice_never_exceeds_max_k():
    assert choose_num_drafts([1.0] * K, 3, 1, 1, affine(0.0), constant(0.0)) == 3
    assert choose_num_drafts([1.0] * K, 0, 1, 1, affine(0.0), constant(0.0)) == 0


def test_acceptance_estimate_learns_only_the_positions_it_tried():
    est = AcceptanceEstimate(4, alpha=0.5, prior=0.6)
    est.observe(num_draft=4, num_accepted=1)  # p1 hit, p2 miss, p3 and p4 untried
    assert est.values == pytest.approx([0.8, 0.3, 0.6, 0.6])
    est.observe(num_draft=4, num_accepted=4)  # all hit
    assert est.values == pytest.approx([0.9, 0.65, 0.8, 0.8])
    est.reset()
    assert est.values == [0.6] * 4


def test_cost_table_is_monotone_interpolated_and_extrapolated():
    table = CostTable(alpha=0.5, prior_slope=0.1)
    assert not table.known and table.estimate(5) == 0.0
    table.observe(4, 0.010)
    assert table.estimate(2) == 0.010  # flat below the narrowest width
    assert table.estimate(8) == pytest.approx(0.010 + 0.1 * 0.010 / 4 * 4)  # the prior slope
    table.observe(8, 0.008)  # noise: a wider step measured cheaper
    assert table.estimate(8) == table.estimate(4) == pytest.approx(0.009)  # pooled: never below a narrower width
    table.observe(8, 0.020)  # EWMA: 0.008 + 0.5 * (0.020 - 0.008) = 0.014
    assert table.estimate(8) == pytest.approx(0.014)
    assert table.estimate(6) == pytest.approx(0.012)
    assert table.estimate(12) == pytest.approx(0.018)  # the last slope
    table.observe(0, 1.0)  # nonsense widths are ignored
    assert table.estimate(1) == 0.010


def test_one_slow_outlier_does_not_make_every_wider_step_look_as_slow():
    table = CostTable()
    for width, seconds in ((1, 0.004), (2, 0.012), (3, 0.0044), (4, 0.0046), (5, 0.0048), (9, 0.0056)):
        table.observe(width, seconds)  # width 2 was measured once, during a stall
    estimates = [table.estimate(w) for w in range(1, 10)]
    assert estimates == sorted(estimates)  # still monotone
    assert estimates[-1] < 0.008  # the running maximum made it 0.012
    assert isotonic([3.0, 1.0, 2.0, 5.0]) == [2.0, 2.0, 2.0, 5.0]


def measured_policy(forward_per_token: float, propose_seconds: float, adaptive: bool = True) -> DraftPolicy:
    policy = DraftPolicy(K, adaptive=adaptive, probe_every=4)
    for tokens in range(1, K + 2):
        policy.record_forward(tokens, DECODE + forward_per_token * (tokens - 1))
    for width in range(1, K + 2):
        policy.record_propose(width, propose_seconds)
    return policy


def probe_positions(choices: list[int], usual: int) -> list[int]:
    return [i for i, k in enumerate(choices) if k != usual]


def test_policy_stops_asking_after_rejections_and_probes_ever_more_rarely():
    policy = measured_policy(0.05 * DECODE, 0.001)
    policy.max_probe_every = 32
    assert policy.decide(1, 1, K) > 0  # the prior (0.6 per position) says drafts pay here
    for _ in range(60):
        policy.record_verify(K, 0)  # every first draft rejected
    choices = [policy.decide(1, 1, K) for _ in range(200)]
    probes = probe_positions(choices, 0)
    assert {choices[i] for i in probes} == {1}  # a probe asks for one draft
    # each probe that finds drafts still do not pay doubles the gap, up to max_probe_every
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [8, 16, 32] and set(gaps[3:]) == {32}, probes


def test_policy_recovers_when_the_drafter_gets_good_again():
    policy = measured_policy(0.05 * DECODE, 0.001)
    for _ in range(60):
        policy.record_verify(K, 0)
    assert [policy.decide(1, 1, K) for _ in range(40)].count(0) == 37  # probes after 4, 8, 16 decisions
    for _ in range(60):  # the probes' drafts are accepted from now on
        policy.record_verify(K, K)
    choices = [policy.decide(1, 1, K) for _ in range(40)]
    assert choices.count(K) >= 30, choices
    # drafting pays again: probes (of k = 0, at K) come every probe_every decisions again
    tail = probe_positions(choices[choices.index(K):], K)
    assert all(b - a == 4 for a, b in zip(tail[1:], tail[2:])), choices


def test_policy_asks_for_k_before_anything_is_measured_and_fixed_always_asks_for_k():
    assert DraftPolicy(K).decide(1, 1, K) == K
    fixed = measured_policy(10 * DECODE, 1.0, adaptive=False)
    for _ in range(60):
        fixed.record_verify(K, 0)
    assert [fixed.decide(1, 1, K) for _ in range(8)] == [K] * 8
    assert fixed.decide(1, 1, 3) == 3  # the sequences' own limit still caps it


def test_forgetting_measurements_returns_to_the_start():
    policy = measured_policy(0.05 * DECODE, 0.001)
    for _ in range(60):
        policy.record_verify(K, 0)
    policy.forget_measurements()
    assert policy.decide(1, 1, K) == K


def test_the_policy_name_is_validated_in_the_config():
    assert EngineConfig(model="m").speculative_policy == "adaptive"
    assert EngineConfig(model="m", speculative_policy="fixed").speculative_policy == "fixed"
    with pytest.raises(ValueError, match="speculative_policy must be one of adaptive, fixed, got 'greedy'"):
        EngineConfig(model="m", speculative_policy="greedy")


def test_widths_far_past_the_measured_ones_are_not_extrapolated():
    """Costs measured at batch 1 (widths 1..9) price k = 1 for a batch of 8 (width 16), not
    k = 8 (width 72): the policy widens step by step, measuring each width first."""
    policy = DraftPolicy(K)
    for tokens in range(1, K + 2):
        policy.record_forward(tokens, DECODE * (1 + 0.01 * (tokens - 1)))  # verifies look almost free
        policy.record_propose(tokens, 0.0001)
    for _ in range(60):
        policy.record_verify(K, K)  # and every draft is accepted
    assert policy.forward.estimate(2 * (K + 1)) < float("inf") == policy.forward.estimate(2 * (K + 1) + 1)
    assert policy.decide(1, 1, K) == K
    assert policy.decide(8, 8, K) == 1  # width 16: within reach of the measured 9
    policy.record_forward(16, DECODE * 1.1)
    policy.record_propose(16, 0.0002)
    assert policy.decide(8, 8, K) == 3  # width 32 now within reach
