"""Drafter faults through real processes: a slow drafter (SIGSTOP/SIGCONT pulses), a hung
one (SIGSTOP: the per-step deadline trips, the target serves without speculation, then
re-handshakes after SIGCONT), and one that answers garbage (tests/garbage_drafter.py).
Never a failed request, never a token that differs from target-only decoding; garbage
is counted in `splitspec_spec_decode_invalid_drafts_total`. (SIGKILL and restart:
tests/test_speculative_faults.py.)
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import (
    Service,
    free_port,
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
UNAVAILABLE = pb.DrafterState.STATUS_UNAVAILABLE
NUM_PAGES = 512
DRAFTER_TIMEOUT_S = 0.3
PROMPTS_UNDER_LOAD = PROMPTS[:8]
MAX_TOKENS = 60


TARGET_ARGS = ("--num-pages", str(NUM_PAGES), "--page-size", "8", "--max-num-batched-tokens", "128",
               "--speculative-policy", "fixed")  # drafts every step, however bad: these tests count them


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A target and a copy of it as the draft LM (its drafts are the target's argmax)."""
    return make_pair(tmp_path_factory.mktemp("fault-models"))


def request(prompt: str, max_tokens: int = MAX_TOKENS, **speculation) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True),
                              speculation=pb.SpeculationParams(**speculation))


def run_streams(address: str, requests: list[pb.GenerateRequest]) -> list[tuple[list[int], pb.Complete, float]]:
    """All at once; per stream: tokens, Complete, and the longest wait between two responses."""

    def one(msg):
        with grpc.insecure_channel(address) as channel:
            tokens, complete, last, gap = [], None, time.monotonic(), 0.0
            for response in pb_grpc.GenerationStub(channel).Generate(msg, timeout=180):
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                else:
                    complete = response.complete
            return tokens, complete, gap

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def metric(port: int, name: str) -> float:
    return scrape_metrics(port).get(name, 0.0)


def test_slow_and_hung_drafter_fall_back_then_recover(models, shm_dir, tmp_path):
    target_model, draft_model = models
    drafter = Service("draft_service.cli", ["--model", str(draft_model), "--port", "0", "--shm-dir", str(shm_dir),
                                            "--num-speculative-tokens", "4"], tmp_path / "drafter.log")
    target = None
    try:
        drafter.wait_serving()
        metrics_port = free_port()
        target = start_target(target_model, shm_dir, tmp_path / "target.log", *TARGET_ARGS, "--drafter",
                              drafter.address, "--drafter-timeout-s", str(DRAFTER_TIMEOUT_S),
                              "--metrics-port", str(metrics_port))
        address = target.wait_serving()
        wait_drafter(address, READY)
        expected = [stream_tokens(address, request(p, disable=True))[0] for p in PROMPTS_UNDER_LOAD]

        # slow: the drafter stops for a while and resumes, again and again, under waves of
        # streams; some Proposes miss their deadline, each resume brings a re-handshake
        pulses_done = threading.Event()

        def pulse():
            rng = random.Random(7)
            time.sleep(0.3)
            for _ in range(3):
                drafter.signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.3, 1.0))
                drafter.signal(signal.SIGCONT)
                time.sleep(rng.uniform(2.0, 3.0))
            pulses_done.set()

        pulser = threading.Thread(target=pulse, daemon=True)
        pulser.start()
        started = time.monotonic()
        slow = []
        try:  # new sequences start under each re-handshaken epoch
            while not pulses_done.is_set():
                slow.append(run_streams(address, [request(p, 30) for p in PROMPTS_UNDER_LOAD]))
        finally:
            pulser.join()
            drafter.signal(signal.SIGCONT)
        print(f"\nslow drafter: {len(slow)} waves of {len(PROMPTS_UNDER_LOAD)} streams in "
              f"{time.monotonic() - started:.1f} s")
        for wave in slow:
            for (tokens, complete, _), want in zip(wave, expected):
                want = want[:30]
                assert tokens == want and complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert metric(metrics_port, "splitspec_spec_decode_fallback_steps_total") > 0  # deadlines tripped...
        epoch = wait_drafter(address, READY).drafter.epoch
        handshakes = metric(metrics_port, 'splitspec_drafter_handshakes_total{result="ok"}')
        assert handshakes >= 2, handshakes  # ...and the link came back (the first handshake + a recovery)

        # hung: SIGSTOP for good while streams run
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(run_streams, address, [request(p) for p in PROMPTS_UNDER_LOAD])
            deadline = time.monotonic() + 60
            while server_info(address).running < len(PROMPTS_UNDER_LOAD) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # a few speculated steps
            drafter.signal(signal.SIGSTOP)
            hung = future.result()
        print(f"\nhung drafter: longest wait between two responses {max(g for _, _, g in hung):.2f} s")
        for (tokens, complete, gap), want in zip(hung, expected):
            # the stall behind a hung drafter is printed above, not asserted: timings on a
            # shared 2-core machine are benchmark figures, not test conditions
            assert tokens == want and complete.finish_reason == pb.FINISH_REASON_LENGTH
        # the hung streams may all finish before the stop lands: this request's Propose surely meets it
        tokens, complete = stream_tokens(address, request(PROMPTS[0]))  # served without it meanwhile
        assert tokens == expected[0] and complete.usage.num_drafts == 0
        info = server_info(address)
        assert info.drafter.status == UNAVAILABLE and "DEADLINE_EXCEEDED" in info.drafter.detail, info.drafter

        # resumed: the next handshake (a new epoch) brings speculation back
        drafter.signal(signal.SIGCONT)
        assert wait_drafter(address, READY).drafter.epoch > epoch
        for _ in range(3):  # on a loaded machine one Propose may still miss the short deadline
            tokens, complete = stream_tokens(address, request(PROMPTS[0]))
            assert tokens == expected[0]
            if complete.usage.num_drafts > 0:
                break
            wait_drafter(address, READY)
        assert complete.usage.num_drafts > 0, "speculation never came back"
        wait_idle(address)
    finally:
        drafter.signal(signal.SIGCONT)
        stopped = target.stop() if target is not None else 0  # the drafter is killed whatever this says
        drafter.kill()
    assert stopped == 0, target.log()


