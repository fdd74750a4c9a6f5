"""The adaptive policy through the real engine and a real drafter: it stops asking for drafts
that are never accepted, keeps asking for drafts that always are, and the output is the
target's own either way.

The step costs are an injected, fixed table (drafts cheap: a verify token costs 2% of a
decode, a Propose 1%, a drafter's catch-up nothing), so what the policy decides depends on acceptance alone and never on
this machine's timing. The acceptance is real: a draft model that is the target itself
(every draft right) or another random model (practically every draft wrong)."""

from __future__ import annotations

import pytest

from target_service.api_types import EngineRequest, SpeculationParams, StopParams
from target_service.draft_policy import BatchCostTables, CostTable, Decision, DraftPolicy
from tests.tiny_models import (
    PROMPTS,
    REFERENCE_DFLASH_K,
    make_pair,
    make_qwen3,
)

K = 4
MAX_TOKENS = 80
DECODE = 0.01  # seconds of a one-token forward, in the injected table
PROBE_EVERY = 8


class FixedCosts(CostTable):
    """An injected cost table: the engine's measurements are ignored, so no timing decides."""

    def __init__(self, per_width) -> None:
        super().__init__()
        self._per_width = per_width

    def observe(self, width: int, seconds: float) -> None:
        pass

    @property
    def known(self) -> bool:
        return True

    def weight(self, width: int) -> float:
        return self.max_weight  # every width known: no probe to measure one

    def estimate(self, width: int) -> float:
        return self._per_width(width)


