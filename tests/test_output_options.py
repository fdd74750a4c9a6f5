"""Logprobs, logit shaping and n > 1 in the engine, with every drafter (a real drafter process)
and without, at concurrency 1 and 8, against independent references:

- greedy output with penalties, logit_bias, banned ids and min_tokens equals a greedy loop over
  Hugging Face's forward and its logits processors;
- completion and prompt logprobs equal log_softmax of Hugging Face's float32 forward over the
  same tokens (the raw distribution, whatever the shaping) within LOGPROB_ATOL;
- seeded sampling with penalties keeps the target's distribution under speculation
  (two-sample chi-square against target-only samples);
- n sequences of a request are the requests they stand for (seed + index).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from common.kv_layout import CacheConfig
from target_service.api_types import (
    EngineRequest,
    LogprobParams,
    SamplingParams,
    SpeculationParams,
    StopParams,
)
from target_service.config import EngineConfig
from target_service.engine import build_engine_core
from tests.procs import TOKEN, Service
from tests.shaping_reference import hf_processors
from tests.stats import CHI2_CRIT, two_sample_chi_square
from tests.tiny_models import PROMPTS, SpecModels

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
LOGPROB_ATOL = 1e-4  # our float32 paged forward against Hugging Face's float32 forward
TOP = 5
PROMPT_TOP = 3
DRAFTERS = ("none", "ngram", "draft_model", "dflash")


@pytest.fixture(scope="module")
def models(spec_models):
    """The draft LM is a copy of the target; DFlash is the reference package's (tests/tiny_models.py)."""
    return spec_models


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(models.target)


def drafter_args(kind: str, models: SpecModels, shm_dir: Path) -> list[str]:
    model = {"ngram": [], "draft_model": ["--model", str(models.draft_lm), "--dtype", "float32"],
             "dflash": ["--model", str(models.dflash)]}
    return ["--kind", kind, *model[kind], "--target-model", str(models.target), "--port", "0",
            "--num-speculative-tokens", "4", "--shm-dir", str(shm_dir)]


@pytest.fixture(scope="module", params=DRAFTERS)
def core(request, models, tmp_path_factory):
    """An in-process engine speculating (fixed K: drafts every step) with a drafter process."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"options-{kind}")
    drafter = None
    if kind != "none":
        drafter = Service("draft_service.cli", drafter_args(kind, models, tmp), tmp / "drafter.log")
        drafter.wait_serving()
    cache = CacheConfig(cache_dtype="float32", shm_dir=str(tmp), num_pages=512, page_size=8)
    engine = build_engine_core(EngineConfig(
        model=str(models.target), cache=cache, drafter=drafter.address if drafter else None, internal_token=TOKEN,
        speculative_policy="fixed", max_num_batched_tokens=128, dtype="float32"))
    try:
        assert drafter is None or engine.link.ready, engine.link.detail
        yield kind, engine
    finally:
        engine.close()
        if drafter is not None:
            drafter.kill()


def run(engine, requests: list[EngineRequest], concurrency: int) -> dict[tuple[str, int], list]:
    """Every output by (request id, index), `concurrency` requests in the engine at a time."""
    outputs: dict[tuple[str, int], list] = {(r.request_id, i): [] for r in requests for i in range(r.n)}
    for start in range(0, len(requests), concurrency):
        for r in requests[start : start + concurrency]:
            engine.add(r)
        while engine.has_work():
            for out in engine.step():
                outputs[(out.request_id, out.index)].append(out)
    assert engine.page_manager.num_free_pages == engine.page_manager.num_pages
    return outputs


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


# ---------------------------------------------------------------- greedy shaping against transformers

SHAPINGS = [  # (sampling, stop) per prompt, cycled
    (SamplingParams(repetition_penalty=1.8), StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
    (SamplingParams(frequency_penalty=1.2, presence_penalty=0.6), StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
    (SamplingParams(logit_bias=((40, 6.0), (41, 4.0)), banned_token_ids=(7, 9, 10)),
     StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
    (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.5, logit_bias=((12, 2.0),)),
     StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
    None,  # min_tokens with EOS biased up: it stops right after the minimum
]


def shaping(i: int, eos: int) -> tuple[SamplingParams, StopParams]:
    entry = SHAPINGS[i % len(SHAPINGS)]
    if entry is None:
        return SamplingParams(logit_bias=((eos, 30.0),)), StopParams(max_tokens=MAX_TOKENS, min_tokens=5)
    return entry


def hf_greedy_shaped(hf, prompt: list[int], sampling: SamplingParams, stop: StopParams, eos: int) -> list[int]:
    """Greedy decoding by Hugging Face's full forward and its processors (no cache, no drafts)."""
    model, _ = hf
    chain = hf_processors(sampling, len(prompt), stop.min_tokens, eos)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(stop.max_tokens):
            scores = chain(torch.tensor([ids]), model(torch.tensor([ids])).logits[:, -1].float())
            token = int(scores.argmax(dim=-1))
            ids.append(token)
            if token == eos and not stop.ignore_eos:
                break
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def greedy_references(models, hf):
    _, tok = hf
    refs = []
    for i, text in enumerate(PROMPTS[:8]):
        prompt = tok.encode(text)
        sampling, stop = shaping(i, tok.eos_token_id)
        refs.append((prompt, sampling, stop, hf_greedy_shaped(hf, prompt, sampling, stop, tok.eos_token_id)))
    return refs


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of Hugging Face's float32 forward: row p predicts ids[p + 1]."""
    model, _ = hf
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_logprobs(reference: torch.Tensor, entries, tokens: list[int], rows: range, top: int, what: str) -> None:
    """Our entries at `rows` of the reference: the chosen token's value and rank, the top list's values
    (best first) and each listed token's value."""
    assert len(entries) == len(tokens) == len(rows), what
    for entry, token, row in zip(entries, tokens, rows):
        want = reference[row]
        assert entry.chosen.token_id == token, what
        assert abs(entry.chosen.logprob - float(want[token])) <= LOGPROB_ATOL, f"{what}, row {row}"
        higher, not_lower = int((want > want[token] + LOGPROB_ATOL).sum()), int((want > want[token] - LOGPROB_ATOL).sum())
        assert higher + 1 <= entry.chosen.rank <= not_lower + 1, f"{what}, row {row}: rank"  # ties within the tolerance
        assert len(entry.top) == top, what
        best = want.topk(top).values.tolist()
        for j, alt in enumerate(entry.top):
            assert abs(alt.logprob - best[j]) <= LOGPROB_ATOL and alt.rank == j + 1, f"{what}, row {row}, top {j}"
            assert abs(alt.logprob - float(want[alt.token_id])) <= LOGPROB_ATOL, f"{what}, row {row}, top {j}"


