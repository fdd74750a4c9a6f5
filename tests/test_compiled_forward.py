"""The compiled forward (common/compiled_forward.py) against the model's eager forward.

Every bucket kind is run on the same paged steps as the eager forward, on tiny checkpoints
of each family we serve: exact buckets (decode, verify), a padded one and a step too large
for any bucket (eager). Float32 logits agree within 1e-4 (measured ~1e-6: Inductor sums
in another order); the captured hidden states too.
"""

from __future__ import annotations

import pytest
import torch

from common.compiled_forward import CompileConfig, CompiledForward, decoder_stack
from common.qwen3 import Qwen3ForCausalLM
from tests.paged_runner import CPU, PagedRunner, Seq
from tests.tiny_models import make_llama_family, make_qwen3

LOGIT_ATOL = 1e-4
# small, so that each kind of bucket is reached; compiled at first use, in the step's thread
CONFIG = CompileConfig(enabled=True, exact_tokens=8, max_tokens=24, background=False)


class Compiled:
    """The model's interface as PagedRunner calls it, with the forward compiled."""

    def __init__(self, model: Qwen3ForCausalLM, config: CompileConfig) -> None:
        self.forward = CompiledForward(decoder_stack(model), config)
        self.compute_logits = model.compute_logits
        self.kv_layer_specs = model.kv_layer_specs

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def model(request, tmp_path_factory) -> Qwen3ForCausalLM:
    folder = tmp_path_factory.mktemp(request.param)
    path = make_qwen3(folder) if request.param == "qwen3" else make_llama_family(folder, request.param)
    return Qwen3ForCausalLM.from_pretrained(path, torch.float32, CPU)


def steps():
    """(chunk lengths per sequence) of each step: a padded prefill, decodes, verifies, an eager prefill."""
    return [[11, 7], [1, 1], [5, 3], [1, 1], [30, 2], [4, 4]]


def test_bucket_policy():
    config = CompileConfig(enabled=True, exact_tokens=16, max_tokens=64)
    assert [config.bucket(t) for t in (1, 9, 16, 17, 24, 25, 33, 64, 65)] == [1, 9, 16, 24, 24, 32, 48, 64, None]
    assert CompileConfig(enabled=False).bucket(1) is None
    assert CompileConfig().bucket(1) is None  # off unless asked for
    assert CompileConfig(enabled=True, exact_tokens=4, max_tokens=40).bucket(33) == 40  # the last bucket is max_tokens itself
    with pytest.raises(ValueError, match="exact_tokens"):
        CompileConfig(exact_tokens=32, max_tokens=16)
    sized = CompileConfig(enabled=True, sizes=(9, 18, 36))  # the buckets given outright (DFlash's blocks)
    assert [sized.bucket(t) for t in (1, 9, 10, 18, 19, 36, 37)] == [9, 9, 18, 18, 36, 36, None]
    assert CompileConfig(sizes=(9,)).bucket(9) is None
    with pytest.raises(ValueError, match="ascending"):
        CompileConfig(sizes=(18, 9))


@pytest.mark.slow  # Inductor compiles every bucket: 10-300 s on 2 shared cores
def test_every_bucket_matches_the_eager_forward(model, shm_dir):
    (other_shm := shm_dir / "compiled").mkdir()  # a second pool: its own folder
    eager_runner, compiled_runner = PagedRunner(model, shm_dir), PagedRunner(model, other_shm)
    compiled = Compiled(model, CONFIG)
    compiled_runner.model = compiled
    try:
        generator = torch.Generator().manual_seed(0)
        tokens = [torch.randint(0, model.vocab_size, (64,), generator=generator).tolist() for _ in range(2)]
        eager_seqs, compiled_seqs = [Seq(list(t)) for t in tokens], [Seq(list(t)) for t in tokens]
        capture = (0, model.num_layers - 1)
        for chunk in steps():
            want, want_captured = eager_runner.step(eager_seqs, chunk, capture)
            got, got_captured = compiled_runner.step(compiled_seqs, chunk, capture)
            for w, g in zip(want, got, strict=True):
                torch.testing.assert_close(g, w, atol=LOGIT_ATOL, rtol=0)
            for layer in capture:
                torch.testing.assert_close(got_captured[layer], want_captured[layer], atol=LOGIT_ATOL, rtol=0)
    finally:
        eager_runner.close()
        compiled_runner.close()
        other_shm.rmdir()
    stats = compiled.forward.stats
    assert set(stats.steps) == {24, 2, 8}  # 18 tokens padded to 24; decodes of 2; verifies of 8 twice
    assert stats.steps == {24: 1, 2: 2, 8: 2}
    assert stats.eager_steps == 1  # 32 tokens: past max_tokens


def test_disabled_runs_the_model_itself(model):
    forward = CompiledForward(decoder_stack(model), CompileConfig(enabled=False))
    forward.prepare([1, 9])
    assert forward.stats.seconds == {}


