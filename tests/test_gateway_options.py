"""OpenAI's sampling and output options through the gateway with the official `openai` client:
logprobs, top_logprobs, echo, n, the penalties, logit_bias, seed, stop and splitspec's extras
(min_p, repetition_penalty, min_tokens, banned_token_ids), against a target that speculates
with a drafter process. Values are compared with the gRPC API's answer to the same request, and
where a parameter's effect is plain (a bias of +100, a banned id, min_tokens) with that effect."""

from __future__ import annotations

import math
import shutil

import grpc
import pytest

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import Service, create_for_x, private_shm_dir, start_gateway, wait_drafter
from tests.tiny_models import PROMPTS, make_qwen3

pytestmark = pytest.mark.slow  # `openai` is imported by the test that uses it (collection stays cheap)
TOP = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A draft LM drafter (the target's own weights), a target drafting every step, a gateway."""
    tmp = tmp_path_factory.mktemp("gateway-options")
    model = make_qwen3(tmp / "model")
    draft = tmp / "draft"
    shutil.copytree(model, draft)
    shm = private_shm_dir()
    drafter = Service("draft_service.cli", ["--model", str(draft), "--dtype", "float32", "--target-model", str(model),
                                            "--port", "0", "--num-speculative-tokens", "4", "--shm-dir", str(shm)],
                      tmp / "drafter.log")
    target = gateway = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli", ["--model", str(model), "--port", "0", "--shm-dir", str(shm),
                                                "--drafter", drafter.address, "--speculative-policy", "fixed"],
                         tmp / "target.log")
        target.wait_serving()
        wait_drafter(target.address, pb.DrafterState.STATUS_READY)
        gateway = start_gateway(target.address, tmp / "gateway.log")
        from transformers import AutoTokenizer

        yield {"target": target.address, "gateway": gateway.address, "model": str(model),
               "tokenizer": AutoTokenizer.from_pretrained(model)}
    finally:
        for service in (gateway, target):
            if service is not None:
                service.stop()
        drafter.kill()
        shutil.rmtree(shm, ignore_errors=True)


def grpc_choices(address: str, request: pb.GenerateRequest) -> tuple[dict, list, list]:
    """Per index: (text, token ids, logprobs); the prompt logprobs; the Completes."""
    choices: dict[int, tuple[list, list, list]] = {}
    prompt, completes = [], []
    with grpc.insecure_channel(address) as channel:
        for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=120):
            if response.HasField("chunk"):
                text, ids, logprobs = choices.setdefault(response.chunk.index, ([], [], []))
                text.append(response.chunk.text)
                ids.extend(response.chunk.token_ids)
                logprobs.extend(response.chunk.logprobs)
                prompt.extend(response.chunk.prompt_logprobs)
            else:
                completes.append(response.complete)
    return {i: ("".join(t), ids, lp) for i, (t, ids, lp) in choices.items()}, prompt, completes


