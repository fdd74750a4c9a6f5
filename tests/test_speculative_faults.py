"""The split stack under handshake variations, drafter faults, sampling, and wire size."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.kv_layout import CacheConfig
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from splitspec.v1 import kv_layout_pb2 as kv_pb
from target_service.api_types import EngineRequest, StopParams
from target_service.config import EngineConfig
from target_service.engine import build_engine_core
from tests.procs import TOKEN, Service, free_port, server_info, stream_tokens, wait_drafter
from tests.stats import CHI2_CRIT, two_sample_chi_square
from tests.tiny_models import PROMPTS, TARGET_LAYERS, make_qwen3, make_reference_dflash

pytestmark = pytest.mark.slow
READY = pb.DrafterState.STATUS_READY
UNAVAILABLE = pb.DrafterState.STATUS_UNAVAILABLE


def target_args(model: Path, shm_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--port", "0", "--shm-dir", str(shm_dir), "--num-pages", "256",
            "--page-size", "8", "--max-num-batched-tokens", "128",
            "--speculative-policy", "fixed", *extra]  # drafts every step, however bad: these tests count them


@contextlib.contextmanager
def drafter_and_target(target_model: Path, tmp_path: Path, drafter_args: list[str], *target_extra: str):
    """A drafter, then a target that speculates with it; yields the target's address once SERVING."""
    drafter = Service("draft_service.cli", [*drafter_args, "--shm-dir", str(tmp_path)], tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli",
                         target_args(target_model, tmp_path, *target_extra, "--drafter", drafter.address),
                         tmp_path / "target.log")
        yield target.wait_serving()
    finally:
        if target:
            target.stop()
        drafter.kill()


def request(prompt: str, max_tokens: int, **kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", None)
    return pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True),
                              speculation=pb.SpeculationParams(**kw), sampling=sampling)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_both_orders_are_agreed_and_used(target_model, draft_lm, tmp_path, order):
    drafter_args = ["--model", str(draft_lm), "--port", "0", "--num-speculative-tokens", "4"]
    with drafter_and_target(target_model, tmp_path, drafter_args, "--kv-layout", order) as address:
        info = wait_drafter(address, READY)
        assert kv_pb.PageOrder.Name(info.kv_layout.order) == f"PAGE_ORDER_{order}"
        assert info.drafter.kind == "draft_model" and info.drafter.num_speculative_tokens == 4
        assert info.drafter.propose_transport == "shm"  # the pool's channel: both map the file
        assert {spec.owner for spec in info.kv_layout.layers} == {1, 2}  # target and draft layers, one pool
        plain, _ = stream_tokens(address, request(PROMPTS[3], 20, disable=True))
        spec, complete = stream_tokens(address, request(PROMPTS[3], 20))
        assert spec == plain and complete.usage.accepted_tokens > 0


def test_incompatible_drafter_is_refused_and_target_serves(target_model, tmp_path):
    other_vocab = make_qwen3(tmp_path / "other", tokenizer_vocab=600)
    with drafter_and_target(target_model, tmp_path, ["--model", str(other_vocab), "--port", "0"]) as address:
        info = wait_drafter(address, UNAVAILABLE)
        assert "FAILED_PRECONDITION" in info.drafter.detail and "vocab_size" in info.drafter.detail
        assert "512" in info.drafter.detail and "600" in info.drafter.detail
        tokens, complete = stream_tokens(address, request(PROMPTS[0], 8))
        assert len(tokens) == 8 and complete.usage.num_drafts == 0


