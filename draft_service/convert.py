"""splitspec.v1.Drafter messages ↔ the plain values the host works on (the target's
convert.py, mirrored). A message that cannot become a value is INVALID_ARGUMENT, naming
the field."""

from __future__ import annotations

from common.drafter_facts import DrafterFacts
from common.layout_proto import (
    drafter_facts_to_proto,
    kv_dtype_from_proto,
    kv_layout_from_proto,
    order_from_proto,
    orders_from_proto,
)
from common.pool_exports import MAX_UNCONFIRMED_EPOCHS
from common.pool_transport import Canary, TorchBuild
from draft_service.drafters import TargetInfo, Update
from draft_service.host import (
    AttachArgs,
    AttachReply,
    InvalidArgumentError,
    NegotiateArgs,
    ProposeArgs,
    ReleaseArgs,
)
from splitspec.v1 import drafter_pb2 as dpb

# ---------------------------------------------------------------- requests → values


def target_info(facts: dpb.TargetFacts) -> TargetInfo:
    return TargetInfo(
        architecture=facts.architecture,
        hidden_size=facts.hidden_size,
        vocab_size=facts.vocab_size,
        num_layers=facts.num_layers,
        fingerprint=facts.fingerprint,
        kv_dtype=kv_dtype_from_proto(facts.kv_dtype, default=""),
        device_type=facts.device_type or "cpu",
        max_model_len=facts.max_model_len,
        torch_build=TorchBuild(facts.torch_version, facts.cuda_version),
    )


def negotiate_args(request: dpb.NegotiateRequest) -> NegotiateArgs:
    return NegotiateArgs(
        target_id=request.target_id,
        target=target_info(request.target),
        requested_order=request.requested_order or "auto",
        target_orders=orders_from_proto(request.target.supported_orders),
        target_preferred=order_from_proto(request.target.preferred_order, default=""),
    )


def attach_args(request: dpb.AttachRequest) -> AttachArgs:
    try:
        layout = kv_layout_from_proto(request.layout)
    except ValueError as exc:
        raise InvalidArgumentError("layout", str(exc)) from exc
    if len(request.unconfirmed_epochs) > MAX_UNCONFIRMED_EPOCHS:
        raise InvalidArgumentError("unconfirmed_epochs", f"lists more than {MAX_UNCONFIRMED_EPOCHS} epochs")
    return AttachArgs(layout, request.pool, Canary(request.canary.offset, request.canary.value),
                      tuple(request.unconfirmed_epochs))


def update(msg: dpb.SequenceUpdate) -> Update:
    return Update(
        seq_id=msg.seq_id,
        context_start=msg.context_start,
        context_token_ids=tuple(msg.context_token_ids),
        last_token_id=msg.last_token_id,
        new_pages=tuple(msg.new_pages),
        staging_row=msg.staging_row,
        num_speculative_tokens=msg.num_speculative_tokens,
        cached_context_tokens=msg.cached_context_tokens,
    )


def propose_args(request: dpb.ProposeRequest) -> ProposeArgs:
    return ProposeArgs(request.target_id, request.epoch, tuple(update(msg) for msg in request.sequences),
                       tuple(request.released_seq_ids))


def release_args(request: dpb.ReleaseRequest) -> ReleaseArgs:
    return ReleaseArgs(request.target_id, request.epoch, tuple(request.seq_ids), request.detach)


# ---------------------------------------------------------------- values → replies


def negotiate_response(facts: DrafterFacts) -> dpb.NegotiateResponse:
    return drafter_facts_to_proto(facts)


def attach_response(reply: AttachReply) -> dpb.AttachResponse:
    return dpb.AttachResponse(target_id=reply.target_id, epoch=reply.epoch, mapped_bytes=reply.mapped_bytes,
                              mapped_epochs=list(reply.mapped_epochs), channel_serving=reply.channel_serving)


def propose_response(drafts: dict[int, list[int]], written: dict[int, int] | None = None) -> dpb.ProposeResponse:
    return dpb.ProposeResponse(drafts=[dpb.Draft(seq_id=s, token_ids=t) for s, t in drafts.items() if t],
                               written=[dpb.ContextWritten(seq_id=s, num_tokens=n) for s, n in (written or {}).items()])
