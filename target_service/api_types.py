"""Request-level types shared by the gRPC layer and the engine. No torch here.

Every request dataclass validates itself; a bad value raises `InvalidRequestError`
naming the public API field, which the server maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


class InvalidRequestError(ValueError):
    """A request field is malformed or out of range."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-waiting."""


class ShuttingDownError(RuntimeError):
    """The server stopped admitting requests."""


class FinishReason(enum.IntEnum):
    """Mirrors splitspec.v1.FinishReason."""

    UNSPECIFIED = 0
    LENGTH = 1  # max_tokens reached
    STOP = 2  # EOS, a stop string or a stop token id
    ABORT = 3  # client cancel, deadline, Abort RPC, or shutdown
    MODEL_LENGTH = 4  # the sequence reached the model's max length


# Temperatures below this decode greedily (as vLLM's _SAMPLING_EPS): the distribution is
# the argmax anyway, and logits / 1e-40 overflow float32 into inf - inf = NaN probabilities.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (below 1e-5) → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("sampling.temperature", f"must be >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("sampling.seed", f"must be in [0, 2^63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024  # each emitted token is looked up in them


@dataclass(frozen=True)
class StopParams:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequestError("stop.max_tokens", f"must be > 0, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError("stop.stop", f"stop strings must have 1..{MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop.stop_token_ids",
                                      f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")


@dataclass(frozen=True)
class SpeculationParams:
    disable: bool = False
    num_speculative_tokens: int = 0  # 0 → the server's K

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise InvalidRequestError(
                "speculation.num_speculative_tokens", f"must be >= 0, got {self.num_speculative_tokens}"
            )


MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema document, as UTF-8
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024  # each choice
MAX_CHOICES_TOTAL_CHARS = 64 * 1024


class StructuredOutputKind(enum.Enum):
    """Mirrors the oneof `constraint` of splitspec.v1.StructuredOutput; the value is its field name."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"


@dataclass(frozen=True)
class StructuredOutputParams:
    """What the output must match. Sizes are bounded here, before anything parses or compiles the
    spec; what needs the grammar engine (syntax, cost) is checked when it compiles."""

    kind: StructuredOutputKind
    spec: str = ""  # the JSON schema document (JSON text) or the regex
    choices: tuple[str, ...] = ()
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (compact output)

    def __post_init__(self) -> None:
        if self.kind is StructuredOutputKind.JSON_SCHEMA:
            if not self.spec:
                raise InvalidRequestError(self.field_name, "must not be empty")
            if len(self.spec) > MAX_SCHEMA_BYTES or len(self.spec.encode()) > MAX_SCHEMA_BYTES:
                raise InvalidRequestError(self.field_name, f"must be at most {MAX_SCHEMA_BYTES} bytes")
        elif self.kind is StructuredOutputKind.REGEX:
            if not self.spec or len(self.spec) > MAX_REGEX_CHARS:
                raise InvalidRequestError(self.field_name, f"must have 1..{MAX_REGEX_CHARS} characters")
        elif self.kind is StructuredOutputKind.CHOICE:
            self._check_choices()

    def _check_choices(self) -> None:
        if not 0 < len(self.choices) <= MAX_CHOICES:
            raise InvalidRequestError(self.field_name, f"must list 1..{MAX_CHOICES} choices, got {len(self.choices)}")
        if any(not c or len(c) > MAX_CHOICE_CHARS for c in self.choices):
            raise InvalidRequestError(self.field_name, f"each choice must have 1..{MAX_CHOICE_CHARS} characters")
        if sum(map(len, self.choices)) > MAX_CHOICES_TOTAL_CHARS:
            raise InvalidRequestError(self.field_name, f"the choices may have at most {MAX_CHOICES_TOTAL_CHARS} "
                                      "characters together")

    @property
    def field_name(self) -> str:
        return f"structured_output.{self.kind.value}"

    def cache_key(self) -> tuple:
        return self.kind, self.spec, self.choices, self.disable_any_whitespace


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopParams = field(default_factory=StopParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    cache_salt: str = ""  # mixed into the prefix cache's hashes: only requests with the same salt share pages
    structured_output: StructuredOutputParams | None = None
    # its compiled grammar (structured_output.CompiledGrammar), compiled off the event loop before admission
    grammar: object | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One increment of a stream: new tokens and the text they completed."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None  # set on the last output only
    usage: Usage | None = None  # set on the last output only


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    num_layers: int
    hidden_size: int


def check_prompt_fits(field_name: str, num_tokens: int, max_model_len: int) -> None:
    """A prompt alone that leaves no room for one new token: its input field is at fault,
    not max_tokens."""
    if num_tokens >= max_model_len:
        raise InvalidRequestError(field_name, f"the prompt is {num_tokens} tokens; the model length is "
                                  f"{max_model_len}, including at least one token to generate")


def validate_prompt(request: EngineRequest, info: ModelInfo) -> None:
    """What a request can only be checked against once the model is known: ids in the
    vocabulary, prompt + max_tokens within the model length."""
    ids = request.prompt_token_ids
    if not ids:
        raise InvalidRequestError("input", "the prompt is empty")
    check_prompt_fits("input.token_ids", len(ids), info.max_model_len)  # before the max_tokens sum
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("input.token_ids", f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    bad = next((t for t in request.stop.stop_token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("stop.stop_token_ids",
                                  f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    total = len(ids) + request.stop.max_tokens
    if total > info.max_model_len:
        raise InvalidRequestError(
            "stop.max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({request.stop.max_tokens}) = {total} exceeds the "
            f"model length {info.max_model_len}",
        )


class EngineClient(Protocol):
    """What the gRPC layer needs from the engine."""

    model_info: ModelInfo

    def tokenizer(self): ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def server_info(self) -> dict: ...
