"""OpenAI request and response shapes (pydantic).

Request models are strict (no string-to-number, bool-to-number or number-to-string
coercion: `"0"` is not a temperature) and forbid unknown fields: a parameter the gateway
does not know is a 400 naming it, never silently ignored. Known OpenAI parameters that
splitspec cannot honour (`suffix`, tools, a lark grammar, ...) are accepted by the schema and
refused by `validation.check_*` with a 400 that says so. Types and the ranges
protobuf can hold are checked here, the rest in `validation`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

INT32_MAX = 2**31 - 1
MAX_LIST_ITEMS = 4096  # stop strings, stop token ids, messages, content parts: bounds the work per request

Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX, strict=True)]
TokenId = Annotated[int, Field(ge=-(2**31), le=INT32_MAX, strict=True)]
Float = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SpeculationOptions(Strict):
    """splitspec's extra field `speculation` (the gRPC API's SpeculationParams)."""

    disable: bool = False
    num_speculative_tokens: Int32 = 0  # 0: the server's K


class JsonSchemaSpec(Strict):
    """OpenAI's `response_format.json_schema`: the schema the output must match. `strict` is
    accepted and changes nothing: the grammar is always enforced."""

    name: str = Field(default="response", max_length=64)
    description: str | None = Field(default=None, max_length=4096)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text", "json_object" or "json_schema" (other types are
    refused by `validation`, naming the type)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str = Field(max_length=64)
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsOptions(Strict):
    """vLLM's extra field `structured_outputs`: one of json, regex, choice or json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=MAX_LIST_ITEMS)] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # there is no fallback: a grammar that cannot compile is a 400 anyway
    # vLLM's, refused by `validation` as unsupported when set
    grammar: str | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False

    def constraints(self) -> list[str]:
        """The constraint fields set, by their vLLM names."""
        named = {"json": self.json_, "regex": self.regex, "choice": self.choice,
                 "json_object": self.json_object or None, "grammar": self.grammar,
                 "structural_tag": self.structural_tag}
        return [name for name, value in named.items() if value is not None]


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
    n: Int32 | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: Annotated[dict[str, Float], Field(max_length=MAX_LIST_ITEMS)] | None = None  # token id (a string) → bias
    # splitspec's extra fields (vLLM's names where vLLM has them)
    top_k: Int32 | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int32 | None = None
    banned_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST_ITEMS)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST_ITEMS)] | None = None
    speculation: SpeculationOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    # vLLM's: only requests with the same salt share cached prompt KV (the target bounds it)
    cache_salt: str | None = Field(default=None, max_length=256)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | list[str] | list[list[TokenId]]
    logprobs: Int32 | None = None  # the chosen token's logprob and this many alternatives per token
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    suffix: str | None = None
    best_of: Int32 | None = None
    # splitspec's extra field: special-token strings in a text prompt become special tokens
    # (unset: the prompt is plain text, as every chat message's content always is)
    parse_special_tokens: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ContentPart(BaseModel):
    """Any other part (image_url, input_audio, file, ...): refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str = Field(max_length=64)


def _part_kind(value: Any) -> str:
    """Which model a content part is checked against: a part of type "text" is a TextPart
    (so a non-string `text` is named as such), any other a ContentPart."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text-part" if kind == "text" else "other-part"


Part = Annotated[Annotated[TextPart, Tag("text-part")] | Annotated[ContentPart, Tag("other-part")],
                 Discriminator(_part_kind)]


class ChatMessage(Strict):
    role: str = Field(max_length=64)
    content: str | Annotated[list[Part], Field(max_length=MAX_LIST_ITEMS)] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None
    refusal: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_LIST_ITEMS)]
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    add_generation_prompt: bool = True  # vLLM's extra field


# ---------------------------------------------------------------- messages


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


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the target's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculation: SpeculationUsage  # splitspec's addition: the drafter's work for this request


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: one entry per token (an echoed prompt's first has no logprob)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
