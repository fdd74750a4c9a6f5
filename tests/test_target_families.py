"""Every model drafter over every target family served: DFlash, an EAGLE-3 head and a draft
LM over a Llama-3 target (llama3 rope scaling, biased attention, tied embeddings) and a
Qwen2 target (q/k/v bias), split across real processes, greedy output equal to the
target's own. (More EAGLE-3: tests/test_eagle3_e2e.py; everything over Qwen3:
tests/test_speculative_e2e.py.)
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from splitspec.v1 import generation_pb2 as pb
from tests.eagle3_reference import HeadShape, build_reference, save_specforge
from tests.procs import Service, stream_tokens
from tests.tiny_models import PROMPTS, TARGET_LAYERS, make_llama_family, make_reference_dflash

pytestmark = pytest.mark.slow
MAX_TOKENS = 20
NUM_PROMPTS = 6


@pytest.fixture(scope="module", params=("llama", "qwen2"))
def family(request, tmp_path_factory) -> tuple[str, Path, Path, Path]:
    """(family, target, draft LM = a copy of the target, DFlash head, EAGLE-3 head for it)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(request.param)
    target = make_llama_family(root / "target", request.param, num_hidden_layers=TARGET_LAYERS)
    draft_lm = root / "draft-lm"
    shutil.copytree(target, draft_lm)
    tokenizer = AutoTokenizer.from_pretrained(target)
    dflash = make_reference_dflash(root / "dflash", vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id)
    eagle3 = save_specforge(build_reference(HeadShape(aux_layer_ids=None), target), root / "eagle3")
    return request.param, target, draft_lm, dflash, eagle3


def generate(address: str, prompt: str, disable: bool) -> tuple[list[int], pb.Complete]:
    request = pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                 speculation=pb.SpeculationParams(disable=disable))
    return stream_tokens(address, request)


def run_prompts(address: str, disable: bool) -> list[tuple[list[int], pb.Complete]]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: generate(address, p, disable), PROMPTS[:NUM_PROMPTS]))


@pytest.mark.parametrize("kind", ("draft_model", "dflash", "eagle3"))
def test_drafter_over_target_family_is_lossless(family, kind, tmp_path):
    name, target_dir, draft_lm, dflash, eagle3 = family
    model = {"draft_model": [str(draft_lm), "--dtype", "float32"], "dflash": [str(dflash)], "eagle3": [str(eagle3)]}[kind]
    drafter = Service("draft_service.cli",
                      ["--kind", kind, "--model", *model, "--target-model", str(target_dir), "--port", "0",
                       "--num-speculative-tokens", "4", "--shm-dir", str(tmp_path)], tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli",
                         ["--model", str(target_dir), "--port", "0", "--shm-dir", str(tmp_path), "--num-pages",
                          "256", "--page-size", "8", "--drafter", drafter.address, "--speculative-policy", "fixed",
                          "--dtype", "float32"],
                         tmp_path / "target.log")
        address = target.wait_serving()
        plain = run_prompts(address, disable=True)
        spec = run_prompts(address, disable=False)
        for i, ((tokens, _), (ref, _)) in enumerate(zip(spec, plain)):
            assert tokens == ref, f"{kind} over {name}, prompt {i}"
        drafted = sum(c.usage.draft_tokens for _, c in spec)
        assert drafted > 0, f"nothing was speculated\n{target.log()}"
        if kind == "draft_model":  # the draft LM is the target itself: every draft is accepted
            assert sum(c.usage.accepted_tokens for _, c in spec) == drafted
        assert target.stop() == 0, target.log()
    finally:
        if target is not None:
            target.kill()
        assert drafter.stop() == 0, drafter.log()
