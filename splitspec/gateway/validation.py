"""One validation policy for the OpenAI surface.

- Types are strict (`protocol.Strict`): `"0"` is not a temperature, `true` not a number,
  `"yes"` not a boolean; a wrong type is a 400 naming the field and the value as sent.
- Values are checked as sent, before they become protobuf's 32-bit floats: a temperature of
  1e308 is reported as 1e308 (not as the `inf` it would become), a top_p of 1e-300 as 1e-300
  (not as 0.0). The target checks every field again; its refusals name the OpenAI
  parameter the client used (`max_completion_tokens`, not `max_tokens`).
- A value that is wrong (`n: 0`) is `invalid_request_error`; a value that is valid OpenAI
  but that splitspec does not do (`suffix`, tools, `best_of` other than n) is `unsupported_parameter`.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

import pydantic

from splitspec.gateway.errors import OpenAIError, invalid, unsupported
from splitspec.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    TextPart,
)

FLOAT32_MAX = 3.4028234663852886e38
SENT_CHARS = 80  # how much of a value as sent an error message quotes
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def sent(value: Any) -> str:
    """A value as the client sent it (JSON), shortened (a long list or object by its size:
    never the work of dumping 10,000 messages to quote 80 characters of them)."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"{'an array' if isinstance(value, list) else 'an object'} of {len(value)} items"
    if isinstance(value, str) and len(value) > SENT_CHARS:
        value = value[:SENT_CHARS]
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= SENT_CHARS else text[:SENT_CHARS] + "…"


def invalid_value(param: str, message: str) -> OpenAIError:
    """A value out of its range: the shape of the target's INVALID_ARGUMENT for the same field."""
    return OpenAIError(400, f"{param}: {message}", "invalid_request_error", param, "invalid_argument")


# ---------------------------------------------------------------- pydantic's errors


def _param(loc: tuple) -> str | None:
    """A pydantic error location as a dotted OpenAI parameter, without union member tags."""
    kept = [str(p) for p in loc if isinstance(p, int) or (_IDENTIFIER.match(p) and p not in _TYPE_TAGS)]
    return ".".join(kept) or None


def _most_telling(errors: list[dict]) -> dict:
    """A union reports every member: a member's real complaint (too long, out of range) over
    "should be a valid <other type>", and of those the deepest (the member that matched furthest)."""
    real = [e for e in errors if not e["type"].endswith("_type")]
    return real[0] if real else max(errors, key=lambda e: len(e["loc"]))


def validation_error(exc: pydantic.ValidationError) -> OpenAIError:
    first = _most_telling(exc.errors(include_url=False))
    param = _param(first["loc"])
    if first["type"] == "extra_forbidden":
        return unsupported(param or "body", f"{param}: unknown parameter (splitspec does not support it)")
    if first["type"] == "json_invalid":
        return invalid(None, f"the body is not valid JSON: {first['msg']}")
    message = f"{first['msg']}, got {sent(first['input'])}" if "input" in first else first["msg"]
    return invalid(param, f"{param}: {message}" if param else message)


# ---------------------------------------------------------------- values as sent


def check_float32(param: str, value: float) -> OpenAIError | None:
    """A float the API carries as a 32-bit float must stay what was sent, roughly."""
    if abs(value) > FLOAT32_MAX:
        return invalid_value(param, f"{sent(value)} is too large (at most {FLOAT32_MAX:.7g}, a 32-bit float)")
    if value != 0 and struct.unpack("f", struct.pack("f", value))[0] == 0:
        return invalid_value(param, f"{sent(value)} is too small for a 32-bit float (it would be 0)")
    return None


def check_sampling_values(req: SamplingRequest) -> OpenAIError | None:
    if req.temperature is not None:
        if req.temperature < 0:
            return invalid_value("temperature", f"must be >= 0, got {sent(req.temperature)}")
        if (found := check_float32("temperature", req.temperature)) is not None:
            return found
    if req.top_p is not None:
        if not 0 < req.top_p <= 1:
            return invalid_value("top_p", f"must be in (0, 1], got {sent(req.top_p)}")
        if (found := check_float32("top_p", req.top_p)) is not None:
            return found
    for name in ("n", "best_of"):
        count = getattr(req, name, None)
        if count is not None and count < 1:
            return invalid_value(name, f"must be >= 1, got {count}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2 <= value <= 2:
            return invalid_value(name, f"must be in [-2, 2], got {sent(value)}")
    return check_logit_bias_keys(req.logit_bias or {})


def check_logit_bias_keys(bias: dict[str, float]) -> OpenAIError | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    for key in bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= 2**31 - 1):
            return invalid_value("logit_bias", f"keys must be token ids, got {sent(key)}")
    return None


# ---------------------------------------------------------------- what splitspec does not do


def _unsupported_common(req: SamplingRequest) -> OpenAIError | None:
    if req.stream_options is not None and not req.stream:
        return unsupported("stream_options", "stream_options is only allowed with stream=true")
    return None


