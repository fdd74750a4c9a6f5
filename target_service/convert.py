"""Protobuf messages ↔ `api_types` dataclasses.

Conversion only maps fields; the dataclasses validate themselves and name the public
field (e.g. "sampling.top_p") in the `InvalidRequestError` they raise. The only checks
here are the ones that need the tokenizer (the input oneof, the chat template).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from common.layout_proto import kv_layout_to_proto
from splitspec.v1 import generation_pb2 as pb
from target_service.api_types import (
    EngineRequest,
    InvalidRequestError,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    SpeculationParams,
    StopParams,
    Usage,
)

MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class RequestDefaults:
    """Server-side defaults for fields a client may leave unset."""

    max_tokens: int = 256  # capped at what fits in the model length after the prompt

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"default max_tokens must be positive, got {self.max_tokens}")


# ---------------------------------------------------------------- requests


def engine_request(msg: pb.GenerateRequest, tokenizer, model_info: ModelInfo,
                   defaults: RequestDefaults = RequestDefaults()) -> EngineRequest:
    """A validated `EngineRequest` from a `GenerateRequest`."""
    prompt = prompt_token_ids(msg, tokenizer)
    return EngineRequest(
        request_id=request_id(msg.request_id),
        prompt_token_ids=prompt,
        sampling=sampling_params(msg.sampling),
        stop=stop_params(msg.stop, default_max_tokens(len(prompt), model_info, defaults)),
        speculation=speculation_params(msg.speculation),
    )


def request_id(given: str) -> str:
    if len(given) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"must have at most {MAX_REQUEST_ID_CHARS} characters")
    if not all(" " <= c <= "~" for c in given):  # it is echoed in gRPC metadata, which allows only these
        raise InvalidRequestError("request_id", "must be printable ASCII (it is echoed as splitspec-request-id "
                                  "metadata)")
    return given or uuid.uuid4().hex


def prompt_token_ids(msg: pb.GenerateRequest, tokenizer) -> tuple[int, ...]:
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "one of text, token_ids or chat is required")
    if kind == "text":
        return _encode_text(msg.text, tokenizer)
    if kind == "token_ids":
        return _token_ids(msg.token_ids)
    return _encode_chat(msg.chat, tokenizer)


def _encode_text(text: str, tokenizer) -> tuple[int, ...]:
    if not text:
        raise InvalidRequestError("input.text", "must not be empty")
    return tuple(tokenizer.encode(text))


def _token_ids(ids: pb.TokenIds) -> tuple[int, ...]:
    if not ids.ids:
        raise InvalidRequestError("input.token_ids", "must not be empty")
    return tuple(ids.ids)  # the engine checks them against the vocabulary


def _encode_chat(chat: pb.ChatMessages, tokenizer) -> tuple[int, ...]:
    if not chat.messages:
        raise InvalidRequestError("input.chat.messages", "must not be empty")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt, tokenize=False)
    except Exception as exc:  # jinja raises for roles or orders a template refuses
        raise InvalidRequestError("input.chat", f"the chat template rejected the messages: {exc}") from exc
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
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
    )


def stop_params(msg: pb.StopParams, default_max: int) -> StopParams:
    return StopParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def speculation_params(msg: pb.SpeculationParams) -> SpeculationParams:
    return SpeculationParams(disable=msg.disable, num_speculative_tokens=msg.num_speculative_tokens)


# ---------------------------------------------------------------- responses


def responses(output: RequestOutput) -> list[pb.GenerateResponse]:
    """A Chunk for new tokens or text, then a Complete when the output is the last one."""
    out = []
    if output.token_ids or output.text:
        chunk = pb.Chunk(token_ids=output.token_ids, text=output.text)
        out.append(pb.GenerateResponse(chunk=chunk, request_id=output.request_id))
    if output.finish_reason is not None:
        complete = pb.Complete(finish_reason=int(output.finish_reason), usage=usage(output.usage or Usage()))
        out.append(pb.GenerateResponse(complete=complete, request_id=output.request_id))
    return out


def usage(u: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
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
    )
    if info.get("kv_layout") is not None:
        msg.kv_layout.CopyFrom(kv_layout_to_proto(info["kv_layout"]))
    return msg


def drafter_state(state: dict) -> pb.DrafterState:
    """The engine's drafter dict ({"state": "none"|"connecting"|"ready"|"unavailable", ...})."""
    return pb.DrafterState(
        status=_drafter_status(state.get("state", "")),
        address=state.get("address", ""),
        kind=state.get("kind", ""),
        num_speculative_tokens=state.get("num_speculative_tokens", 0),
        epoch=state.get("epoch", 0),
        detail=state.get("detail", ""),
    )


def _drafter_status(name: str) -> int:
    key = f"STATUS_{name.upper()}"
    statuses = pb.DrafterState.Status
    return statuses.Value(key) if key in statuses.keys() else pb.DrafterState.STATUS_UNSPECIFIED