@pytest.mark.slow  # Inductor compiles every bucket: 10-300 s on 2 shared cores
def test_prepare_compiles_ahead_of_use(model):
    forward = CompiledForward(decoder_stack(model), CONFIG)
    forward.prepare([1, 3, 100])
    assert set(forward.stats.seconds) == {1, 3}  # 100 tokens run eagerly: nothing to compile


@pytest.mark.slow  # Inductor compiles every bucket: 10-300 s on 2 shared cores
def test_a_bucket_first_needed_mid_serving_compiles_in_the_background(model, shm_dir):
    """The step that first needs a bucket runs eagerly (no step waits for a compile); once the
    background compile is done, steps of that size run compiled, with the same values."""
    runner = PagedRunner(model, shm_dir)
    compiled = Compiled(model, CompileConfig(enabled=True, exact_tokens=8, max_tokens=24))
    runner.model = compiled
    try:
        seqs = [Seq(list(range(3, 40)))]
        runner.step(seqs, [6])
        stats = compiled.forward.stats
        assert stats.eager_steps == 1 and stats.steps == {}
        compiled.forward.wait_ready()
        assert set(stats.seconds) == {6}
        runner.step(seqs, [6])
        assert stats.steps == {6: 1} and stats.eager_steps == 1
    finally:
        compiled.forward.close()
        runner.close()


def test_a_bucket_that_fails_to_compile_runs_eagerly(model, monkeypatch):
    forward = CompiledForward(decoder_stack(model), CONFIG)

    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(forward, "_compile", broken)
    forward.prepare([3])
    assert forward.stats.failed == {3: "RuntimeError: no compiler here"}
    assert not forward._start_compiling(3)  # given up: never retried


@pytest.mark.slow  # Inductor compiles every bucket: 10-300 s on 2 shared cores
def test_speculative_greedy_through_the_compiled_forward_equals_eager_target_only(target_model, draft_lm, shm_dir,
                                                                                   speculative_engine):
    """The engine and an in-process draft model both compiled (every bucket at warmup), against the
    eager engine without speculation: the same greedy tokens."""
    from common.kv_layout import CacheConfig
    from target_service.api_types import EngineRequest, SpeculationParams, StopParams
    from target_service.config import EngineConfig
    from target_service.engine import build_engine_core
    from tests.tiny_models import PROMPTS

    compiled = CompileConfig(enabled=True, exact_tokens=4, max_tokens=16)  # buckets 1-4 and 16
    cache = CacheConfig(shm_dir=str(shm_dir), num_pages=256, page_size=8)

    def generate(core, prompt: str, speculate: bool) -> list[int]:
        request_id = f"{speculate}-{prompt}"
        core.add(EngineRequest(request_id, tuple(core.tokenizer.encode(prompt)),
                               stop=StopParams(max_tokens=24, ignore_eos=True),
                               speculation=SpeculationParams(disable=not speculate)))
        tokens = []
        while core.in_flight(request_id):
            for out in core.step():
                tokens.extend(out.token_ids)
        return tokens

    eager = build_engine_core(EngineConfig(model=str(target_model), cache=cache, dtype="float32"))
    try:
        expected = [generate(eager, p, speculate=False) for p in PROMPTS[:3]]
    finally:
        eager.close()
    core = speculative_engine(target_model, draft_lm, drafter={"dtype": "float32", "compile": True}, cache=cache,
                              num_speculative_tokens=4, speculative_policy="fixed", compile=compiled)
    try:
        core.warmup()
        assert set(core.runner.forward.stats.seconds) == {1, 2, 3, 4, 16}
        assert [generate(core, p, speculate=True) for p in PROMPTS[:3]] == expected
        assert core.runner.forward.stats.steps.get(16, 0) > 0  # the verifies of 1 + 4 drafts, padded to 16
    finally:
        core.close()


@pytest.mark.slow  # Inductor compiles two buckets
def test_compiled_rows_pad_to_their_bucket_and_fall_back_to_eager():
    """A row-wise function compiled per row bucket: padded rows are cut off the outputs; rows of
    another dtype than traced, or more than the largest bucket, run the function itself."""
    from common.compiled_forward import CompiledRows

    weight = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))  # [out, in]

    def fn(x, positions, w):  # row t of each output from row t of the inputs alone
        return x @ w.T.to(x.dtype) + positions[:, None], x.sum(-1)

    rows = CompiledRows(fn, [weight], CompileConfig(enabled=True, exact_tokens=4, max_tokens=8, background=False),
                        "test rows")
    x, positions = torch.randn(10, 5), torch.arange(10)
    for count in (6, 3):
        got = rows(x[:count], positions[:count])
        for g, w in zip(got, fn(x[:count], positions[:count], weight), strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w)
    assert rows.stats.steps == {8: 1, 3: 1} and rows.stats.eager_steps == 0
    rows(x[:3].double(), positions[:3])  # traced for float32
    rows(x, positions)  # 10 rows: past max_tokens
    assert rows.stats.eager_steps == 2 and rows.stats.steps == {8: 1, 3: 1}
