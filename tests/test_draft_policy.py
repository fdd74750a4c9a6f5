"""The adaptive speculation policy as a pure function: deterministic inputs → the expected k.

Costs are injected tables (seconds by width), never timed."""

from __future__ import annotations

import math

import pytest

from target_service.config import EngineConfig
from target_service.draft_policy import (AcceptanceEstimate, CostTable, Decision, DraftPolicy, choose_num_drafts,
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


def test_among_rates_within_min_gain_the_longest_draft_is_chosen():
    """Verify and Propose cost about the same at every width: the per-width estimates differ by
    noise (here widths 8 and 9 measured 3% and 5% dearer), and the longer draft is asked for."""
    acceptance = [0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.5, 0.5]
    noisy = {8: DECODE * 1.03, 9: DECODE * 1.05}

    def forward(tokens: int) -> float:
        return noisy.get(tokens, DECODE)

    rates = {k: expected_tokens(acceptance, k) / (forward(1 + k) + 0.3 * DECODE) for k in range(1, K + 1)}
    assert max(rates, key=rates.get) == 6  # the estimates' own best ...
    assert rates[8] >= rates[6] * 0.98
    assert choose_num_drafts(acceptance, K, 1, 1, forward, constant(0.3 * DECODE), min_gain=0.02) == K  # ... K wins
    assert choose_num_drafts(acceptance, K, 1, 1, forward, constant(0.3 * DECODE), min_gain=0.0) == 6


def test_the_choice_never_exceeds_max_k():
    assert choose_num_drafts([1.0] * K, 3, 1, 1, affine(0.0), constant(0.0)) == 3
    assert choose_num_drafts([1.0] * K, 0, 1, 1, affine(0.0), constant(0.0)) == 0


def test_acceptance_estimate_learns_only_the_positions_it_tried():
    est = AcceptanceEstimate(4, prior=0.6, strength=2.0)
    assert est.values == pytest.approx([0.6] * 4)  # nothing seen: the prior
    est.observe(num_draft=4, num_accepted=1)  # p1 hit, p2 miss, p3 and p4 untried
    assert (est.trials(1), est.trials(2), est.trials(3)) == (1.0, 1.0, 0.0)
    pooled = (1 + 2 * 0.6) / (2 + 2)  # one hit in two trials, shrunk toward the prior
    assert est.values == pytest.approx([(1 + 2 * pooled) / 3, (0 + 2 * pooled) / 3, pooled, pooled])
    for _ in range(200):
        est.observe(num_draft=4, num_accepted=4)  # all hit, many times: the counts outweigh the prior
    assert min(est.values) > 0.97
    est.reset()
    assert est.values == pytest.approx([0.6] * 4)


def test_acceptance_counts_fade_so_doubt_returns():
    est = AcceptanceEstimate(2, window=10.0)
    for _ in range(100):
        est.observe(num_draft=2, num_accepted=0)  # position 1 rejected every time; position 2 never tried
    sure = est.optimistic()
    assert est.values[0] < 0.05 and sure[0] - est.values[0] < 0.06  # tried often: a tight bound
    assert sure[1] - est.values[1] > 0.3  # never tried: wide open
    for _ in range(30):
        est.age()  # 30 decisions with nothing verified: e^-3 of the counts remain
    assert est.trials(1) == pytest.approx(100 * 0.9 ** 30)
    assert est.optimistic()[0] > sure[0] + 0.1  # the old lesson is now in doubt: worth a probe again


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="window must be >= 1"):
        AcceptanceEstimate(4, window=0.5)
    with pytest.raises(ValueError, match="1 <= probe_every <= max_probe_every"):
        DraftPolicy(4, probe_every=0)
    with pytest.raises(ValueError, match="1 <= probe_every <= max_probe_every"):
        DraftPolicy(4, probe_every=64, max_probe_every=32)
    with pytest.raises(ValueError, match="catch_up_horizon >= 1"):
        DraftPolicy(4, catch_up_horizon=0)