def check_common(req: SamplingRequest) -> OpenAIError | None:
    return check_sampling_values(req) or _unsupported_common(req) or check_structured_output(req)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check_structured_output(req: SamplingRequest) -> OpenAIError | None:
    """`response_format` and vLLM's `structured_outputs`: one constraint at most, with what it needs.
    The target compiles it and names what is wrong inside a schema or a regex."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None:
        if fmt.type not in RESPONSE_FORMATS:
            return unsupported("response_format.type", f"response_format.type {sent(fmt.type)} is not supported "
                                                       f"(only {', '.join(map(repr, RESPONSE_FORMATS))})")
        if fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.json_schema is None):
            return invalid("response_format.json_schema", "response_format.json_schema.schema is required with "
                                                          "type 'json_schema'")
        if fmt.type != "json_schema" and fmt.json_schema is not None:
            return invalid("response_format.json_schema", f"response_format.json_schema needs type 'json_schema', "
                                                          f"not {sent(fmt.type)}")
    if so is None:
        return None
    for name in ("grammar", "structural_tag", "whitespace_pattern"):
        if getattr(so, name) is not None:
            return unsupported(f"structured_outputs.{name}", f"structured_outputs.{name} is not supported (json, "
                                                             "regex, choice and json_object are)")
    if so.disable_additional_properties:
        return unsupported("structured_outputs.disable_additional_properties",
                           "structured_outputs.disable_additional_properties is not supported")
    constraints = so.constraints()
    formatted = fmt is not None and fmt.type != "text"
    if len(constraints) > 1 or (formatted and constraints):
        given = constraints + (["response_format"] if formatted else [])
        return invalid("structured_outputs", f"structured_outputs: set one constraint, got {', '.join(given)}")
    if not constraints and not formatted:  # options alone apply to a response_format
        return invalid("structured_outputs", "structured_outputs: set one of json, regex, choice or json_object "
                                             "(or a response_format its options apply to)")
    return None


def check_completion(req: CompletionRequest) -> OpenAIError | None:
    """The first problem of a completion request the schema let through, or None."""
    if (found := check_common(req)) is not None:
        return found
    if req.suffix is not None:
        return unsupported("suffix", "suffix is not supported")
    if req.best_of is not None and req.best_of != (req.n or 1):
        return unsupported("best_of", f"best_of: {req.best_of} is not supported (only best_of = n, which returns "
                                      "every choice)")
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list)):
        if len(req.prompt) != 1:
            return unsupported("prompt", "a batch of several prompts is not supported: send one prompt per request")
    if req.parse_special_tokens and not _text_prompt(req.prompt):
        return invalid("parse_special_tokens", "parse_special_tokens applies to a text prompt only (token ids are "
                                               "taken as they are)")
    return None


def _text_prompt(prompt) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))


def check_chat(req: ChatCompletionRequest) -> OpenAIError | None:
    """The first problem of a chat request the schema let through, or None."""
    if (found := check_common(req)) is not None:
        return found
    if req.top_logprobs is not None and not req.logprobs:
        return invalid("top_logprobs", "top_logprobs: needs logprobs: true")
    for name in ("tools", "tool_choice", "functions", "function_call"):
        if getattr(req, name) not in (None, [], "none"):
            return unsupported(name, f"{name}: tool and function calling is not supported")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        return invalid("max_tokens", "give max_tokens or max_completion_tokens, not both")
    for i, message in enumerate(req.messages):
        if (found := _unsupported_message(i, message)) is not None:
            return found
    return None


def _unsupported_message(i: int, message: ChatMessage) -> OpenAIError | None:
    for name in ("name", "tool_calls", "tool_call_id", "function_call"):
        if getattr(message, name) is not None:
            return unsupported(f"messages.{i}.{name}", f"messages[{i}].{name} is not supported")
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if not isinstance(part, TextPart):
                return unsupported(f"messages.{i}.content.{j}",
                                   f"content parts of type {part.type!r} are not supported (only 'text')")
    return None


def param_aliases(req: SamplingRequest) -> dict[str, str]:
    """How the target's refusals (named after the completion API) map to what this request sent."""
    aliases = _structured_output_aliases(req)
    if not isinstance(req, ChatCompletionRequest):
        return aliases
    aliases |= {"prompt": "messages", "logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    return aliases


def _structured_output_aliases(req: SamplingRequest) -> dict[str, str]:
    """The target's structured_output.* fields as the parameter this request set."""
    if req.structured_outputs is not None:
        return {"structured_output.json_schema": "structured_outputs.json",
                "structured_output.regex": "structured_outputs.regex",
                "structured_output.choice": "structured_outputs.choice",
                "structured_output.json_object": "structured_outputs.json_object"}
    if req.response_format is not None:
        return {"structured_output.json_schema": "response_format.json_schema.schema",
                "structured_output.json_object": "response_format"}
    return {}
