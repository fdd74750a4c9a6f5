"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
matching HTTP status, from the gateway's own checks and from the target's gRPC status."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from splitspec.gateway.protocol import ErrorBody, ErrorResponse

# HTTP status and OpenAI error type for each gRPC status the target answers with
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.UNAUTHENTICATED: (502, "upstream_error"),
    grpc.StatusCode.PERMISSION_DENIED: (502, "upstream_error"),
}
DEFAULT_HTTP = (502, "upstream_error")

# The target names fields by their path in GenerateRequest; clients know OpenAI's names.
PROTO_TO_OPENAI: dict[str, str] = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "stop.max_tokens": "max_tokens",
    "stop.stop": "stop",
    "stop.stop_token_ids": "stop_token_ids",
    "stop.ignore_eos": "ignore_eos",
    "stop.min_tokens": "min_tokens",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.min_p": "min_p",
    "sampling.logit_bias": "logit_bias",
    "sampling.banned_token_ids": "banned_token_ids",
    "logprobs.top": "logprobs",  # completions; chat's is top_logprobs (validation.param_aliases)
    "logprobs.prompt_top": "logprobs",
    "speculation.num_speculative_tokens": "speculation.num_speculative_tokens",
    "speculation.disable": "speculation.disable",
    "input.text": "prompt",
    "input.token_ids": "prompt",
    "input.chat.messages": "messages",
    "input.chat": "messages",
    "input": "prompt",
}


class OpenAIError(Exception):
    """An error answered as OpenAI's error JSON with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.close = close  # close the connection after answering (the rest of the request is unread)

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={"connection": "close"} if self.close else None)


def invalid(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, None)


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, "unsupported_parameter")


def openai_param(details: str, aliases: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(OpenAI parameter, message) for a target's "field.path: message" error detail;
    `aliases` renames a parameter to the one the request used (chat: prompt → messages)."""
    field, sep, rest = details.partition(": ")
    if not sep or " " in field:
        return None, details
    param = PROTO_TO_OPENAI.get(field, field)
    param = (aliases or {}).get(param, param)
    return param, f"{param}: {rest}" if param != field else details


def from_rpc_error(exc: grpc.aio.AioRpcError, aliases: dict[str, str] | None = None) -> OpenAIError:
    """The OpenAI error for a failed call to the target."""
    code = exc.code()
    status, type_ = GRPC_TO_HTTP.get(code, DEFAULT_HTTP)
    details = exc.details() or code.name
    param = None
    if status == 400:
        param, details = openai_param(details, aliases)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"the request did not finish within its deadline (--request-timeout-s): {details}"
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"the target is unavailable: {details}"
    return OpenAIError(status, details, type_, param, code.name.lower())