def test_cost_table_is_monotone_interpolated_and_extrapolated():
    table = CostTable(prior_slope=0.1)
    assert not table.known and table.estimate(5) == 0.0
    table.observe(4, 0.010)
    assert table.estimate(2) == 0.010  # flat below the narrowest width
    assert table.estimate(8) == pytest.approx(0.010 + 0.1 * 0.010 / 4 * 4)  # the prior slope
    table.observe(8, 0.008)  # noise: a wider step measured cheaper
    assert table.estimate(8) == table.estimate(4) == pytest.approx(0.009)  # pooled: never below a narrower width
    table.observe(8, 0.020)  # the median of 0.008 and 0.020
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


def test_a_width_measured_once_yields_to_widths_measured_all_along():
    table = CostTable()
    table.observe(2, 0.0072)  # a probe's width, measured once (its first call is slow)
    for _ in range(20):
        for width in (7, 8, 9):
            table.observe(width, 0.0048)
    # unweighted pooling made widths 2..9 all 0.0054; weighted, the verifies keep their cost
    assert table.estimate(9) == pytest.approx((0.0072 + 8 * 0.0048 * 3) / 25)
    assert table.estimate(9) < 0.0050
    assert isotonic([3.0, 1.0], [1.0, 3.0]) == [1.5, 1.5]


def test_a_stall_moves_nothing_and_a_lasting_change_moves_a_width_within_half_its_window():
    table = CostTable(window=9)
    for _ in range(9):
        table.observe(9, 0.0044)
    table.observe(9, 0.180)  # a 180 ms stall of a 4.4 ms verify
    assert table.estimate(9) == pytest.approx(0.0044)  # an EWMA of 0.3 made it 58 ms, and k = 8 never ran again
    for _ in range(3):
        table.observe(9, 0.0060)  # the verify really got dearer
    assert table.estimate(9) == pytest.approx(0.0044)
    table.observe(9, 0.0060)
    assert table.estimate(9) == pytest.approx(0.0060)  # with the stall, 5 of the last 9 samples
    with pytest.raises(ValueError, match="window must be >= 1"):
        CostTable(window=0)
    with pytest.raises(ValueError, match="max_weight must be in"):
        CostTable(window=4)  # a weight of 8 needs 8 samples kept


def test_below_measured_follows_the_narrowest_width_seen_and_forgets_it_on_clear():
    table = CostTable()
    assert not table.below_measured(1)
    table.observe(9, 0.0044)
    assert table.below_measured(1) and not table.below_measured(9)
    table.observe(2, 0.0040)
    assert not table.below_measured(2) and table.below_measured(1)
    assert table.weight(2) == 1 and table.weight(3) == 0
    table.clear()
    assert not table.below_measured(1) and table.weight(2) == 0


def measured_policy(forward_per_token: float, propose_seconds: float, adaptive: bool = True,
                    probe_every: int = 4) -> DraftPolicy:
    policy = DraftPolicy(K, adaptive=adaptive, probe_every=probe_every)
    for tokens in range(1, K + 2):
        policy.record_forward(1, tokens, DECODE + forward_per_token * (tokens - 1))
    for width in range(1, K + 2):
        policy.record_propose(width, propose_seconds)
    return policy


def run(policy: DraftPolicy, steps: int, accepted: int | None = None, num_seqs: int = 1) -> list[Decision]:
    """`steps` decisions; every sequence that drafts has `accepted` of its drafts accepted."""
    decisions = []
    for _ in range(steps):
        decision = policy.decide(num_seqs, num_seqs, K)
        decisions.append(decision)
        drafted = [decision.k] * num_seqs
        if decision.probe_k:
            drafted[0] = decision.probe_k
        for k in drafted:
            if k and accepted is not None:
                policy.record_verify(k, min(accepted, k))
    return decisions


def test_policy_stops_asking_after_rejections_and_probes_ever_more_rarely():
    policy = measured_policy(0.05 * DECODE, 0.001, probe_every=4)
    policy.max_probe_every = 32
    assert policy.decide(1, 1, K).k > 0  # the prior (0.6 per position) says drafts pay here
    decisions = run(policy, 400, accepted=0)  # every first draft rejected
    late = decisions[20:]
    assert {d.k for d in late} == {0}
    probes = [i for i, d in enumerate(decisions) if d.probe_k]
    # each probe that finds drafts still do not pay doubles the gap, up to max_probe_every
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-5:] == [32] * 5 and gaps == sorted(gaps), probes


