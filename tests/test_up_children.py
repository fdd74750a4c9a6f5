"""How `splitspec up` starts its services and how they stop with it (splitspec/up.py,
splitspec/cli_args.stop_with_parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitspec.cli_args import PARENT_PID_ENV
from splitspec.up import Child
from tests.procs import REPO_ROOT

SPAWNS = 40


def test_services_start_cleanly_from_a_process_that_uses_grpc():
    """`up` health-checks the target and drafter over gRPC, then starts the gateway. Started
    with a preexec_fn, a child is forked, gRPC's fork handlers restart its poller in the child,
    and Popen's close_fds closes that poller's epoll fd under it: the child aborted before
    exec in ~40% of spawns here (CI saw the gateway die with -6). Every child now starts."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    codes = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(SPAWNS):
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # gRPC busy in this process
                child = Child.start("probe", "platform", [], dict(os.environ), threading.Lock(), echo=False)
                codes.append(child.proc.wait(timeout=60))
    finally:
        server.stop(None)
    assert codes == [0] * SPAWNS, codes


PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                         env=dict(os.environ, {env}=str(os.getpid())))
print(child.pid, flush=True)
time.sleep(600)
"""

CHILD = """
import signal, sys, time
from pathlib import Path
from splitspec.cli_args import stop_with_parent
def stop(signum, frame):
    Path(sys.argv[1]).write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
stop_with_parent()
Path(sys.argv[1] + ".ready").touch()
time.sleep(600)
"""


def test_a_service_started_by_up_gets_sigterm_when_up_is_killed(tmp_path: Path):
    marker = tmp_path / "stopped"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(env=PARENT_PID_ENV), CHILD, str(marker)],
                              stdout=subprocess.PIPE, text=True, env=env)
    child_pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not marker.with_name("stopped.ready").exists():
            assert time.monotonic() < deadline, "the child never got ready"
            time.sleep(0.05)
        assert not marker.exists()
        parent.kill()  # SIGKILL: no handler of the parent's runs
        parent.wait(timeout=10)
        while not marker.exists():
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
        assert marker.read_text() == "SIGTERM"
    finally:
        parent.kill()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
