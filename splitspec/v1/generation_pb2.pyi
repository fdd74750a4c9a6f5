from splitspec.v1 import kv_layout_pb2 as _kv_layout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_MODEL_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_MODEL_LENGTH: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "stop", "speculation", "parse_special_tokens", "cache_salt", "n", "logprobs", "structured_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    stop: StopParams
    speculation: SpeculationParams
    parse_special_tokens: bool
    cache_salt: str
    n: int
    logprobs: LogprobParams
    structured_output: StructuredOutput
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., parse_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., n: _Optional[int] = ..., logprobs: _Optional[_Union[LogprobParams, _Mapping]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "disable_any_whitespace")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    disable_any_whitespace: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class LogprobParams(_message.Message):
    __slots__ = ("completion", "top", "prompt", "prompt_top")
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_FIELD_NUMBER: _ClassVar[int]
    completion: bool
    top: int
    prompt: bool
    prompt_top: int
    def __init__(self, completion: _Optional[bool] = ..., top: _Optional[int] = ..., prompt: _Optional[bool] = ..., prompt_top: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "banned_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., banned_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StopParams(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos", "min_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("disable", "num_speculative_tokens")
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    disable: bool
    num_speculative_tokens: int
    def __init__(self, disable: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "complete", "request_id")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    complete: Complete
    request_id: str
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text", "index", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("finish_reason", "usage", "index")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    index: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "num_drafts", "draft_tokens", "accepted_tokens", "accepted_per_position", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., num_drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "max_model_len", "eos_token_ids", "dtype", "num_layers", "hidden_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    num_layers: int
    hidden_size: int
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("kv_layout", "num_pages", "free_pages", "running", "waiting", "drafter", "prefix_cache")
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    kv_layout: _kv_layout_pb2.KVLayout
    num_pages: int
    free_pages: int
    running: int
    waiting: int
    drafter: DrafterState
    prefix_cache: PrefixCacheState
    def __init__(self, kv_layout: _Optional[_Union[_kv_layout_pb2.KVLayout, _Mapping]] = ..., num_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., drafter: _Optional[_Union[DrafterState, _Mapping]] = ..., prefix_cache: _Optional[_Union[PrefixCacheState, _Mapping]] = ...) -> None: ...

class PrefixCacheState(_message.Message):
    __slots__ = ("enabled", "cached_pages", "evictable_pages", "query_tokens", "hit_tokens", "evictions")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    cached_pages: int
    evictable_pages: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    def __init__(self, enabled: _Optional[bool] = ..., cached_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class DrafterState(_message.Message):
    __slots__ = ("status", "address", "kind", "num_speculative_tokens", "epoch", "detail", "propose_transport")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[DrafterState.Status]
        STATUS_NONE: _ClassVar[DrafterState.Status]
        STATUS_CONNECTING: _ClassVar[DrafterState.Status]
        STATUS_READY: _ClassVar[DrafterState.Status]
        STATUS_UNAVAILABLE: _ClassVar[DrafterState.Status]
    STATUS_UNSPECIFIED: DrafterState.Status
    STATUS_NONE: DrafterState.Status
    STATUS_CONNECTING: DrafterState.Status
    STATUS_READY: DrafterState.Status
    STATUS_UNAVAILABLE: DrafterState.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    status: DrafterState.Status
    address: str
    kind: str
    num_speculative_tokens: int
    epoch: int
    detail: str
    propose_transport: str
    def __init__(self, status: _Optional[_Union[DrafterState.Status, str]] = ..., address: _Optional[str] = ..., kind: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., epoch: _Optional[int] = ..., detail: _Optional[str] = ..., propose_transport: _Optional[str] = ...) -> None: ...
