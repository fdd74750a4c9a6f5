"""Propose over the KV pool's shm channel, with a real drafter process (common/shm_channel.py).

The target engine runs in the test's process (so the test can reach its end of the channel);
the drafter is `splitspec-draft`, a separate process mapping the same pool file."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from common.kv_layout import CacheConfig
from common.shm_channel import ChannelError
from splitspec.v1 import drafter_pb2 as dpb
from target_service.api_types import EngineRequest, SpeculationParams, StopParams
from target_service.config import EngineConfig
from target_service.engine import build_engine_core
from tests.procs import TOKEN, Service
from tests.tiny_models import PROMPTS

pytestmark = pytest.mark.slow
K = 4


@pytest.mark.parametrize("same_shm_dir", [True, False])
def test_an_ngram_drafter_maps_the_pool_for_the_channel_alone(target_model, tmp_path, same_shm_dir):
    """n-gram reads no pages, but its Propose is the one that costs least in the drafter: the
    round trip is all it costs, so it maps the pool (with the same checks) to answer there.
    Where it may not (its --shm-dir is another folder) it drafts over gRPC, as before."""
    shm_dir = tmp_path if same_shm_dir else tmp_path / "elsewhere"
    shm_dir.mkdir(exist_ok=True)
    service = Service("draft_service.cli", ["--kind", "ngram", "--target-model", str(target_model), "--port", "0",
                                            "--shm-dir", str(shm_dir), "--num-speculative-tokens", str(K)],
                      tmp_path / "ngram.log")
    service.wait_serving()
    core = engine(target_model, service, tmp_path)
    try:
        assert core.link.describe(0)["propose_transport"] == ("shm" if same_shm_dir else "grpc")
        reference, _ = generate(core, PROMPTS[0] * 3, speculate=False)
        tokens, _ = generate(core, PROMPTS[0] * 3)
        assert tokens == reference
        proposes, on_channel = core.link.num_proposes, core.link.channel_proposes
        assert proposes > 0
        assert (proposes - 2 <= on_channel) if same_shm_dir else (on_channel == 0)
    finally:
        core.close()
        service.kill()
    if not same_shm_dir:
        assert "gRPC only" in service.log()


@pytest.fixture
def drafter(draft_lm, tmp_path):
    # float32: the target's own copy drafts exactly its argmax only when it computes the target's numbers
    service = Service("draft_service.cli", ["--model", str(draft_lm), "--port", "0", "--shm-dir", str(tmp_path),
                                            "--num-speculative-tokens", str(K), "--dtype", "float32"],
                      tmp_path / "drafter.log")
    service.wait_serving()
    yield service
    service.kill()


def engine(target_model: Path, drafter: Service, shm_dir: Path, transport: str = "auto", timeout_s: float = 60.0):
    config = EngineConfig(model=str(target_model), cache=CacheConfig(shm_dir=str(shm_dir), num_pages=256, page_size=8),
                          drafter=drafter.address, internal_token=TOKEN, num_speculative_tokens=K,
                          speculative_policy="fixed", propose_transport=transport, drafter_timeout_s=timeout_s,
                          max_num_batched_tokens=128)
    core = build_engine_core(config)
    assert core.link.ready, core.link.detail
    core.warmup()  # as a server does before serving: the decode and verify steps are compiled
    return core


def generate(core, prompt: str, max_tokens: int = 24, speculate: bool = True):
    request_id = f"r{core.link.num_proposes}-{speculate}-{prompt[:6]}"
    core.add(EngineRequest(request_id, tuple(core.tokenizer.encode(prompt)),
                           stop=StopParams(max_tokens=max_tokens, ignore_eos=True),
                           speculation=SpeculationParams(disable=not speculate)))
    tokens = []
    while True:
        for out in core.step():
            tokens.extend(out.token_ids)
            if out.finish_reason is not None:
                return tokens, out.usage


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_propose_goes_over_the_pool_channel_unless_told_grpc_and_is_lossless(target_model, drafter, tmp_path,
                                                                             transport):
    core = engine(target_model, drafter, tmp_path, transport)
    try:
        assert core.link.describe(0)["propose_transport"] == ("shm" if transport == "auto" else "grpc")
        for prompt in PROMPTS[:3]:
            reference, _ = generate(core, prompt, speculate=False)
            tokens, usage = generate(core, prompt)
            assert tokens == reference
            assert usage.accepted_tokens == usage.draft_tokens > 0  # the target's own copy drafts
        proposes, on_channel = core.link.num_proposes, core.link.channel_proposes
        assert proposes > 0
        if transport == "auto":  # the first Propose after each pause (3 runs without drafts) may go by gRPC
            assert proposes - 4 <= on_channel <= proposes
        else:
            assert on_channel == 0
    finally:
        core.close()


def test_garbage_on_the_channel_gets_an_error_reply_and_the_drafter_keeps_serving(target_model, drafter, tmp_path):
    """What a writer other than the engine could put in the region: bytes that are no
    ProposeRequest, and a ProposeRequest for another epoch. Each gets gRPC's status for it;
    the engine's own Proposes go on over the channel."""
    core = engine(target_model, drafter, tmp_path)
    try:
        channel = core.link.shm_channel
        with pytest.raises(ChannelError) as garbage:
            channel.call(b"\xff\x01" * 64, timeout_s=30.0)
        assert garbage.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid splitspec.v1.ProposeRequest" in garbage.value.details
        stale = dpb.ProposeRequest(target_id=core.layout.target_id, epoch=core.layout.epoch + 7)
        with pytest.raises(ChannelError) as wrong_epoch:
            channel.call(stale.SerializeToString(), timeout_s=30.0)
        assert wrong_epoch.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"epoch {core.layout.epoch + 7}" in wrong_epoch.value.details
        before = core.link.channel_proposes
        reference, _ = generate(core, PROMPTS[1], speculate=False)
        tokens, usage = generate(core, PROMPTS[1])
        assert tokens == reference and usage.accepted_tokens > 0
        assert core.link.ready and core.link.channel_proposes > before
    finally:
        core.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_drafter_gone_from_the_channel_is_noticed_by_its_heartbeat(target_model, drafter, tmp_path, sig):
    """The Propose deadline is a minute: a killed or stopped drafter must be noticed by its
    heartbeat (UNAVAILABLE), not waited out (DEADLINE_EXCEEDED a minute later)."""
    core = engine(target_model, drafter, tmp_path, timeout_s=60.0)
    try:
        reference, _ = generate(core, PROMPTS[2], speculate=False)
        drafter.signal(sig)
        tokens, _ = generate(core, PROMPTS[2])
        assert tokens == reference  # served without speculation meanwhile
        assert not core.link.ready
        assert "UNAVAILABLE" in core.link.detail and "stopped serving the shm channel" in core.link.detail
    finally:
        if sig == signal.SIGSTOP:
            drafter.signal(signal.SIGCONT)
        core.close()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_the_drafter_burns_no_core_between_proposes(target_model, drafter, tmp_path):
    """The two processes take turns on the same cores: while the target verifies, or serves
    with no drafts asked, the drafter's channel thread must sleep, not spin. It spun (with
    sched_yield) for 20 ms after each Propose, which held a core through every verify: a K+1
    verify cost 2.5 decodes on 2 cores. A Propose is answered before `step` returns, so the
    20 ms after each step stand for a verify on a busy machine, and the drafter's CPU is
    counted in those windows only: what it spends drafting depends on the CPU's speed (it
    reached half the wall time on a slow CI machine when the whole run was counted), what it
    spends between proposes must be nothing whatever the CPU."""
    core = engine(target_model, drafter, tmp_path)
    pid = drafter.proc.pid
    idle_cpu = idle_wall = 0.0
    try:
        generate(core, PROMPTS[0], max_tokens=8)  # warm
        proposes = core.link.channel_proposes
        core.add(EngineRequest("turns", tuple(core.tokenizer.encode(PROMPTS[1])),
                               stop=StopParams(max_tokens=200, ignore_eos=True)))
        while core.has_work():
            core.step()
            cpu, wall = process_cpu_seconds(pid), time.monotonic()
            threading.Event().wait(0.02)
            idle_cpu += process_cpu_seconds(pid) - cpu
            idle_wall += time.monotonic() - wall
    finally:
        core.close()
    assert core.link.channel_proposes - proposes >= 20
    # spinning through each window would read about 1.0; CPU time moves in 10 ms ticks, so a
    # window that merely straddles one tick adds 10 ms: a quarter leaves room for those
    assert idle_cpu < 0.25 * idle_wall, f"the drafter used {idle_cpu:.2f} s of CPU in {idle_wall:.2f} s of turns not its own"