def test_drafter_sigkill_midstream_then_restart(target_model, draft_lm, tmp_path):
    port = free_port()
    drafter_args = ["--model", str(draft_lm), "--port", str(port), "--num-speculative-tokens", "4",
                    "--shm-dir", str(tmp_path)]
    drafter = Service("draft_service.cli", drafter_args, tmp_path / "drafter.log")
    drafter.wait_serving()
    target = Service("target_service.cli", target_args(target_model, tmp_path, "--drafter", f"127.0.0.1:{port}",
                                                       "--drafter-timeout-s", "1"), tmp_path / "target.log")
    try:
        address = target.wait_serving()
        wait_drafter(address, READY)
        prompts = PROMPTS[:8]
        expected = [stream_tokens(address, request(p, 60, disable=True))[0] for p in prompts]
        started = threading.Barrier(len(prompts) + 1)

        def run(prompt: str):
            with grpc.insecure_channel(address) as channel:
                stream = pb_grpc.GenerationStub(channel).Generate(request(prompt, 60), timeout=120)
                tokens, complete = [], None
                for i, response in enumerate(stream):
                    if response.HasField("chunk"):
                        tokens.extend(response.chunk.token_ids)
                    else:
                        complete = response.complete
                    if i == 1:
                        started.wait()
                return tokens, complete

        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(run, p) for p in prompts]
            started.wait(timeout=60)
            drafter.signal(signal.SIGKILL)
            results = [f.result() for f in futures]
        for (tokens, complete), want in zip(results, expected):
            assert tokens == want
            assert complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert wait_drafter(address, UNAVAILABLE).drafter.detail

        drafter = Service("draft_service.cli", drafter_args, tmp_path / "drafter2.log")
        drafter.wait_serving()
        info = wait_drafter(address, READY)
        assert info.drafter.epoch >= 2  # a new handshake generation
        tokens, complete = stream_tokens(address, request(prompts[0], 60))
        assert tokens == expected[0]
        assert complete.usage.num_drafts > 0 and complete.usage.accepted_tokens > 0
        assert server_info(address).free_pages == 256
    finally:
        stopped = target.stop()  # the drafter is killed whatever this says
        drafter.kill()
    assert stopped == 0, target.log()


def test_temperature_one_keeps_the_target_distribution(target_model, draft_lm, tmp_path):
    """Speculated samples (drafts = target argmax, accepted with probability p) follow p."""
    drafter_args = ["--model", str(draft_lm), "--port", "0", "--num-speculative-tokens", "3"]
    with drafter_and_target(target_model, tmp_path, drafter_args) as address:
        wait_drafter(address, READY)
        n = 400

        def sample(seed: int, disable: bool):
            sampling = pb.SamplingParams(temperature=1.0, seed=seed)
            return stream_tokens(address, request(PROMPTS[6], 4, disable=disable, sampling=sampling))

        with ThreadPoolExecutor(8) as pool:
            plain = list(pool.map(lambda s: sample(s, True), range(n)))
            spec = list(pool.map(lambda s: sample(s + 10_000, False), range(n)))
        assert sum(c.usage.num_drafts for _, c in spec) > n // 2, "speculation did not run"
        assert 0 < sum(c.usage.accepted_tokens for _, c in spec) < sum(c.usage.draft_tokens for _, c in spec)
        for position in (1, 2, 3):  # position 0 comes from the prefill, never from a draft
            stat, dof = two_sample_chi_square(Counter(t[position] for t, _ in plain),
                                               Counter(t[position] for t, _ in spec))
            assert dof >= 1 and stat < CHI2_CRIT[min(dof, 20)], f"position {position}: chi2 {stat:.1f}, dof {dof}"


def _propose_bytes_per_sequence(tmp_path: Path, hidden_size: int) -> float:
    target = make_qwen3(tmp_path / "target", num_hidden_layers=TARGET_LAYERS, hidden_size=hidden_size,
                        intermediate_size=2 * hidden_size, head_dim=hidden_size // 4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    dflash = make_reference_dflash(tmp_path / "dflash", vocab_size=len(tok), mask_token_id=tok.mask_token_id,
                                   hidden_size=hidden_size)
    drafter = Service("draft_service.cli", ["--model", str(dflash), "--target-model", str(target), "--port", "0",
                                            "--shm-dir", str(tmp_path)], tmp_path / "drafter.log")
    try:
        address = drafter.wait_serving()
        cache = CacheConfig(cache_dtype="float32", shm_dir=str(tmp_path), num_pages=128, page_size=8)
        core = build_engine_core(EngineConfig(model=str(target), cache=cache, drafter=address,
                                              internal_token=TOKEN, speculative_policy="fixed"))
        try:
            assert core.link.ready, core.link.detail
            for i, p in enumerate(PROMPTS[:4]):
                core.add(EngineRequest(f"r{i}", tuple(tok.encode(p)), stop=StopParams(max_tokens=16, ignore_eos=True)))
            while core.has_work():
                core.step()
            assert core.link.num_proposes > 0
            return core.link.propose_bytes / core.link.propose_sequences
        finally:
            core.close()
    finally:
        drafter.kill()


def test_propose_bytes_do_not_grow_with_hidden_size(tmp_path):
    """Propose carries ids only: the hidden states travel through the shared staging rows."""
    small = _propose_bytes_per_sequence(tmp_path / "h64", 64)
    large = _propose_bytes_per_sequence(tmp_path / "h256", 256)
    # prefill updates carry the prompt ids; decode updates a handful of ids and page numbers
    assert large < 1.25 * small and large < 200, (small, large)
