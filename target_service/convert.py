"""Protobuf messages ↔ `api_types` dataclasses.

Conversion only maps fields; the dataclasses validate themselves and name the public
field (e.g. "sampling.top_p") in the `InvalidRequestError` they raise. The only checks
here are the ones that need the tokenizer (the input oneof, the chat template) and the
prompt's length against the model's, which names the input field and comes before any
tokenizing it can spare (`PromptLimits.max_text_bytes`, see prompt_bound.py). Text a client
wrote is tokenized as plain text: it never becomes a special token (prompt_tokens.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from common.layout_proto import kv_layout_to_proto
from splitspec.v1 import generation_pb2 as pb
from target_service.api_types import (
    MAX_LOGIT_BIAS_ENTRIES,
    EngineRequest,
    InvalidRequestError,
    LogprobParams,
    ModelInfo,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
    SpeculationParams,
    StopParams,
    StructuredOutputKind,
    StructuredOutputParams,
    TokenLogprob,
    Usage,
    check_prompt_fits,
)
from target_service.prompt_tokens import PromptTokenizer

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit: the model length and, when provable for the tokenizer, the
    longest text that can still fit it (a longer one is refused before tokenizing)."""

    max_model_len: int
    max_text_bytes: int | None = None  # None: no early refusal

    @classmethod
    def of(cls, tokenizer, info: ModelInfo) -> PromptLimits:
        from target_service.prompt_bound import text_byte_bound

        return cls(info.max_model_len, text_byte_bound(tokenizer, info.max_model_len))


@dataclass(frozen=True)
class RequestDefaults:
    """Server-side defaults for fields a client may leave unset."""

    max_tokens: int = 256  # capped at what fits in the model length after the prompt

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"default max_tokens must be positive, got {self.max_tokens}")


# ---------------------------------------------------------------- requests


def engine_request(msg: pb.GenerateRequest, tokenizer: PromptTokenizer, model_info: ModelInfo,
                   defaults: RequestDefaults = RequestDefaults(), limits: PromptLimits | None = None) -> EngineRequest:
    """A validated `EngineRequest` from a `GenerateRequest`."""
    prompt = prompt_token_ids(msg, tokenizer, limits or PromptLimits(model_info.max_model_len))
    return EngineRequest(
        request_id=request_id(msg.request_id),
        prompt_token_ids=prompt,
        sampling=sampling_params(msg.sampling),
        stop=stop_params(msg.stop, default_max_tokens(len(prompt), model_info, defaults)),
        speculation=speculation_params(msg.speculation),
        cache_salt=cache_salt(msg.cache_salt),
        structured_output=structured_output_params(msg),
        logprobs=logprob_params(msg.logprobs),
        n=msg.n or 1,
    )


def cache_salt(given: str) -> str:
    if len(given) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError("cache_salt", f"must have at most {MAX_CACHE_SALT_CHARS} characters")
    return given


def request_id(given: str) -> str:
    if len(given) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"must have at most {MAX_REQUEST_ID_CHARS} characters")
    if not all(" " <= c <= "~" for c in given):  # it is echoed in gRPC metadata, which allows only these
        raise InvalidRequestError("request_id", "must be printable ASCII (it is echoed as splitspec-request-id "
                                  "metadata)")
    return given or uuid.uuid4().hex


def prompt_token_ids(msg: pb.GenerateRequest, tokenizer: PromptTokenizer, limits: PromptLimits) -> tuple[int, ...]:
    """The prompt's ids, refused naming the input field when it cannot fit the model."""
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "one of text, token_ids or chat is required")
    if msg.parse_special_tokens and kind != "text":
        raise InvalidRequestError("parse_special_tokens", f"applies to a text prompt only, not to {kind}")
    if kind == "token_ids":
        return _token_ids(msg.token_ids, limits)
    if kind == "text":
        ids = _encode_text(msg.text, tokenizer, limits, msg.parse_special_tokens)
    else:
        ids = _encode_chat(msg.chat, tokenizer, limits)
    check_prompt_fits(f"input.{kind}", len(ids), limits.max_model_len)
    return ids



def _check_text_fits(field_name: str, text: str, limits: PromptLimits) -> None:
    """Refuse text too long to fit before tokenizing it (a character is at least a byte)."""
    limit = limits.max_text_bytes
    if limit is None or (len(text) <= limit and len(text.encode()) <= limit):
        return
    _refuse_text(field_name, limits)