def test_a_probe_asks_for_the_k_an_optimistic_view_would_choose():
    policy = measured_policy(0.02 * DECODE, 0.0005, probe_every=1)
    for _ in range(10):
        policy.record_verify(K, 1)  # p_1 certain, p_2 rejected; positions past 2 never tried
    decision = policy.decide(1, 1, K)
    assert decision.probe_k > 2  # the untried positions are in doubt: the probe reaches past them


def test_no_probe_where_even_the_optimistic_view_would_not_pay():
    """A batch where a verify token costs as much as a decode: no acceptance could pay, so the
    policy never probes (a probe would cost a wider verify and a catch-up for nothing)."""
    policy = DraftPolicy(K, probe_every=1)
    for tokens in (16, 32, 64, 144):
        policy.record_forward(16, tokens, DECODE * tokens / 16 * 1.6)
    policy.record_propose(16 * (K + 1), 0.004)
    for _ in range(50):
        policy.record_verify(K, 2)
    assert run(policy, 100, accepted=2, num_seqs=16) == [Decision(0)] * 100


def test_a_step_without_drafts_narrower_than_any_measured_is_measured_before_drafts_are_priced():
    """A batch that only ever drafted knows the cost of its verify widths, not of a step
    without drafts: priced as the narrowest measured width, drafts would look free."""
    policy = DraftPolicy(K)
    policy.record_forward(8, 8 * (K + 1), 0.015)  # the batch of 8 drafted K at its first step
    policy.record_propose(8 * (K + 1), 0.005)
    for _ in range(20):
        policy.record_verify(K, 1)
    assert policy.decide(8, 8, K) == Decision(0)  # measure width 8 first
    policy.record_forward(8, 8, 0.0055)
    assert policy.decide(8, 8, K).k == 0  # and then drafts do not pay


def test_the_prefill_in_a_step_is_not_counted_against_drafts():
    """A step with prefill chunks (base 105 tokens, 4 decoding sequences) takes 20 ms whatever
    k: drafts are judged against the 4 sequences' decoding alone. Counting the prefill in made a
    5 ms Propose look cheap next to 20 ms, and a batch of 8 probed drafts that never paid."""
    forward = lambda tokens: 0.005 + 0.00014 * tokens  # noqa: E731 - linear: 4 decodes 5.6 ms, 105 tokens 19.7 ms
    propose = lambda width: 0.005  # noqa: E731
    acceptance = [0.4, 0.3] + [0.6] * (K - 2)
    assert choose_num_drafts(acceptance, K, 4, 105, forward, propose) == 0
    assert choose_num_drafts(acceptance, K, 4, 4, forward, propose) == 0  # the same as without the prefill
    beyond_reach = lambda tokens: math.inf if tokens > 64 else forward(tokens)  # noqa: E731 - CostTable.reach
    assert choose_num_drafts(acceptance, K, 4, 105, beyond_reach, propose) == 0  # was a ValueError (NaN rates)
    cheap = lambda width: 0.0002  # noqa: E731 - where drafts pay for decoding, a prefill does not stop them
    assert choose_num_drafts([0.9] * K, K, 4, 105, forward, cheap) == choose_num_drafts([0.9] * K, K, 4, 4, forward,
                                                                                          cheap) > 0


