"""splitspec-gateway through real processes: a target on a tiny checkpoint, a gateway in
front of it, and the official `openai` client (or plain HTTP) talking to the gateway."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import grpc
import httpx2
import pytest

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import (
    REPO_ROOT,
    Service,
    create_for_x,
    family_of,
    free_port,
    openai_client,
    private_shm_dir,
    scrape_metrics,
    server_info,
    start_gateway,
    wait_idle,
)
from tests.tiny_models import PROMPTS, make_qwen3

# `openai` is imported by the tests that use it: make test-fast imports this module only to leave it out.
MAX_BODY = 64 * 1024
LONG = 400  # tokens: a stream that is still running when the test acts on it
MODEL_LEN = 16384  # the stack's model length, so a stream can outlast a slow, busy test
ENDLESS = MODEL_LEN - 256  # tokens: a stream that surely outlives the test acting on it


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A target (one running sequence, one waiting: easy to fill) with its metrics endpoint,
    and a gateway in front of it."""
    tmp = tmp_path_factory.mktemp("gateway")
    model = make_qwen3(tmp / "model", max_position_embeddings=MODEL_LEN)
    shm = private_shm_dir()
    metrics_port = free_port()
    target = Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(shm),
                                            "--max-num-seqs", "1", "--max-waiting", "1",
                                            "--metrics-port", str(metrics_port)], tmp / "target.log")
    gateway = None
    try:
        target.wait_serving()
        gateway = start_gateway(target.address, tmp / "gateway.log", "--max-body-bytes", str(MAX_BODY))
        yield {"target": target.address, "gateway": gateway.address, "model": str(model),
               "metrics": metrics_port, "target_proc": target, "gateway_proc": gateway}
        assert gateway.stop() == 0, gateway.log()
        assert target.stop() == 0, target.log()
        assert not list(shm.iterdir()), "the pool file outlived the target"
    finally:
        if gateway is not None:
            gateway.kill()
        target.kill()
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(autouse=True)
def target_idle_after(request):
    """Every test leaves the target with nothing running and every page free."""
    yield
    if "stack" in request.fixturenames:
        wait_idle(request.getfixturevalue("stack")["target"])


def grpc_generate(address: str, request: pb.GenerateRequest) -> tuple[str, list[int], pb.Complete]:
    text, ids, complete = [], [], None
    with grpc.insecure_channel(address) as channel:
        for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=120):
            if response.HasField("chunk"):
                text.append(response.chunk.text)
                ids.extend(response.chunk.token_ids)
            else:
                complete = response.complete
    return "".join(text), ids, complete


def greedy(max_tokens: int, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0),
                              stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True), **fields)


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": "You write Python."}, {"role": "user", "content": prompt}]