def test_completions_logprobs_echo_and_n(stack, client):
    """logprobs=3 with echo and n=2 (greedy, so the two agree): the legacy shape over the prompt and
    the completion, values as the gRPC API's, the first prompt token without a logprob."""
    prompt = PROMPTS[1]
    request = pb.GenerateRequest(text=prompt, n=2, stop=pb.StopParams(max_tokens=10, ignore_eos=True),
                                 logprobs=pb.LogprobParams(completion=True, top=TOP, prompt=True, prompt_top=TOP))
    choices, prompt_entries, _ = grpc_choices(stack["target"], request)
    whole = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=10, temperature=0, n=2,
                                      logprobs=TOP, echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 20
    for choice in whole.choices:
        text, ids, entries = choices[0]
        assert choice.text == prompt + text
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt_entries) + len(ids)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        want = [e.chosen.logprob for e in prompt_entries[1:] + entries]
        assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(logprobs.token_logprobs[1:], want))
        assert logprobs.tokens == [e.chosen.token for e in prompt_entries + entries]
        assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
        for top, entry in zip(logprobs.top_logprobs[1:], prompt_entries[1:] + entries):
            # keyed by text: tokens that decode alike alone (partial UTF-8 as U+FFFD) share a key
            assert len(top) <= TOP + 1 and entry.chosen.token in top

    chunks = list(client.completions.create(model=stack["model"], prompt=prompt, max_tokens=10, temperature=0,
                                            n=2, logprobs=TOP, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == whole.choices[index].text
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == whole.choices[index].logprobs.tokens
        assert mine[-1].finish_reason == "length"


def test_echo_without_logprobs_returns_the_prompt(stack, client):
    ids = stack["tokenizer"].encode(PROMPTS[2])
    for prompt in (PROMPTS[2], ids):
        whole = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=4, temperature=0,
                                          echo=True)
        assert whole.choices[0].text.startswith(PROMPTS[2]) and whole.choices[0].logprobs is None


def test_chat_logprobs_top_logprobs_and_n_streamed(stack, client):
    messages = [{"role": "user", "content": PROMPTS[3]}]
    whole = client.chat.completions.create(model=stack["model"], messages=messages, max_tokens=8, temperature=0.9,
                                           seed=7, n=3, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2]
    for choice in whole.choices:
        content = choice.logprobs.content
        assert len(content) == 8
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # the best is at least the sampled one
            assert bytes(entry.bytes).decode(errors="replace") == entry.token
    chunks = list(client.chat.completions.create(model=stack["model"], messages=messages, max_tokens=8,
                                                 temperature=0.9, seed=7, n=3, logprobs=True, top_logprobs=2,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert sum(len(c.logprobs.content) for c in mine if c.logprobs) == 8
    assert chunks[-1].usage.completion_tokens == 24


def test_penalties_bias_and_extras_equal_the_grpc_api(stack, client):
    """Every shaping parameter at once, greedy, through both APIs."""
    tok = stack["tokenizer"]
    prompt = PROMPTS[4]
    banned = tok.encode(" the")[:1] + [10, 11]
    fields = dict(presence_penalty=0.6, frequency_penalty=0.9, logit_bias={"40": 3.0, "41": -5.0})
    extra = dict(repetition_penalty=1.3, min_p=0.05, banned_token_ids=banned, min_tokens=3, ignore_eos=True)
    sampling = pb.SamplingParams(presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.3, min_p=0.05,
                                 logit_bias={40: 3.0, 41: -5.0}, banned_token_ids=banned)
    choices, _, _ = grpc_choices(stack["target"], pb.GenerateRequest(
        text=prompt, sampling=sampling, stop=pb.StopParams(max_tokens=16, ignore_eos=True, min_tokens=3)))
    whole = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=16, temperature=0, **fields,
                                      extra_body=extra)
    assert whole.choices[0].text == choices[0][0]
    assert not set(banned) & set(choices[0][1])
    plain, _, _ = grpc_choices(stack["target"], pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=16,
                                                                                                 ignore_eos=True)))
    assert plain[0][1] != choices[0][1]  # the shaping changed the output


def test_a_large_bias_and_min_tokens_have_their_effect(stack, client):
    tok = stack["tokenizer"]
    forced = tok.encode(" x")[-1]
    whole = client.completions.create(model=stack["model"], prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                      logit_bias={str(forced): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].logprobs.tokens == [tok.decode([forced])] * 6
    eos = tok.eos_token_id
    stopped = client.completions.create(model=stack["model"], prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                        logit_bias={str(eos): 100}, logprobs=0, extra_body={"min_tokens": 4})
    assert len(stopped.choices[0].logprobs.tokens) == 5 and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 5


def test_seeded_sampling_with_n_equals_the_grpc_api(stack, client):
    """n = 2 seeded, target-only (speculation's draft count changes how many random numbers a step
    draws): choice i is the gRPC request's choice i."""
    request = pb.GenerateRequest(text=PROMPTS[5], n=2, sampling=pb.SamplingParams(temperature=1.0, seed=123),
                                 stop=pb.StopParams(max_tokens=8, ignore_eos=True),
                                 speculation=pb.SpeculationParams(disable=True))
    choices, _, _ = grpc_choices(stack["target"], request)
    whole = client.completions.create(model=stack["model"], prompt=PROMPTS[5], max_tokens=8, temperature=1.0,
                                      seed=123, n=2, extra_body={"ignore_eos": True, "speculation": {"disable": True}})
    assert [c.text for c in whole.choices] == [choices[0][0], choices[1][0]]


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"n": 17}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 200}}, "logit_bias"),
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("completions", {"extra_body": {"min_tokens": 9}}, "min_tokens"),
    ("completions", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("completions", {"extra_body": {"min_p": 2}}, "min_p"),
    ("completions", {"extra_body": {"banned_token_ids": [10**6]}}, "banned_token_ids"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
])
def test_out_of_range_options_are_400_naming_the_parameter(stack, client, endpoint, fields, param):
    import openai

    with pytest.raises(openai.BadRequestError) as exc_info:
        create_for_x(client, endpoint, stack["model"], 4, fields)
    error = exc_info.value.body
    assert exc_info.value.status_code == 400 and error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error