def test_a_widest_width_measured_on_its_first_slow_calls_is_probed_until_measured_enough():
    """The demo pair's split: width 9 (k=8) measured three times on its first, slow calls stood
    20% above width 8, k=8 was never chosen again and width 9 never measured again."""
    table = CostTable()
    for _ in range(20):
        table.observe(7, 0.00387)
        table.observe(8, 0.00407)
    for seconds in (0.0052, 0.0049, 0.0047):
        table.observe(9, seconds)
    assert table.estimate(9) == pytest.approx(0.0049) and table.weight(9) == 3  # what it measured, barely
    for _ in range(5):
        table.observe(9, 0.0042)
    assert table.estimate(9) == pytest.approx(0.0042) and table.weight(9) == 8  # measured enough: its median

    policy = DraftPolicy(K, probe_every=4)
    for tokens in range(1, K + 1):
        policy.record_forward(1, tokens, DECODE * (1 + 0.01 * tokens))
    policy.record_forward(1, K + 1, 3 * DECODE)  # the widest, once, on a slow first call
    for width in range(2, K + 2):
        policy.record_propose(width, 0.001)
    for _ in range(50):
        policy.record_verify(K, K - 1)  # position K never accepted: the optimistic view asks no more
    decisions = run(policy, 8)  # (run() measures no forwards: width K + 1 stays barely known)
    assert {d.k for d in decisions} == {K - 1}
    assert [d.probe_k for d in decisions] == [0, 0, 0, K] * 2, decisions  # probes measure width K + 1
    for _ in range(8):
        policy.record_forward(1, K + 1, DECODE * (1 + 0.01 * (K + 1)))
    assert not any(d.probe_k for d in run(policy, 8))  # known now, and acceptance has nothing to teach


def test_policy_recovers_when_the_drafter_gets_good_again():
    policy = measured_policy(0.05 * DECODE, 0.001)
    run(policy, 200, accepted=0)
    assert policy.decide(1, 1, K).k == 0
    decisions = run(policy, 200, accepted=K)  # the probes' drafts are accepted from now on
    assert [d.k for d in decisions[-50:]] == [K] * 50, decisions
    assert not any(d.probe_k for d in decisions[-50:])  # at K: nothing wider to probe


def test_catching_up_is_learnt_per_row_and_priced_into_resuming_drafts():
    policy = measured_policy(0.02 * DECODE, 0.001)
    for _ in range(50):
        policy.record_verify(K, 3)
    assert policy.decide(1, 1, K).k > 0
    policy.record_catch_up(K + 1, rows=200, seconds=0.001 + 200 * 0.0001)  # 0.1 ms a row over steady
    assert policy.catch_up_per_row == pytest.approx(0.0001)
    # 200 rows behind, the sequence drafting 16 more steps at most: 1.25 ms a step of catch-up
    assert policy.amortized_rows(200, 1000) == pytest.approx(12.5)
    assert policy.amortized_rows(200, 2) == pytest.approx(100)  # ending soon: repaid over 2 steps
    assert policy.decide(1, 1, K, catch_up_rows=12.5).k > 0  # worth it
    assert policy.decide(1, 1, K, catch_up_rows=400.0).k == 0  # 40 ms for a few tokens: not


def test_policy_asks_for_k_before_anything_is_measured_and_fixed_always_asks_for_k():
    assert DraftPolicy(K).decide(1, 1, K) == Decision(K)
    fixed = measured_policy(10 * DECODE, 1.0, adaptive=False)
    for _ in range(60):
        fixed.record_verify(K, 0)
    assert [fixed.decide(1, 1, K) for _ in range(8)] == [Decision(K)] * 8
    assert fixed.decide(1, 1, 3) == Decision(3)  # the sequences' own limit still caps it


def test_the_policy_refuses_a_bound_above_its_k():
    """k is bounded once, by the caller (Speculation.draft_limit): an ask past the policy's K is a bug."""
    with pytest.raises(ValueError, match="exceeds the policy's K"):
        DraftPolicy(K).decide(1, 1, K + 1)
    with pytest.raises(ValueError, match="exceeds the policy's K"):
        DraftPolicy(K, adaptive=False).decide(1, 1, K + 1)


def test_forgetting_measurements_returns_to_the_start():
    policy = measured_policy(0.05 * DECODE, 0.001)
    run(policy, 100, accepted=0)
    policy.record_catch_up(K + 1, 100, 0.5)
    policy.forget_measurements()
    assert policy.catch_up_per_row is None
    assert policy.decide(1, 1, K) == Decision(K)


