from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_ORDER_UNSPECIFIED: _ClassVar[PageOrder]
    PAGE_ORDER_NHD: _ClassVar[PageOrder]
    PAGE_ORDER_HND: _ClassVar[PageOrder]

class KVDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDtype]
    KV_DTYPE_FP8_E4M3: _ClassVar[KVDtype]
    KV_DTYPE_FP8_E5M2: _ClassVar[KVDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KVDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KVDtype]

class LayerOwner(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYER_OWNER_UNSPECIFIED: _ClassVar[LayerOwner]
    LAYER_OWNER_TARGET: _ClassVar[LayerOwner]
    LAYER_OWNER_DRAFT: _ClassVar[LayerOwner]
PAGE_ORDER_UNSPECIFIED: PageOrder
PAGE_ORDER_NHD: PageOrder
PAGE_ORDER_HND: PageOrder
KV_DTYPE_UNSPECIFIED: KVDtype
KV_DTYPE_FP8_E4M3: KVDtype
KV_DTYPE_FP8_E5M2: KVDtype
KV_DTYPE_BFLOAT16: KVDtype
KV_DTYPE_FLOAT16: KVDtype
KV_DTYPE_FLOAT32: KVDtype
LAYER_OWNER_UNSPECIFIED: LayerOwner
LAYER_OWNER_TARGET: LayerOwner
LAYER_OWNER_DRAFT: LayerOwner

class LayerSpec(_message.Message):
    __slots__ = ("owner", "index", "num_kv_heads", "head_dim", "offset", "k_scale", "v_scale")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    K_SCALE_FIELD_NUMBER: _ClassVar[int]
    V_SCALE_FIELD_NUMBER: _ClassVar[int]
    owner: LayerOwner
    index: int
    num_kv_heads: int
    head_dim: int
    offset: int
    k_scale: float
    v_scale: float
    def __init__(self, owner: _Optional[_Union[LayerOwner, str]] = ..., index: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., offset: _Optional[int] = ..., k_scale: _Optional[float] = ..., v_scale: _Optional[float] = ...) -> None: ...

class StagingSpec(_message.Message):
    __slots__ = ("rows", "width", "dtype", "offset", "layer_ids")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    width: int
    dtype: KVDtype
    offset: int
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[_Union[KVDtype, str]] = ..., offset: _Optional[int] = ..., layer_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChannelSpec(_message.Message):
    __slots__ = ("capacity", "offset")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    offset: int
    def __init__(self, capacity: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("order", "page_size", "kv_dtype", "num_pages", "layers", "staging", "target_id", "epoch", "total_bytes", "channel")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    order: PageOrder
    page_size: int
    kv_dtype: KVDtype
    num_pages: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    staging: StagingSpec
    target_id: str
    epoch: int
    total_bytes: int
    channel: ChannelSpec
    def __init__(self, order: _Optional[_Union[PageOrder, str]] = ..., page_size: _Optional[int] = ..., kv_dtype: _Optional[_Union[KVDtype, str]] = ..., num_pages: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., staging: _Optional[_Union[StagingSpec, _Mapping]] = ..., target_id: _Optional[str] = ..., epoch: _Optional[int] = ..., total_bytes: _Optional[int] = ..., channel: _Optional[_Union[ChannelSpec, _Mapping]] = ...) -> None: ...
