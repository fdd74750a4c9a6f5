"""Real service processes for tests: start, wait until listening and SERVING, stop."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.kv_pool import SHM_PREFIX, SHM_SUFFIX
from splitspec.net import free_port  # noqa: F401 (tests import it from here)

REPO_ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (\S+):(\d+)")
TOKEN = "test-internal-token"


def wait_for_line(proc: subprocess.Popen, log_path: Path, pattern: re.Pattern, timeout: float,
                  poll_s: float = 0.1) -> re.Match:
    """The first match of `pattern` in `proc`'s log; the test fails if `proc` exits first, or
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (match := pattern.search(log_path.read_text(errors="replace"))) is not None:
            return match
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        time.sleep(poll_s)
    pytest.fail(f"{proc.args} printed no {pattern.pattern!r} within {timeout} s:\n"
                f"{log_path.read_text(errors='replace')}")


class Service:
    """`python -m <module> <args>` with its log in a file (`metrics_flag`: the module takes
    --metrics-port, which defaults to 0 here)."""

    def __init__(self, module: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 metrics_flag: bool = True) -> None:
        self.log_path = log_path
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITSPEC_INTERNAL_TOKEN": TOKEN, **(env or {})}
        if metrics_flag and not any(a.startswith("--metrics-port") for a in args):
            args = [*args, "--metrics-port=0"]  # many services at once: no fixed metrics ports
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO_ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, env=environ)
        self.address = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float = 120.0) -> str:
        match = wait_for_line(self.proc, self.log_path, LISTENING, timeout, poll_s=0.02)
        self.address = f"{match[1]}:{match[2]}"
        return self.address

    def wait_serving(self, timeout: float = 180.0, credentials: grpc.ChannelCredentials | None = None) -> str:
        address = self.address or self.wait_listening(timeout)
        channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(f"{self.proc.args} exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return address
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        pytest.fail(f"{self.proc.args} not SERVING within {timeout} s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def pool_files(shm_dir: Path) -> list[Path]:
    """The KV pool files in `shm_dir` (a server must leave none behind)."""
    return sorted(shm_dir.glob(f"{SHM_PREFIX}*{SHM_SUFFIX}"))


def stream_tokens(address: str, request, timeout: float = 120.0):
    """Run one Generate; (token ids, Complete)."""
    from splitspec.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return collect_stream(pb_grpc.GenerationStub(channel), request, timeout)


def collect_stream(stub, request, timeout: float = 120.0):
    """One Generate on `stub`; (token ids, Complete or None if the stream ended without one)."""
    tokens, complete = [], None
    for response in stub.Generate(request, timeout=timeout):
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
        else:
            complete = response.complete
    return tokens, complete


def private_shm_dir() -> Path:
    """A private folder for pool files, under /dev/shm where the host has one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix="splitspec-test-", dir=base))


def start_target(model: Path, shm_dir: Path, log_path: Path, *args: str) -> Service:
    """A target process serving `model` on any free port with its pool in `shm_dir` (started, not
    awaited), computing in float32 unless `args` name a `--dtype` (auto is bfloat16 on a CPU with
    AMX, AVX512-BF16 or AVX2: what a test checks must not depend on the CPU it runs on)."""
    dtype = [] if "--dtype" in args else ["--dtype", "float32"]
    return Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(shm_dir), *dtype,
                                          *args], log_path)


@contextlib.contextmanager
def served_target(model: Path, log_path: Path, *args: str) -> Iterator[Service]:
    """A target process on a private shm dir, SERVING; on exit it must stop cleanly and
    leave no pool file behind."""
    shm = private_shm_dir()
    proc = start_target(model, shm, log_path, *args)
    try:
        proc.wait_serving()
        yield proc
        assert proc.stop() == 0, proc.log()
        assert not list(shm.iterdir()), "the pool file outlived the server"
    finally:
        proc.kill()
        shutil.rmtree(shm, ignore_errors=True)


@contextlib.contextmanager
def served_drafter(log_path: Path, *args: str) -> Iterator[Service]:
    """A drafter process, SERVING; on exit it must stop cleanly."""
    proc = Service("draft_service.cli", ["--port", "0", *args], log_path)
    try:
        proc.wait_serving()
        yield proc
        assert proc.stop() == 0, proc.log()
    finally:
        proc.kill()


def server_info(address: str):
    from splitspec.v1 import generation_pb2 as pb
    from splitspec.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.GenerationStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def wait_drafter(address: str, status: int, timeout: float = 90.0):
    """ServerInfo once the target's drafter is in `status` (a DrafterState.Status; else the test fails)."""
    from splitspec.v1 import generation_pb2 as pb

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = server_info(address)
        if info.drafter.status == status:
            return info
        time.sleep(0.2)
    pytest.fail(f"drafter state never became {pb.DrafterState.Status.Name(status)}: {server_info(address)}")


def client_cmd() -> list[str]:
    """The `splitspec` client command of this environment."""
    script = Path(sys.executable).with_name("splitspec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "splitspec.cli"]


def wait_idle(address: str, timeout: float = 30.0):
    """ServerInfo once every page is free and nothing runs or waits (else the test fails)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(address)
        if info.free_pages == info.num_pages and info.running == 0 and info.waiting == 0:
            return info
        if time.monotonic() > deadline:
            pytest.fail(f"not idle within {timeout} s: {info.free_pages}/{info.num_pages} pages free, "
                        f"{info.running} running, {info.waiting} waiting")
        time.sleep(0.05)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident set size of a process (VmRSS; RssAnon: its anonymous memory only), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def scrape_metrics(port: int) -> dict[str, float]:
    """Every sample of a /metrics endpoint: 'name{label="v",...}' (labels sorted) or 'name' → value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


METRIC_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")


def family_of(name: str) -> str:
    """The metric family a sample name belongs to (its Prometheus suffix dropped)."""
    for suffix in METRIC_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def openai_client(gateway: str, **options):
    """The official `openai` client on a gateway's /v1 (no retries: a test sees every answer)."""
    import openai

    return openai.OpenAI(base_url=f"http://{gateway}/v1", **{"api_key": "unused", "max_retries": 0, **options})


def create_for_x(client, endpoint: str, model: str, max_tokens: int, fields: dict):
    """One request through `client` for the prompt "x": a completion (`endpoint` "completions")
    or a chat of one user message; `fields` add to (or replace) the request's."""
    if endpoint == "completions":
        return client.completions.create(**{"model": model, "prompt": "x", "max_tokens": max_tokens, **fields})
    return client.chat.completions.create(**{"model": model, "max_tokens": max_tokens,
                                             "messages": [{"role": "user", "content": "x"}], **fields})


def start_gateway(target: str, log_path: Path, *args: str) -> Service:
    """A `splitspec-gateway` child in front of `target`, once it listens."""
    gateway = Service("splitspec.gateway.cli", ["--target", target, "--port", "0", *args], log_path,
                      metrics_flag=False)
    gateway.wait_listening()
    return gateway
