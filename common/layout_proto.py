"""The KV layout and the handshake's enums ↔ protobuf, for both sides of the internal channel.

Plain values are the names `common.kv_layout` uses ("NHD", "bfloat16", "draft") and the
drafter kinds ("dflash"); on the wire they are the `splitspec.v1` enums. Reading a
message raises ValueError for an unspecified or unknown enum, unless the reader gives a
default for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.drafter_facts import DrafterFacts
from common.kv_layout import ORDERS, ChannelSpec, KVLayout, LayerSpec, StagingSpec
from common.pool_transport import TorchBuild
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import kv_layout_pb2 as kv_pb

# ---------------------------------------------------------------- enums


def _enum_value(enum, prefix: str, name: str) -> int:
    return enum.Value(f"{prefix}{name.upper()}")


def _enum_name(enum, prefix: str, value: int, *, lower: bool, default: str | None = None) -> str:
    """The name without `prefix`; `default` (when given) for unspecified or unknown values."""
    if value in enum.values() and value != 0:
        name = enum.Name(value).removeprefix(prefix)
        return name.lower() if lower else name
    if default is not None:
        return default
    if value == 0:
        raise ValueError(f"{enum.DESCRIPTOR.name} is unspecified")
    raise ValueError(f"{enum.DESCRIPTOR.name} has no value {value}")


def order_to_proto(order: str) -> int:
    return _enum_value(kv_pb.PageOrder, "PAGE_ORDER_", order)


def order_from_proto(value: int, default: str | None = None) -> str:
    return _enum_name(kv_pb.PageOrder, "PAGE_ORDER_", value, lower=False, default=default)


def orders_from_proto(values: Iterable[int]) -> tuple[str, ...]:
    """The page orders among `values`, in order; unspecified or unknown ones are dropped."""
    return tuple(order for order in (order_from_proto(v, default="") for v in values) if order in ORDERS)


def kv_dtype_to_proto(kv_dtype: str) -> int:
    return _enum_value(kv_pb.KVDtype, "KV_DTYPE_", kv_dtype)


def kv_dtype_from_proto(value: int, default: str | None = None) -> str:
    return _enum_name(kv_pb.KVDtype, "KV_DTYPE_", value, lower=True, default=default)


def drafter_kind_to_proto(kind: str) -> int:
    return _enum_value(dpb.DrafterKind, "DRAFTER_KIND_", kind)


def drafter_kind_from_proto(value: int, default: str | None = None) -> str:
    return _enum_name(dpb.DrafterKind, "DRAFTER_KIND_", value, lower=True, default=default)


# ---------------------------------------------------------------- the drafter's facts (both directions)


def drafter_facts_to_proto(facts: DrafterFacts) -> dpb.NegotiateResponse:
    return dpb.NegotiateResponse(
        kind=drafter_kind_to_proto(facts.kind),
        layers=[layer_spec_to_proto(spec) for spec in facts.layers],
        target_layer_ids=list(facts.target_layer_ids),
        supported_orders=[order_to_proto(o) for o in facts.supported_orders],
        num_speculative_tokens=facts.num_speculative_tokens,
        model_id=facts.model_id,
        torch_version=facts.torch_build.torch,
        cuda_version=facts.torch_build.cuda,
    )


def drafter_facts_from_proto(msg: dpb.NegotiateResponse) -> DrafterFacts:
    return DrafterFacts(
        kind=drafter_kind_from_proto(msg.kind, default="unknown"),
        layers=tuple(layer_spec_from_proto(spec) for spec in msg.layers),
        target_layer_ids=tuple(msg.target_layer_ids),
        supported_orders=orders_from_proto(msg.supported_orders),
        num_speculative_tokens=msg.num_speculative_tokens,
        model_id=msg.model_id,
        torch_build=TorchBuild(msg.torch_version, msg.cuda_version),
    )


# ---------------------------------------------------------------- the layout (both directions)


def kv_layout_to_proto(layout: KVLayout) -> kv_pb.KVLayout:
    msg = kv_pb.KVLayout(
        order=order_to_proto(layout.order),
        page_size=layout.page_size,
        kv_dtype=kv_dtype_to_proto(layout.kv_dtype),
        num_pages=layout.num_pages,
        layers=[layer_spec_to_proto(spec) for spec in layout.layers],
        target_id=layout.target_id,
        epoch=layout.epoch,
        total_bytes=layout.total_bytes,
    )
    if layout.staging is not None:
        msg.staging.CopyFrom(staging_spec_to_proto(layout.staging))
    if layout.channel is not None:
        msg.channel.CopyFrom(kv_pb.ChannelSpec(capacity=layout.channel.capacity, offset=layout.channel.offset))
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
    dtype = kv_dtype_to_proto(spec.dtype)
    return kv_pb.StagingSpec(rows=spec.rows, width=spec.width, dtype=dtype, offset=spec.offset,
                             layer_ids=list(spec.layer_ids))


def kv_layout_from_proto(msg: kv_pb.KVLayout) -> KVLayout:
    """The inverse of `kv_layout_to_proto`; raises ValueError for unspecified enums."""
    return KVLayout(
        order=order_from_proto(msg.order),
        page_size=msg.page_size,
        kv_dtype=kv_dtype_from_proto(msg.kv_dtype),
        num_pages=msg.num_pages,
        layers=tuple(layer_spec_from_proto(spec) for spec in msg.layers),
        staging=staging_spec_from_proto(msg.staging) if msg.HasField("staging") else None,
        target_id=msg.target_id,
        epoch=msg.epoch,
        total_bytes=msg.total_bytes,
        channel=ChannelSpec(capacity=msg.channel.capacity, offset=msg.channel.offset) if msg.HasField("channel") else None,
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
    dtype = kv_dtype_from_proto(msg.dtype)
    return StagingSpec(rows=msg.rows, width=msg.width, dtype=dtype, offset=msg.offset,
                       layer_ids=tuple(msg.layer_ids))
