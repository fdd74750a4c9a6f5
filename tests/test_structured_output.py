"""Structured output: grammars compiled with their cost bounded, verify rows masked through the
draft, and, across real processes, output token-identical to target-only constrained decoding
with every drafter, valid against its schema (`jsonschema`) every time."""

from __future__ import annotations

import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import pytest
import torch

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from target_service.api_types import InvalidRequestError, StructuredOutputKind, StructuredOutputParams
from target_service.structured_output import GrammarCompiler, GrammarLimits, constrain_rows
from tests.procs import Service, create_for_x, openai_client, private_shm_dir, stream_tokens, wait_idle
from tests.tiny_models import PROMPTS, make_tokenizer

KIND = StructuredOutputKind

# Schemas a random tiny model finishes within MAX_TOKENS: every string, number and array bounded.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["n", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False},
        "label": {"enum": ["red", "green", "blue"]}}, "required": ["point", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "score": {"enum": [0, 0.25, 0.5, 1]},
                                      "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["id", "score", "note"], "additionalProperties": False},
    {"anyOf": [{"type": "boolean"}, {"type": "object", "properties": {"v": {"const": 1}}, "required": ["v"],
                                                       "additionalProperties": False}]},
]
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta", "ε"]
MAX_TOKENS = 96
DRAFTERS = ("ngram", "draft_model", "dflash")


# ---------------------------------------------------------------- the compiler and the masks (in-process)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("so-tokenizer"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer) + 8, (tokenizer.eos_token_id,))  # 8 padded ids


def schema(value: dict, **kw) -> StructuredOutputParams:
    return StructuredOutputParams(KIND.JSON_SCHEMA, json.dumps(value), **kw)


def _deep(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "array", "items": value}
    return value


@pytest.mark.parametrize("params, field, words", [
    (lambda: StructuredOutputParams(KIND.REGEX, "(a"), "structured_output.regex", "cannot be compiled"),
    (lambda: StructuredOutputParams(KIND.JSON_SCHEMA, "{not json"), "structured_output.json_schema", "not valid JSON"),
    (lambda: StructuredOutputParams(KIND.JSON_SCHEMA, "[1]"), "structured_output.json_schema", "JSON object"),
    (lambda: schema({"type": "strnig"}), "structured_output.json_schema", "strnig"),
    (lambda: schema({"$ref": "#/missing"}), "structured_output.json_schema", "missing"),
    (lambda: schema(_deep(40)), "structured_output.json_schema", "deeper than 32"),
])
def test_bad_grammars_are_refused_naming_the_field(compiler, params, field, words):
    with pytest.raises(InvalidRequestError) as exc_info:
        compiler.compile(params())
    assert exc_info.value.field_name == field and words in str(exc_info.value), exc_info.value


@pytest.mark.parametrize("make, words", [
    (lambda: StructuredOutputParams(KIND.JSON_SCHEMA, " " * (64 * 1024 + 1)), "at most 65536 bytes"),
    (lambda: StructuredOutputParams(KIND.JSON_SCHEMA, ""), "must not be empty"),
    (lambda: StructuredOutputParams(KIND.REGEX, "a" * 4097), "1..4096 characters"),
    (lambda: StructuredOutputParams(KIND.CHOICE, choices=tuple(map(str, range(257)))), "1..256 choices"),
    (lambda: StructuredOutputParams(KIND.CHOICE, choices=("a", "")), "1..1024 characters"),
    (lambda: StructuredOutputParams(KIND.CHOICE, choices=()), "1..256 choices"),
])
def test_sizes_are_bounded_before_anything_parses_them(make, words):
    with pytest.raises(InvalidRequestError) as exc_info:
        make()
    assert words in str(exc_info.value)


def test_a_costly_regex_is_bounded_by_the_lexer_fuel(compiler):
    """Nested counted repetitions (10^8 states unrolled) took 3-5 s under llguidance's default fuel."""
    started = time.monotonic()
    try:
        compiler.compile(StructuredOutputParams(KIND.REGEX, "((((a{100}){100}){100}){100})"))
    except InvalidRequestError:
        pass
    assert time.monotonic() - started < 2.0