def _refuse_text(field_name: str, limits: PromptLimits) -> None:
    limit = limits.max_text_bytes
    raise InvalidRequestError(field_name, f"more than {limit} bytes of text cannot fit the model length "
                              f"{limits.max_model_len} with this tokenizer (refused before tokenizing)")


def _encode_text(text: str, tokenizer: PromptTokenizer, limits: PromptLimits,
                 parse_special_tokens: bool) -> tuple[int, ...]:
    if not text:
        raise InvalidRequestError("input.text", "must not be empty")
    _check_text_fits("input.text", text, limits)
    return tokenizer.text(text, parse_special_tokens)


def _token_ids(ids: pb.TokenIds, limits: PromptLimits) -> tuple[int, ...]:
    if not ids.ids:
        raise InvalidRequestError("input.token_ids", "must not be empty")
    check_prompt_fits("input.token_ids", len(ids.ids), limits.max_model_len)  # before copying them
    return tuple(ids.ids)  # the engine checks them against the vocabulary


def _encode_chat(chat: pb.ChatMessages, tokenizer: PromptTokenizer, limits: PromptLimits) -> tuple[int, ...]:
    if not chat.messages:
        raise InvalidRequestError("input.chat.messages", "must not be empty")
    messages = [(m.role, m.content) for m in chat.messages]
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        pieces = tokenizer.render_chat(messages, add_prompt)
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja raises for roles or orders a template refuses
        raise InvalidRequestError("input.chat", f"the chat template rejected the messages: {exc}") from exc
    if limits.max_text_bytes is not None and pieces.text_bytes() > limits.max_text_bytes:
        _refuse_text("input.chat", limits)  # the rendered text is what gets tokenized
    ids = tokenizer.chat_ids(pieces)
    if not ids:
        raise InvalidRequestError("input.chat", "the rendered chat is empty")
    return ids


def default_max_tokens(prompt_len: int, model_info: ModelInfo, defaults: RequestDefaults) -> int:
    """The server default, shortened to what fits after the prompt (at least 1)."""
    return max(1, min(defaults.max_tokens, model_info.max_model_len - prompt_len))


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=_logit_bias(msg),
        banned_token_ids=tuple(msg.banned_token_ids),
    )


def _logit_bias(msg: pb.SamplingParams) -> tuple[tuple[int, float], ...]:
    """The map as sorted pairs, its size bounded before it is copied."""
    if len(msg.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                                  f"got {len(msg.logit_bias)}")
    return tuple(sorted(msg.logit_bias.items()))


def stop_params(msg: pb.StopParams, default_max: int) -> StopParams:
    return StopParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
    )


def logprob_params(msg: pb.LogprobParams) -> LogprobParams:
    return LogprobParams(completion=msg.completion, top=msg.top, prompt=msg.prompt, prompt_top=msg.prompt_top)


def speculation_params(msg: pb.SpeculationParams) -> SpeculationParams:
    return SpeculationParams(disable=msg.disable, num_speculative_tokens=msg.num_speculative_tokens)


def structured_output_params(msg: pb.GenerateRequest) -> StructuredOutputParams | None:
    """The request's grammar, None when unset (an empty StructuredOutput names no constraint: refused)."""
    if not msg.HasField("structured_output"):
        return None
    so = msg.structured_output
    kind = so.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequestError("structured_output", "set one of json_schema, json_object, regex or choice")
    if kind == "json_object" and not so.json_object:
        raise InvalidRequestError("structured_output.json_object", "must be true when set")
    return StructuredOutputParams(
        kind=StructuredOutputKind(kind),
        spec=so.json_schema if kind == "json_schema" else so.regex if kind == "regex" else "",
        choices=tuple(so.choice.choices) if kind == "choice" else (),
        disable_any_whitespace=so.disable_any_whitespace,
    )


# ---------------------------------------------------------------- responses


