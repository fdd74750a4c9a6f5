"""The public gRPC API through a real `splitspec-target` process running a tiny Qwen3.

Each server binds port 0 and logs the port it got; its KV pool file lives in a private
folder under /dev/shm that must be empty again once the server is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.grpc_errors import ErrorMappingInterceptor
from common.kv_layout import LayerSpec, StagingSpec, build_layout
from common.layout_proto import kv_layout_from_proto, kv_layout_to_proto
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from splitspec.v1 import kv_layout_pb2 as kv_pb
from target_service import convert
from target_service.api_types import FinishReason
from target_service.server import ERRORS, SERVICE_NAME, EngineSlot
from tests.procs import (
    REPO_ROOT,
    client_cmd,
    pool_files,
    served_target,
    start_target,
)
from tests.tiny_models import PROMPTS, make_qwen3

# A full-length stream must outlast every timeout below (the 4 s drain grace included):
# 4096 tokens took 3.7 s on an idle 2-core machine, so 16384; the pool holds two of them.
MODEL_LEN = 16384
PAGE_SIZE = 16
NUM_PAGES = 2 * MODEL_LEN // PAGE_SIZE
DEFAULT_MAX_TOKENS = 24
DRAINED = re.compile(r"drained in ([\d.]+) s")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


TARGET_ARGS = ("--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE), "--max-num-batched-tokens", "256")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("qwen3"), max_position_embeddings=MODEL_LEN)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ("--shutdown-grace-s", "5", "--default-max-tokens", str(DEFAULT_MAX_TOKENS))
    with served_target(tiny_model, log, *TARGET_ARGS, *args) as proc:
        yield proc


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture
def stub(channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


# ---------------------------------------------------------------- request helpers


def request(text: str | None = None, *, max_tokens: int | None = 8, ignore_eos: bool = True, **sampling):
    msg = pb.GenerateRequest()
    if text is not None:
        msg.text = text
    if max_tokens is not None:
        msg.stop.max_tokens = max_tokens
    msg.stop.ignore_eos = ignore_eos
    for name, value in sampling.items():
        setattr(msg.sampling, name, value)
    return msg


def collect(responses) -> tuple[list[int], str, pb.Complete]:
    """Token ids, text and the Complete of a finished stream; checks Complete is last."""
    ids, text, complete = [], "", None
    for response in responses:
        assert complete is None, "a message arrived after Complete"
        if response.HasField("chunk"):
            ids.extend(response.chunk.token_ids)
            text += response.chunk.text
        else:
            complete = response.complete
    assert complete is not None, "the stream ended without Complete"
    return ids, text, complete


def generate(stub, msg, timeout: float = 60) -> tuple[list[int], str, pb.Complete]:
    return collect(stub.Generate(msg, timeout=timeout))


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.02)


def wait_pages_free(stub, timeout: float = 10.0) -> pb.ServerInfo:
    def idle(info: pb.ServerInfo) -> bool:
        return info.free_pages == info.num_pages and info.running == 0 and info.waiting == 0

    wait_for(lambda: idle(stub.GetServerInfo(pb.GetServerInfoRequest())), "free pool", timeout)
    return stub.GetServerInfo(pb.GetServerInfoRequest())


def wait_only_running(stub, n: int, timeout: float = 10.0) -> pb.ServerInfo:
    def only(info: pb.ServerInfo) -> bool:
        return info.running == n and info.waiting == 0

    wait_for(lambda: only(stub.GetServerInfo(pb.GetServerInfoRequest())), f"drop to {n} running", timeout)
    return stub.GetServerInfo(pb.GetServerInfoRequest())


def long_request(request_id: str = "") -> pb.GenerateRequest:
    """A stream that runs for hundreds of steps unless something ends it."""
    msg = request("def f(x):", max_tokens=MODEL_LEN - 16)
    msg.request_id = request_id
    return msg


def first_chunk(responses) -> pb.GenerateResponse:
    response = next(responses)
    assert response.HasField("chunk"), response
    return response


# ---------------------------------------------------------------- lifecycle


def _observe_startup(channel, shm_dir: Path):
    """NOT_SERVING while loading, then SERVING for both names; returns the open Watch."""
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
    assert next(watch).status == NOT_SERVING  # the model is still loading
    service_watch = health.Watch(health_pb2.HealthCheckRequest(service="splitspec.v1.Generation"))
    assert next(watch).status == SERVING
    statuses = [next(service_watch).status]
    if statuses[0] == NOT_SERVING:
        statuses.append(next(service_watch).status)
    assert statuses[-1] == SERVING
    service_watch.cancel()
    assert len(pool_files(shm_dir)) == 1
    return watch


def _fill_the_queue(stub):
    """With --max-num-seqs 1 --max-waiting 1: one running, one waiting, the next refused."""
    running = stub.Generate(long_request())
    first_chunk(running)
    waiting = stub.Generate(long_request())
    wait_for(lambda: stub.GetServerInfo(pb.GetServerInfoRequest()).waiting == 1, "a waiting request")
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request(PROMPTS[0], max_tokens=2))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    return running, waiting


def test_lifecycle_health_queue_full_and_sigterm_drain(tiny_model, shm_dir, tmp_path):
    grace = 4.0
    args = ("--shutdown-grace-s", str(grace), "--max-num-seqs", "1", "--max-waiting", "1")
    proc = start_target(tiny_model, shm_dir, tmp_path / "server.log", *TARGET_ARGS, *args)
    try:
        with grpc.insecure_channel(proc.wait_listening()) as channel:
            watch = _observe_startup(channel, shm_dir)
            stub = pb_grpc.GenerationStub(channel)
            streams = _fill_the_queue(stub)
            proc.signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING  # flipped before draining
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, request(PROMPTS[0], max_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            for stream in streams:  # too long for the grace period: aborted, with a Complete
                assert collect(stream)[2].finish_reason == pb.FINISH_REASON_ABORT
            assert proc.stop(timeout=grace + 10) == 0, proc.log()
            drained = DRAINED.search(proc.log())
            assert drained and float(drained[1]) < grace + 0.5, f"drain exceeded the grace:\n{proc.log()}"
        assert not pool_files(shm_dir), "the pool file outlived the server"
    finally:
        proc.kill()


def test_sigterm_right_after_listening_exits_cleanly(tiny_model, shm_dir, tmp_path):
    proc = start_target(tiny_model, shm_dir, tmp_path / "server.log", *TARGET_ARGS)
    try:
        proc.wait_listening()
        assert proc.stop(timeout=60) == 0, proc.log()
        assert not pool_files(shm_dir)
    finally:
        proc.kill()


def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in next(responses).list_services_response.service}
    assert {"splitspec.v1.Generation", "grpc.health.v1.Health"} <= names


# ---------------------------------------------------------------- info


def test_model_info(stub, tokenizer):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.architecture == "Qwen3ForCausalLM"
    assert info.vocab_size == len(tokenizer)
    assert info.max_model_len == MODEL_LEN
    assert tokenizer.eos_token_id in info.eos_token_ids
    assert (info.num_layers, info.hidden_size) == (2, 64)
    assert info.dtype == "float32"


def test_server_info_reports_the_pool_and_layout(stub):
    info = wait_pages_free(stub)
    assert info.num_pages == NUM_PAGES
    layout = kv_layout_from_proto(info.kv_layout)
    assert (layout.order, layout.page_size, layout.num_pages) == ("NHD", PAGE_SIZE, NUM_PAGES)
    assert [(spec.owner, spec.index) for spec in layout.layers] == [("target", 0), ("target", 1)]
    assert layout.target_id and layout.total_bytes > 0
    assert info.drafter.status == pb.DrafterState.STATUS_NONE


def test_kv_layout_round_trips_through_proto():
    layers = [LayerSpec("target", 0, 2, 16, k_scale=0.5), LayerSpec("draft", 0, 4, 64, v_scale=2.0)]
    layout = build_layout(order="HND", page_size=32, kv_dtype="fp8_e4m3", num_pages=7, layers=layers,
                          staging=StagingSpec(rows=8, width=64, dtype="bfloat16"), target_id="abc", epoch=3)
    wire = kv_layout_to_proto(layout).SerializeToString()
    assert kv_layout_from_proto(kv_pb.KVLayout.FromString(wire)) == layout


def test_finish_reasons_match_the_engine_enum():
    assert {r.name: int(r) for r in FinishReason} == {
        name.removeprefix("FINISH_REASON_"): value for name, value in pb.FinishReason.items()
    }


# ---------------------------------------------------------------- generate


def test_generate_from_text(stub, tokenizer):
    ids, text, complete = generate(stub, request(PROMPTS[0], max_tokens=8))
    assert len(ids) == 8 and text == tokenizer.decode(ids, skip_special_tokens=True)
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert complete.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))
    assert complete.usage.completion_tokens == 8


def test_generate_from_token_ids_matches_text(stub, tokenizer):
    by_text = generate(stub, request(PROMPTS[1], max_tokens=6))
    msg = request(max_tokens=6)
    msg.token_ids.ids.extend(tokenizer.encode(PROMPTS[1]))
    assert generate(stub, msg) == by_text


def test_generate_from_chat_uses_the_template(stub, tokenizer):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[2]}]
    msg = request(max_tokens=5)
    for m in chat:
        msg.chat.messages.add(**m)
    ids, _, complete = generate(stub, msg)
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert complete.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    plain = request(max_tokens=5)
    plain.token_ids.ids.extend(tokenizer.encode(rendered, add_special_tokens=False))
    assert generate(stub, plain)[0] == ids


def test_unset_max_tokens_uses_the_server_default(stub):
    ids, _, complete = generate(stub, request(PROMPTS[3], max_tokens=None))
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == DEFAULT_MAX_TOKENS


def test_request_id_is_echoed_and_assigned(stub):
    msg = request(PROMPTS[4], max_tokens=2)
    msg.request_id = "my-id"
    call = stub.Generate(msg)
    assert all(r.request_id == "my-id" for r in call)
    assert ("splitspec-request-id", "my-id") in call.initial_metadata()
    call = stub.Generate(request(PROMPTS[4], max_tokens=2))
    assigned = {r.request_id for r in call}
    assert len(assigned) == 1 and "" not in assigned


def _with(**fields):
    """A valid request with some fields changed (dotted paths)."""

    def make(tokenizer, vocab):
        msg = request(PROMPTS[5], max_tokens=4)
        for path, value in fields.items():
            *parents, name = path.split(".")
            target = msg
            for parent in parents:
                target = getattr(target, parent)
            if isinstance(value, list):
                getattr(target, name).extend(value)
            else:
                setattr(target, name, value)
        return msg

    return make


def _token_ids(ids_of):
    def make(tokenizer, vocab):
        msg = request(max_tokens=4)
        msg.token_ids.ids.extend(ids_of(vocab))
        return msg

    return make


def _with_logit_bias(bias_of):
    def make(tokenizer, vocab):
        msg = request(PROMPTS[5], max_tokens=4)
        msg.sampling.logit_bias.update(bias_of(vocab))
        return msg

    return make


def _no_input(tokenizer, vocab):
    return request(max_tokens=4)


def _empty_chat(tokenizer, vocab):
    msg = request(max_tokens=4)
    msg.chat.SetInParent()
    return msg


INVALID = {
    "no input": (_no_input, "input"),
    "empty text": (_with(text=""), "input.text"),
    "empty token ids": (_token_ids(lambda vocab: []), "input"),
    "empty chat": (_empty_chat, "input.chat"),
    "max_tokens 0": (_with(**{"stop.max_tokens": 0}), "stop.max_tokens"),
    "max_tokens negative": (_with(**{"stop.max_tokens": -3}), "stop.max_tokens"),
    "prompt + max_tokens over the model length": (_with(**{"stop.max_tokens": MODEL_LEN}), "stop.max_tokens"),
    "temperature < 0": (_with(**{"sampling.temperature": -0.5}), "sampling.temperature"),
    "temperature nan": (_with(**{"sampling.temperature": math.nan}), "sampling.temperature"),
    "top_p 0": (_with(**{"sampling.top_p": 0.0}), "sampling.top_p"),
    "top_p > 1": (_with(**{"sampling.top_p": 1.5}), "sampling.top_p"),
    "top_k < 0": (_with(**{"sampling.top_k": -1}), "sampling.top_k"),
    "seed >= 2^63": (_with(**{"sampling.seed": 2**63}), "sampling.seed"),
    "too many stop strings": (_with(**{"stop.stop": ["x"] * 17}), "stop.stop"),
    "negative num_speculative_tokens": (
        _with(**{"speculation.num_speculative_tokens": -1}), "speculation.num_speculative_tokens"),
    "token id >= vocab": (_token_ids(lambda vocab: [1, vocab, 2]), "input.token_ids"),
    "token id < 0": (_token_ids(lambda vocab: [1, -1]), "input.token_ids"),
    "request_id too long": (_with(request_id="x" * 300), "request_id"),
    # echoed as gRPC metadata, which carries printable ASCII only (was INTERNAL, and leaked the stream)
    "request_id not ASCII": (_with(request_id="h\u00e9llo"), "request_id"),
    "request_id with a newline": (_with(request_id="a\nb"), "request_id"),
    "stop token id >= vocab": (lambda tokenizer, vocab: _with(**{"stop.stop_token_ids": [vocab]})(tokenizer, vocab),
                               "stop.stop_token_ids"),
    "too many stop token ids": (_with(**{"stop.stop_token_ids": [1] * 1025}), "stop.stop_token_ids"),
    "presence_penalty > 2": (_with(**{"sampling.presence_penalty": 2.5}), "sampling.presence_penalty"),
    "frequency_penalty < -2": (_with(**{"sampling.frequency_penalty": -3.0}), "sampling.frequency_penalty"),
    "frequency_penalty inf": (_with(**{"sampling.frequency_penalty": math.inf}), "sampling.frequency_penalty"),
    "repetition_penalty 0": (_with(**{"sampling.repetition_penalty": 0.0}), "sampling.repetition_penalty"),
    "min_p > 1": (_with(**{"sampling.min_p": 1.5}), "sampling.min_p"),
    "logit_bias id >= vocab": (_with_logit_bias(lambda vocab: {vocab: 1.0}), "sampling.logit_bias"),
    "logit_bias > 100": (_with_logit_bias(lambda vocab: {3: 150.0}), "sampling.logit_bias"),
    "too many logit_bias entries": (_with_logit_bias(lambda vocab: {i: 1.0 for i in range(2000)}),
                                    "sampling.logit_bias"),
    "banned id >= vocab": (lambda tokenizer, vocab: _with(**{"sampling.banned_token_ids": [vocab]})(tokenizer, vocab),
                           "sampling.banned_token_ids"),
    "banning every token": (lambda tokenizer, vocab: _with(**{"sampling.banned_token_ids": list(range(vocab))})(
        tokenizer, vocab), "sampling.banned_token_ids"),
    "min_tokens > max_tokens": (_with(**{"stop.min_tokens": 5}), "stop.min_tokens"),
    "min_tokens masking every token left": (lambda tokenizer, vocab: _with(**{
        "sampling.banned_token_ids": list(range(1, vocab)), "stop.stop_token_ids": [0], "stop.min_tokens": 2})(
        tokenizer, vocab), "stop.min_tokens"),
    "n > 16": (_with(n=17), "n"),
    "n < 0": (_with(n=-1), "n"),
    "logprobs.top > 20": (_with(**{"logprobs.completion": True, "logprobs.top": 21}), "logprobs.top"),
    "logprobs.top without completion": (_with(**{"logprobs.top": 2}), "logprobs.top"),
    "logprobs.prompt_top < 0": (_with(**{"logprobs.prompt": True, "logprobs.prompt_top": -1}), "logprobs.prompt_top"),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_invalid_request_is_invalid_argument_naming_the_field(stub, tokenizer, case):
    make, field_name = INVALID[case]
    vocab = stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, make(tokenizer, vocab))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field_name), err.value.details()
    _, _, complete = generate(stub, request(PROMPTS[6], max_tokens=2))  # still serving
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH


def test_n_sequences_stream_with_their_index_and_logprobs(stub, tokenizer):
    """n = 3 seeded: three interleaved sequences, each with its Chunks and one Complete carrying its
    index, a logprob (and the top 4) per token, the prompt's logprobs once (on sequence 0)."""
    msg = request(PROMPTS[1], max_tokens=6, temperature=1.0, seed=5, presence_penalty=0.5)
    msg.n = 3
    msg.logprobs.completion, msg.logprobs.top, msg.logprobs.prompt = True, 4, True
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    completes, prompt_entries = {}, []
    for response in stub.Generate(msg, timeout=60):
        if response.HasField("chunk"):
            chunk = response.chunk
            assert chunk.index not in completes, "a chunk after its sequence's Complete"
            assert len(chunk.logprobs) == len(chunk.token_ids)
            for entry, token in zip(chunk.logprobs, chunk.token_ids):
                assert entry.chosen.token_id == token and entry.chosen.token == tokenizer.decode([token])
                assert entry.chosen.logprob <= 0 and entry.chosen.rank >= 1 and len(entry.top) == 4
                assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
            tokens[chunk.index].extend(chunk.token_ids)
            if chunk.prompt_logprobs:
                assert chunk.index == 0 and not prompt_entries
                prompt_entries = list(chunk.prompt_logprobs)
        else:
            completes[response.complete.index] = response.complete
    prompt = tokenizer.encode(PROMPTS[1])
    assert [e.chosen.token_id for e in prompt_entries] == prompt
    assert not prompt_entries[0].chosen.HasField("logprob") and all(e.chosen.HasField("logprob")
                                                                    for e in prompt_entries[1:])
    assert sorted(completes) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())
    assert all(c.usage.completion_tokens == 6 and c.usage.prompt_tokens == len(prompt) for c in completes.values())
    for index in range(3):  # each is the single request with seed + index
        single = request(PROMPTS[1], max_tokens=6, temperature=1.0, seed=5 + index, presence_penalty=0.5)
        assert generate(stub, single)[0] == tokens[index]
    wait_pages_free(stub)


