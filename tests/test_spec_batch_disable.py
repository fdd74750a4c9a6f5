"""--speculative-disable-by-batch-size: no drafts in a large batch, drafting resumes when it
shrinks, and the drafter never loses a sequence's context in between."""

from __future__ import annotations

import pytest

from target_service.api_types import EngineRequest, SpeculationParams, StopParams
from target_service.config import EngineConfig
from tests.tiny_models import PROMPTS, make_pair

K = 4
MAX_TOKENS = (6, 6, 30)  # two short requests finish first; the long one then runs alone


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("batch-disable"))  # the target's copy drafts: every draft is right


def _core(speculative_engine, target, draft, disable_at):
    return speculative_engine(target, draft, drafter={"num_speculative_tokens": K}, num_speculative_tokens=K,
                              speculative_disable_batch_size=disable_at,
                              speculative_policy="fixed")  # every step asks for drafts: the threshold alone decides


def batch_disabled_steps(core) -> float:
    return core.metrics.registry.get_sample_value("splitspec_spec_decode_batch_disabled_steps_total")


def _run_together(core, speculate: bool = True) -> dict[str, tuple[list[int], object]]:
    """All requests added before the first step; {request id: (tokens, usage)}."""
    for i, max_tokens in enumerate(MAX_TOKENS):
        core.add(EngineRequest(f"r{i}", tuple(core.tokenizer.encode(PROMPTS[i])),
                               stop=StopParams(max_tokens=max_tokens, ignore_eos=True),
                               speculation=SpeculationParams(disable=not speculate)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(MAX_TOKENS))}
    usage = {}
    while len(usage) < len(MAX_TOKENS):
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finish_reason is not None:
                usage[out.request_id] = out.usage
    return {rid: (tokens[rid], usage[rid]) for rid in tokens}


def test_a_full_batch_runs_without_drafts_and_drafting_resumes_when_it_shrinks(speculative_engine, checkpoints):
    target, draft = checkpoints
    core = _core(speculative_engine, target, draft, disable_at=len(MAX_TOKENS))
    assert core.link.ready, core.link.detail
    reference = _run_together(core, speculate=False)
    results = _run_together(core)

    for rid in results:  # lossless either way
        assert results[rid][0] == reference[rid][0], rid
    short, long = [results["r0"][1], results["r1"][1]], results["r2"][1]
    assert all(u.num_drafts == 0 for u in short)  # they only ever ran in the full batch
    assert long.num_drafts > 0  # alone, the long request is speculated again ...
    assert long.accepted_tokens == long.draft_tokens  # ... and its drafter kept every token of context
    assert batch_disabled_steps(core) > 0
    core.close()


def test_below_the_threshold_every_request_is_speculated(speculative_engine, checkpoints):
    target, draft = checkpoints
    core = _core(speculative_engine, target, draft, disable_at=len(MAX_TOKENS) + 1)
    results = _run_together(core)
    assert all(usage.num_drafts > 0 for _, usage in results.values())
    assert batch_disabled_steps(core) == 0
    core.close()


def test_the_threshold_must_be_positive():
    with pytest.raises(ValueError, match="speculative_disable_batch_size must be positive"):
        EngineConfig(model="m", speculative_disable_batch_size=0)