def test_the_policy_name_is_validated_in_the_config():
    assert EngineConfig(model="m").speculative_policy == "adaptive"
    assert EngineConfig(model="m", speculative_policy="fixed").speculative_policy == "fixed"
    with pytest.raises(ValueError, match="speculative_policy must be one of adaptive, fixed, got 'greedy'"):
        EngineConfig(model="m", speculative_policy="greedy")


def test_widths_far_past_the_measured_ones_are_not_extrapolated():
    """A batch size is priced from its own widths only, widened step by step: a batch of 8
    first measures its step without drafts, then k = 1 (width 16), not k = 8 (width 72)."""
    policy = DraftPolicy(K)
    for tokens in range(1, K + 2):
        policy.record_forward(1, tokens, DECODE * (1 + 0.01 * (tokens - 1)))  # verifies look almost free
        policy.record_propose(tokens, 0.0001)
    for _ in range(60):
        policy.record_verify(K, K)  # and every draft is accepted
    batch_1 = policy.forward.table(1)
    assert batch_1.estimate(2 * (K + 1)) < float("inf") == batch_1.estimate(2 * (K + 1) + 1)
    assert policy.decide(1, 1, K).k == K
    assert policy.decide(8, 8, K) == Decision(0)  # never measured at 8 sequences: its plain step first
    policy.record_forward(8, 8, DECODE * 1.05)
    assert policy.decide(8, 8, K).k == 1  # width 16: within reach of the measured 8
    policy.record_forward(8, 16, DECODE * 1.1)
    policy.record_propose(16, 0.0002)
    assert policy.decide(8, 8, K).k == 3  # width 32 now within reach


def test_a_batch_is_not_priced_from_another_batch_sizes_widths():
    """After concurrency 1, a batch of 8 with one draft each (width 16) was priced at batch 1's
    verify, 4.4 ms (flat past width 9), where it takes ~8 ms: the policy drafted whole batches
    of 8 for nothing. Each batch size now has its own table; `batch_seqs` names it when some of
    the step's sequences may not draft."""
    policy = DraftPolicy(K)
    for tokens in range(1, K + 2):
        policy.record_forward(1, tokens, 0.0041 + 0.00003 * (tokens - 1))  # the demo pair at concurrency 1
        policy.record_propose(tokens, 0.0018)
    for _ in range(60):
        policy.record_verify(K, 2)
    assert policy.decide(1, 1, K).k > 0
    assert policy.decide(8, 8, K) == Decision(0)
    for _ in range(3):
        policy.record_forward(8, 8, 0.0077)  # 8 decodes: 7.7 ms, not batch 1's 4.3 for width 8
    table = policy.forward.table(8)
    assert table.estimate(8) == pytest.approx(0.0077) and policy.forward.table(1).estimate(8) < 0.005
    assert policy.decide(6, 8, K, batch_seqs=8).k == 1  # 2 of the 8 may not draft: still batch 8's table
    assert policy.decide(6, 8, K) == Decision(0)  # a batch of 6 was never measured
    assert policy.forward.table(7).known is False
    policy.forget_measurements()
    assert not policy.forward.known


def keep_or_decide(policy: DraftPolicy, batch: object) -> Decision | None:
    """What a step's caller does: keep the last k = 0 for this batch (None), else decide."""
    if policy.keeps_no_drafts(batch):
        return None
    return policy.decide(1, 1, K, batch=batch)


def test_a_batch_that_asked_for_no_drafts_keeps_that_answer_for_a_few_steps_then_decides_again():
    policy = measured_policy(0.05 * DECODE, 0.001, probe_every=4)
    policy.max_probe_every = policy.probe_every = 64  # no probe within this test's steps
    run(policy, 50, accepted=0)  # drafts stop paying
    assert policy.decide(1, 1, K, batch=("a",)) == Decision(0)
    kept = [keep_or_decide(policy, ("a",)) for _ in range(policy.recheck_every)]
    assert kept == [None] * policy.recheck_every  # the bookkeeping of a decision is skipped
    assert keep_or_decide(policy, ("a",)) == Decision(0)  # then decided again (and kept again)
    assert keep_or_decide(policy, ("b",)) == Decision(0)  # another batch is never kept for: decided
    assert not policy.keeps_no_drafts(None) and policy.keeps_no_drafts(("b",))