def test_a_long_prompts_logprobs_come_in_several_chunks(stub):
    """1,200 prompt positions with 20 alternatives each (~600 KB): three Chunks of at most 512
    positions, in order, the last carrying the first token."""
    ids = [(7 * i) % 400 + 3 for i in range(1200)]
    msg = request(max_tokens=2)
    msg.token_ids.ids.extend(ids)
    msg.logprobs.prompt, msg.logprobs.prompt_top = True, 20
    chunks = [r.chunk for r in stub.Generate(msg, timeout=60) if r.HasField("chunk")]
    sizes = [len(c.prompt_logprobs) for c in chunks if c.prompt_logprobs]
    assert sizes == [512, 512, 176] and chunks[2].token_ids and not chunks[0].token_ids
    assert [e.chosen.token_id for c in chunks for e in c.prompt_logprobs] == ids
    assert all(len(e.top) == 20 for c in chunks for e in c.prompt_logprobs[1:] if e.chosen.HasField("logprob"))


def test_a_tiny_temperature_decodes_greedily(stub):
    """logits / 1e-40 overflow float32 (inf - inf = NaN): such a request used to fail the step
    for every request in the batch; below 1e-5 the temperature means greedy."""
    greedy = generate(stub, request(PROMPTS[8], max_tokens=6))[0]
    for temperature in (1e-40, 1e-6):
        ids, _, complete = generate(stub, request(PROMPTS[8], max_tokens=6, temperature=temperature))
        assert ids == greedy and complete.finish_reason == pb.FINISH_REASON_LENGTH