def test_the_cache_is_bounded_and_reused(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), GrammarLimits(cache_size=2))
    first = compiler.compile(StructuredOutputParams(KIND.REGEX, "a+"))
    assert compiler.compile(StructuredOutputParams(KIND.REGEX, "a+")) is first
    for regex in ("b+", "c+", "d+"):
        compiler.compile(StructuredOutputParams(KIND.REGEX, regex))
    assert compiler.cached() == 2
    assert compiler.compile(StructuredOutputParams(KIND.REGEX, "a+")) is not first


def _row_mask(matcher, vocab: int) -> torch.Tensor:
    """A matcher's next-token mask as [V] bool, through llguidance's own bytes (not our unpacking)."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = torch.tensor([(int(words[t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
    return bits


def test_verify_rows_are_the_masks_of_decoding_one_token_at_a_time(compiler, tokenizer):
    vocab = len(tokenizer) + 8
    params = schema(SCHEMAS[0], disable_any_whitespace=True)
    valid = tokenizer.encode('{"name":"ab","ok":true}')
    grammar = compiler.compile(params).new_sequence()
    for token in valid[:3]:
        assert grammar.accept(token)
    draft = valid[3:7]
    forbidden = tokenizer.encode("}")[0]
    cases = [(draft, len(draft)), (draft[:2] + [forbidden] + draft[3:], 2), ([forbidden], 0)]
    for case, kept in cases:
        logits = torch.randn(len(case) + 1, vocab)
        before = logits.clone()
        spans = constrain_rows(logits, [(0, len(case) + 1, case)], [grammar])
        assert spans == [(0, kept + 1, case[:kept])]
        reference = compiler.compile(params).new_sequence()  # decoding one token at a time
        for token in valid[:3]:
            reference.accept(token)
        for row in range(kept + 1):
            allowed = _row_mask(reference._matcher, vocab)
            assert not allowed[len(tokenizer):].any(), "ids past the tokenizer are never allowed"
            assert torch.equal(logits[row][allowed], before[row][allowed])
            assert torch.isneginf(logits[row][~allowed]).all()
            if row < kept:
                reference.accept(case[row])
        assert torch.equal(logits[kept + 1:], before[kept + 1:]), "rows past a forbidden draft are left alone"
    for case, kept in cases:  # the cut the engine makes before the forward: the same
        assert grammar.valid_prefix(case) == kept
    # the matcher was rolled back: it still takes the rest of the valid output
    for token in valid[3:]:
        assert grammar.accept(token)
    assert grammar.accept(tokenizer.eos_token_id) and grammar.terminated


def test_unconstrained_rows_are_untouched(compiler, tokenizer):
    vocab = len(tokenizer) + 8
    grammar = compiler.compile(StructuredOutputParams(KIND.CHOICE, choices=("yes", "no"))).new_sequence()
    logits = torch.randn(5, vocab)
    before = logits.clone()
    spans = [(0, 3, [7, 9]), (3, 4, []), (4, 5, [])]
    out = constrain_rows(logits, spans, [None, grammar, None])
    assert out[0] == spans[0] and out[2] == spans[2]
    assert torch.equal(logits[[0, 1, 2, 4]], before[[0, 1, 2, 4]])
    assert torch.isneginf(logits[3]).sum() >= vocab - 2


def test_sampled_verify_keeps_the_constrained_distribution(compiler, tokenizer):
    """Drafts from a drafter that ignores the grammar (some forbidden), masked rows, the rejection
    sampler: the first emitted token follows the target's distribution restricted to the grammar
    (chi-square at significance 0.001, 4 degrees of freedom)."""
    from target_service.sampling import SamplingSpec, make_generator
    from target_service.spec_decode import verify_tokens

    letters = ("a", "b", "c", "d", "e")
    ids = [tokenizer.convert_tokens_to_ids(c) for c in letters]
    grammar = compiler.compile(StructuredOutputParams(KIND.CHOICE, choices=letters)).new_sequence()
    gen = make_generator(11, torch.device("cpu"))
    logits = torch.randn(2, len(tokenizer) + 8, generator=make_generator(3, torch.device("cpu"))) * 2  # K = 1
    proposals = torch.tensor(ids[:2] + [tokenizer.convert_tokens_to_ids(c) for c in ("x", "}")])  # half forbidden
    counts = torch.zeros(len(ids))
    for _ in range(4000):
        rows = logits.clone()
        draft = [int(proposals[torch.randint(len(proposals), (1,), generator=gen)])]
        [(lo, hi, kept)] = constrain_rows(rows, [(0, 2, draft)], [grammar])
        first = verify_tokens(kept, rows[lo:hi], SamplingSpec(temperature=1.0), gen)[0]
        counts[ids.index(first)] += 1
    expected = torch.softmax(logits[0, ids], dim=-1)
    chi_square = float(((counts - expected * counts.sum()) ** 2 / (expected * counts.sum())).sum())
    assert chi_square < 18.467, (counts, expected)


def test_a_broken_matcher_leaves_only_the_end_allowed(compiler, tokenizer):
    """A matcher in error (a mask past its fuel, say) must not leave a row of -inf (NaN
    probabilities would fail the whole batch's step): its row allows EOS alone, and the engine
    ends that sequence (ABORT) when it sees the grammar broken."""
    grammar = compiler.compile(StructuredOutputParams(KIND.CHOICE, choices=("yes",))).new_sequence()
    assert not grammar.accept(tokenizer.encode("}")[0])
    logits = torch.randn(2, len(tokenizer) + 8)
    assert constrain_rows(logits, [(0, 2, [5])], [grammar]) == [(0, 1, [])]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert grammar.broken


# ---------------------------------------------------------------- real processes


def structured(kind: str, **fields) -> pb.StructuredOutput:
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=fields.pop("choices")), **fields)
    return pb.StructuredOutput(**{kind: fields.pop("value")}, **fields)


def cases() -> list[tuple[str, pb.StructuredOutput]]:
    """(prompt, structured output): every schema on two prompts, a regex, a choice list."""
    out = []
    for i, value in enumerate(SCHEMAS):
        for prompt in (PROMPTS[i], PROMPTS[i + 7]):
            out.append((prompt, structured("json_schema", value=json.dumps(value), disable_any_whitespace=True)))
    out.append((PROMPTS[15], structured("regex", value=REGEX)))
    out.append((PROMPTS[16], structured("choice", choices=CHOICES)))
    out.append((PROMPTS[17], structured("json_object", value=True, disable_any_whitespace=True)))
    return out


def generate(address: str, prompt: str, so: pb.StructuredOutput, **sampling) -> tuple[list[int], pb.Complete]:
    request = pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=MAX_TOKENS), structured_output=so,
                                 sampling=pb.SamplingParams(**sampling))
    return stream_tokens(address, request)


def run_cases(address: str, concurrency: int, **sampling) -> list[tuple[list[int], pb.Complete]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda case: generate(address, *case, **sampling), cases()))


def check_valid(tokenizer, results) -> None:
    """Every schema's output parses and validates; the regex and the choice match whole."""
    for (_, so), (tokens, complete) in zip(cases(), results):
        text = tokenizer.decode(tokens, skip_special_tokens=True)  # a grammar may end with EOS
        kind = so.WhichOneof("constraint")
        if kind == "json_object":  # unbounded: a random model may run to max_tokens inside a string
            assert text.startswith("{")
            if complete.finish_reason == pb.FINISH_REASON_STOP:
                assert isinstance(json.loads(text), dict), text
            continue
        assert complete.finish_reason == pb.FINISH_REASON_STOP, (kind, text)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), json.loads(so.json_schema))
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES, text


