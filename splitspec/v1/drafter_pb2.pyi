from splitspec.v1 import kv_layout_pb2 as _kv_layout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_DFLASH: _ClassVar[DrafterKind]
    DRAFTER_KIND_DRAFT_MODEL: _ClassVar[DrafterKind]
    DRAFTER_KIND_NGRAM: _ClassVar[DrafterKind]
    DRAFTER_KIND_EAGLE3: _ClassVar[DrafterKind]
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_DFLASH: DrafterKind
DRAFTER_KIND_DRAFT_MODEL: DrafterKind
DRAFTER_KIND_NGRAM: DrafterKind
DRAFTER_KIND_EAGLE3: DrafterKind

class TargetFacts(_message.Message):
    __slots__ = ("architecture", "hidden_size", "vocab_size", "num_layers", "fingerprint", "supported_orders", "preferred_order", "kv_dtype", "page_size", "max_num_seqs", "max_tokens_per_step", "device_type", "device_uuid", "max_model_len", "torch_version", "cuda_version")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_ORDERS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_ORDER_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    fingerprint: str
    supported_orders: _containers.RepeatedScalarFieldContainer[_kv_layout_pb2.PageOrder]
    preferred_order: _kv_layout_pb2.PageOrder
    kv_dtype: _kv_layout_pb2.KVDtype
    page_size: int
    max_num_seqs: int
    max_tokens_per_step: int
    device_type: str
    device_uuid: str
    max_model_len: int
    torch_version: str
    cuda_version: str
    def __init__(self, architecture: _Optional[str] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., fingerprint: _Optional[str] = ..., supported_orders: _Optional[_Iterable[_Union[_kv_layout_pb2.PageOrder, str]]] = ..., preferred_order: _Optional[_Union[_kv_layout_pb2.PageOrder, str]] = ..., kv_dtype: _Optional[_Union[_kv_layout_pb2.KVDtype, str]] = ..., page_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_tokens_per_step: _Optional[int] = ..., device_type: _Optional[str] = ..., device_uuid: _Optional[str] = ..., max_model_len: _Optional[int] = ..., torch_version: _Optional[str] = ..., cuda_version: _Optional[str] = ...) -> None: ...

class NegotiateRequest(_message.Message):
    __slots__ = ("target_id", "target", "requested_order")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_ORDER_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    target: TargetFacts
    requested_order: str
    def __init__(self, target_id: _Optional[str] = ..., target: _Optional[_Union[TargetFacts, _Mapping]] = ..., requested_order: _Optional[str] = ...) -> None: ...

class NegotiateResponse(_message.Message):
    __slots__ = ("kind", "layers", "target_layer_ids", "supported_orders", "num_speculative_tokens", "model_id", "torch_version", "cuda_version")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_ORDERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    kind: DrafterKind
    layers: _containers.RepeatedCompositeFieldContainer[_kv_layout_pb2.LayerSpec]
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    supported_orders: _containers.RepeatedScalarFieldContainer[_kv_layout_pb2.PageOrder]
    num_speculative_tokens: int
    model_id: str
    torch_version: str
    cuda_version: str
    def __init__(self, kind: _Optional[_Union[DrafterKind, str]] = ..., layers: _Optional[_Iterable[_Union[_kv_layout_pb2.LayerSpec, _Mapping]]] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., supported_orders: _Optional[_Iterable[_Union[_kv_layout_pb2.PageOrder, str]]] = ..., num_speculative_tokens: _Optional[int] = ..., model_id: _Optional[str] = ..., torch_version: _Optional[str] = ..., cuda_version: _Optional[str] = ...) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("shm", "cuda_ipc")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    shm: ShmHandle
    cuda_ipc: CudaIpcHandle
    def __init__(self, shm: _Optional[_Union[ShmHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "device_index", "handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    device_index: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class Canary(_message.Message):
    __slots__ = ("offset", "value")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    value: bytes
    def __init__(self, offset: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("layout", "pool", "canary", "unconfirmed_epochs")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    UNCONFIRMED_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    layout: _kv_layout_pb2.KVLayout
    pool: PoolHandle
    canary: Canary
    unconfirmed_epochs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[_Union[_kv_layout_pb2.KVLayout, _Mapping]] = ..., pool: _Optional[_Union[PoolHandle, _Mapping]] = ..., canary: _Optional[_Union[Canary, _Mapping]] = ..., unconfirmed_epochs: _Optional[_Iterable[int]] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("target_id", "epoch", "mapped_bytes", "mapped_epochs", "channel_serving")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAPPED_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_SERVING_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    epoch: int
    mapped_bytes: int
    mapped_epochs: _containers.RepeatedScalarFieldContainer[int]
    channel_serving: bool
    def __init__(self, target_id: _Optional[str] = ..., epoch: _Optional[int] = ..., mapped_bytes: _Optional[int] = ..., mapped_epochs: _Optional[_Iterable[int]] = ..., channel_serving: _Optional[bool] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("seq_id", "context_start", "context_token_ids", "staging_row", "new_pages", "last_token_id", "num_speculative_tokens", "cached_context_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_START_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGING_ROW_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    context_start: int
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    staging_row: int
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    last_token_id: int
    num_speculative_tokens: int
    cached_context_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., context_start: _Optional[int] = ..., context_token_ids: _Optional[_Iterable[int]] = ..., staging_row: _Optional[int] = ..., new_pages: _Optional[_Iterable[int]] = ..., last_token_id: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., cached_context_tokens: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("target_id", "epoch", "sequences", "released_seq_ids")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    epoch: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    released_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, target_id: _Optional[str] = ..., epoch: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., released_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("seq_id", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ContextWritten(_message.Message):
    __slots__ = ("seq_id", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("drafts", "written")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[Draft]
    written: _containers.RepeatedCompositeFieldContainer[ContextWritten]
    def __init__(self, drafts: _Optional[_Iterable[_Union[Draft, _Mapping]]] = ..., written: _Optional[_Iterable[_Union[ContextWritten, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("target_id", "epoch", "seq_ids", "detach")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    epoch: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    detach: bool
    def __init__(self, target_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., detach: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