def test_a_kept_answer_delays_a_due_probe_by_at_most_recheck_every_steps():
    def policy_after_rejections() -> DraftPolicy:
        policy = measured_policy(0.05 * DECODE, 0.001, probe_every=4)
        policy.max_probe_every = 8
        run(policy, 40, accepted=0)
        return policy

    kept, decided = policy_after_rejections(), policy_after_rejections()
    kept_probes, decided_probes = [], []
    for step in range(96):
        if (d := keep_or_decide(kept, ("a",))) is not None and d.probe_k:
            kept_probes.append(step)
            kept.record_verify(d.probe_k, 0)
        if (d := decided.decide(1, 1, K)).probe_k:
            decided_probes.append(step)
            decided.record_verify(d.probe_k, 0)
    assert len(decided_probes) >= 3 and kept_probes[0] == decided_probes[0]
    kept_gaps = [b - a for a, b in zip(kept_probes, kept_probes[1:])]
    decided_gaps = [b - a for a, b in zip(decided_probes, decided_probes[1:])]
    assert len(kept_gaps) >= len(decided_gaps) - 1
    assert all(k <= d + kept.recheck_every for k, d in zip(kept_gaps, decided_gaps)), (kept_probes, decided_probes)


def test_kept_answers_age_the_acceptance_as_decisions_do():
    def policy_after_rejections() -> DraftPolicy:
        policy = measured_policy(0.05 * DECODE, 0.001, probe_every=4)
        policy.max_probe_every = policy.probe_every = 256  # no probe within this test's steps
        run(policy, 50, accepted=0)
        return policy

    kept, decided = policy_after_rejections(), policy_after_rejections()
    for _ in range(50):
        keep_or_decide(kept, ("a",))
        decided.decide(1, 1, K)
    assert kept._ages_owed > 0  # most of those steps were kept, not decided
    kept.decide(1, 1, K)  # pays the ages it owes
    decided.decide(1, 1, K)
    assert kept.acceptance.values == pytest.approx(decided.acceptance.values)
    assert [kept.acceptance.trials(i) for i in (1, 2)] == pytest.approx([decided.acceptance.trials(i) for i in (1, 2)])


def test_the_fixed_policy_and_a_new_epoch_keep_nothing():
    fixed = DraftPolicy(K, adaptive=False)
    assert fixed.decide(1, 1, K, batch=("a",)) == Decision(K) and not fixed.keeps_no_drafts(("a",))
    policy = measured_policy(0.05 * DECODE, 0.001, probe_every=64)
    policy.max_probe_every = 64
    run(policy, 50, accepted=0)
    assert policy.decide(1, 1, K, batch=("a",)) == Decision(0)
    policy.new_epoch()  # a new drafter: its acceptance is unknown, so decide
    assert not policy.keeps_no_drafts(("a",))


def test_idle_once_probes_find_no_drafts_pay_and_not_after_they_pay_again():
    """`idle` (a DFlash target then lets a prompt take its whole prefix-cache hit, unfollowed):
    only after the last decision asked no drafts and a probe since found none worth it."""
    policy = measured_policy(0.05 * DECODE, 0.001, probe_every=4)
    assert not policy.idle  # nothing decided yet
    first = policy.decide(1, 1, K)
    assert first.k > 0 and not policy.idle
    run(policy, 200, accepted=0)
    assert policy.decide(1, 1, K).k == 0 and policy.idle
    run(policy, 200, accepted=K)
    assert policy.decide(1, 1, K).k > 0 and not policy.idle
    fixed = measured_policy(0.05 * DECODE, 10.0, adaptive=False)
    run(fixed, 50, accepted=0)
    assert not fixed.idle  # a fixed policy always drafts