@pytest.fixture(scope="module")
def models(spec_models):
    """The draft LM is a copy of the target; DFlash is the reference package's (tests/tiny_models.py)."""
    return spec_models


def target_args(model: Path, shm_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--port", "0", "--shm-dir", str(shm_dir), "--kv-cache-dtype", "float32",
            "--num-pages", "256", "--page-size", "8", "--max-num-batched-tokens", "128", *extra]


@pytest.fixture(scope="module", params=DRAFTERS)
def drafter(request, models, tmp_path_factory):
    """A drafter process of each kind (K = 4); its target keeps the pool in the drafter's --shm-dir."""
    tmp = tmp_path_factory.mktemp(f"so-drafter-{request.param}")
    model = {"ngram": [], "draft_model": ["--model", str(models.draft_lm), "--dtype", "float32"],
             "dflash": ["--model", str(models.dflash)]}[request.param]
    args = ["--kind", request.param, *model, "--target-model", str(models.target), "--port", "0",
            "--num-speculative-tokens", "4", "--shm-dir", str(tmp)]
    service = Service("draft_service.cli", args, tmp / "drafter.log")
    try:
        service.wait_serving()
        yield request.param, service, tmp
    finally:
        service.kill()


@pytest.fixture(scope="module")
def target_only(models, tmp_path_factory):
    """A target without a drafter (float32 KV), serving for the module."""
    tmp = tmp_path_factory.mktemp("so-target-only")
    shm = private_shm_dir()
    target = Service("target_service.cli", target_args(models.target, shm), tmp / "target.log")
    try:
        yield target.wait_serving(), target
    finally:
        stopped = target.stop()  # the shm folder is removed whatever this says (it was left behind)
        leftovers = list(shm.iterdir())
        shutil.rmtree(shm, ignore_errors=True)
    assert stopped == 0, target.log()
    assert not leftovers, f"the pool file outlived the target: {leftovers}"


