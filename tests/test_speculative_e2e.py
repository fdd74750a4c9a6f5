"""Lossless speculative decoding across real processes: a target and a drafter, per kind.

Greedy output through `splitspec-target --drafter ...` must be token-identical to a
target-only server with the same KV dtype, for 20 prompts at concurrency 1, 4 and 8.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from splitspec.v1 import generation_pb2 as pb
from tests.procs import Service, stream_tokens
from tests.tiny_models import PROMPTS, SpecModels

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
KINDS = ("ngram", "draft_model", "dflash", "dflash-compiled")  # the last: DFlash through its compiled forward
KV_DTYPES = ("float32", "fp8_e4m3")


@pytest.fixture(scope="module")
def models(spec_models):
    """The draft LM is a copy of the target; DFlash is the reference package's (tests/tiny_models.py)."""
    return spec_models


def target_args(model: Path, shm_dir: Path, kv_dtype: str, *extra: str) -> list[str]:
    """A float32 target (its references are float32 transformers and dflash_generate)."""
    return ["--model", str(model), "--port", "0", "--shm-dir", str(shm_dir), "--kv-cache-dtype", kv_dtype, "--dtype",
            "float32",
            "--num-pages", "256", "--page-size", "8", "--max-num-batched-tokens", "128", *extra]


def speculating_target_args(model: Path, shm_dir: Path, kv_dtype: str, drafter: str) -> list[str]:
    """Drafts asked every step (fixed K), so every verify path runs whatever the drafts' quality;
    tests/test_adaptive_speculation.py checks the default policy's output is lossless too."""
    return target_args(model, shm_dir, kv_dtype, "--drafter", drafter, "--speculative-policy", "fixed")


def drafter_args(kind: str, models: SpecModels, shm_dir: Path) -> list[str]:
    # The draft LM is the target itself, computing in the target's float32 (`auto` would take
    # bfloat16 on a CPU that has it): then every draft is accepted, which checks the bonus path.
    model = {"ngram": [], "draft_model": ["--model", str(models.draft_lm), "--dtype", "float32"],
             "dflash": ["--model", str(models.dflash)], "dflash-compiled": ["--model", str(models.dflash), "--compile"]}
    return ["--kind", kind.removesuffix("-compiled"), *model[kind], "--target-model", str(models.target),
            "--port", "0", "--num-speculative-tokens", "4", "--shm-dir", str(shm_dir)]


def generate(address: str, prompt: str, **speculation) -> tuple[list[int], pb.Complete]:
    request = pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                 speculation=pb.SpeculationParams(**speculation))
    return stream_tokens(address, request)


def run_prompts(address: str, concurrency: int) -> list[tuple[list[int], pb.Complete]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: generate(address, p), PROMPTS))


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory) -> dict[str, list[list[int]]]:
    """Target-only outputs per KV dtype."""
    refs = {}
    for kv_dtype in KV_DTYPES:
        tmp = tmp_path_factory.mktemp(f"ref-{kv_dtype}")
        target = Service("target_service.cli", target_args(models.target, tmp, kv_dtype), tmp / "target.log")
        try:
            address = target.wait_serving()
            refs[kv_dtype] = [tokens for tokens, _ in run_prompts(address, 4)]
        finally:
            target.stop()
    return refs


@pytest.fixture(scope="module", params=KINDS)
def drafter(request, models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"drafter-{request.param}")
    service = Service("draft_service.cli", drafter_args(request.param, models, tmp), tmp / "drafter.log")
    try:
        service.wait_serving()
        yield request.param, service, tmp  # the targets keep their pools in the drafter's --shm-dir
    finally:
        service.kill()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_speculative_greedy_is_lossless(models, reference, drafter, kv_dtype, tmp_path):
    kind, drafter_service, shm_dir = drafter
    target = Service("target_service.cli",
                     speculating_target_args(models.target, shm_dir, kv_dtype, drafter_service.address),
                     tmp_path / "target.log")
    try:
        address = target.wait_serving()
        for concurrency in (1, 4, 8):
            results = run_prompts(address, concurrency)
            for i, ((tokens, complete), ref) in enumerate(zip(results, reference[kv_dtype])):
                assert tokens == ref, f"{kind}, {kv_dtype}, concurrency {concurrency}, prompt {i}"
                usage = complete.usage
                assert usage.accepted_tokens <= usage.draft_tokens
                assert sum(usage.accepted_per_position) == usage.accepted_tokens
                assert list(usage.accepted_per_position) == sorted(usage.accepted_per_position, reverse=True)
            drafted = sum(c.usage.draft_tokens for _, c in results)
            assert drafted > 0, f"{kind}: nothing was speculated\n{target.log()}"
            if kind == "draft_model":  # the draft LM is the target itself
                assert all(c.usage.accepted_tokens == c.usage.draft_tokens for _, c in results)
        tokens, complete = generate(address, PROMPTS[0], disable=True)
        assert tokens == reference[kv_dtype][0] and complete.usage.num_drafts == 0
    finally:
        assert target.stop() == 0, target.log()


def test_split_stack_equals_dflash_generate(models, reference):
    """z-lab's own `dflash_generate` on the same checkpoints gives the same greedy tokens as
    target-only decoding, which the split stack reproduces (test above)."""
    import torch
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.target)
    target = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(models.dflash, dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(prompt)])
        out = dflash_generate(draft, target, ids, max_new_tokens=MAX_TOKENS, stop_token_ids=None)
        assert out[0, ids.shape[1]:].tolist() == reference["float32"][i], f"prompt {i}"