def test_abort_without_request_id_is_invalid(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(pb.AbortRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
    assert stub.Abort(pb.AbortRequest(request_id="no-such-request")).found is False


# ---------------------------------------------------------------- ending streams early


def test_client_cancel_mid_stream_frees_the_pages(stub):
    # `twin` is the same request, left running: while it runs, the cancelled stream
    # could not have finished on its own, so its pages were freed by the cancel.
    twin, doomed = stub.Generate(long_request()), stub.Generate(long_request())
    first_chunk(twin)
    first_chunk(doomed)
    assert stub.GetServerInfo(pb.GetServerInfoRequest()).running == 2
    doomed.cancel()
    wait_only_running(stub, 1)
    twin.cancel()
    wait_pages_free(stub)


def test_deadline_mid_stream_frees_the_pages(stub):
    twin, doomed = stub.Generate(long_request()), stub.Generate(long_request(), timeout=2.0)
    first_chunk(twin)
    first_chunk(doomed)
    with pytest.raises(grpc.RpcError) as err:
        collect(doomed)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_only_running(stub, 1)  # the twin shows the doomed stream had far to go
    twin.cancel()
    wait_pages_free(stub)


def test_abort_rpc_ends_the_stream_with_abort(stub):
    request_id = f"abort-{uuid.uuid4().hex}"
    stream = stub.Generate(long_request(request_id))
    ids = list(first_chunk(stream).chunk.token_ids)
    assert stub.Abort(pb.AbortRequest(request_id=request_id)).found
    rest, _, complete = collect(stream)
    assert complete.finish_reason == pb.FINISH_REASON_ABORT
    assert complete.usage.completion_tokens == len(ids + rest) < MODEL_LEN - 16
    wait_pages_free(stub)


# ---------------------------------------------------------------- concurrency


def _mixed_requests() -> list[pb.GenerateRequest]:
    """16 prompts of different lengths and completion lengths; every fourth one sampled."""
    out = []
    for i, prompt in enumerate(PROMPTS[:16]):
        msg = request(prompt * (1 + i % 3), max_tokens=3 + 5 * i)
        if i % 4 == 3:
            msg.sampling.temperature = 0.8
            msg.sampling.top_p = 0.9
            msg.sampling.seed = 1000 + i
        out.append(msg)
    return out


def test_concurrent_streams_match_their_solo_runs_and_free_every_page(stub):
    requests = _mixed_requests()
    solo = [generate(stub, msg) for msg in requests]
    start = threading.Barrier(len(requests))

    def run(msg):
        start.wait()
        return generate(stub, msg)

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, requests))
    for i, (alone, batched) in enumerate(zip(solo, together)):
        assert batched[0] == alone[0], f"request {i}: tokens differ when batched"
        assert batched[1] == alone[1], f"request {i}: text differs when batched"
        assert batched[2].finish_reason == alone[2].finish_reason
    wait_pages_free(stub)