class FixedForward(BatchCostTables):
    """The injected forward costs, the same at every batch size."""

    def __init__(self, per_width) -> None:
        super().__init__()
        self._fixed = FixedCosts(per_width)

    def table(self, num_seqs: int) -> CostTable:
        return self._fixed

    @property
    def known(self) -> bool:
        return True

    def observe(self, num_seqs: int, width: int, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    target, same = make_pair(root)  # the target as its own draft model: every draft is right
    other = make_qwen3(root / "other", seed=1)  # another random model: its drafts are (almost) all wrong
    return target, same, other


def _core(speculative_engine, target, draft):
    # float32 like the target: where a copy of it drafts, every draft must be accepted (in bfloat16,
    # the drafter's default on a CPU with native bfloat16, a near-tie may round the other way)
    core = speculative_engine(target, draft, drafter={"num_speculative_tokens": K, "dtype": "float32"},
                              num_speculative_tokens=K)
    assert core.config.speculative_policy == "adaptive"  # the default
    assert core.link.ready, core.link.detail
    policy = core.speculator.policy
    policy.forward = FixedForward(lambda tokens: DECODE * (1 + 0.02 * (tokens - 1)))
    policy.propose = FixedCosts(lambda width: 0.01 * DECODE * width)
    policy.record_catch_up = lambda *args: None  # a catch-up's measured seconds would price it: catch-ups are free
    policy.catch_up_per_row = None
    policy.probe_every = PROBE_EVERY
    return core


def _generate(core, prompt: str, speculate: bool = True) -> tuple[list[int], list[int | None], object]:
    """One request alone; its tokens, the drafts asked at each step (None: no decision), its usage."""
    core.add(EngineRequest(f"r{len(core._tracked)}-{speculate}-{prompt[:8]}", tuple(core.tokenizer.encode(prompt)),
                           stop=StopParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                           speculation=SpeculationParams(disable=not speculate)))
    tokens: list[int] = []
    chosen: list[int | None] = []
    histogram = core.metrics.draft_decisions
    while True:
        before = _count_and_sum(histogram)
        outputs = core.step()
        after = _count_and_sum(histogram)
        chosen.append(int(after[1] - before[1]) if after[0] > before[0] else None)
        for out in outputs:
            tokens.extend(out.token_ids)
            if out.finish_reason is not None:
                return tokens, chosen, out.usage


def _count_and_sum(histogram) -> tuple[float, float]:
    samples = {s.name: s.value for family in histogram.collect() for s in family.samples}
    return samples["splitspec_spec_decode_num_drafts_chosen_count"], samples["splitspec_spec_decode_num_drafts_chosen_sum"]


def _zero_steps(core) -> float:
    return core.metrics.registry.get_sample_value("splitspec_spec_decode_policy_zero_draft_steps_total")


def _probes(core) -> float:
    return core.metrics.registry.get_sample_value("splitspec_spec_decode_policy_probes_total")


def test_drafts_that_are_never_accepted_stop_being_asked_for(speculative_engine, checkpoints):
    target, _, other = checkpoints
    core = _core(speculative_engine, target, other)
    reference, _, _ = _generate(core, PROMPTS[0], speculate=False)
    tokens, chosen, usage = _generate(core, PROMPTS[0])
    assert tokens == reference  # lossless whatever was asked
    decided = [k for k in chosen if k is not None]
    assert usage.draft_tokens > 0 and usage.accepted_tokens <= usage.draft_tokens // 10, usage
    # at first every draft is asked for; once the rejections are learnt, only the probes draft
    # (the histogram counts the batch's k, 0 on a probe step; the probe counter counts probes)
    assert decided[0] == K
    late = decided[len(decided) // 2 :]
    assert late.count(0) >= len(late) - 2 and all(k <= 1 for k in late), late
    assert 0 < _probes(core) <= len(decided) // PROBE_EVERY
    assert _zero_steps(core) + _probes(core) == chosen.count(0)
    core.close()


def test_steps_without_drafts_do_not_call_a_drafter_that_reads_no_hidden_states(speculative_engine,
                                                                                 checkpoints):
    """A draft model needs only token ids: a step asking for no drafts makes no Propose, and its
    context reaches the drafter merged into the next Propose that asks for drafts. That merged
    context is whole: the target's own copy as drafter still has every draft accepted."""
    target, same, other = checkpoints
    core = _core(speculative_engine, target, other)
    before = core.link.num_proposes
    _, chosen, _ = _generate(core, PROMPTS[2])
    decided = [k for k in chosen if k is not None]
    asking = len(chosen) - decided.count(0) + _probes(core)  # a probe step's histogram k is the batch's 0
    assert core.link.num_proposes - before <= asking  # none for a step that asks for no drafts
    core.close()

    core = _core(speculative_engine, target, same)
    core.speculator.policy = ScriptedPolicy(K, [K, 0, 0, K, 0, K, 0, 0, 0, 2] * 4)  # context merged often
    reference, _, _ = _generate(core, PROMPTS[3], speculate=False)
    tokens, chosen, usage = _generate(core, PROMPTS[3])
    assert tokens == reference
    assert [k for k in chosen if k is not None].count(0) >= 5
    assert usage.accepted_tokens == usage.draft_tokens > 0
    core.close()


def test_a_request_that_disables_speculation_is_never_sent_to_the_drafter(speculative_engine, checkpoints_dflash,
                                                                         shm_dir):
    """Its context would cost the drafter (and a DFlash target its staging rows) for nothing."""
    core, _, _ = _dflash_core(speculative_engine, checkpoints_dflash, shm_dir, 16, [], defer=True)
    before = core.link.num_proposes
    _generate(core, PROMPTS[0], speculate=False)
    assert core.link.num_proposes == before
    speculator = core.speculator
    assert not speculator._followed and not speculator._pending and speculator.staging_row() == 0
    core.close()


def test_rows_held_for_a_drafter_that_then_fails_do_not_push_the_next_forward_off_the_staging_buffer(
        speculative_engine, checkpoints_dflash, shm_dir):
    """Rows held for a deferred Propose stay where they are; once the drafter fails they serve nobody,
    and a full-width prefill chunk must still find its staging rows (from row 0)."""
    core, _, _ = _dflash_core(speculative_engine, checkpoints_dflash, shm_dir, 16, [0] * 100, defer=True)
    core.add(EngineRequest("held", tuple(core.tokenizer.encode(PROMPTS[0]))[:8],
                           stop=StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
    for _ in range(4):
        core.step()
    assert core.speculator.staging_row() > 0  # the prompt's and the decodes' rows are held
    core.link.mark_failed("the drafter went away (test)")
    assert core.speculator.staging_row() == 0
    long_prompt = tuple(core.tokenizer.encode(PROMPTS[1] * 4))[:40]
    core.add(EngineRequest("long", long_prompt, stop=StopParams(max_tokens=2, ignore_eos=True)))
    finished = set()
    for _ in range(MAX_TOKENS + 10):
        finished |= {out.request_id for out in core.step() if out.finish_reason is not None}
        if finished == {"held", "long"}:
            break
    assert finished == {"held", "long"}
    core.close()


def test_drafts_that_are_always_accepted_keep_being_asked_for(speculative_engine, checkpoints):
    target, same, _ = checkpoints
    core = _core(speculative_engine, target, same)
    reference, _, _ = _generate(core, PROMPTS[1], speculate=False)
    tokens, chosen, usage = _generate(core, PROMPTS[1])
    assert tokens == reference
    assert usage.accepted_tokens == usage.draft_tokens > 0
    decided = [k for k in chosen if k is not None]
    # every decision asks for all K drafts (at K there is nothing wider to probe), except the
    # last steps, where max_tokens leaves room for fewer
    assert decided.count(K) >= len(decided) - 2, decided
    assert not _probes(core)
    core.close()


class ScriptedPolicy(DraftPolicy):
    """Asks for the drafts of a script, step after step (then all K): which steps defer their
    context is chosen by the test, not by timing."""

    def __init__(self, max_k: int, script: list[int]) -> None:
        super().__init__(max_k)
        self._script = iter(script)

    def decide(self, num_seqs: int, base_tokens: int, max_k: int, catch_up_rows: float = 0.0,
               batch_seqs: int | None = None, batch: object = None) -> Decision:
        step = next(self._script, self.max_k)
        k, probe_k = step if isinstance(step, tuple) else (step, 0)
        return Decision(min(k, max_k), min(probe_k, max_k))


class IdlePolicy(ScriptedPolicy):
    """A script of decisions made while no drafts pay (`DraftPolicy.idle`)."""

    @property
    def idle(self) -> bool:
        return True


def _dflash_core(speculative_engine, checkpoints_dflash, shm_dir, budget: int, script: list[int], defer: bool,
                 idle: bool = False):
    target, dflash = checkpoints_dflash
    core = speculative_engine(target, dflash, kind="dflash", shm=shm_dir, num_speculative_tokens=REFERENCE_DFLASH_K,
                              max_num_batched_tokens=budget, staging_rows=budget)
    assert core.link.ready, core.link.detail
    core.speculator.policy = (IdlePolicy if idle else ScriptedPolicy)(REFERENCE_DFLASH_K, script)
    if not defer:  # the path before deferral: a context-only Propose at every step
        core.speculator._may_defer = lambda scheduled: False
    drafts: list[dict[int, list[int]]] = []
    unwritten: list[int] = []  # after each Propose: context rows the drafter holds unwritten
    propose = core.speculator.propose

    def recording_propose(scheduled, metrics):
        drafts.append(answer := propose(scheduled, metrics))
        unwritten.append(sum(seq.context_len - seq.num_context for seq in core.link._stub.host.drafter.sequences.values()))
        return answer

    core.speculator.propose = recording_propose
    return core, drafts, unwritten


@pytest.fixture(scope="module")
def checkpoints_dflash(spec_models):
    return spec_models.target, spec_models.dflash


@pytest.mark.parametrize(("budget", "script"), [
    (128, [0, 0, 0, 4, 0, 0, 2, 0, 4, 1, 0, 0, 0, 0, 0, 3] * 3),  # short runs of k = 0: held, then restaged
    (16, [0] * 30 + [4, 0, 0, 4] + [0] * 20),  # long runs overflow 16 staging rows: context-only Proposes
])
def test_steps_without_drafts_hold_the_hidden_states_a_dflash_drafter_reads(speculative_engine, checkpoints_dflash,
                                                                           tmp_path, budget, script, monkeypatch):
    """DFlash reads the target's hidden states from staging rows the next forward overwrites. A
    step that asks for no drafts sends no Propose: its rows are held and packed in front of the
    next Propose's own. The drafter holds the rows it receives and writes their context K/V
    only when the sequence drafts. Either way it drafts exactly what it drafts when told, and
    writes, every step ("eager")."""
    from draft_service.drafters.base import FeatureDrafter

    results = {}
    for mode in ("held", "told", "eager"):
        if mode == "eager":
            monkeypatch.setattr(FeatureDrafter, "max_held_rows", 1)  # every row received is written at once
        shm_dir = tmp_path / f"shm-{mode}"
        shm_dir.mkdir()
        core, drafts, unwritten = _dflash_core(speculative_engine, checkpoints_dflash, shm_dir, budget, script,
                                               defer=mode == "held")
        before = core.link.num_proposes
        reference, _, _ = _generate(core, PROMPTS[0], speculate=False)
        tokens, chosen, usage = _generate(core, PROMPTS[0])
        assert tokens == reference
        results[mode] = ([d for d in drafts if d], core.link.num_proposes - before, chosen, usage, unwritten)
        core.close()
    held, told, eager = results["held"], results["told"], results["eager"]
    assert held[0] == told[0] == eager[0] and len(held[0]) >= 4  # the same drafts, step for step
    assert held[3].accepted_tokens == told[3].accepted_tokens == eager[3].accepted_tokens
    assert max(told[4]) > 0 and max(eager[4]) == 0  # told: context received, not yet written
    steps_asking = sum(1 for k in held[2] if k)
    assert held[1] < told[1]  # fewer round trips ...
    if budget >= 128:
        assert held[1] <= steps_asking + 4  # ... at most the prefill's and those asking for drafts


def test_while_no_drafts_pay_a_full_staging_buffer_unfollows_instead_of_catching_the_drafter_up(
        speculative_engine, checkpoints_dflash, tmp_path):
    """Two requests side by side past 16 staging rows, no drafts asked: while the policy finds
    that none pay, the sequences holding rows are unfollowed (no Propose at all; the drafter is
    told to release one it had been sent) where otherwise a context-only Propose goes at every
    overflow. The output is the target's own either way."""
    counts = {}
    for idle in (True, False):
        shm_dir = tmp_path / f"shm-{idle}"
        shm_dir.mkdir()
        core, drafts, _ = _dflash_core(speculative_engine, checkpoints_dflash, shm_dir, 16, [0] * 500, defer=True,
                                       idle=idle)
        reference = [_generate(core, prompt, speculate=False)[0] for prompt in PROMPTS[:2]]
        before = core.link.num_proposes
        for i, prompt in enumerate(PROMPTS[:2]):
            core.add(EngineRequest(f"both-{i}", tuple(core.tokenizer.encode(prompt)),
                                   stop=StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
        tokens: dict[str, list[int]] = {"both-0": [], "both-1": []}
        while core.has_work():
            for out in core.step():
                tokens[out.request_id].extend(out.token_ids)
        assert list(tokens.values()) == reference
        counts[idle] = core.link.num_proposes - before
        if idle:
            assert not core.speculator._followed and not core.speculator._pending
            assert not core.link._stub.host.drafter.sequences  # nothing left at the drafter
        core.close()
    assert counts[True] <= 1 < counts[False], counts  # at most the release of what was sent


def test_dflash_drafts_fewer_tokens_as_the_first_of_its_whole_block(speculative_engine, checkpoints_dflash, tmp_path):
    """Asked for k < K drafts, DFlash still runs the block of K masks it was trained with and
    keeps the first k: a block of fewer masks attends differently and drafts worse (the demo
    pair accepted 2.12 tokens a step with blocks of 7, 2.56 with its trained 8)."""
    first: dict[int, list[int]] = {}
    blocks: list[int] = []
    for k in (REFERENCE_DFLASH_K, 2):
        shm_dir = tmp_path / f"shm-{k}"
        shm_dir.mkdir()
        core, drafts, _ = _dflash_core(speculative_engine, checkpoints_dflash, shm_dir, 128, [k] * MAX_TOKENS,
                                       defer=True)
        model = core.link._stub.host.drafter.model  # the in-process stub _dflash_core gave it
        forward = model.propose
        model.propose = lambda *args, **kwargs: blocks.append(kwargs["num_tokens"]) or forward(*args, **kwargs)
        _generate(core, PROMPTS[0])
        [first[k]] = next(d for d in drafts if d).values()  # the first step that drafted: the same context
        core.close()
    assert len(first[2]) == 2 and first[2] == first[REFERENCE_DFLASH_K][:2], first
    # every block had the trained K masks, bar those the sequence's last page could not hold
    assert blocks.count(REFERENCE_DFLASH_K) >= 0.8 * len(blocks), blocks


def test_a_probe_asks_one_sequence_of_the_batch(speculative_engine, checkpoints):
    """While no draft pays, a probe asks one sequence for its drafts, not the batch (the whole
    batch would pay a wider verify and every sequence's catch-up for one lesson), and the same
    one while it runs: the drafter then catches up only what came since the last probe. While
    drafts pay, a probe asks one sequence for more and the others keep their k."""
    target, _, other = checkpoints
    core = _core(speculative_engine, target, other)
    reserved: list[tuple[dict[int, int], Decision]] = []
    lookahead, decide = core.speculator.lookahead, core.speculator.policy.decide
    decisions: list[Decision] = []

    def recording_decide(*args, **kwargs):
        decisions.append(decision := decide(*args, **kwargs))
        return decision

    def recording_lookahead(running, metrics):
        answer = lookahead(running, metrics)
        if answer:
            reserved.append((answer, decisions[-1]))
        return answer

    core.speculator.policy.decide = recording_decide
    core.speculator.lookahead = recording_lookahead
    for i, prompt in enumerate(PROMPTS[:4]):
        core.add(EngineRequest(f"batch-{i}", tuple(core.tokenizer.encode(prompt)),
                               stop=StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
    while core.has_work():
        core.step()
    assert len(reserved[0][0]) == 4 and not reserved[0][1].probe_k  # at first every sequence drafts
    probes = [answer for answer, decision in reserved if decision.probe_k and not decision.k]
    assert len(probes) >= 2 and all(len(answer) == 1 for answer in probes), reserved
    assert len({next(iter(answer)) for answer in probes}) == 1  # all four run to the end: one is probed
    core.close()

    core = _core(speculative_engine, target, other)
    core.speculator.policy = ScriptedPolicy(K, [(1, 3)] * 8)
    core.speculator.lookahead = lambda running, metrics: reserved.append(answer := lookahead(running, metrics)) or answer
    lookahead = core.speculator.__class__.lookahead.__get__(core.speculator)
    reserved = []
    for i, prompt in enumerate(PROMPTS[:3]):
        core.add(EngineRequest(f"k-{i}", tuple(core.tokenizer.encode(prompt)),
                               stop=StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
    while core.has_work():
        core.step()
    batch = next(answer for answer in reserved if len(answer) == 3)
    assert sorted(batch.values()) == [1, 1, 3]  # one sequence probes 3; the others draft their 1
    core.close()


class RecordingPolicy(ScriptedPolicy):
    def __init__(self, max_k: int, script: list[int]) -> None:
        super().__init__(max_k, script)
        self.proposes: list[int] = []
        self.catch_ups: list[tuple[int, int]] = []

    def record_propose(self, draft_positions: int, seconds: float) -> None:
        self.proposes.append(draft_positions)

    def record_catch_up(self, draft_positions: int, rows: int, seconds: float) -> None:
        self.catch_ups.append((draft_positions, rows))


class VerifyRecordingPolicy(ScriptedPolicy):
    def __init__(self, max_k: int, script: list[int]) -> None:
        super().__init__(max_k, script)
        self.verifies: list[tuple[int, int]] = []

    def record_verify(self, num_draft: int, num_accepted: int) -> None:
        self.verifies.append((num_draft, num_accepted))


def test_an_ask_that_gets_no_drafts_is_learnt_as_a_miss(speculative_engine, checkpoints):
    """What the policy learns is what asking brought: an n-gram drafter that finds no match
    sends no drafts, and learning only from the sequences it drafted for priced every ask as
    a drafted one (at concurrency 16 it drafted for a few, the verify cost all: 12% slower)."""
    target, same, _ = checkpoints
    core = _core(speculative_engine, target, same)  # the target as draft model: every draft it sends is accepted
    policy = VerifyRecordingPolicy(K, [3] * MAX_TOKENS)
    core.speculator.policy = policy
    drafter = core.link._stub.host.drafter  # the in-process stub _core gave it
    propose, asks = drafter.propose, []
    drafter.propose = lambda items: asks.append(1) or ({} if len(asks) % 2 else propose(items))  # every other: none
    _generate(core, PROMPTS[1])
    assert len(policy.verifies) == len(asks) > 4  # every ask is learnt from, drafts or not
    assert (3, 0) in policy.verifies and all(a in (0, k) for k, a in policy.verifies), policy.verifies


def test_propose_costs_are_learnt_from_steady_drafting_and_catching_up_per_row(speculative_engine,
                                                                                checkpoints):
    """The Propose that follows a prompt, or steps that asked for no drafts, also catches the
    drafter up on their context: dearer once. Priced into k, it made the first drafts and every
    probe look too dear to ask for again; it is learnt apart, per row caught up, and only
    Proposes of steady drafting price k."""
    target, same, _ = checkpoints
    core = _core(speculative_engine, target, same)
    policy = RecordingPolicy(K, [K, K, 0, 0, 0, 2, 3, 0, 1, 1])
    core.speculator.policy = policy
    prompt = core.tokenizer.encode(PROMPTS[1])
    _generate(core, PROMPTS[1])
    # K after the prompt: catching up; K: steady; 0, 0, 0: no call; 2 after them: catching up;
    # 3: steady; 0: no call; 1: catching up (two steps' context); 1: steady; then K, steady
    assert policy.proposes[:4] == [K + 1, 3 + 1, 1 + 1, K + 1], policy.proposes
    # the rows caught up: the prompt; the three steps without drafts; the one step without
    assert policy.catch_ups == [(K + 1, len(prompt)), (2 + 1, 3), (1 + 1, 1)], policy.catch_ups
    core.close()


def test_a_batch_far_behind_does_not_resume_drafting(speculative_engine, checkpoints):
    """Sequences that went long without drafts would make the drafter catch up on all their
    context at once; with that cost learnt per row, the policy keeps them at k = 0 where the
    same acceptance, caught up, would draft."""
    target, same, _ = checkpoints
    core = _core(speculative_engine, target, same)
    policy = core.speculator.policy
    for _ in range(50):
        policy.record_verify(K, K)
    policy.catch_up_per_row = 10 * DECODE  # ten decodes a row: resuming never pays
    assert policy.decide(1, 1, K, catch_up_rows=0.0).k == K  # caught up, drafts pay
    reference, chosen_ref, _ = _generate(core, PROMPTS[2], speculate=False)
    tokens, chosen, usage = _generate(core, PROMPTS[2])  # its prompt is context the drafter has not seen
    assert tokens == reference
    assert usage.draft_tokens == 0 and not _probes(core), chosen
    core.close()


def test_a_step_without_drafts_is_priced_only_when_no_propose_ran_in_it_or_the_step_before(
        speculative_engine, checkpoints):
    """The forward right after a Propose runs cold (the drafter's work evicted the target's weights):
    priced as a step without drafts, it would make declining drafts look dearer than it is. Drafts
    that are never accepted keep the policy at k = 0 with probes, so Proposes and steps without
    drafts alternate; which forwards reach the cost tables is what is checked, through the real
    engine and drafter."""
    from target_service.speculation import COLD_STEPS

    target, _, other = checkpoints
    core = _core(speculative_engine, target, other)
    step = {"index": 0, "proposed": set()}
    priced: list[tuple[int, int, int]] = []  # (step, sequences, query tokens) of each priced forward
    link, policy = core.speculator.link, core.speculator.policy
    propose, record_forward, engine_step = link.propose, policy.record_forward, core.step

    def counted_propose(request):
        step["proposed"].add(step["index"])
        return propose(request)

    def counted_step():
        step["index"] += 1
        return engine_step()

    link.propose = counted_propose
    policy.record_forward = lambda n, tokens, seconds: (priced.append((step["index"], n, tokens)),
                                                        record_forward(n, tokens, seconds))
    core.step = counted_step
    tokens, _, _ = _generate(core, PROMPTS[1])
    assert tokens == _generate(core, PROMPTS[1], speculate=False)[0]
    plain = [index for index, n, width in priced if width == n]  # one query token per sequence: no drafts
    cold = [index for index in plain if any(index - ago in step["proposed"] for ago in range(COLD_STEPS))]
    assert cold == [], f"steps without drafts priced within {COLD_STEPS} steps of a Propose: {cold}"
    assert len(step["proposed"]) >= 3 and len(plain) >= 10, (step["proposed"], plain)
    drafted = [index for index, n, width in priced if width > n]
    assert drafted and set(drafted) <= step["proposed"]  # every verify priced: it always follows its Propose
    core.close()


class IdleProbeIn(IdlePolicy):
    """Idle, with the next probe due a set number of decisions away."""

    def __init__(self, max_k: int, script: list[int], probe_in: int) -> None:
        super().__init__(max_k, script)
        self.probe_in = probe_in

    def steps_until_probe(self) -> int:
        return self.probe_in


def _idle_dflash_core(speculative_engine, checkpoints_dflash, tmp_path, probe_in: int):
    """A DFlash engine whose policy finds that no drafts pay, the next probe `probe_in` decisions away;
    and the list its Proposes' answers are recorded in."""
    shm_dir = tmp_path / f"shm-{probe_in}"
    shm_dir.mkdir()
    core, proposes, _ = _dflash_core(speculative_engine, checkpoints_dflash, shm_dir, 128, [0] * 500, defer=True,
                                     idle=True)
    core.speculator.policy = IdleProbeIn(REFERENCE_DFLASH_K, [0] * 500, probe_in)
    return core, proposes


def test_while_no_drafts_pay_a_sequence_no_probe_reaches_is_never_followed(speculative_engine, checkpoints_dflash,
                                                                          tmp_path):
    """Following a sequence costs every step (its hidden states captured into the staging rows, its
    updates queued). While no drafts pay, a sequence admitted with the next probe further away than
    it can run is never followed: no forward of it captures anything and the drafter never hears
    of it. One admitted with a probe due within its life is followed from its first forward. The
    output is the target's own either way."""
    captured = {}
    for probe_in in (10_000, 0):
        core, _ = _idle_dflash_core(speculative_engine, checkpoints_dflash, tmp_path, probe_in)
        reference = _generate(core, PROMPTS[0], speculate=False)[0]
        reads = core.speculator.reads_hidden_states
        steps = []
        core.speculator.reads_hidden_states = lambda scheduled: steps.append(answer := reads(scheduled)) or answer
        tokens = _generate(core, PROMPTS[0])[0]
        assert tokens == reference
        captured[probe_in] = sum(steps)
        if probe_in:
            assert not core.speculator._followed and not core.speculator._pending and not core.speculator._admitted
            assert not core.link._stub.host.drafter.sequences
        core.close()
    assert captured[10_000] == 0 and captured[0] >= MAX_TOKENS - 1, captured


def test_while_no_drafts_pay_one_sequence_is_followed_for_a_probe_and_quiet_steps_call_nothing(
        speculative_engine, checkpoints_dflash, tmp_path):
    """A probe asks one sequence, so while no drafts pay only one is followed for it, however many
    are admitted (each followed one is captured and recorded every step). With none followed, a
    step is quiet: no Propose, nothing captured, and still one k = 0 decision counted per step in
    the metrics Prometheus reads. The output is the target's own."""
    for probe_in in (0, 10_000):
        core, proposes = _idle_dflash_core(speculative_engine, checkpoints_dflash, tmp_path, probe_in)
        references = [_generate(core, prompt, speculate=False)[0] for prompt in PROMPTS[:3]]
        zero_before = _zero_steps(core) or 0.0
        for i, prompt in enumerate(PROMPTS[:3]):
            core.add(EngineRequest(f"together-{probe_in}-{i}", tuple(core.tokenizer.encode(prompt)),
                                   stop=StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        followed, steps = [], 0
        while core.has_work():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
            steps += 1
            followed.append(len(core.speculator._followed))
        assert [tokens[f"together-{probe_in}-{i}"] for i in range(3)] == references
        if probe_in == 0:
            assert max(followed) == 1  # the probe's one sequence
        else:
            assert max(followed) == 0 and proposes == []  # quiet: not one Propose
            assert not core.link._stub.host.drafter.sequences
            decode_steps = steps - 1  # the first step prefills the three prompts
            assert _zero_steps(core) - zero_before >= decode_steps
        core.close()


def test_while_the_drafter_is_down_every_step_is_a_fallback_step_whatever_the_policy(
        speculative_engine, checkpoints_dflash, tmp_path):
    """A step served without a drafter counts in splitspec_spec_decode_fallback_steps, quiet or not:
    a policy that finds no drafts pay must not hide an outage from the dashboards."""
    core, proposes = _idle_dflash_core(speculative_engine, checkpoints_dflash, tmp_path, 10_000)
    core.link.mark_failed("stopped for the test")
    core.link._next_attempt = float("inf")  # no handshake again within the test
    before = core.metrics.registry.get_sample_value("splitspec_spec_decode_fallback_steps_total")
    _, chosen, _ = _generate(core, PROMPTS[0])
    after = core.metrics.registry.get_sample_value("splitspec_spec_decode_fallback_steps_total")
    assert not core.link.ready and proposes == []
    assert after - before == len(chosen) >= MAX_TOKENS - 1
    core.close()
