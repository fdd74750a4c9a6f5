"""splitspec-gateway under faults and hostile clients, through real processes: a target
killed mid-request, a deadline, slow or never-ending requests, too many connections,
clients hanging up mid-upload, and one validation policy for every field."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx2
import pytest

from tests.procs import Service, free_port, private_shm_dir, server_info
from tests.tiny_models import PROMPTS, make_qwen3

MODEL_LEN = 16384  # a request of MODEL_LEN - 256 tokens outlives any test acting on it
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("faults") / "model", max_position_embeddings=MODEL_LEN)


@pytest.fixture
def target(model, tmp_path):
    shm = private_shm_dir()
    proc = Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(shm)],
                   tmp_path / "target.log")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.kill()
        for leftover in shm.iterdir():
            leftover.unlink()
        shm.rmdir()


@pytest.fixture(scope="module")
def lone_gateway(tmp_path_factory):
    """A gateway with short read deadlines and few connections, in front of no target: what
    it refuses, it refuses before it calls one."""
    log = tmp_path_factory.mktemp("lone") / "gateway.log"
    gateway = start_gateway(f"127.0.0.1:{free_port()}", log, "--header-timeout-s", str(HEADER_TIMEOUT_S),
                            "--body-timeout-s", str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS))
    try:
        yield gateway
        assert gateway.stop() == 0, gateway.log()
    finally:
        gateway.kill()


def start_gateway(target: str, log_path: Path, *args: str) -> Service:
    gateway = Service("splitspec.gateway.cli", ["--target", target, "--port", "0", *args], log_path,
                      metrics_flag=False)
    gateway.wait_listening()
    return gateway


def metric(address: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"http://{address}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def wait_running(address: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server_info(address).running < 1:
        if time.monotonic() > deadline:
            pytest.fail("the request never ran on the target")
        time.sleep(0.02)


# ---------------------------------------------------------------- the target fails mid-request


def test_target_killed_mid_request_is_503_in_openai_shape(target, tmp_path):
    """A non-streaming request whose target is SIGKILLed mid-generation gets OpenAI's error
    shape with 503, counted in splitspec_gateway_requests_total (it was a plain-text 500,
    uncounted: the error came wrapped in an ExceptionGroup)."""
    gateway = start_gateway(target.address, tmp_path / "gateway.log")
    try:
        body = {"model": "x", "prompt": PROMPTS[0], "max_tokens": MODEL_LEN - 256, "temperature": 0,
                "ignore_eos": True}
        body["model"] = httpx2.get(f"http://{gateway.address}/v1/models", timeout=30).json()["data"][0]["id"]
        replies = []
        thread = threading.Thread(target=lambda: replies.append(
            httpx2.post(f"http://{gateway.address}/v1/completions", json=body, timeout=120)))
        thread.start()
        wait_running(target.address)
        time.sleep(0.5)
        target.kill()
        thread.join(60)
        reply = replies[0]
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "unavailable", error
        assert "target is unavailable" in error["message"]
        assert metric(gateway.address, "splitspec_gateway_requests_total", endpoint="/v1/completions",
                      status="503") == 1
        assert "Traceback" not in gateway.log(), gateway.log()
    finally:
        assert gateway.stop() == 0, gateway.log()


def test_a_deadline_is_504_whole_or_streamed(target, tmp_path):
    gateway = start_gateway(target.address, tmp_path / "gateway.log", "--request-timeout-s", "1")
    try:
        model = httpx2.get(f"http://{gateway.address}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": MODEL_LEN - 256, "temperature": 0,
                "ignore_eos": True}
        reply = httpx2.post(f"http://{gateway.address}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 504, reply.text
        error = reply.json()["error"]
        assert error["type"] == "timeout" and error["code"] == "deadline_exceeded", error
        assert "--request-timeout-s" in error["message"]
        with httpx2.stream("POST", f"http://{gateway.address}/v1/completions", json={**body, "stream": True},
                           timeout=60) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "deadline_exceeded"
        assert metric(gateway.address, "splitspec_gateway_requests_total", status="504") == 1
    finally:
        assert gateway.stop() == 0, gateway.log()


def test_chat_errors_name_the_parameter_sent(target, tmp_path):
    gateway = start_gateway(target.address, tmp_path / "gateway.log")
    try:
        model = httpx2.get(f"http://{gateway.address}/v1/models", timeout=30).json()["data"][0]["id"]
        for name in ("max_completion_tokens", "max_tokens"):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], name: -5}
            reply = httpx2.post(f"http://{gateway.address}/v1/chat/completions", json=body, timeout=30)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == name, reply.text
            assert reply.json()["error"]["message"].startswith(f"{name}: must be > 0, got -5"), reply.text
    finally:
        assert gateway.stop() == 0, gateway.log()


# ---------------------------------------------------------------- slow and endless requests


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"],
                         ids=["nothing", "partial-headers"])
def test_headers_that_never_finish_get_408_and_a_closed_connection(lone_gateway, sent):
    with _connect(lone_gateway.address) as sock:
        sock.sendall(sent)
        data, took = _read_until_closed(sock, 10 * HEADER_TIMEOUT_S)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert HEADER_TIMEOUT_S * 0.8 < took < HEADER_TIMEOUT_S + 3


@pytest.mark.parametrize("headers, sent", [
    (b"Content-Length: 1000\r\n", b'{"model": "m", '),
    (b"Transfer-Encoding: chunked\r\n", b"5\r\n{\"a\":\r\n"),
], ids=["short-body", "endless-chunks"])
def test_bodies_that_never_finish_get_408_and_a_closed_connection(lone_gateway, headers, sent):
    with _connect(lone_gateway.address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers
                     + b"\r\n" + sent)
        start = time.monotonic()
        while time.monotonic() - start < BODY_TIMEOUT_S + 1:  # trickle: each byte well inside any idle timeout
            try:
                sock.sendall(b" " if b"Length" in headers else b"1\r\n \r\n")
            except OSError:
                break
            time.sleep(0.2)
        data, _ = _read_until_closed(sock, 10)
        took = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b"--body-timeout-s" in data
    assert took < BODY_TIMEOUT_S + 4


def test_connections_past_the_cap_get_503_and_the_rest_are_served(lone_gateway):
    held = [_connect(lone_gateway.address) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        with _connect(lone_gateway.address) as extra:
            data, _ = _read_until_closed(extra, 5)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert httpx2.get(f"http://{lone_gateway.address}/metrics", timeout=10).status_code == 200


def test_a_client_hanging_up_mid_body_logs_one_quiet_line(lone_gateway):
    before = lone_gateway.log()
    for _ in range(3):
        with _connect(lone_gateway.address) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 5000\r\n\r\n{\"model\": \"m\", \"messages\": [")
            time.sleep(0.2)
    time.sleep(0.5)
    new = lone_gateway.log()[len(before):]
    assert "Traceback" not in new and "ERROR" not in new, new
    lines = [line for line in new.splitlines() if "disconnected while sending" in line]
    assert len(lines) == 3, new


# ---------------------------------------------------------------- one validation policy


@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": "0"}, "temperature", 'valid number, got "0"'),
    ({"temperature": True}, "temperature", "valid number, got true"),
    ({"top_p": "1"}, "top_p", 'valid number, got "1"'),
    ({"stream": "yes"}, "stream", 'valid boolean, got "yes"'),
    ({"max_tokens": "10"}, "max_tokens", 'valid integer, got "10"'),
    ({"max_tokens": True}, "max_tokens", "valid integer, got true"),
    ({"seed": 1.5}, "seed", "valid integer, got 1.5"),
    ({"temperature": 1e308}, "temperature", "1e+308 is too large"),
    ({"top_p": 1e-300}, "top_p", "1e-300 is too small"),
    ({"top_p": 1.1}, "top_p", "must be in (0, 1], got 1.1"),
    ({"temperature": -0.5}, "temperature", "must be >= 0, got -0.5"),
    ({"n": 0}, "n", "must be >= 1, got 0"),
    ({"n": -3}, "n", "must be >= 1, got -3"),
    ({"best_of": 0}, "best_of", "must be >= 1, got 0"),
    ({"prompt": [1, True]}, "prompt.1", "valid integer, got true"),
    ({"stop": 5}, "stop", "got 5"),
    ({"parse_special_tokens": True, "prompt": [1, 2]}, "parse_special_tokens", "text prompt only"),
])
def test_completion_fields_are_strict_and_named_as_sent(lone_gateway, fields, param, words):
    body = {"model": "m", "prompt": "x", **fields}
    reply = httpx2.post(f"http://{lone_gateway.address}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["message"].startswith(f"{param}: ") or param == "parse_special_tokens", error


@pytest.mark.parametrize("fields, param, words", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text",
     "valid string, got 5"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "got 5"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages.0.role", "valid string, got 1"),
    ({"n": 0}, "n", "must be >= 1, got 0"),
    ({"logprobs": "yes"}, "logprobs", 'valid boolean, got "yes"'),
    ({"max_completion_tokens": "5"}, "max_completion_tokens", 'valid integer, got "5"'),
])
def test_chat_fields_are_strict_and_named_as_sent(lone_gateway, fields, param, words):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    reply = httpx2.post(f"http://{lone_gateway.address}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "not supported" not in error["message"], error


def test_no_openapi_schema_and_no_compressed_bodies(lone_gateway):
    base = f"http://{lone_gateway.address}"
    for path in ("/openapi.json", "/docs", "/redoc"):
        reply = httpx2.get(base + path, timeout=10)
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error", (path, reply.text)
    import gzip

    body = gzip.compress(json.dumps({"model": "m", "prompt": "x"}).encode())
    for encoding in ("gzip", "deflate", "br"):
        reply = httpx2.post(f"{base}/v1/completions", content=body, timeout=10,
                            headers={"content-type": "application/json", "content-encoding": encoding})
        assert reply.status_code == 415, reply.text
        error = reply.json()["error"]
        assert error["code"] == "unsupported_media_type" and encoding in error["message"], error
    assert metric(lone_gateway.address, "splitspec_gateway_requests_total", endpoint="/v1/completions",
                  status="415") >= 3

