"""Fuzzing the public API: hypothesis-generated GenerateRequests against one real target.

Every field is drawn, valid or not: each `input` variant (and none), request ids (empty,
non-ASCII, too long), float32 temperatures and top_p (NaN, infinities, denormals),
int32 limits, huge and empty strings, out-of-vocabulary token ids, chat messages. An
oracle written from the API contract (generation.proto, docs/design.md#error-model) decides what the
server must answer: INVALID_ARGUMENT whose details start with the field's name, or a
stream that ends in one Complete. Requests stay tiny (at most 4 new tokens) so 2,000 of
them run in about two minutes; SPLITSPEC_FUZZ_EXAMPLES asks for more (or fewer).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import Service, served_target, wait_idle
from tests.tiny_models import PROMPTS, make_qwen3

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("SPLITSPEC_FUZZ_EXAMPLES", "2000"))
MODEL_LEN = 512  # tiny_models' max_position_embeddings
DEFAULT_MAX_TOKENS = 4
MAX_NEW_TOKENS = 4  # a valid request never asks for more: the fuzzer stays fast
INT32 = (-(2**31), 2**31 - 1)
TEXT = st.characters(codec="utf-8")  # any code point protobuf strings can carry (no surrogates)
ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)


@dataclass
class Target:
    address: str
    tokenizer: object
    vocab_size: int
    proc: Service


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("fuzz")
    model = make_qwen3(root / "model")
    with served_target(model, root / "target.log", "--num-pages", "128", "--page-size", "16",
                       "--max-num-batched-tokens", "512", "--default-max-tokens", str(DEFAULT_MAX_TOKENS)) as proc:
        tokenizer = AutoTokenizer.from_pretrained(model)
        yield Target(proc.address, tokenizer, len(tokenizer), proc)


# ---------------------------------------------------------------- strategies


def repeated(unit: st.SearchStrategy, low: int, high: int) -> st.SearchStrategy:
    """A long value as a repetition: hypothesis need not draw every element."""
    return st.builds(lambda u, n: u * n, unit, st.integers(low, high))


def texts(max_size: int = 30) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(TEXT, max_size=max_size),
        st.sampled_from(PROMPTS),
        repeated(st.text(TEXT, min_size=1, max_size=3), 200, 2000),  # often past the model length
    )


def token_id_lists(vocab: int) -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.lists(st.integers(0, vocab - 1), max_size=12),
        st.lists(st.one_of(st.integers(0, vocab - 1), st.integers(*INT32), st.sampled_from([-1, vocab])),
                 max_size=6),
        repeated(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=2), 200, 600),
    )


def chats() -> st.SearchStrategy[pb.ChatMessages]:
    message = st.builds(pb.ChatMessage, role=st.one_of(st.sampled_from(["system", "user", "assistant"]),
                                                       st.text(TEXT, max_size=8)),
                        content=texts(20))
    return st.builds(lambda messages, add: pb.ChatMessages(messages=messages, add_generation_prompt=add),
                     mostly(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=1)),
                     st.one_of(st.none(), st.booleans()))


def request_ids() -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.text(ASCII, max_size=24), st.text(TEXT, max_size=6),
                     repeated(st.sampled_from(["r", "x-"]), 100, 200))


def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """Usually (5 in 6) a valid value, else anything the wire type holds."""
    return st.sampled_from([True] * 5 + [False]).flatmap(lambda ok: valid if ok else anything)


@st.composite
def generate_requests(draw, vocab: int) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(request_id=draw(mostly(st.just(""), request_ids())))
    kind = draw(st.sampled_from(["text"] * 4 + ["token_ids"] * 3 + ["chat"] * 2 + ["none"]))
    if kind == "text":
        msg.text = draw(mostly(st.sampled_from(PROMPTS), texts()))
    elif kind == "token_ids":
        msg.token_ids.ids.extend(draw(mostly(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12),
                                             token_id_lists(vocab))))
    elif kind == "chat":
        msg.chat.CopyFrom(draw(chats()))
    if draw(st.booleans()):
        s = msg.sampling
        s.temperature = draw(mostly(st.one_of(st.just(0.0), st.floats(0, 2, width=32),
                                              st.sampled_from([1e-45, 1e-38, 1e-6, 3e38])),
                                    st.floats(width=32)))
        if (top_p := draw(st.one_of(st.none(), mostly(st.floats(0, 1, width=32), st.floats(width=32))))) is not None:
            s.top_p = top_p
        s.top_k = draw(mostly(st.integers(0, vocab + 2), st.integers(*INT32)))
        if (seed := draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))) is not None:
            s.seed = seed
    if draw(st.booleans()):
        stop = msg.stop
        max_tokens = draw(st.one_of(st.none(), st.integers(1, MAX_NEW_TOKENS), st.integers(1, MAX_NEW_TOKENS),
                                    st.integers(INT32[0], 0), st.integers(MODEL_LEN, INT32[1])))
        if max_tokens is not None:
            stop.max_tokens = max_tokens
        stop.stop.extend(draw(mostly(st.lists(st.text(TEXT, min_size=1, max_size=4), max_size=3),
                                     st.lists(st.one_of(st.text(TEXT, max_size=3), repeated(st.just("s"), 250, 260)),
                                              max_size=18))))
        stop.stop_token_ids.extend(draw(mostly(st.lists(st.integers(0, vocab - 1), max_size=3),
                                               st.one_of(st.lists(st.integers(*INT32), max_size=3),
                                                         repeated(st.just([1]), 1020, 1030)))))
        stop.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        msg.speculation.disable = draw(st.booleans())
        msg.speculation.num_speculative_tokens = draw(mostly(st.integers(0, 16), st.integers(*INT32)))
    if draw(st.integers(0, 3)) == 0:
        _draw_output_options(draw, msg, vocab)
    return msg


def _draw_output_options(draw, msg: pb.GenerateRequest, vocab: int) -> None:
    """Logit shaping, min_tokens, logprobs and n: mostly in range, else anything the wire holds."""
    s = msg.sampling
    s.min_p = draw(mostly(st.floats(0, 1, width=32), st.floats(width=32)))
    s.presence_penalty = draw(mostly(st.floats(-2, 2, width=32), st.floats(width=32)))
    s.frequency_penalty = draw(mostly(st.floats(-2, 2, width=32), st.floats(width=32)))
    if draw(st.booleans()):
        s.repetition_penalty = draw(mostly(st.floats(0.5, 2, width=32), st.floats(width=32)))
    s.logit_bias.update(draw(mostly(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100, width=32),
                                                    max_size=3),
                                    st.dictionaries(st.integers(*INT32), st.floats(width=32), max_size=3))))
    s.banned_token_ids.extend(draw(mostly(st.lists(st.integers(0, vocab - 1), max_size=3),
                                          st.one_of(st.lists(st.integers(*INT32), max_size=3),
                                                    st.just(list(range(vocab)))))))
    msg.stop.min_tokens = draw(mostly(st.integers(0, 2), st.integers(*INT32)))
    msg.n = draw(mostly(st.integers(0, 3), st.integers(*INT32)))
    lp = msg.logprobs
    lp.completion, lp.prompt = draw(st.booleans()), draw(st.booleans())
    lp.top = draw(mostly(st.integers(0, 20), st.integers(*INT32))) if lp.completion or draw(st.booleans()) else 0
    lp.prompt_top = draw(mostly(st.integers(0, 5), st.integers(*INT32))) if lp.prompt or draw(st.booleans()) else 0


# ---------------------------------------------------------------- the oracle


class Invalid(Exception):
    def __init__(self, field_name: str) -> None:
        self.field_name = field_name


def _prompt(msg: pb.GenerateRequest, tokenizer) -> list[int]:
    """The prompt's ids; Invalid naming the input field when it is missing, empty, or too
    long to leave one token to generate."""
    kind = msg.WhichOneof("input")
    if kind is None:
        raise Invalid("input")
    prompt = _encode_input(msg, kind, tokenizer)
    if len(prompt) >= MODEL_LEN:
        raise Invalid(f"input.{kind}")
    return prompt


def _encode_input(msg: pb.GenerateRequest, kind: str, tokenizer) -> list[int]:
    if kind == "text":
        if not msg.text:
            raise Invalid("input.text")
        return tokenizer.encode(msg.text)
    if kind == "token_ids":
        if not msg.token_ids.ids:
            raise Invalid("input.token_ids")
        return list(msg.token_ids.ids)
    if not msg.chat.messages:
        raise Invalid("input.chat.messages")
    messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
    add = msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _check_fields(msg: pb.GenerateRequest, prompt_len: int) -> int:
    """Raise Invalid for the first bad field in the server's order; the effective max_tokens."""
    if len(msg.request_id) > 256 or not all(" " <= c <= "~" for c in msg.request_id):
        raise Invalid("request_id")
    s = msg.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise Invalid("sampling.temperature")
    if s.HasField("top_p") and not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        raise Invalid("sampling.top_p")
    if s.top_k < 0:
        raise Invalid("sampling.top_k")
    if s.HasField("seed") and s.seed >= 2**63:
        raise Invalid("sampling.seed")
    _check_shaping(s)
    stop = msg.stop
    max_tokens = stop.max_tokens if stop.HasField("max_tokens") else max(1, min(DEFAULT_MAX_TOKENS,
                                                                                  MODEL_LEN - prompt_len))
    if max_tokens <= 0:
        raise Invalid("stop.max_tokens")
    if not 0 <= stop.min_tokens <= max_tokens:
        raise Invalid("stop.min_tokens")
    if len(stop.stop) > 16 or any(not 1 <= len(x) <= 256 for x in stop.stop):
        raise Invalid("stop.stop")
    if len(stop.stop_token_ids) > 1024:
        raise Invalid("stop.stop_token_ids")
    if msg.speculation.num_speculative_tokens < 0:
        raise Invalid("speculation.num_speculative_tokens")
    lp = msg.logprobs
    for name in ("top", "prompt_top"):
        if not 0 <= getattr(lp, name) <= 20:
            raise Invalid(f"logprobs.{name}")
    if lp.top and not lp.completion:
        raise Invalid("logprobs.top")
    if lp.prompt_top and not lp.prompt:
        raise Invalid("logprobs.prompt_top")
    if not 1 <= (msg.n or 1) <= 16:
        raise Invalid("n")
    return max_tokens