def test_a_declined_probe_waits_a_gap_as_an_asked_one_does():
    """A probe due where even the optimistic view asks no drafts is declined; the next is a gap
    away, as after one asked. Were it due every step after, the engine would follow every new
    sequence for a probe never asked (`steps_until_probe` 0), paying its bookkeeping each step."""
    policy = measured_policy(0.6 * DECODE, 0.02, probe_every=4)  # a verify far dearer than decodes
    run(policy, 200, accepted=0)
    assert policy.idle
    due = policy.steps_until_probe()
    assert due > 0
    for _ in range(due):
        assert policy.decide(1, 1, K) == Decision(0)
    assert policy.steps_until_probe() == 0
    assert policy.decide(1, 1, K) == Decision(0) and policy._probe_declined  # due, and declined
    assert policy.steps_until_probe() >= due and policy.idle


def test_steps_with_nobody_to_decide_for_bring_the_next_probe_nearer():
    """While no drafts pay the engine follows no sequence the next probe cannot reach, so steps pass
    without a decision; each counts toward the probe as a kept k = 0 decision does, so a probe still
    comes due and a sequence admitted then is followed for it."""
    policy = measured_policy(0.05 * DECODE, 0.001, probe_every=4)
    run(policy, 200, accepted=0)
    assert policy.decide(1, 1, K).k == 0 and policy.idle
    left = policy.steps_until_probe()
    assert left > 0
    for _ in range(left):
        policy.pass_step_without_decision()
    assert policy.steps_until_probe() == 0 and policy.idle
    assert policy.decide(1, 1, K).probe_k > 0  # the probe that came due


def test_costly_probes_are_spaced_to_keep_within_the_probe_budget():
    """While no drafts pay, the gap between probes doubles up to `max_probe_every`, or further when a
    probe's Propose (its catch-up included) would otherwise cost more than `probe_budget` of the time."""
    def probe_gaps(probe_seconds: float) -> list[int]:
        policy = measured_policy(0.05 * DECODE, 0.001, probe_every=4)
        policy.max_probe_every = 32
        decisions = []
        for _ in range(3000):
            decision = policy.decide(1, 1, K)
            decisions.append(decision)
            if decision.probe_k:
                policy.record_probe(probe_seconds)
                policy.record_verify(decision.probe_k, 0)
        probes = [i for i, d in enumerate(decisions) if d.probe_k]
        return [b - a for a, b in zip(probes, probes[1:])]

    cheap = probe_gaps(0.0)[-10:]  # a cheap probe: the configured cap, and a declined probe waits the cap too
    assert 32 in cheap and all(gap % 32 == 0 for gap in cheap), cheap
    # a probe of 20 decode steps at a 1% budget: 2,000 decisions apart, reached by doubling
    longest = math.ceil(20 * DECODE / (0.01 * DECODE))
    gaps = probe_gaps(20 * DECODE)
    assert gaps == sorted(gaps) and 32 < gaps[-1] <= longest, gaps
    with pytest.raises(ValueError, match="0 < probe_budget <= 1"):
        DraftPolicy(K, probe_budget=0)


def test_without_evidence_the_estimates_stay_and_only_the_doubt_grows():
    """Decisions without verified drafts leave p_j where the evidence left them (a policy whose
    estimates drifted back to the prior drafted a whole batch on no evidence); the optimistic view
    widens, more slowly over a longer idle window, and the faded weight is folded into the counts
    when evidence comes again."""
    est = AcceptanceEstimate(2, window=10.0)
    for _ in range(50):
        est.observe(num_draft=2, num_accepted=0)
    est.age()  # the decision after the evidence discounts the counts themselves
    values, sure = est.values, est.optimistic()
    for _ in range(30):
        est.age()
    assert est.values == values and est.optimistic()[0] > sure[0] + 0.1
    assert est.trials(1) == pytest.approx(50 * 0.9 ** 31)
    slow = AcceptanceEstimate(2, window=10.0)
    for _ in range(50):
        slow.observe(num_draft=2, num_accepted=0)
    slow.age()
    for _ in range(30):
        slow.age(idle_window=100.0)
    assert slow.trials(1) == pytest.approx(50 * 0.9 * 0.99 ** 30)
    est.observe(num_draft=2, num_accepted=2)  # evidence again: old counts at their faded weight, plus it
    assert est.trials(1) == pytest.approx(50 * 0.9 ** 31 + 1)
    assert est.values[0] > values[0]
