"""The prefix cache across real processes: a target and a DFlash drafter, each its own
process, over gRPC. The drafter's report of what it wrote crosses the process boundary; a
warm cache's output equals the target alone with the cache off; `cache_salt` isolates;
the counters, GetServerInfo and `splitspec info` show it."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import (
    REPO_ROOT,
    Service,
    free_port,
    scrape_metrics,
    served_target,
    server_info,
    stream_tokens,
    wait_idle,
)
from tests.tiny_models import TARGET_LAYERS, make_qwen3, make_reference_dflash

pytestmark = pytest.mark.slow
PAGE = 8
SYSTEM = list(range(10, 60))  # a 50-token "system prompt"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("served-prefix")
    target = make_qwen3(root / "target", num_hidden_layers=TARGET_LAYERS)
    tok = AutoTokenizer.from_pretrained(target)
    dflash = make_reference_dflash(root / "dflash", vocab_size=len(tok), mask_token_id=tok.mask_token_id)
    return target, dflash


def request(suffix: list[int], salt: str = "", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[*SYSTEM, *suffix]), cache_salt=salt,
                              sampling=pb.SamplingParams(**sampling),
                              stop=pb.StopParams(max_tokens=12, ignore_eos=True))


TURNS = [[70, 71, 72], [70, 71, 72, 80, 81, 82, 83, 84, 85, 86, 87], [90, 91]]


def run_turns(address: str) -> list[tuple[list[int], pb.Complete]]:
    out = []
    for suffix in TURNS:
        out.append(stream_tokens(address, request(suffix)))
        out.append(stream_tokens(address, request(suffix, temperature=0.9, seed=5)))
    return out


def speculating_target(target, drafter: Service, shm_dir, log_path, *extra: str) -> Service:
    args = ["--model", str(target), "--port", "0", "--shm-dir", str(shm_dir), "--page-size", str(PAGE),
            "--num-pages", "128", "--kv-cache-dtype", "float32", "--drafter", drafter.address,
            "--speculative-policy", "fixed", *extra]
    return Service("target_service.cli", args, log_path)


def test_warm_cache_with_a_drafter_process_equals_cache_off(models, tmp_path):
    """Seeded sampling with drafts consumes the generator as the drafts go, so the reference is
    the same drafter with the cache off: equal output means equal drafts, too."""
    target, dflash = models
    drafter = Service("draft_service.cli", ["--kind", "dflash", "--model", str(dflash), "--target-model",
                                            str(target), "--port", "0", "--num-speculative-tokens", "4",
                                            "--shm-dir", str(tmp_path)], tmp_path / "drafter.log")
    try:
        drafter.wait_serving()
        off = speculating_target(target, drafter, tmp_path, tmp_path / "off.log", "--no-prefix-caching")
        try:
            reference = run_turns(off.wait_serving())
            assert not server_info(off.address).prefix_cache.enabled
        finally:
            assert off.stop() == 0, off.log()
        metrics_port = free_port()
        on = speculating_target(target, drafter, tmp_path, tmp_path / "on.log", "--metrics-port", str(metrics_port))
        try:
            address = on.wait_serving()
            cold = run_turns(address)
            warm = run_turns(address)
            expected = [tokens for tokens, _ in reference]
            assert [tokens for tokens, _ in cold] == expected
            assert [tokens for tokens, _ in warm] == expected
            assert all(c.usage.cached_tokens >= len(SYSTEM) + len(TURNS[i // 2]) - PAGE
                       for i, (_, c) in enumerate(warm)), [c.usage.cached_tokens for _, c in warm]
            assert sum(c.usage.draft_tokens for _, c in warm) > 0
            assert [c.usage.accepted_per_position for _, c in warm] == \
                [c.usage.accepted_per_position for _, c in reference]

            info = wait_idle(address).prefix_cache
            assert info.enabled and info.cached_pages > 0 and 0 < info.hit_tokens < info.query_tokens
            metrics = scrape_metrics(metrics_port)
            assert metrics["splitspec_prefix_cache_queries_total"] == info.query_tokens
            assert metrics["splitspec_prefix_cache_hits_total"] == info.hit_tokens
            assert metrics["splitspec_prefix_cache_pages"] == info.cached_pages
            shown = subprocess.run([sys.executable, "-m", "splitspec.cli", "info", "--target", address],
                                   capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
            assert shown.returncode == 0, shown.stderr
            assert "prefix cache" in shown.stdout and "hit rate" in shown.stdout, shown.stdout
        finally:
            assert on.stop() == 0, on.log()
    finally:
        drafter.kill()


def test_cache_salt_isolates_and_is_bounded(models, tmp_path):
    target, _ = models
    with served_target(target, tmp_path / "target.log", "--page-size", str(PAGE)) as served:
        address = served.address
        _, first = stream_tokens(address, request([1, 2, 3], salt="tenant-a"))
        _, same = stream_tokens(address, request([1, 2, 3], salt="tenant-a"))
        _, other = stream_tokens(address, request([1, 2, 3], salt="tenant-b"))
        _, unsalted = stream_tokens(address, request([1, 2, 3]))
        assert first.usage.cached_tokens == 0
        assert same.usage.cached_tokens == (len(SYSTEM) + 2) // PAGE * PAGE
        assert other.usage.cached_tokens == 0 and unsalted.usage.cached_tokens == 0
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
            list(pb_grpc.GenerationStub(channel).Generate(request([1], salt="s" * 257), timeout=30))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in error.value.details()
        wait_idle(address)  # still serving, nothing leaked
        assert stream_tokens(address, request([4]))[1] is not None