class TokenTexts:
    """Each token id decoded alone, as logprobs name their tokens; memoized (at most a
    vocabulary's worth of short strings)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


PROMPT_LOGPROBS_PER_CHUNK = 512  # a long prompt's logprobs (21 tokens a position) spread over messages


def responses(output: RequestOutput, token_text: TokenTexts) -> list[pb.GenerateResponse]:
    """Chunks of the prompt's logprobs (at most PROMPT_LOGPROBS_PER_CHUNK positions each, so no
    message outgrows a client's 4 MiB default), a Chunk for new tokens or text, then a Complete
    when the output is its sequence's last one."""
    out = []
    prompt = output.prompt_logprobs or ()
    for start in range(0, max(0, len(prompt) - PROMPT_LOGPROBS_PER_CHUNK), PROMPT_LOGPROBS_PER_CHUNK):
        chunk = pb.Chunk(index=output.index, prompt_logprobs=[
            position_logprobs(entry, token_text) for entry in prompt[start : start + PROMPT_LOGPROBS_PER_CHUNK]])
        out.append(pb.GenerateResponse(chunk=chunk, request_id=output.request_id))
    last_prompt = prompt[len(out) * PROMPT_LOGPROBS_PER_CHUNK :]
    if output.token_ids or output.text or last_prompt:
        chunk = pb.Chunk(token_ids=output.token_ids, text=output.text, index=output.index,
                         logprobs=[position_logprobs(entry, token_text) for entry in output.logprobs or ()],
                         prompt_logprobs=[position_logprobs(entry, token_text) for entry in last_prompt])
        out.append(pb.GenerateResponse(chunk=chunk, request_id=output.request_id))
    if output.finish_reason is not None:
        complete = pb.Complete(finish_reason=int(output.finish_reason), usage=usage(output.usage or Usage()),
                               index=output.index)
        out.append(pb.GenerateResponse(complete=complete, request_id=output.request_id))
    return out


def position_logprobs(entry: PositionLogprobs, token_text: TokenTexts) -> pb.PositionLogprobs:
    return pb.PositionLogprobs(chosen=token_logprob(entry.chosen, token_text),
                               top=[token_logprob(t, token_text) for t in entry.top])


def token_logprob(entry: TokenLogprob, token_text: TokenTexts) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank or 0,
                           token=token_text(entry.token_id))


def usage(u: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
        num_drafts=u.num_drafts,
        draft_tokens=u.draft_tokens,
        accepted_tokens=u.accepted_tokens,
        accepted_per_position=list(u.accepted_per_position),
    )


def model_info(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model_id=info.model_id,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        eos_token_ids=info.eos_token_ids,
        dtype=info.dtype,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
    )


def server_info(info: dict) -> pb.ServerInfo:
    """`AsyncEngine.server_info()` as a ServerInfo; kv_layout stays unset until resolved."""
    msg = pb.ServerInfo(
        num_pages=info.get("num_pages", 0),
        free_pages=info.get("free_pages", 0),
        running=info.get("running", 0),
        waiting=info.get("waiting", 0),
        drafter=drafter_state(info.get("drafter") or {}),
        prefix_cache=prefix_cache_state(info.get("prefix_cache") or {}),
    )
    if info.get("kv_layout") is not None:
        msg.kv_layout.CopyFrom(kv_layout_to_proto(info["kv_layout"]))
    return msg


def prefix_cache_state(state: dict) -> pb.PrefixCacheState:
    """`PageManager.describe_cache()` as a PrefixCacheState."""
    return pb.PrefixCacheState(enabled=state.get("enabled", False), cached_pages=state.get("cached_pages", 0),
                               evictable_pages=state.get("evictable_pages", 0), query_tokens=state.get("queries", 0),
                               hit_tokens=state.get("hits", 0), evictions=state.get("evictions", 0))


def drafter_state(state: dict) -> pb.DrafterState:
    """The engine's drafter dict ({"state": "none"|"connecting"|"ready"|"unavailable", ...})."""
    return pb.DrafterState(
        status=_drafter_status(state.get("state", "")),
        address=state.get("address", ""),
        kind=state.get("kind", ""),
        num_speculative_tokens=state.get("num_speculative_tokens", 0),
        epoch=state.get("epoch", 0),
        detail=state.get("detail", ""),
        propose_transport=state.get("propose_transport", ""),
    )


def _drafter_status(name: str) -> int:
    key = f"STATUS_{name.upper()}"
    statuses = pb.DrafterState.Status
    return statuses.Value(key) if key in statuses.keys() else pb.DrafterState.STATUS_UNSPECIFIED
