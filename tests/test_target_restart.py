"""The target's life around a running drafter, through real processes.

A target is SIGKILLed mid-stream and restarted beside the same drafter: the new target
removes the dead one's pool file (and only that: another live target's file in the same
folder stays), the drafter sees the new target id, drops the old mapping and every
sequence, never touches the dead pool again (it is gone from the drafter's memory map)
and attaches to the new pool, where speculation works. Then the new target is stopped
with SIGTERM while the drafter is attached: health NOT_SERVING, no new admissions,
in-flight streams finish within the grace or end with ABORT, the pool file is gone and
the drafter unmaps the pool at once.
"""

from __future__ import annotations

import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import (
    Service,
    free_port,
    pool_files,
    private_shm_dir,
    scrape_metrics,
    server_info,
    start_target,
    stream_tokens,
    wait_drafter,
    wait_idle,
)
from tests.tiny_models import PROMPTS, make_pair

pytestmark = pytest.mark.slow
READY = pb.DrafterState.STATUS_READY
MODEL_LEN = 4096  # a stream of MODEL_LEN - 100 tokens outlasts the grace on any machine
GRACE_S = 5.0


TARGET_ARGS = ("--num-pages", "2048", "--page-size", "8", "--max-num-batched-tokens", "128",
               "--shutdown-grace-s", str(GRACE_S), "--speculative-policy", "fixed")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("restart-models"), max_position_embeddings=MODEL_LEN)


def request(prompt: str, max_tokens: int, **speculation) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True),
                              speculation=pb.SpeculationParams(**speculation))


def mapped_files(pid: int) -> set[str]:
    """Files a process has mapped (what it can still read)."""
    return {line.split(maxsplit=5)[5].removesuffix(" (deleted)")
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if len(line.split(maxsplit=5)) == 6}


def pool_file_of(address: str, shm: Path) -> Path:
    target_id = server_info(address).kv_layout.target_id
    (path,) = [p for p in pool_files(shm) if target_id in p.name]
    return path


def drafter_state(port: int) -> dict[str, float]:
    m = scrape_metrics(port)
    return {"attached": m['splitspec_draft_handshake_state{state="attached"}'],
            "waiting": m['splitspec_draft_handshake_state{state="waiting"}'],
            "epoch": m["splitspec_draft_epoch"], "mapped_bytes": m["splitspec_draft_mapped_bytes"]}


def wait_for(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.05)
    return value


def test_target_sigkill_restart_then_sigterm_with_the_drafter_attached(models, tmp_path):
    target_model, draft_model = models
    shm = private_shm_dir()
    drafter_metrics = free_port()
    drafter = Service("draft_service.cli", ["--model", str(draft_model), "--port", "0", "--num-speculative-tokens",
                                            "4", "--metrics-port", str(drafter_metrics), "--shm-dir", str(shm)],
                      tmp_path / "drafter.log")
    other = first = second = None
    try:
        drafter.wait_serving()
        # a live target sharing the folder
        other = start_target(target_model, shm, tmp_path / "other.log", *TARGET_ARGS)
        first = start_target(target_model, shm, tmp_path / "first.log", *TARGET_ARGS,
                             "--drafter", drafter.address)
        other_address, first_address = other.wait_serving(), first.wait_serving()
        other_file = pool_file_of(other_address, shm)
        wait_drafter(first_address, READY)
        first_id = server_info(first_address).kv_layout.target_id
        first_file = pool_file_of(first_address, shm)
        assert stream_tokens(first_address, request(PROMPTS[0], 20))[1].usage.num_drafts > 0
        assert str(first_file) in mapped_files(drafter.proc.pid)

        # SIGKILL the first target mid-stream: its pool file stays behind, stale
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream_tokens, first_address, request(p, 1500)) for p in PROMPTS[:4]]
            wait_for(lambda: server_info(first_address).running == 4, "4 running streams")
            first.signal(signal.SIGKILL)
            first.proc.wait(10)
            for future in streams:
                with pytest.raises(grpc.RpcError):
                    future.result()
        assert first_file.exists() and other_file.exists()

        second = start_target(target_model, shm, tmp_path / "second.log", *TARGET_ARGS,
                              "--drafter", drafter.address)
        second_address = second.wait_serving()
        assert "removed 1 stale KV pool file(s)" in second.log()
        assert not first_file.exists(), "the dead target's pool file survived the restart"
        assert other_file.exists(), "a live target's pool file was removed"
        info = wait_drafter(second_address, READY)
        second_id, second_file = info.kv_layout.target_id, pool_file_of(second_address, shm)
        assert second_id != first_id
        assert f"target {second_id} replaces {first_id}: dropping the old mapping" in drafter.log()
        state = drafter_state(drafter_metrics)
        assert state["attached"] == 1 and state["epoch"] == info.drafter.epoch, state
        assert state["mapped_bytes"] == info.kv_layout.total_bytes, state
        maps = mapped_files(drafter.proc.pid)
        assert str(first_file) not in maps, "the drafter still maps the dead target's pool"
        assert str(second_file) in maps
        plain = [stream_tokens(second_address, request(p, 40, disable=True))[0] for p in PROMPTS[:4]]
        speculated = [stream_tokens(second_address, request(p, 40)) for p in PROMPTS[:4]]
        assert [t for t, _ in speculated] == plain
        assert sum(c.usage.accepted_tokens for _, c in speculated) > 0  # the drafter reads the new pool right
        wait_idle(second_address)

        # SIGTERM with the drafter attached and streams in flight
        with grpc.insecure_channel(second_address) as channel, ThreadPoolExecutor(4) as pool:
            stub = pb_grpc.GenerationStub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            long = [pool.submit(stream_tokens, second_address, request(p, MODEL_LEN - 100, disable=True))
                    for p in PROMPTS[6:8]]
            wait_for(lambda: server_info(second_address).running == 2, "2 long streams")
            short = [pool.submit(stream_tokens, second_address, request(p, 10)) for p in PROMPTS[4:6]]
            wait_for(lambda: server_info(second_address).running == 4 or all(f.done() for f in short), "admission")
            started = time.monotonic()
            second.signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request(PROMPTS[0], 4), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            for future in short:
                assert future.result()[1].finish_reason == pb.FINISH_REASON_LENGTH  # finished within the grace
            for future in long:
                assert future.result()[1].finish_reason == pb.FINISH_REASON_ABORT  # too long: a clear ending
            watch.cancel()
        assert second.proc.wait(GRACE_S + 10) == 0, second.log()
        assert time.monotonic() - started < GRACE_S + 3
        assert not second_file.exists() and other_file.exists()
        state = wait_for(lambda: (s := drafter_state(drafter_metrics))["mapped_bytes"] == 0 and s, "detach")
        assert state["waiting"] == 1 and state["attached"] == 0, state
        assert str(second_file) not in mapped_files(drafter.proc.pid), "the drafter still maps a stopped pool"
        assert f"target {second_id} detached" in drafter.log()
    finally:
        for proc in (second, first, other):
            if proc is not None:
                proc.stop()
        drafter.kill()
        leftovers = pool_files(shm)
        shutil.rmtree(shm, ignore_errors=True)
    assert not leftovers, leftovers
