"""The prefix cache through the real engine and real drafters (in-process stubs): output with
the cache warm is the output with it off, token for token, for every drafter, greedy and
seeded; a warm cache drafts exactly as a cold one; a re-attached drafter never trusts the
draft layers of pages written before it attached; preemption and aborts of sequences that
share pages lose nothing."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from common.kv_layout import CacheConfig
from draft_service.drafters import DrafterConfig
from draft_service.local import LocalDrafterStub
from target_service.api_types import EngineRequest, FinishReason, SamplingParams, StopParams
from target_service.config import EngineConfig
from target_service.engine import build_engine_core
from tests.tiny_models import REFERENCE_DFLASH_K

K = REFERENCE_DFLASH_K
PAGE = 8
MAX_TOKENS = 16
KINDS = ("ngram", "draft_model", "dflash")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, spec_models):
    """The target; a draft LM near it (the target's weights with noise: some drafts right,
    some wrong); a DFlash drafter for it."""
    from safetensors.torch import load_file, save_file

    target = spec_models.target
    near = tmp_path_factory.mktemp("prefix-cache") / "near"
    shutil.copytree(target, near)
    weights = load_file(near / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    noisy = {name: (w + 0.6 * w.std() * torch.randn(w.shape, generator=gen)).contiguous()
             if w.dim() == 2 and "embed" not in name else w for name, w in weights.items()}
    save_file(noisy, near / "model.safetensors", metadata={"format": "pt"})
    return {"target": target, "draft_model": near, "dflash": spec_models.dflash}


def _core(checkpoints, shm_dir, kind: str | None, *, prefix_caching: bool = True, kv_dtype: str = "float32",
          num_pages: int | None = 128, **engine):
    shm_dir.mkdir(parents=True, exist_ok=True)
    cache = CacheConfig(cache_dtype=kv_dtype, shm_dir=str(shm_dir), page_size=PAGE, num_pages=num_pages)
    if kind is None:
        config = EngineConfig(model=str(checkpoints["target"]), cache=cache, enable_prefix_caching=prefix_caching,
                              **engine)
        return build_engine_core(config)
    model = {"ngram": {}, "draft_model": {"model": str(checkpoints["draft_model"]), "dtype": "float32"},
             "dflash": {"model": str(checkpoints["dflash"]), "dtype": "float32"}}[kind]
    stub = LocalDrafterStub(DrafterConfig(kind=kind, target_model=str(checkpoints["target"]),
                                          num_speculative_tokens=K, shm_dir=str(shm_dir), **model))
    config = EngineConfig(model=str(checkpoints["target"]), cache=cache, enable_prefix_caching=prefix_caching,
                          drafter="in-process", internal_token="unused", num_speculative_tokens=K,
                          **{"speculative_policy": "fixed", **engine})
    core = build_engine_core(config, drafter_stub=stub)
    assert core.link.ready, core.link.detail
    return core


def run_all(core, requests: list[EngineRequest]) -> dict[str, tuple[list[int], object]]:
    """Each request's tokens and final usage, all admitted at once."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    usage = {}
    for r in requests:
        core.add(r)
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finish_reason is not None:
                usage[out.request_id] = out.usage
    core.page_manager.check_invariants()
    return {rid: (tokens[rid], usage[rid]) for rid in tokens}


SYSTEM = tuple(random.Random(1).randrange(5, 400) for _ in range(45))  # a shared "system prompt"


