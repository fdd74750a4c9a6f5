"""A target that comes up before its drafter: real processes, the drafter started only
once the target serves without it, and loading a draft model (health NOT_SERVING) for a
while after it listens.

The target's handshake retries have backed off by then (the next one many seconds
away); it must not wait for them: it follows the drafter's grpc.health.v1 status and
handshakes as soon as the drafter reports SERVING — the handshake it logs is the one the
health change triggered, ahead of the backoff's retry — and spends no handshake on the
drafter while it is still loading.
"""

from __future__ import annotations

import re
import time

import pytest

from splitspec.v1 import generation_pb2 as pb
from tests.procs import Service, free_port, server_info, stream_tokens
from tests.tiny_models import PROMPTS, make_qwen3

READY = pb.DrafterState.STATUS_READY
EARLY_HANDSHAKE = re.compile(r"is SERVING: handshaking now, ([\d.]+) s before the backoff's retry")


def test_the_target_handshakes_as_soon_as_a_late_drafter_reports_serving(tmp_path, shm_dir):
    target_model = make_qwen3(tmp_path / "target")
    drafter_port = free_port()
    target = Service("target_service.cli", [
        "--model", str(target_model), "--port", "0", "--shm-dir", str(shm_dir), "--num-pages", "256",
        "--drafter", f"127.0.0.1:{drafter_port}", "--drafter-startup-wait-s", "3", "--speculative-policy", "fixed",
    ], tmp_path / "target.log")
    drafter = None
    try:
        address = target.wait_serving()  # without its drafter: the retries have backed off to 16 s and more
        assert server_info(address).drafter.status != READY
        drafter = Service("draft_service.cli", ["--model", str(target_model), "--kind", "draft_model", "--port",
                                                str(drafter_port), "--shm-dir", str(shm_dir)], tmp_path / "drafter.log")
        drafter.wait_serving()
        deadline = time.monotonic() + 120
        while server_info(address).drafter.status != READY:
            if time.monotonic() > deadline:
                pytest.fail(f"the drafter was never handshaken:\n{target.log()}")
            time.sleep(0.05)
        log = target.log()
        early = EARLY_HANDSHAKE.search(log)
        assert early is not None and float(early[1]) > 0, log  # the health change, not the backoff, triggered it
        assert log.index("reports SERVING") < early.start() < log.index("ready: draft_model")
        assert "still loading" not in log, log  # no handshake was spent on the loading drafter
        _, complete = stream_tokens(address, pb.GenerateRequest(text=PROMPTS[0], stop=pb.StopParams(
            max_tokens=16, ignore_eos=True)))
        assert complete.usage.num_drafts > 0  # and it speculates
        assert target.stop() == 0, target.log()
    finally:
        target.kill()
        if drafter is not None:
            drafter.stop()
