"""EAGLE-3 heads served split across real processes, lossless: a Qwen3 target with a head in
speculators' layout (`--kind auto` tells it from the checkpoint) and a Llama-3 target (llama3
rope scaling) with a head in the SpecForge layout (`--kind eagle3`); then `splitspec up` with
a user's own target and drafter folders. Greedy output must equal target-only output.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from splitspec.v1 import generation_pb2 as pb
from tests.eagle3_reference import HeadShape, build_reference, save_specforge, save_speculators
from tests.procs import REPO_ROOT, Service, free_port, stream_tokens, wait_for_line
from tests.tiny_models import PROMPTS, make_llama_family, make_qwen3

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
TARGET_LAYERS = 6
NUM_PROMPTS = 8
READY = re.compile(r"splitspec up: ready at (\S+)")


def make_pair(root: Path, family: str) -> tuple[Path, Path]:
    """(target folder, EAGLE-3 head folder) for a `family` target."""
    if family == "qwen3":
        target = make_qwen3(root / "target", num_hidden_layers=TARGET_LAYERS)
        head = save_speculators(build_reference(HeadShape(layer_type="qwen3", num_layers=2), target),
                                root / "eagle3", target)
    else:
        target = make_llama_family(root / "target", "llama", num_hidden_layers=TARGET_LAYERS)
        head = save_specforge(build_reference(HeadShape(aux_layer_ids=None), target, seed=3), root / "eagle3")
    return target, head


def target_args(model: Path, shm_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--port", "0", "--shm-dir", str(shm_dir), "--num-pages", "256",
            "--page-size", "8", "--max-num-batched-tokens", "128", *extra]


def generate(address: str, prompt: str, disable: bool = False) -> tuple[list[int], pb.Complete]:
    request = pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                 speculation=pb.SpeculationParams(disable=disable))
    return stream_tokens(address, request)


def run_prompts(address: str, concurrency: int, disable: bool = False) -> list[tuple[list[int], pb.Complete]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: generate(address, p, disable), PROMPTS[:NUM_PROMPTS]))


@pytest.mark.parametrize(("family", "kind", "policy", "kv_dtype"), [
    ("qwen3", "auto", "fixed", "float32"),
    ("llama", "eagle3", "fixed", "float32"),
    ("qwen3", "eagle3", "adaptive", "fp8_e4m3"),  # the default policy; fp8 pages for the head's layers too
])
def test_eagle3_split_is_lossless(family, kind, policy, kv_dtype, tmp_path):
    target_dir, head_dir = make_pair(tmp_path / "models", family)
    drafter = Service("draft_service.cli",
                      ["--kind", kind, "--model", str(head_dir), "--target-model", str(target_dir), "--port", "0",
                       "--num-speculative-tokens", "4", "--shm-dir", str(tmp_path)],
                      tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        assert "serving eagle3 drafter" in drafter.log()
        target = Service("target_service.cli",
                         target_args(target_dir, tmp_path, "--drafter", drafter.address, "--speculative-policy",
                                     policy, "--kv-cache-dtype", kv_dtype),
                         tmp_path / "target.log")
        address = target.wait_serving()
        reference = [tokens for tokens, _ in run_prompts(address, 4, disable=True)]
        for concurrency in (1, 4):
            results = run_prompts(address, concurrency)
            for i, ((tokens, complete), ref) in enumerate(zip(results, reference)):
                assert tokens == ref, f"{family}, concurrency {concurrency}, prompt {i}"
                assert complete.usage.accepted_tokens <= complete.usage.draft_tokens
            if policy == "fixed":  # the adaptive policy may rightly find a random head's drafts do not pay
                assert sum(c.usage.draft_tokens for _, c in results) > 0, f"nothing was speculated\n{target.log()}"
        assert target.stop() == 0, target.log()
    finally:
        if target is not None:
            target.kill()
        assert drafter.stop() == 0, drafter.log()


def test_up_serves_your_own_target_and_eagle3_head(tmp_path):
    target_dir, head_dir = make_pair(tmp_path / "models", "llama")
    port, draft_port = free_port(), free_port()
    args = ["up", "--drafter", "auto", "--target-model", str(target_dir), "--draft-model", str(head_dir),
            "--models", str(tmp_path / "no-demo"), "--port", str(port), "--draft-port", str(draft_port),
            "--no-gateway", "--metrics-port", "0", "--draft-metrics-port", "0", "--shm-dir", str(tmp_path),
            "--max-num-seqs", "4", "--speculative-policy", "fixed"]
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "splitspec.cli", *args], cwd=REPO_ROOT, stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        address = wait_for_line(up, log_path, READY, 300, poll_s=0.2)[1]
        drafted = 0
        for prompt in PROMPTS[:3]:
            plain, _ = generate(address, prompt, disable=True)
            spec, complete = generate(address, prompt)
            assert spec == plain, prompt
            drafted += complete.usage.draft_tokens
        assert drafted > 0
        assert "eagle3" in log_path.read_text(errors="replace")
    finally:
        up.send_signal(subprocess.signal.SIGINT)
        try:
            assert up.wait(60) == 0, log_path.read_text(errors="replace")
        finally:
            if up.poll() is None:
                up.kill()


def test_malformed_head_stops_the_drafter_at_start_naming_the_field(tmp_path):
    """A head whose reduced vocabulary has no d2t: the drafter process never serves."""
    from safetensors.torch import load_file, save_file

    target_dir, head_dir = make_pair(tmp_path / "models", "llama")
    tensors = load_file(head_dir / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, str(head_dir / "model.safetensors"))
    drafter = Service("draft_service.cli",
                      ["--kind", "auto", "--model", str(head_dir), "--target-model", str(target_dir), "--port", "0",
                       "--shm-dir", str(tmp_path)], tmp_path / "drafter.log")
    try:
        assert drafter.proc.wait(180) == 1, drafter.log()
        assert "d2t is missing" in drafter.log()
    finally:
        drafter.kill()


def test_a_target_of_another_vocabulary_serves_without_the_head(tmp_path):
    """The handshake refuses the head, naming vocab_size; the target serves without speculation."""
    from tests.procs import server_info, wait_drafter

    target_dir, head_dir = make_pair(tmp_path / "models", "qwen3")
    other = make_qwen3(tmp_path / "other", num_hidden_layers=TARGET_LAYERS, tokenizer_vocab=400)
    drafter = Service("draft_service.cli",
                      ["--kind", "eagle3", "--model", str(head_dir), "--target-model", str(target_dir), "--port",
                       "0", "--shm-dir", str(tmp_path)], tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli", target_args(other, tmp_path, "--drafter", drafter.address),
                         tmp_path / "target.log")
        address = target.wait_serving()
        info = wait_drafter(address, pb.DrafterState.STATUS_UNAVAILABLE)
        assert "vocab_size" in info.drafter.detail, info
        tokens, complete = generate(address, PROMPTS[0])
        assert len(tokens) == MAX_TOKENS and complete.usage.num_drafts == 0
        assert server_info(address).drafter.status == pb.DrafterState.STATUS_UNAVAILABLE
        assert target.stop() == 0, target.log()
    finally:
        if target is not None:
            target.kill()
        assert drafter.stop() == 0, drafter.log()


def test_temperature_one_keeps_the_target_distribution(tmp_path):
    """Sampled tokens with the head's drafts follow the target's own samples (chi-square per
    position, as tests/test_speculative_faults.py checks the draft LM)."""
    from collections import Counter

    from tests.stats import same_distribution

    target_dir, head_dir = make_pair(tmp_path / "models", "qwen3")
    drafter = Service("draft_service.cli",
                      ["--kind", "eagle3", "--model", str(head_dir), "--target-model", str(target_dir), "--port",
                       "0", "--num-speculative-tokens", "3", "--shm-dir", str(tmp_path)], tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli", target_args(target_dir, tmp_path, "--drafter", drafter.address,
                                                           "--speculative-policy", "fixed"), tmp_path / "target.log")
        address = target.wait_serving()
        n = 400

        def sample(seed: int, disable: bool):
            request = pb.GenerateRequest(text=PROMPTS[6], stop=pb.StopParams(max_tokens=4, ignore_eos=True),
                                         sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                                         speculation=pb.SpeculationParams(disable=disable))
            return stream_tokens(address, request)

        with ThreadPoolExecutor(8) as pool:
            plain = list(pool.map(lambda s: sample(s, True), range(n)))
            spec = list(pool.map(lambda s: sample(s + 10_000, False), range(n)))
        assert sum(c.usage.num_drafts for _, c in spec) > n // 2, "speculation did not run"
        accepted, drafted = (sum(getattr(c.usage, f) for _, c in spec) for f in ("accepted_tokens", "draft_tokens"))
        assert 0 < accepted < drafted, (accepted, drafted)
        for position in (1, 2, 3):
            same, figures = same_distribution(Counter(t[position] for t, _ in plain),
                                              Counter(t[position] for t, _ in spec))
            assert same, f"position {position}: {figures}"
        assert target.stop() == 0, target.log()
    finally:
        if target is not None:
            target.kill()
        assert drafter.stop() == 0, drafter.log()