def test_garbage_drafts_are_counted_and_never_change_the_output(models, shm_dir, tmp_path):
    target_model, _ = models
    stats_file = tmp_path / "garbage.json"
    drafter = Service("tests.garbage_drafter", ["--port", "0", "--stats-file", str(stats_file)],
                      tmp_path / "garbage.log")
    target = None
    try:
        drafter.wait_serving()
        metrics_port = free_port()
        target = start_target(target_model, shm_dir, tmp_path / "target.log", *TARGET_ARGS, "--drafter",
                              drafter.address, "--drafter-timeout-s", "10", "--metrics-port", str(metrics_port))
        address = target.wait_serving()
        info = wait_drafter(address, READY)
        # warmup proposed before SERVING: garbage the served metrics must not count
        sent_in_warmup = json.loads(stats_file.read_text())["invalid_drafts"] if stats_file.exists() else 0
        expected = [stream_tokens(address, request(p, disable=True))[0] for p in PROMPTS_UNDER_LOAD]
        greedy = run_streams(address, [request(p) for p in PROMPTS_UNDER_LOAD])
        sampled_requests = [request(p, max_tokens=30) for p in PROMPTS[8:12]]
        for i, msg in enumerate(sampled_requests):
            msg.sampling.temperature, msg.sampling.seed = 0.8, i
        sampled = run_streams(address, sampled_requests)
        for (tokens, complete, _), want in zip(greedy, expected):
            assert tokens == want and complete.finish_reason == pb.FINISH_REASON_LENGTH
        for tokens, complete, _ in sampled:
            assert len(tokens) == 30 and complete.finish_reason == pb.FINISH_REASON_LENGTH

        sent = json.loads(stats_file.read_text())
        assert all(sent[kind] > 0 for kind in ("oov", "too_long", "wrong_seq", "duplicate", "random")), sent
        counted = metric(metrics_port, "splitspec_spec_decode_invalid_drafts_total")
        assert counted == sent["invalid_drafts"] - sent_in_warmup, (counted, sent, sent_in_warmup)
        # the random (valid) drafts were verified like any others; the link never dropped
        usage = [c.usage for _, c, _ in greedy + sampled]
        assert sum(u.num_drafts for u in usage) > 0
        assert sum(u.accepted_tokens for u in usage) < sum(u.draft_tokens for u in usage)
        after = server_info(address).drafter
        assert after.status == READY and after.epoch == info.drafter.epoch, after
        assert metric(metrics_port, "splitspec_spec_decode_fallback_steps_total") == 0
        wait_idle(address)
    finally:
        stopped = target.stop() if target is not None else 0  # the drafter is stopped whatever this says
        drafter.stop()
    assert stopped == 0, target.log()