def _check_shaping(s: pb.SamplingParams) -> None:
    """The shaping fields in the server's order (the map's size first: it is bounded before it is copied)."""
    if len(s.logit_bias) > 1024:
        raise Invalid("sampling.logit_bias")
    if not (math.isfinite(s.min_p) and 0 <= s.min_p <= 1):
        raise Invalid("sampling.min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (math.isfinite(value) and -2 <= value <= 2):
            raise Invalid(f"sampling.{name}")
    if s.HasField("repetition_penalty") and not (math.isfinite(s.repetition_penalty)
                                                 and 0 < s.repetition_penalty <= 10):
        raise Invalid("sampling.repetition_penalty")
    if any(not (math.isfinite(b) and -100 <= b <= 100) for b in s.logit_bias.values()):
        raise Invalid("sampling.logit_bias")
    if len(s.banned_token_ids) > 1024:
        raise Invalid("sampling.banned_token_ids")


def _check_some_token_left(msg: pb.GenerateRequest, vocab: int, eos: int) -> None:
    blocked = set(msg.sampling.banned_token_ids)
    if len(blocked) >= vocab:
        raise Invalid("sampling.banned_token_ids")
    if msg.stop.min_tokens:
        blocked |= set(msg.stop.stop_token_ids) | (set() if msg.stop.ignore_eos else {eos})
        if len(blocked) >= vocab:
            raise Invalid("stop.min_tokens")


def oracle(msg: pb.GenerateRequest, tokenizer, vocab: int) -> tuple[str | None, int, int]:
    """(the field an INVALID_ARGUMENT must name, or None when valid; prompt tokens; max_tokens)."""
    eos = tokenizer.eos_token_id
    try:
        prompt = _prompt(msg, tokenizer)
        max_tokens = _check_fields(msg, len(prompt))
        if not prompt:
            raise Invalid("input")
        if any(not 0 <= t < vocab for t in prompt):
            raise Invalid("input.token_ids")
        if any(not 0 <= t < vocab for t in msg.stop.stop_token_ids):
            raise Invalid("stop.stop_token_ids")
        if any(not 0 <= t < vocab for t in msg.sampling.banned_token_ids):
            raise Invalid("sampling.banned_token_ids")
        if any(not 0 <= t < vocab for t in msg.sampling.logit_bias):
            raise Invalid("sampling.logit_bias")
        _check_some_token_left(msg, vocab, eos)
        if len(prompt) + max_tokens > MODEL_LEN:
            raise Invalid("stop.max_tokens")
    except Invalid as bad:
        return bad.field_name, 0, 0
    return None, len(prompt), max_tokens


# ---------------------------------------------------------------- the test


def test_fuzzed_requests_get_invalid_argument_naming_the_field_or_complete(target):
    seen: Counter[str] = Counter()
    channel = grpc.insecure_channel(target.address)
    stub = pb_grpc.GenerationStub(channel)

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(msg=generate_requests(target.vocab_size))
    def check(msg: pb.GenerateRequest) -> None:
        expected, prompt_len, max_tokens = oracle(msg, target.tokenizer, target.vocab_size)
        assert expected is not None or max_tokens <= MAX_NEW_TOKENS, "the strategies keep valid requests tiny"
        try:
            responses = list(stub.Generate(msg, timeout=60))
        except grpc.RpcError as err:
            assert expected is not None, f"a valid request failed: {err.code().name}: {err.details()}\n{msg}"
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code().name}: {err.details()}\n{msg}"
            assert err.details().startswith(f"{expected}:"), f"expected {expected!r}, got {err.details()!r}\n{msg}"
            seen[expected] += 1
            return
        assert expected is None, f"expected INVALID_ARGUMENT naming {expected!r}, the request completed\n{msg}"
        n = msg.n or 1
        assert responses and responses[-1].HasField("complete"), responses[-1]
        completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
        assert sorted(completes) == list(range(n)), completes
        for index, complete in completes.items():
            assert complete.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP), complete
            tokens = [t for r in responses if r.HasField("chunk") and r.chunk.index == index
                      for t in r.chunk.token_ids]
            assert msg.stop.min_tokens <= len(tokens) == complete.usage.completion_tokens <= max_tokens
            assert all(0 <= t < target.vocab_size for t in tokens)
            assert not set(tokens) & set(msg.sampling.banned_token_ids)
            assert complete.usage.prompt_tokens == prompt_len
        assert not msg.request_id or all(r.request_id == msg.request_id for r in responses)
        seen["valid"] += 1

    try:
        check()
    finally:
        channel.close()
        print(f"\nfuzz: {sum(seen.values())} requests: {dict(seen.most_common())}")
    assert target.proc.proc.poll() is None, "the server died"
    assert target.proc.wait_serving(timeout=10) == target.address  # health still SERVING
    wait_idle(target.address, timeout=10)  # every page free, nothing running or waiting
    if EXAMPLES >= 1000:  # both kinds of answer, and the fields the contract names, were exercised
        assert seen["valid"] >= EXAMPLES // 8, seen
        wanted = {"input", "input.text", "input.token_ids", "input.chat.messages", "request_id",
                  "sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.seed", "stop.max_tokens",
                  "stop.stop", "stop.stop_token_ids", "speculation.num_speculative_tokens"}
        assert wanted <= set(seen), f"never generated: {wanted - set(seen)}"
