"""OpenAI request and response shapes (pydantic), and what of them splitspec supports.

Request models forbid unknown fields: a parameter the gateway does not know is a 400
naming it, never silently ignored. Known OpenAI parameters that splitspec cannot honour
(`n > 1`, `logprobs`, tools, penalties, ...) are accepted by the schema and refused by
`unsupported_*` with a 400 that says so. Types and the ranges protobuf can hold are
checked here; the value ranges (temperature >= 0, top_p in (0, 1], ...) are the
target's, which answers INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
MAX_LIST_ITEMS = 4096  # stop strings, stop token ids, messages, content parts: bounds the work per request

Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX, strict=True)]
TokenId = Annotated[int, Field(ge=-(2**31), le=INT32_MAX, strict=True)]
Float = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class SpeculationOptions(Strict):
    """splitspec's extra field `speculation` (the gRPC API's SpeculationParams)."""

    disable: bool = False
    num_speculative_tokens: Int32 = 0  # 0: the server's K


class SamplingRequest(Strict):
    """What completions and chat completions share."""

    model: str = Field(max_length=1024)
    max_tokens: Int32 | None = None
    temperature: Float | None = None  # OpenAI's default is 1 (sampling); 0 is greedy
    top_p: Float | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64, strict=True)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_LIST_ITEMS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=1024)  # accepted, used for nothing
    # OpenAI parameters splitspec does not support: refused with a 400 when set
    n: Int32 | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    top_logprobs: Int32 | None = None
    # splitspec's extra fields (vLLM's names where vLLM has them)
    top_k: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST_ITEMS)] | None = None
    speculation: SpeculationOptions | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | list[str] | list[list[TokenId]]
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ContentPart(BaseModel):
    """Any other part (image_url, input_audio, file, ...): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(max_length=64)


class ChatMessage(Strict):
    role: str = Field(max_length=64)
    content: str | Annotated[list[TextPart | ContentPart], Field(max_length=MAX_LIST_ITEMS)] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(max_length=64)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_LIST_ITEMS)]
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True  # vLLM's extra field


# ---------------------------------------------------------------- what is not supported


def unsupported_common(req: SamplingRequest) -> tuple[str, str] | None:
    """(param, message) of the first parameter set to something splitspec does not do."""
    if req.n is not None and req.n != 1:
        return "n", "n > 1 is not supported: ask for one choice per request"
    if req.presence_penalty or req.frequency_penalty:
        param = "presence_penalty" if req.presence_penalty else "frequency_penalty"
        return param, f"{param} is not supported (only 0)"
    if req.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    if req.top_logprobs is not None:
        return "top_logprobs", "logprobs are not supported"
    if req.stream_options is not None and not req.stream:
        return "stream_options", "stream_options is only allowed with stream=true"
    return None


def unsupported_completion(req: CompletionRequest) -> tuple[str, str] | None:
    if (found := unsupported_common(req)) is not None:
        return found
    if req.logprobs is not None:
        return "logprobs", "logprobs are not supported"
    if req.echo:
        return "echo", "echo is not supported"
    if req.suffix is not None:
        return "suffix", "suffix is not supported"
    if req.best_of is not None and req.best_of != 1:
        return "best_of", "best_of > 1 is not supported"
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list)):
        if len(req.prompt) != 1:
            return "prompt", "a batch of several prompts is not supported: send one prompt per request"
    return None


def unsupported_chat(req: ChatCompletionRequest) -> tuple[str, str] | None:
    if (found := unsupported_common(req)) is not None:
        return found
    if req.logprobs:
        return "logprobs", "logprobs are not supported"
    for name in ("tools", "tool_choice", "functions", "function_call"):
        if getattr(req, name) not in (None, [], "none"):
            return name, f"{name}: tool and function calling is not supported"
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format", f"response_format {req.response_format.type!r} is not supported (only 'text')"
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        return "max_tokens", "give max_tokens or max_completion_tokens, not both"
    for i, message in enumerate(req.messages):
        if (found := _unsupported_message(i, message)) is not None:
            return found
    return None


def _unsupported_message(i: int, message: ChatMessage) -> tuple[str, str] | None:
    for name in ("name", "tool_calls", "tool_call_id", "function_call"):
        if getattr(message, name) is not None:
            return f"messages.{i}.{name}", f"messages[{i}].{name} is not supported"
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if not isinstance(part, TextPart):
                return (f"messages.{i}.content.{j}",
                        f"content parts of type {part.type!r} are not supported (only 'text')")
    return None


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


# ---------------------------------------------------------------- responses


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class SpeculationUsage(BaseModel):
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: SpeculationUsage  # splitspec's addition: the drafter's work for this request


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": text}, {} at the end
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitspec"
    root: str  # the target's model id
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- streamed chunks, rendered once per stream


TEXT_PLACEHOLDER = "\x00splitspec-text\x00"  # where a chunk template's text goes
_PLACEHOLDER_JSON = json.dumps(TEXT_PLACEHOLDER)


class TextChunks:
    """The JSON of a stream's text chunks: the pydantic model renders one chunk per stream
    with a placeholder text, and each chunk splices in its own text (json.dumps), which
    costs a fraction of a model build and dump per token."""

    def __init__(self, template: pydantic.BaseModel) -> None:
        self._prefix, found, self._suffix = template.model_dump_json().rpartition(_PLACEHOLDER_JSON)
        if not found:
            raise ValueError("the chunk template has no text placeholder")

    def __call__(self, text: str) -> str:
        return self._prefix + json.dumps(text, ensure_ascii=False) + self._suffix