def check_usage(usage, complete: pb.Complete) -> None:
    assert usage.prompt_tokens == complete.usage.prompt_tokens > 0
    assert usage.completion_tokens == complete.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# ---------------------------------------------------------------- the openai client, end to end


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_completions_equal_the_grpc_api(stack, client, prompt):
    text, ids, complete = grpc_generate(stack["target"], greedy(24, text=prompt))
    assert len(ids) == 24 and text
    whole = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
    check_usage(whole.usage, complete)

    chunks = list(client.completions.create(model=stack["model"], prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage is not None  # the usage chunk comes last
    check_usage(chunks[-1].usage, complete)
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_completions_take_token_ids_as_the_prompt(stack, client):
    prompt_ids = [5, 17, 99, 250, 3]
    text, _, complete = grpc_generate(stack["target"], greedy(8, token_ids=pb.TokenIds(ids=prompt_ids)))
    whole = client.completions.create(model=stack["model"], prompt=prompt_ids, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == text
    assert whole.usage.prompt_tokens == len(prompt_ids) == complete.usage.prompt_tokens


@pytest.mark.parametrize("prompt", PROMPTS[3:5])
def test_chat_completions_equal_the_grpc_api(stack, client, prompt):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in chat_messages(prompt)])
    text, ids, complete = grpc_generate(stack["target"], greedy(20, chat=chat))
    whole = client.chat.completions.create(model=stack["model"], messages=chat_messages(prompt),
                                           max_completion_tokens=20, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == "length"
    check_usage(whole.usage, complete)

    chunks = list(client.chat.completions.create(model=stack["model"], messages=chat_messages(prompt),
                                                 max_tokens=20, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(ids)
    check_usage(chunks[-1].usage, complete)


def test_cached_tokens_and_cache_salt(stack, client):
    """usage.prompt_tokens_details.cached_tokens is the target's Usage.cached_tokens; a
    cache_salt only shares cached prompt pages with requests of the same salt."""
    prompt = " ".join(PROMPTS) * 2  # several full pages

    def cached(salt: str) -> tuple[int, int]:
        whole = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=2, temperature=0,
                                          extra_body={"ignore_eos": True, "cache_salt": salt})
        return whole.usage.prompt_tokens_details.cached_tokens, whole.usage.prompt_tokens

    first, prompt_tokens = cached("gateway-tenant-a")
    again, _ = cached("gateway-tenant-a")
    other, _ = cached("gateway-tenant-b")
    assert first == 0 and other == 0
    assert prompt_tokens - 16 <= again < prompt_tokens  # all full pages but the one holding the last token
    reply = httpx2.post(f"http://{stack['gateway']}/v1/completions", timeout=60,
                        json={"model": stack["model"], "prompt": "x", "max_tokens": 1, "cache_salt": "s" * 257})
    assert reply.status_code == 400 and "cache_salt" in reply.text, reply.text


def test_stream_without_include_usage_has_no_usage_chunk(stack, client):
    chunks = list(client.completions.create(model=stack["model"], prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_sse_wire_format_ends_with_done(stack):
    body = {"model": stack["model"], "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx2.stream("POST", f"http://{stack['gateway']}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0].removeprefix("data: "))["object"] == "text_completion"


def test_stop_strings_seed_top_k_and_speculation_fields_reach_the_target(stack, client):
    text, _, _ = grpc_generate(stack["target"], greedy(30, text=PROMPTS[2]))
    stop = text[10:13]
    want, _, complete = grpc_generate(stack["target"], pb.GenerateRequest(
        text=PROMPTS[2], sampling=pb.SamplingParams(temperature=0.0), stop=pb.StopParams(max_tokens=30, stop=[stop])))
    whole = client.completions.create(model=stack["model"], prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                      stop=[stop], extra_body={"speculation": {"disable": True}})
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    sampled = pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(temperature=1.0, top_k=5, seed=7),
                                 stop=pb.StopParams(max_tokens=12, ignore_eos=True))
    want, _, _ = grpc_generate(stack["target"], sampled)
    got = client.completions.create(model=stack["model"], prompt=PROMPTS[0], max_tokens=12, temperature=1.0,
                                    seed=7, extra_body={"top_k": 5, "ignore_eos": True})
    assert got.choices[0].text == want


def test_models_and_health(stack, client):
    models = client.models.list()
    info = _model_info(stack["target"])
    assert [m.id for m in models.data] == [info.model_id]
    assert models.data[0].max_model_len == info.max_model_len
    reply = httpx2.get(f"http://{stack['gateway']}/health", timeout=10)
    assert reply.status_code == 200 and reply.json()["status"] == "SERVING"


def _model_info(address: str) -> pb.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)


# ---------------------------------------------------------------- a client that goes away


def _abort_count(stack) -> float:
    return scrape_metrics(stack["metrics"]).get('splitspec_requests_finished_total{finish_reason="abort"}', 0.0)


def _gateway_metric(stack, name: str, **labels: str) -> float:
    """The sum of a gateway metric's samples that carry `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"http://{stack['gateway']}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _wait_target_clean(stack, aborts_before: float) -> None:
    """The target aborted exactly one request and holds nothing, read from its /metrics."""
    deadline = time.monotonic() + 30
    while True:
        m = scrape_metrics(stack["metrics"])
        done = (m["splitspec_requests_running"] == 0 and m["splitspec_requests_waiting"] == 0
                and m["splitspec_kv_cache_usage_ratio"] == 0
                and m["splitspec_kv_cache_free_pages"] == m["splitspec_kv_cache_pages"])
        if done and _abort_count(stack) == aborts_before + 1:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the target still holds the request: {m}, aborts {_abort_count(stack) - aborts_before}")
        time.sleep(0.05)


def _wait_running(stack, running: int, waiting: int = 0) -> None:
    deadline = time.monotonic() + 30
    while (info := server_info(stack["target"])).running != running or info.waiting != waiting:
        if time.monotonic() > deadline:
            pytest.fail(f"expected {running} running, {waiting} waiting: {info}")
        time.sleep(0.01)


def test_client_disconnect_mid_stream_aborts_on_the_target(stack):
    aborts = _abort_count(stack)
    disconnects = _gateway_metric(stack, "splitspec_gateway_client_disconnects_total")
    body = {"model": stack["model"], "messages": chat_messages(PROMPTS[0]), "max_tokens": LONG,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx2.stream("POST", f"http://{stack['gateway']}/v1/chat/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert len(data) >= 2  # the role chunk and some text: the request is mid-stream
        assert server_info(stack["target"]).running == 1
    # leaving the block closed the connection
    _wait_target_clean(stack, aborts)
    assert _gateway_metric(stack, "splitspec_gateway_client_disconnects_total") == disconnects + 1


def test_client_disconnect_before_a_whole_response_aborts_on_the_target(stack):
    aborts = _abort_count(stack)
    body = {"model": stack["model"], "prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True}

    async def go() -> None:
        async with httpx2.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(http.post(f"http://{stack['gateway']}/v1/completions", json=body))
            await asyncio.to_thread(_wait_running, stack, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    _wait_target_clean(stack, aborts)


# ---------------------------------------------------------------- errors, through real HTTP


def _error(exc_info, status: int) -> dict:
    exc = exc_info.value
    assert exc.status_code == status, exc
    error = exc.body if "message" in (exc.body or {}) else exc.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("fields, param, words", [
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"max_tokens": 100000}, "max_tokens", "exceeds the model length"),
    ({"max_tokens": 0}, "max_tokens", "> 0"),
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids", "outside the vocabulary"),
    ({"extra_body": {"top_k": -2}}, "top_k", ">= 0"),
    ({"extra_body": {"speculation": {"num_speculative_tokens": -1}}}, "speculation.num_speculative_tokens", ">= 0"),
    ({"prompt": [5, 10**6]}, "prompt", "outside the vocabulary"),
    ({"prompt": ""}, "prompt", "must not be empty"),
])
def test_invalid_argument_is_400_naming_the_field(stack, client, fields, param, words):
    import openai

    fields = {"prompt": PROMPTS[0], "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=stack["model"], **fields)
    error = _error(exc_info, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_argument"
    assert error["message"].startswith(f"{param}: ") and words in error["message"], error


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"n": 2, "best_of": 3}, "best_of"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ("completions", {"extra_body": {"structured_outputs": {"grammar": "start: x"}}}, "structured_outputs.grammar"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ("chat", {"extra_body": {"guided_json": {}}}, "guided_json"),
])
def test_unsupported_parameters_are_400_saying_so(stack, client, endpoint, fields, param):
    import openai

    with pytest.raises(openai.BadRequestError) as exc_info:
        create_for_x(client, endpoint, stack["model"], 2, fields)
    error = _error(exc_info, 400)
    assert error["param"] == param and error["code"] == "unsupported_parameter", error
    assert "not supported" in error["message"] or "does not support" in error["message"], error


def test_queue_full_is_429(stack):
    """max-num-seqs 1 and max-waiting 1: a running stream, a waiting one, then a third → 429."""
    import openai

    url = f"http://{stack['gateway']}/v1/completions"
    body = {"model": stack["model"], "prompt": PROMPTS[0], "max_tokens": ENDLESS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    aborts = _abort_count(stack)
    with httpx2.Client(timeout=60) as http, http.stream("POST", url, json=body) as first:
        assert first.status_code == 200
        with httpx2.Client(timeout=60) as http2, http2.stream("POST", url, json=body) as second:
            assert second.status_code == 200
            _wait_running(stack, 1, waiting=1)
            with openai_client(stack["gateway"]) as c:
                with pytest.raises(openai.RateLimitError) as exc_info:
                    c.completions.create(model=stack["model"], prompt=PROMPTS[1], max_tokens=2)
    error = _error(exc_info, 429)
    assert error["type"] == "rate_limit_error" and "queue is full" in error["message"]
    deadline = time.monotonic() + 30
    while _abort_count(stack) < aborts + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort_count(stack) == aborts + 2  # both streams were aborted when their clients left


def test_unknown_model_is_404(stack, client):
    import openai

    with pytest.raises(openai.NotFoundError) as exc_info:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    error = _error(exc_info, 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stop": ["a"] * 5000}, "stop"),
    ({"prompt": "x", "stop_token_ids": [1] * 5000}, "stop_token_ids"),
    ({"prompt": "x", "speculation": {"num_speculative_tokens": 2**31}}, "speculation.num_speculative_tokens"),
])
def test_malformed_fields_are_400_naming_them(stack, body, param):
    reply = httpx2.post(f"http://{stack['gateway']}/v1/completions", json={"model": stack["model"], **body},
                        timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_bodies_are_bounded_and_must_be_json(stack):
    url = f"http://{stack['gateway']}/v1/chat/completions"
    big = {"model": stack["model"], "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    reply = httpx2.post(url, json=big, timeout=30)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit applies while the body streams in
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    reply = httpx2.post(url, content=chunked(), headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 413, reply.text
    for junk in (b"{not json", b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                 b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"):
        reply = httpx2.post(url, content=junk, headers={"content-type": "application/json"}, timeout=30)
        assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"], reply.text
    reply = httpx2.get(f"http://{stack['gateway']}/v1/nothing", timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
    # still serving
    assert httpx2.get(f"http://{stack['gateway']}/health", timeout=10).status_code == 200


def test_gateway_metrics_count_requests_and_tokens(stack, client):
    before = _gateway_metric(stack, "splitspec_gateway_generation_tokens_total")
    ok = {"endpoint": "/v1/completions", "status": "200"}
    requests = _gateway_metric(stack, "splitspec_gateway_requests_total", **ok)
    client.completions.create(model=stack["model"], prompt=PROMPTS[0], max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    assert _gateway_metric(stack, "splitspec_gateway_generation_tokens_total") == before + 7
    assert _gateway_metric(stack, "splitspec_gateway_requests_total", **ok) == requests + 1
    assert _gateway_metric(stack, "splitspec_gateway_time_to_first_token_seconds_count") > 0


def test_docs_document_every_gateway_metric(stack):
    text = httpx2.get(f"http://{stack['gateway']}/metrics", timeout=10).text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    ours = {family_of(f) for f in families if f.startswith("splitspec_gateway_")}
    assert len(ours) == 8
    documented = (REPO_ROOT / "docs" / "metrics.md").read_text()
    assert not sorted(f for f in ours if f not in documented), "docs/metrics.md does not document them"


# ---------------------------------------------------------------- no target


def test_target_unavailable_is_503(tmp_path):
    import openai

    nowhere = f"127.0.0.1:{free_port()}"
    gateway = start_gateway(nowhere, tmp_path / "gateway.log")
    try:
        reply = httpx2.get(f"http://{gateway.address}/health", timeout=30)
        assert reply.status_code == 503 and reply.json()["status"] == "UNAVAILABLE"
        with openai_client(gateway.address) as c:
            with pytest.raises(openai.InternalServerError) as exc_info:
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        error = _error(exc_info, 503)
        assert error["type"] == "service_unavailable" and error["code"] == "unavailable"
        assert "unavailable" in error["message"]
    finally:
        assert gateway.stop() == 0, gateway.log()


def test_sigterm_lets_a_running_stream_finish(stack, tmp_path):
    """SIGTERM mid-stream: the gateway stops accepting, the stream still ends with [DONE]
    within --shutdown-grace-s, nothing is aborted on the target, and the gateway exits 0."""
    import signal

    gateway = start_gateway(stack["target"], tmp_path / "gateway.log", "--shutdown-grace-s", "60")
    aborts = _abort_count(stack)
    body = {"model": stack["model"], "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        with httpx2.stream("POST", f"http://{gateway.address}/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            gateway.signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == LONG
        assert gateway.proc.wait(60) == 0, gateway.log()
        with pytest.raises(httpx2.ConnectError):
            httpx2.get(f"http://{gateway.address}/health", timeout=5)
        assert _abort_count(stack) == aborts
    finally:
        gateway.kill()
