"""Protobuf messages ↔ `api_types` dataclasses.

Conversion only maps fields; the dataclasses validate themselves and name the public
field (e.g. "sampling.top_p") in the `InvalidRequestError` they raise. The only checks
here are the ones that need the tokenizer (the input oneof, the chat template).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from common.kv_layout import KVLayout, LayerSpec, StagingSpec
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import kv_layout_pb2 as kv_pb
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


# ---------------------------------------------------------------- KV layout (both directions)


def _enum_value(enum, prefix: str, name: str) -> int:
    return enum.Value(f"{prefix}{name.upper()}")


def _enum_name(enum, prefix: str, value: int, *, lower: bool) -> str:
    name = enum.Name(value).removeprefix(prefix)
    if name == "UNSPECIFIED":
        raise ValueError(f"{enum.DESCRIPTOR.name} is unspecified")
    return name.lower() if lower else name


def kv_layout_to_proto(layout: KVLayout) -> kv_pb.KVLayout:
    msg = kv_pb.KVLayout(
        order=_enum_value(kv_pb.PageOrder, "PAGE_ORDER_", layout.order),
        page_size=layout.page_size,
        kv_dtype=_enum_value(kv_pb.KVDtype, "KV_DTYPE_", layout.kv_dtype),
        num_pages=layout.num_pages,
        layers=[layer_spec_to_proto(spec) for spec in layout.layers],
        target_id=layout.target_id,
        epoch=layout.epoch,
        total_bytes=layout.total_bytes,
    )
    if layout.staging is not None:
        msg.staging.CopyFrom(staging_spec_to_proto(layout.staging))
    return msg


def layer_spec_to_proto(spec: LayerSpec) -> kv_pb.LayerSpec:
    return kv_pb.LayerSpec(
        owner=_enum_value(kv_pb.LayerOwner, "LAYER_OWNER_", spec.owner),
        index=spec.index,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        offset=spec.offset,
        k_scale=spec.k_scale,
        v_scale=spec.v_scale,
    )


def staging_spec_to_proto(spec: StagingSpec) -> kv_pb.StagingSpec:
    dtype = _enum_value(kv_pb.KVDtype, "KV_DTYPE_", spec.dtype)
    return kv_pb.StagingSpec(rows=spec.rows, width=spec.width, dtype=dtype, offset=spec.offset,
                             layer_ids=list(spec.layer_ids))


def kv_layout_from_proto(msg: kv_pb.KVLayout) -> KVLayout:
    """The inverse of `kv_layout_to_proto`; raises ValueError for unspecified enums."""
    return KVLayout(
        order=_enum_name(kv_pb.PageOrder, "PAGE_ORDER_", msg.order, lower=False),
        page_size=msg.page_size,
        kv_dtype=_enum_name(kv_pb.KVDtype, "KV_DTYPE_", msg.kv_dtype, lower=True),
        num_pages=msg.num_pages,
        layers=tuple(layer_spec_from_proto(spec) for spec in msg.layers),
        staging=staging_spec_from_proto(msg.staging) if msg.HasField("staging") else None,
        target_id=msg.target_id,
        epoch=msg.epoch,
        total_bytes=msg.total_bytes,
    )


def layer_spec_from_proto(msg: kv_pb.LayerSpec) -> LayerSpec:
    return LayerSpec(
        owner=_enum_name(kv_pb.LayerOwner, "LAYER_OWNER_", msg.owner, lower=True),
        index=msg.index,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        offset=msg.offset,
        k_scale=msg.k_scale,
        v_scale=msg.v_scale,
    )


def staging_spec_from_proto(msg: kv_pb.StagingSpec) -> StagingSpec:
    dtype = _enum_name(kv_pb.KVDtype, "KV_DTYPE_", msg.dtype, lower=True)
    return StagingSpec(rows=msg.rows, width=msg.width, dtype=dtype, offset=msg.offset,
                       layer_ids=tuple(msg.layer_ids))