@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_shaping_and_logprobs_equal_transformers(core, hf, greedy_references, concurrency):
    kind, engine = core
    logprobs = LogprobParams(completion=True, top=TOP, prompt=True, prompt_top=PROMPT_TOP)
    requests = [EngineRequest(f"g{i}", tuple(prompt), sampling=sampling, stop=stop, logprobs=logprobs)
                for i, (prompt, sampling, stop, _) in enumerate(greedy_references)]
    outputs = run(engine, requests, concurrency)
    drafts = 0
    for i, (prompt, _, _, want) in enumerate(greedy_references):
        outs = outputs[(f"g{i}", 0)]
        got = tokens_of(outs)
        assert got == want, f"{kind}, concurrency {concurrency}, prompt {i}"
        reference = hf_logprobs(hf, prompt + got)
        completion = [e for o in outs for e in o.logprobs]
        check_logprobs(reference, completion, got, range(len(prompt) - 1, len(prompt) - 1 + len(got)), TOP,
                       f"{kind}, prompt {i}, completion")
        [(first, *prompt_entries)] = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert (first.chosen.token_id, first.chosen.logprob, first.top) == (prompt[0], None, ())
        check_logprobs(reference, prompt_entries, prompt[1:], range(len(prompt) - 1), PROMPT_TOP,
                       f"{kind}, prompt {i}, prompt")
        drafts += outs[-1].usage.draft_tokens
    if kind != "none":
        assert drafts > 0, f"{kind}: nothing was speculated"
    min_tokens_case = 4  # SHAPINGS[4]: stops at EOS right after the minimum
    assert len(greedy_references[min_tokens_case][3]) == 6


