"""Request-level types shared by the gRPC layer and the engine. No torch here.

Every request dataclass validates itself; a bad value raises `InvalidRequestError`
naming the public API field, which the server maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
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


MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # each bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BANNED_TOKEN_IDS = 1024
SEED_LIMIT = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from the target's logits, one field per public API field.

    Logit shaping (target_service/logits_shaping.py) applies first, in this order: banned ids,
    logit_bias and min_tokens, then the repetition, frequency and presence penalties; then
    temperature, min_p, top_k and top_p."""

    temperature: float = 0.0  # 0 (below 1e-5) → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    min_p: float = 0.0  # 0 → off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 → off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("sampling.temperature", f"must be >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise InvalidRequestError("sampling.seed", f"must be in [0, 2^63), got {self.seed}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError("sampling.min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(f"sampling.{name}", f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                          f"got {value}")
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError("sampling.repetition_penalty",
                                      f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        self._check_logit_bias()
        if len(self.banned_token_ids) > MAX_BANNED_TOKEN_IDS:
            raise InvalidRequestError("sampling.banned_token_ids", f"at most {MAX_BANNED_TOKEN_IDS} ids, "
                                      f"got {len(self.banned_token_ids)}")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                                      f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError("sampling.logit_bias", f"the bias of token {token} must be in "
                                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequestError("sampling.logit_bias", "a token id is given twice")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def shapes_logits(self) -> bool:
        """Whether any shaping applies before temperature (a plain request skips that step)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.banned_token_ids)

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of a request with n > 1: its own seed stream (seed + index), as vLLM's."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + index) % SEED_LIMIT)


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024  # each emitted token is looked up in them


@dataclass(frozen=True)
class StopParams:
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop of any kind before this many tokens (EOS and stop ids are masked)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequestError("stop.max_tokens", f"must be > 0, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("stop.min_tokens", f"must be in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens}")
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


MAX_TOP_LOGPROBS = 20
MAX_N = 16  # sequences per request


@dataclass(frozen=True)
class LogprobParams:
    """Which log-probabilities a request returns. They are the target's raw distribution,
    log_softmax of its logits before any shaping, temperature or truncation, whether a token
    came from a draft or not."""

    completion: bool = False  # the chosen token's logprob for every completion token
    top: int = 0  # and this many most likely tokens per completion token
    prompt: bool = False  # the logprob of each prompt token (None for the first)
    prompt_top: int = 0  # and this many most likely tokens per prompt position

    def __post_init__(self) -> None:
        for name in ("top", "prompt_top"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"logprobs.{name}", f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if self.top and not self.completion:
            raise InvalidRequestError("logprobs.top", "needs logprobs.completion")
        if self.prompt_top and not self.prompt:
            raise InvalidRequestError("logprobs.prompt_top", "needs logprobs.prompt")


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
    logprobs: LogprobParams = field(default_factory=LogprobParams)
    n: int = 1  # sequences generated from the prompt, each streamed with its index

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {self.n}")


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
class TokenLogprob:
    """A token's log-probability at one position, and its rank there (1 = most likely); None
    for both where nothing predicts the token (a prompt's first)."""

    token_id: int
    logprob: float | None
    rank: int | None


@dataclass(frozen=True)
class PositionLogprobs:
    """One position: the token there and, when asked, the most likely tokens, best first."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One increment of one choice's stream: new tokens and the text they completed."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None  # set on the choice's last output only
    usage: Usage | None = None  # set on the choice's last output only
    index: int = 0  # the choice (0..n-1)
    logprobs: tuple[PositionLogprobs, ...] | None = None  # one per token_ids entry, when asked
    prompt_logprobs: tuple[PositionLogprobs, ...] | None = None  # choice 0's first output, when asked


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
    for field_name, listed in (("stop.stop_token_ids", request.stop.stop_token_ids),
                               ("sampling.banned_token_ids", request.sampling.banned_token_ids),
                               ("sampling.logit_bias", [t for t, _ in request.sampling.logit_bias])):
        bad = next((t for t in listed if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(field_name, f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    check_some_token_allowed(request, info)
    total = len(ids) + request.stop.max_tokens
    if total > info.max_model_len:
        raise InvalidRequestError(
            "stop.max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({request.stop.max_tokens}) = {total} exceeds the "
            f"model length {info.max_model_len}",
        )


def check_some_token_allowed(request: EngineRequest, info: ModelInfo) -> None:
    """Banned ids, and while min_tokens holds the stop ids and EOS, must leave a token to
    generate: a row of -inf everywhere has no distribution to sample (nor an argmax that means
    anything)."""
    blocked = set(request.sampling.banned_token_ids)
    if len(blocked) >= info.vocab_size:
        raise InvalidRequestError("sampling.banned_token_ids", "bans every token of the vocabulary")
    stop = request.stop
    if stop.min_tokens:
        blocked.update(stop.stop_token_ids)
        if not stop.ignore_eos:
            blocked.update(info.eos_token_ids)
        if len(blocked) >= info.vocab_size:
            raise InvalidRequestError("stop.min_tokens", "with the banned ids, the stop ids and EOS masked "
                                      "until min_tokens, no token is left to generate")


class EngineClient(Protocol):
    """What the gRPC layer needs from the engine."""

    model_info: ModelInfo

    def tokenizer(self): ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def server_info(self) -> dict: ...
