"""The target's KV pool as the drafter shares it, and the handshake that shares it.

`SharedPool` owns the pool. The pool's layout is the one record of what was agreed: the
page order and dtype, every layer region, the staging rows, the target id and the epoch
(the handshake generation). A handshake (docs/design.md#the-handshake):

  Negotiate   send the target's facts, get the drafter's (its layers, the target layers
              whose hidden states it reads, its orders and K);
  re-plan     if the drafter's layers are not in the pool, plan a new pool; only while
              no sequence runs, since the old pool's pages hold their KV;
  Attach      bump the epoch, write a canary, send the layout and the pool's handle.

Any failure leaves the link UNAVAILABLE (the engine serves without speculation and tries
again after a backoff). A replaced pool stays exported until the drafter attaches to the
new one (`PoolExports`), so its memory never moves under the drafter's feet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.kv_layout import KVLayout
from common.kv_pool import PagePool
from common.layout_proto import kv_dtype_to_proto, kv_layout_to_proto, order_to_proto
from common.pool_exports import PoolExports
from common.pool_transport import TorchBuild, device_uuid, ipc_build_mismatch, write_canary
from common.shm_channel import ChannelClient
from splitspec.v1 import drafter_pb2 as dpb
from target_service.api_types import ModelInfo
from target_service.config import EngineConfig
from target_service.drafter_link import DrafterLink, DrafterRejected, describe_rpc_error
from target_service.pool_planning import PoolPlanner, same_regions

NO_DRAFTER = {"state": "none", "address": ""}


def negotiate_request(config: EngineConfig, model, backend_cls: type, device: torch.device, info: ModelInfo,
                      layout: KVLayout) -> dpb.NegotiateRequest:
    """The target's facts: its model's identity, what its backend supports, its limits."""
    facts = dpb.TargetFacts(
        architecture=info.architecture, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
        num_layers=info.num_layers, fingerprint=model.fingerprint(),
        supported_orders=[order_to_proto(o) for o in backend_cls.supported_orders(device)],
        preferred_order=order_to_proto(backend_cls.preferred_order(device)),
        kv_dtype=kv_dtype_to_proto(layout.kv_dtype), page_size=layout.page_size,
        max_num_seqs=config.max_num_seqs, max_tokens_per_step=config.max_num_batched_tokens,
        device_type=device.type, device_uuid=device_uuid(device), max_model_len=info.max_model_len,
        torch_version=TorchBuild.here().torch, cuda_version=TorchBuild.here().cuda,
    )
    return dpb.NegotiateRequest(target_id=layout.target_id, target=facts, requested_order=config.cache.kv_layout)


@dataclass(frozen=True)
class HandshakeOutcome:
    ok: bool
    result: str | None  # for splitspec_drafter_handshakes_total: ok, rejected, error; None: not tried
    replanned: bool  # the pool was replaced: the engine must use the new one


class SharedPool:
    """The KV pool, the record of its layout, and the drafter's attachment to it."""

    def __init__(self, pool: PagePool, planner: PoolPlanner, negotiate: dpb.NegotiateRequest,
                 link: DrafterLink | None) -> None:
        self.pool = pool
        self.planner = planner
        self.negotiate_request = negotiate  # the target's facts: fixed for the target's life
        self.link = link
        self.exports = PoolExports()  # keeps exported CUDA pools alive until the drafter moves on

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    def handshake(self, may_replan: bool) -> HandshakeOutcome:
        """Negotiate, (re)plan the pool if the drafter's layers are not in it, attach."""
        link, replanned = self.link, False
        try:
            facts = link.negotiate(self.negotiate_request)
            if self.planner.device.type == "cuda" and facts.maps_pool:  # no CUDA IPC handle for another torch
                if (problem := ipc_build_mismatch(TorchBuild.here(), facts.torch_build)) is not None:
                    raise DrafterRejected(problem)
            layout = self.planner.plan(facts, self.layout.target_id, self.layout.epoch + 1)
            if not same_regions(layout, self.layout):
                if not may_replan:
                    link.mark_failed("the drafter's layers are not in the KV pool; re-planning it when idle")
                    return HandshakeOutcome(ok=False, result=None, replanned=False)
                self._replace_pool(layout)
                replanned = True
            self._attach(layout.epoch)
        except Exception as exc:  # rejected, unreachable, or no common layout: serve without it
            rejected = isinstance(exc, (DrafterRejected, ValueError))
            link.mark_failed(describe_rpc_error(exc), rejected=rejected)
            return HandshakeOutcome(ok=False, result="rejected" if rejected else "error", replanned=replanned)
        link.mark_ready(facts, self.layout.epoch)
        return HandshakeOutcome(ok=True, result="ok", replanned=replanned)

    def _replace_pool(self, layout: KVLayout) -> None:
        """Free the (idle) pool and create one planned for `layout`."""
        self.pool.close()
        self.pool = PagePool.create(layout, self.planner.device, self.planner.config.cache.shm_dir)

    def _attach(self, epoch: int) -> None:
        """A new epoch of the pool's layout, sent with the pool's handle and a canary."""
        self.pool.layout = dataclasses.replace(self.pool.layout, epoch=epoch)
        canary = write_canary(self.pool)
        target_id = self.layout.target_id
        reply = self.link.attach(dpb.AttachRequest(
            layout=kv_layout_to_proto(self.layout), pool=self.exports.export(self.pool),
            canary=dpb.Canary(offset=canary.offset, value=canary.value),
            unconfirmed_epochs=self.exports.unconfirmed_epochs(target_id, epoch)))
        # older exports may go now (with torch's IPC reference of those the drafter never mapped)
        self.exports.attached(target_id, epoch, reply.mapped_epochs, mapped=reply.mapped_bytes > 0)
        self.link.use_channel(self._channel_client() if reply.channel_serving else None)

    def _channel_client(self) -> ChannelClient | None:
        channel = self.layout.channel
        if channel is None:  # a drafter claiming a channel we never offered: gRPC it is
            return None
        return ChannelClient(self.pool.channel_buffer(), channel.capacity)

    def describe_drafter(self) -> dict:
        return self.link.describe(self.layout.epoch) if self.link is not None else dict(NO_DRAFTER)

    def close(self) -> None:
        if self.link is not None:
            self.link.detach(self.layout.target_id, self.layout.epoch)
            self.link.close()
        self.exports.close()
        self.pool.close()