@pytest.fixture(scope="module")
def reference(target_only) -> list[tuple[list[int], pb.Complete]]:
    """Target-only constrained greedy decoding of every case."""
    return run_cases(target_only[0], 4)


@pytest.fixture(scope="module")
def hf_tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.target)


@pytest.mark.slow
def test_target_only_output_is_valid(reference, hf_tokenizer):
    check_valid(hf_tokenizer, reference)


@pytest.mark.slow
def test_speculative_constrained_output_equals_target_only(models, reference, drafter, hf_tokenizer, tmp_path):
    kind, drafter_service, shm_dir = drafter
    # drafts asked every step (fixed K), whatever their acceptance
    target = Service("target_service.cli", target_args(models.target, shm_dir, "--drafter", drafter_service.address,
                                                       "--speculative-policy", "fixed"), tmp_path / "target.log")
    try:
        address = target.wait_serving()
        for concurrency in (1, 8):
            results = run_cases(address, concurrency)
            for i, ((tokens, _), (ref, _)) in enumerate(zip(results, reference)):
                assert tokens == ref, f"{kind}, concurrency {concurrency}, case {i}"
            check_valid(hf_tokenizer, results)
            drafted = sum(c.usage.draft_tokens for _, c in results)
            accepted = sum(c.usage.accepted_tokens for _, c in results)
            assert drafted > 0, f"{kind}: nothing was speculated\n{target.log()}"
            assert accepted > 0, f"{kind}: no draft was ever accepted"
        # sampled: every output still matches its grammar
        check_valid(hf_tokenizer, run_cases(address, 8, temperature=0.9, seed=7))
        wait_idle(address)
    finally:
        assert target.stop() == 0, target.log()


@pytest.mark.slow
@pytest.mark.parametrize("so, field, words", [
    (pb.StructuredOutput(regex="(a"), "structured_output.regex", "cannot be compiled"),
    (pb.StructuredOutput(json_schema="{"), "structured_output.json_schema", "not valid JSON"),
    (pb.StructuredOutput(json_schema=json.dumps(_deep(100))), "structured_output.json_schema", "deeper than 32"),
    (pb.StructuredOutput(json_schema="x" * (64 * 1024 + 1)), "structured_output.json_schema", "65536 bytes"),
    (pb.StructuredOutput(json_schema='{"type": "strnig"}'), "structured_output.json_schema", "strnig"),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=[str(i) for i in range(300)])), "structured_output.choice",
     "1..256"),
    (pb.StructuredOutput(json_object=False), "structured_output.json_object", "must be true"),
    (pb.StructuredOutput(disable_any_whitespace=True), "structured_output", "set one of"),
])
def test_bad_structured_output_is_invalid_argument(target_only, so, field, words):
    address, _ = target_only
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), structured_output=so)
        with pytest.raises(grpc.RpcError) as exc_info:
            list(stub.Generate(request, timeout=60))
    assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc_info.value.details().startswith(f"{field}: ") and words in exc_info.value.details()
    tokens, complete = generate(address, PROMPTS[0], structured("choice", choices=["yes", "no"]))
    assert complete.finish_reason == pb.FINISH_REASON_STOP  # still serving
    wait_idle(address)


# ---------------------------------------------------------------- the gateway, with the official openai client


@pytest.fixture(scope="module")
def gateway(target_only, tmp_path_factory):
    proc = Service("splitspec.gateway.cli", ["--target", target_only[0], "--port", "0"],
                   tmp_path_factory.mktemp("so-gateway") / "gateway.log", metrics_flag=False)
    try:
        proc.wait_listening()
        yield proc.address
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(gateway):
    with openai_client(gateway, timeout=120) as c:
        yield c


COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model would pad JSON forever


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _grpc_chat_text(address: str, prompt: str, so: pb.StructuredOutput) -> str:
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
                                 sampling=pb.SamplingParams(temperature=0.0), stop=pb.StopParams(max_tokens=MAX_TOKENS),
                                 structured_output=so)
    with grpc.insecure_channel(address) as channel:
        return "".join(r.chunk.text for r in pb_grpc.GenerationStub(channel).Generate(request, timeout=120)
                       if r.HasField("chunk"))


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 3])
def test_response_format_json_schema_through_the_openai_client(target_only, client, models, i):
    fmt = {"type": "json_schema", "json_schema": {"name": f"schema_{i}", "schema": SCHEMAS[i], "strict": True}}
    reply = client.chat.completions.create(model=str(models.target), messages=_chat(PROMPTS[i]), temperature=0,
                                           max_tokens=MAX_TOKENS, response_format=fmt, extra_body=COMPACT)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])
    so = structured("json_schema", value=json.dumps(SCHEMAS[i]), disable_any_whitespace=True)
    assert choice.message.content == _grpc_chat_text(target_only[0], PROMPTS[i], so)


@pytest.mark.slow
def test_parse_with_a_pydantic_model_through_the_openai_client(client, models):
    """The SDK's own path: a pydantic model becomes a strict json_schema, the reply is parsed back."""
    from typing import Literal

    from pydantic import BaseModel

    class Reading(BaseModel):
        label: Literal["red", "green", "blue"]
        ok: bool

    for stream in (False, True):
        if stream:
            with client.chat.completions.stream(model=str(models.target), messages=_chat(PROMPTS[2]),
                                                temperature=0, max_tokens=MAX_TOKENS, response_format=Reading,
                                                extra_body=COMPACT) as events:
                parsed = events.get_final_completion().choices[0].message.parsed
        else:
            reply = client.chat.completions.parse(model=str(models.target), messages=_chat(PROMPTS[2]),
                                                  temperature=0, max_tokens=MAX_TOKENS, response_format=Reading,
                                                  extra_body=COMPACT)
            parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, Reading)


@pytest.mark.slow
def test_json_object_and_vllm_structured_outputs_through_the_openai_client(client, models):
    reply = client.chat.completions.create(model=str(models.target), messages=_chat(PROMPTS[4]), temperature=0,
                                           max_tokens=MAX_TOKENS, response_format={"type": "json_object"},
                                           extra_body=COMPACT)
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    reply = client.completions.create(model=str(models.target), prompt=PROMPTS[5], temperature=0, max_tokens=16,
                                      extra_body={"structured_outputs": {"choice": CHOICES}})
    assert reply.choices[0].text in CHOICES and reply.choices[0].finish_reason == "stop"
    reply = client.completions.create(model=str(models.target), prompt=PROMPTS[6], temperature=0.8, seed=3,
                                      max_tokens=16, extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, reply.choices[0].text), reply.choices[0].text
    reply = client.completions.create(model=str(models.target), prompt=PROMPTS[7], temperature=0,
                                      max_tokens=MAX_TOKENS, stream=False,
                                      extra_body={"structured_outputs": {"json": SCHEMAS[2],
                                                                         "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMAS[2])


@pytest.mark.slow
@pytest.mark.parametrize("endpoint, fields, param, words", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format.json_schema.schema", "strnig"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema is required"),
    ("completions", {"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs.regex",
     "cannot be compiled"),
    ("completions", {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs",
     "one constraint"),
    ("chat", {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs", "one constraint"),
    ("completions", {"extra_body": {"structured_outputs": {"choice": [str(i) for i in range(300)]}}},
     "structured_outputs.choice", "1..256"),
])
def test_bad_structured_output_is_400_naming_the_parameter(client, models, endpoint, fields, param, words):
    import openai

    with pytest.raises(openai.BadRequestError) as exc_info:
        create_for_x(client, endpoint, str(models.target), 2, fields)
    error = exc_info.value.body if "message" in (exc_info.value.body or {}) else exc_info.value.body["error"]
    assert error["param"] == param and words in error["message"], error