def test_sampled_logprobs_are_the_raw_distribution(core, hf):
    """Seeded sampling with penalties: whatever was sampled (drafted or not), its logprob is the
    raw target's; with a temperature and penalties applied to the sampling only."""
    kind, engine = core
    _, tok = hf
    requests = [EngineRequest(f"s{i}", tuple(tok.encode(text)), logprobs=LogprobParams(completion=True, top=2),
                              sampling=SamplingParams(temperature=0.8, seed=i, repetition_penalty=1.4),
                              stop=StopParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                for i, text in enumerate(PROMPTS[:8])]
    outputs = run(engine, requests, 8)
    for r in requests:
        outs = outputs[(r.request_id, 0)]
        got = tokens_of(outs)
        prompt = list(r.prompt_token_ids)
        check_logprobs(hf_logprobs(hf, prompt + got), [e for o in outs for e in o.logprobs], got,
                       range(len(prompt) - 1, len(prompt) - 1 + len(got)), 2, f"{kind}, {r.request_id}")


def test_prompt_logprobs_of_a_chunked_prompt_equal_transformers(core, hf):
    """A prompt prefilled in chunks of 128 tokens (and two of them at once): every position's
    logprob, those at the chunk boundaries included."""
    kind, engine = core
    _, tok = hf
    prompt = tok.encode("\n".join(PROMPTS))
    assert len(prompt) > 2 * 128
    logprobs = LogprobParams(prompt=True, prompt_top=PROMPT_TOP)
    requests = [EngineRequest(f"long{i}", tuple(prompt), logprobs=logprobs, stop=StopParams(max_tokens=2))
                for i in range(2)]
    outputs = run(engine, requests, 2)
    reference = hf_logprobs(hf, prompt)
    for r in requests:
        [(first, *entries)] = [o.prompt_logprobs for o in outputs[(r.request_id, 0)] if o.prompt_logprobs]
        assert first.chosen.token_id == prompt[0] and first.chosen.logprob is None
        check_logprobs(reference, entries, prompt[1:], range(len(prompt) - 1), PROMPT_TOP, f"{kind}, {r.request_id}")


# ---------------------------------------------------------------- sampled distribution under speculation


def test_sampling_with_penalties_keeps_the_target_distribution(core, hf):
    """Samples with frequency and presence penalties and a logit bias, speculated, follow
    target-only samples (position 0 comes from the prefill; 1.. may come from drafts, shaped
    after the drafts before them), and repeat a token as rarely. At temperature 0.3 a few tokens
    hold most of the mass, and the penalties move it between them. The prompt holds the tokens the target samples most often
    after its text, so the n-gram drafter finds drafts too."""
    kind, engine = core
    _, tok = hf
    text = tuple(tok.encode(PROMPTS[0]))
    per_request, requests_per_side = 16, 25

    def side(prompt: tuple[int, ...], disable: bool, seed0: int, requests_per_side: int = requests_per_side):
        requests = [EngineRequest(f"{disable}-{r}", prompt, n=per_request,
                                  sampling=SamplingParams(temperature=0.3, frequency_penalty=2.0, presence_penalty=2.0,
                                                          logit_bias=((text[-1], 1.5),), seed=seed0 + r * per_request),
                                  stop=StopParams(max_tokens=4, ignore_eos=True),
                                  speculation=SpeculationParams(disable=disable))
                    for r in range(requests_per_side)]
        outputs = run(engine, requests, 4)
        return [tokens_of(outs) for outs in outputs.values()], [outs[-1].usage for outs in outputs.values()]

    first, _ = side(text, True, 10_000_000, 4)
    common = [t for t, _ in Counter(t for tokens in first for t in tokens).most_common(12)]
    prompt = text + tuple(common) + text
    plain, _ = side(prompt, True, 0)
    spec, usage = side(prompt, False, 1_000_000)
    if kind != "none":
        assert sum(u.draft_tokens for u in usage) > 0, "speculation did not run"
    # A token again within a sequence: what the penalties forbid, and what a row shaped without the
    # drafts before it would let through whenever a draft was accepted
    repeats = [Counter(len(set(t)) < len(t) for t in side_samples) for side_samples in (plain, spec)]
    stat, dof = two_sample_chi_square(*repeats)
    assert dof == 0 or stat < CHI2_CRIT[dof], f"{kind}: repeats {repeats[0][True]} target-only, {repeats[1][True]} speculated"
    for position in (1, 2, 3):
        stat, dof = two_sample_chi_square(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert dof >= 1 and stat < CHI2_CRIT[min(dof, 20)], f"{kind}, position {position}: chi2 {stat:.1f}, dof {dof}"


# ---------------------------------------------------------------- n > 1


def test_n_sequences_are_the_requests_they_stand_for(core, hf):
    """Choice i of a seeded request with n = 3 is the request with seed + i (target-only: how many
    drafts a step verifies changes how many random numbers it draws); greedy choices agree."""
    kind, engine = core
    _, tok = hf
    prompt = tuple(tok.encode(PROMPTS[2]))
    stop = StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=42, presence_penalty=0.3)
    plain = SpeculationParams(disable=True)
    outputs = run(engine, [EngineRequest("n", prompt, sampling=sampled, stop=stop, n=3, speculation=plain),
                           EngineRequest("g", prompt, stop=stop, n=2, logprobs=LogprobParams(prompt=True))], 8)
    singles = run(engine, [EngineRequest(f"one{i}", prompt, sampling=sampled.for_choice(i), stop=stop,
                                         speculation=plain) for i in range(3)], 1)
    for i in range(3):
        assert tokens_of(outputs[("n", i)]) == tokens_of(singles[(f"one{i}", 0)]), f"{kind}, choice {i}"
        assert outputs[("n", i)][-1].index == i and outputs[("n", i)][-1].usage.completion_tokens == MAX_TOKENS
    assert len({tuple(tokens_of(outputs[("n", i)])) for i in range(3)}) > 1
    assert tokens_of(outputs[("g", 0)]) == tokens_of(outputs[("g", 1)])
    assert [len(o.prompt_logprobs) for o in outputs[("g", 0)] if o.prompt_logprobs] == [len(prompt)]
    assert not any(o.prompt_logprobs for o in outputs[("g", 1)])  # once per request, on choice 0


def test_abort_ends_every_sequence_of_a_request(core, hf):
    _, engine = core
    _, tok = hf
    engine.add(EngineRequest("a", tuple(tok.encode(PROMPTS[0])), n=4, stop=StopParams(max_tokens=200)))
    engine.step()
    outs = engine.abort("a")
    assert sorted(o.index for o in outs) == [0, 1, 2, 3] and not engine.in_flight("a")
    assert engine.page_manager.num_free_pages == engine.page_manager.num_pages