def chat_requests(tag: str, sampled: bool = False, turns: int = 3) -> list[EngineRequest]:
    """Conversations sharing SYSTEM, each turn's prompt extending the previous one."""
    rng = random.Random(7)
    requests = []
    for conv in range(3):
        history = list(SYSTEM)
        for turn in range(turns):
            history += [rng.randrange(5, 400) for _ in range(rng.randrange(3, 12))]
            sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=100 * conv + turn) if sampled else \
                SamplingParams()
            requests.append(EngineRequest(f"{tag}-c{conv}-t{turn}", tuple(history), sampling,
                                          StopParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
            history += [rng.randrange(5, 400) for _ in range(5)]  # the "assistant's" answer, as a client sends it
    return requests


def record_drafts(core) -> list[list[int]]:
    """Every draft the drafter returns from now on, in order (one sequence at a time)."""
    drafts: list[list[int]] = []
    propose = core.speculator.propose

    def recording(scheduled, metrics):
        out = propose(scheduled, metrics)
        drafts.extend(out.values())
        return out

    core.speculator.propose = recording
    return drafts


def _tokens(results) -> dict[str, list[int]]:
    return {rid: tokens for rid, (tokens, _) in results.items()}


# Every drafter over float32 pages, and the n-gram drafter over fp8 pages (their scales in the
# page hashes), run in make test-fast; the other low-precision pairs, a second or two of engine
# steps each, are marked slow (make test runs them).
WARM_CASES = [pytest.param(kind, kv_dtype, id=f"{kind}-{kv_dtype}",
                           marks=() if kv_dtype == "float32" or (kind, kv_dtype) == ("ngram", "fp8_e4m3")
                           else pytest.mark.slow)
              for kv_dtype in ("float32", "bfloat16", "fp8_e4m3") for kind in KINDS]


@pytest.mark.parametrize(("kind", "kv_dtype"), WARM_CASES)
def test_warm_cache_output_equals_cache_off(checkpoints, tmp_path, kind, kv_dtype):
    for sampled in (False, True):
        requests = chat_requests("q", sampled)
        off = _core(checkpoints, tmp_path / "off", kind, prefix_caching=False, kv_dtype=kv_dtype)
        expected = _tokens(run_all(off, requests))
        assert off.page_manager.num_cached_pages == 0
        off.close()
        on = _core(checkpoints, tmp_path / "on", kind, kv_dtype=kv_dtype)
        cold = run_all(on, requests)  # all at once: concurrent sequences share SYSTEM's pages
        warm = run_all(on, requests)  # every prompt's full pages cached now
        assert _tokens(cold) == expected, f"{kind} {kv_dtype} sampled={sampled}: cold"
        assert _tokens(warm) == expected, f"{kind} {kv_dtype} sampled={sampled}: warm"
        hits = [usage.cached_tokens for _, usage in warm.values()]
        if kind == "dflash":  # only pages DFlash wrote its layers in are reused with it
            assert sum(hits) > 0
        else:
            assert all(hit >= len(r.prompt_token_ids) - PAGE for hit, r in zip(hits, requests))
        assert sum(usage.draft_tokens for _, usage in warm.values()) > 0
        assert on.page_manager.num_free_pages == on.page_manager.num_pages
        on.close()


@pytest.mark.parametrize("kind", ["draft_model", "dflash"])
def test_acceptance_warm_equals_cold(checkpoints, tmp_path, kind):
    """One request at a time, fixed K: what a warm cache drafts (the drafter's layers for the
    cached pages reused, not recomputed) is what a cold one drafted, position by position."""
    core = _core(checkpoints, tmp_path, kind)
    drafts = record_drafts(core)
    for request in chat_requests("a", turns=2)[:2]:
        (cold_tokens, cold), = run_all(core, [request]).values()
        cold_drafts = list(drafts)
        drafts.clear()
        again = EngineRequest(request.request_id + "-again", request.prompt_token_ids, request.sampling, request.stop)
        (warm_tokens, warm), = run_all(core, [again]).values()
        assert warm.cached_tokens >= len(request.prompt_token_ids) - PAGE, kind
        assert warm_tokens == cold_tokens
        assert drafts == cold_drafts  # every draft token, step by step
        drafts.clear()
        assert (warm.num_drafts, warm.draft_tokens, warm.accepted_tokens) == \
            (cold.num_drafts, cold.draft_tokens, cold.accepted_tokens)
        assert warm.accepted_per_position == cold.accepted_per_position
    core.close()


def _scribble_draft_layers(core) -> None:
    """Overwrite every draft layer's pages with noise: what a drafter that is not the one that
    wrote them would find."""
    pool = core.shared.pool
    for spec in core.layout.layers:
        if spec.owner == "draft":
            region = pool.region(spec)
            region.copy_(torch.randn(region.shape, generator=torch.Generator().manual_seed(5)).to(region.dtype))


@pytest.mark.parametrize("kind", ["draft_model", "dflash"])
def test_reattached_drafter_never_reads_stale_draft_pages(checkpoints, tmp_path, kind):
    core = _core(checkpoints, tmp_path, kind)
    drafts = record_drafts(core)
    request = chat_requests("r", turns=1)[0]
    (cold_tokens, cold), = run_all(core, [request]).values()
    cold_drafts = list(drafts)
    drafts.clear()
    epoch = core.layout.epoch
    assert core.handshake() and core.layout.epoch == epoch + 1
    _scribble_draft_layers(core)  # cached pages' draft layers are void for the new epoch
    again = EngineRequest("again", request.prompt_token_ids, request.sampling, request.stop)
    (tokens, usage), = run_all(core, [again]).values()
    assert tokens == cold_tokens
    assert drafts == cold_drafts
    drafts.clear()
    if kind == "draft_model":  # the target's pages are reused; the draft LM recomputes its own
        assert usage.cached_tokens > 0
    else:  # DFlash needs the hidden states of what it did not write: nothing is reused for it
        assert usage.cached_tokens == 0
    # The control: trusting scribbled draft pages would change the drafts (the test can fail)
    _scribble_draft_layers(core)
    third = EngineRequest("third", request.prompt_token_ids, request.sampling, request.stop)
    (tokens, usage), = run_all(core, [third]).values()
    assert tokens == cold_tokens  # lossless whatever the drafts
    assert usage.cached_tokens > 0  # the second run's pages were marked written in this epoch
    assert drafts != cold_drafts
    core.close()


def test_preemption_and_abort_of_sequences_sharing_pages(checkpoints, tmp_path):
    requests = chat_requests("p", turns=2)
    off = _core(checkpoints, tmp_path / "off", "draft_model", prefix_caching=False)
    expected = _tokens(run_all(off, requests))
    off.close()
    # 24 pages of 8 for 6 sequences of up to ~90 tokens sharing SYSTEM: preemptions happen
    core = _core(checkpoints, tmp_path / "on", "draft_model", num_pages=24, max_num_seqs=6)
    preemptions_before = core.metrics.preemptions._value.get()
    assert _tokens(run_all(core, requests)) == expected
    assert core.metrics.preemptions._value.get() > preemptions_before
    # Aborting a sequence that shares SYSTEM's pages leaves the others whole
    first, second = chat_requests("x", turns=1)[:2]
    core.add(first)
    core.add(second)
    collected: list[int] = []
    for _ in range(2):
        collected += [t for o in core.step() if o.request_id == second.request_id for t in o.token_ids]
    shared = [p for p in core.scheduler.running[0].page_table if core.page_manager.refcount(p) > 1]
    assert shared, "the two conversations share SYSTEM's full pages"
    [out] = core.abort(first.request_id)
    assert out.finish_reason is FinishReason.ABORT
    assert all(core.page_manager.refcount(p) == 1 for p in shared)
    while core.has_work():
        collected += [t for o in core.step() for t in o.token_ids]
    alone = _core(checkpoints, tmp_path / "alone", None, prefix_caching=False)
    (reference, _), = run_all(alone, [second]).values()
    alone.close()
    assert collected == reference
    core.page_manager.check_invariants()
    assert core.page_manager.num_free_pages == core.page_manager.num_pages
    core.close()


def test_prefix_cache_metrics_and_state(checkpoints, tmp_path):
    core = _core(checkpoints, tmp_path, None)
    requests = chat_requests("m", turns=2)
    run_all(core, requests[:1])  # admitted in one step, the others would all compute SYSTEM at once
    run_all(core, requests[1:])
    queries = core.metrics.prefix_cache_queries._value.get()
    hits = core.metrics.prefix_cache_hits._value.get()
    assert queries == sum(len(r.prompt_token_ids) for r in requests)
    assert 0 < hits < queries
    state = core.state().prefix_cache
    assert state["enabled"] and state["cached_pages"] > 0 and state["hits"] == hits
    core.close()


def test_dflash_takes_the_whole_hit_unfollowed_while_no_drafts_pay(checkpoints, tmp_path):
    """While the policy finds that no drafts pay (`DraftPolicy.idle`), a DFlash target does not
    recompute cached prompt pages its drafter never wrote: the prompt takes its whole hit, and
    the sequence goes unfollowed (no drafts, no staged rows). Its output is the cache-off one."""
    request = chat_requests("idle", turns=1)[0]
    off = _core(checkpoints, tmp_path / "off", None, prefix_caching=False)
    expected = _tokens(run_all(off, [request]))
    off.close()
    core = _core(checkpoints, tmp_path / "on", "dflash", speculative_policy="adaptive")
    policy = core.speculator.policy
    for tokens in range(1, K + 2):  # a verify costs as much per token as a decode: drafts never pay
        policy.record_forward(1, tokens, 0.001 * tokens)
    for width in range(1, K + 2):
        policy.record_propose(width, 0.01)
    for _ in range(1000):
        if policy.idle:
            break
        policy.decide(1, 1, K)
    assert policy.idle
    cold = run_all(core, [request])
    assert _tokens(cold) == expected
    again = EngineRequest("idle-again", request.prompt_token_ids, request.sampling, request.stop)
    (tokens, usage), = run_all(core, [again]).values()
    assert tokens == expected[request.request_id]
    assert usage.cached_tokens >= len(request.prompt_token_ids) - PAGE  # the whole hit, not the drafter's pages
    assert usage.draft_tokens == 0
    assert not core.speculator._pending and not core.speculator._followed
    core.close()