# ---------------------------------------------------------------- the client CLI


def test_splitspec_generate_prints_the_text(server, stub):
    prompt = PROMPTS[7]
    _, expected, _ = generate(stub, request(prompt, max_tokens=12))
    cmd = [*client_cmd(), "generate", "--target", server.address, "--max-tokens", "12", "--ignore-eos",
           prompt]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert "completion_tokens=12" in done.stderr and "finish_reason=length" in done.stderr


def test_splitspec_generate_reports_invalid_argument(server):
    cmd = [*client_cmd(), "generate", "--target", server.address, "--top-p", "2", "hi"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 1
    assert "INVALID_ARGUMENT" in done.stderr and "sampling.top_p" in done.stderr


def test_splitspec_info_prints_model_and_server(server):
    cmd = [*client_cmd(), "info", "--target", server.address]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert "Qwen3ForCausalLM" in done.stdout and re.search(rf"pages free +\d+ / {NUM_PAGES}\n", done.stdout)


def test_splitspec_health_is_the_compose_healthcheck(server):
    done = subprocess.run([*client_cmd(), "health", server.address], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
    from tests.procs import free_port

    closed = f"127.0.0.1:{free_port()}"
    done = subprocess.run([*client_cmd(), "health", closed, "--timeout", "1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr


# ---------------------------------------------------------------- in process, before any engine


def _in_process(check) -> None:
    """Run `check(channel)` against start_server() (no engine), then stop the server."""
    from target_service.config import EngineConfig
    from target_service.server import ServeConfig, start_server

    async def main():
        running = await start_server(ServeConfig(engine=EngineConfig(model="never-loaded"), port=0))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                await check(channel, running)
        finally:
            await running.server.stop(0)

    asyncio.run(main())


async def _status_of(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_before_the_engine_is_ready_health_is_not_serving_and_rpcs_are_unavailable():
    async def check(channel, running):
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "splitspec.v1.Generation"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == NOT_SERVING
        stub = pb_grpc.GenerationStub(channel)
        assert await _status_of(stub.GetModelInfo(pb.GetModelInfoRequest())) == grpc.StatusCode.UNAVAILABLE
        assert await _status_of(stub.GetServerInfo(pb.GetServerInfoRequest())) == grpc.StatusCode.UNAVAILABLE
        assert await _status_of(stub.Abort(pb.AbortRequest(request_id="x"))) == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(request("hi")):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()

    _in_process(check)


def test_unexpected_exceptions_become_internal_and_are_logged(caplog):
    from target_service.server import GenerationServicer

    class Failing(GenerationServicer):
        async def GetModelInfo(self, request, context):
            raise ZeroDivisionError("secret detail")

    async def main() -> grpc.aio.AioRpcError:
        server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(ERRORS, (SERVICE_NAME,))])
        pb_grpc.add_GenerationServicer_to_server(Failing(EngineSlot(), convert.RequestDefaults()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest())
                return err.value
        finally:
            await server.stop(0)

    with caplog.at_level(logging.ERROR, logger="target_service.server"):
        err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "ZeroDivisionError" in err.details() and "secret" not in err.details()
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)
