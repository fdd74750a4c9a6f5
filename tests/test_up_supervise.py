"""`splitspec up` supervises (slow: the demo pair, real processes): a service that dies is
restarted with its last log lines printed while the others keep serving; a crash loop
stops the stack with status 1; Ctrl-C stops it with 0. (It used to stop every service
1.8 s after its drafter was SIGKILLed.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from bench.chaos import ChaosConfig, Up, complete, gateway_healthy, target_serving
from tests.procs import REPO_ROOT, private_shm_dir

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (REPO_ROOT / "demo" / "dflash" / "config.json").is_file(), reason="no demo/")]


def wait_for(check, what: str, up: Up, timeout: float = 240.0) -> float:
    start = time.monotonic()
    while not check():
        if up.proc.poll() is not None:
            pytest.fail(f"splitspec up exited with {up.proc.returncode} waiting for {what}:\n{up.log()[-5000:]}")
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} not within {timeout} s:\n{up.log()[-5000:]}")
        time.sleep(0.1)
    return time.monotonic() - start


def speculated(base: str, reference: str) -> bool:
    """A greedy request answered with the reference text, and drafted for."""
    reply = httpx2.post(f"{base}/v1/completions", timeout=120, json={
        "model": "splitspec-demo", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == reference, reply.text
    return reply.json()["usage"]["speculation"]["num_drafts"] > 0


def kill(up: Up, service: str) -> int:
    pid = up.pids()[service]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture
def shm():
    path = private_shm_dir()
    yield path
    leftovers = list(path.iterdir())
    for item in leftovers:
        item.unlink()
    path.rmdir()
    assert not leftovers, leftovers


def test_a_killed_service_is_restarted_and_the_rest_keep_serving(tmp_path: Path, shm):
    up = Up(ChaosConfig(), shm, tmp_path / "up.log")
    try:
        up.wait_ready(600)
        reference = complete(up.base, "def fibonacci(n):", 24, False, disable_speculation=True)

        old = kill(up, "draft")
        # the drafter is away: the target serves alone, through the gateway
        assert complete(up.base, "def fibonacci(n):", 24, stream=True) == reference
        wait_for(lambda: up.pids().get("draft") not in (None, old), "the drafter restarted", up)
        wait_for(lambda: speculated(up.base, reference), "speculation with the restarted drafter", up)
        log = up.log()
        assert "splitspec up: draft exited with status -9; restarting it in" in log
        assert "Its last lines:\n  [draft] " in log  # the dead one's last lines, printed
        assert complete(up.base, "def fibonacci(n):", 24, stream=False) == reference

        for service, back in (("target", lambda: target_serving(up.target)),
                              ("gateway", lambda: gateway_healthy(up.base))):
            old = kill(up, service)
            wait_for(lambda: up.pids().get(service) not in (None, old) and back(), f"{service} back", up)
            wait_for(lambda: gateway_healthy(up.base), "the gateway reaching the target", up)
            assert complete(up.base, "def fibonacci(n):", 24, stream=False) == reference
        assert up.proc.poll() is None
    finally:
        code = up.interrupt()
    assert code == 0, up.log()[-5000:]
    assert "splitspec up: stopping" in up.log()


def test_a_crash_loop_stops_the_stack(tmp_path: Path, shm):
    """--max-restarts 1: the drafter's second exit within the window stops everything, status 1."""
    up = Up(ChaosConfig(drafter="ngram"), shm, tmp_path / "up.log",
            extra=("--max-restarts", "1", "--restart-window-s", "120"))
    try:
        up.wait_ready(600)
        first = kill(up, "draft")
        wait_for(lambda: up.pids().get("draft") not in (None, first), "the first restart", up)
        kill(up, "draft")
        assert up.proc.wait(120) == 1
    finally:
        if up.proc.poll() is None:
            up.interrupt()
    log = up.log()
    assert "draft exited 2 times within 120 s (status -9 last): a crash loop, giving up" in log, log[-3000:]
    assert "target stopped (status 0)" in log and "gateway stopped (status 0)" in log


def test_restart_flags_are_checked():
    run = subprocess.run([sys.executable, "-m", "splitspec.cli", "up", "--restart-window-s", "0"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "--restart-window-s must be > 0, got 0.0" in run.stdout, run
