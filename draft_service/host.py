"""The drafter's handshake state machine, on plain values (convert.py turns protos into these).

Negotiate (the target's facts) → Attach (layout, pool, canary) → Propose / Release
(docs/design.md#the-handshake). Every call — handshakes, forwards — runs on the event
loop's thread, or a `Propose` on the shm channel's thread, one at a time under the host's
lock (draft_service/server.py); only model loading (before the drafter is handed to the
host) and the final close run elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from common.drafter_facts import DrafterFacts
from common.kv_layout import KVLayout, LayerSpec, LayoutNotResolvedError, canonical_kv_dtype, resolve_order
from common.memory import freeze_startup_heap
from common.pool_exports import MappedExports
from common.pool_transport import (
    Canary,
    TorchBuild,
    TransportError,
    ipc_build_mismatch,
    map_pool,
    read_canary,
    sync_for_handoff,
)
from common.shm_channel import ChannelServer, ErrorStatus, Handler
from common.shm_file import PoolAccessDenied
from draft_service.drafters import Drafter, TargetInfo, Update
from draft_service.drafters.base import DraftSequence, mismatch, raise_mismatches
from draft_service.metrics import DrafterMetrics

log = logging.getLogger(__name__)

MiB = 1 << 20


class InvalidArgumentError(ValueError):
    """A request field is malformed or out of range (INVALID_ARGUMENT naming the field)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


class HandshakeError(RuntimeError):
    """The call does not fit the handshake state (FAILED_PRECONDITION)."""


class NotReadyError(RuntimeError):
    """The draft model is still loading (UNAVAILABLE)."""


# ---------------------------------------------------------------- the calls, as values


@dataclass(frozen=True)
class NegotiateArgs:
    target_id: str
    target: TargetInfo
    requested_order: str  # "auto" unless the operator asked for one
    target_orders: tuple[str, ...]
    target_preferred: str  # "" when unspecified


@dataclass(frozen=True)
class AttachArgs:
    layout: KVLayout
    pool_handle: object  # splitspec.v1.PoolHandle, opened by common.pool_transport.map_pool
    canary: Canary
    unconfirmed_epochs: tuple[int, ...] = ()  # the target's exports it is unsure the drafter mapped


@dataclass(frozen=True)
class AttachReply:
    target_id: str
    epoch: int
    mapped_bytes: int
    mapped_epochs: tuple[int, ...] = ()  # of the unconfirmed epochs, those this drafter mapped
    channel_serving: bool = False  # Propose is answered on the layout's shm channel too


@dataclass(frozen=True)
class ProposeArgs:
    target_id: str
    epoch: int
    updates: tuple[Update, ...]
    released_seq_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReleaseArgs:
    target_id: str
    epoch: int
    seq_ids: tuple[int, ...]
    detach: bool


@dataclass(frozen=True)
class ChannelService:
    """What the shm channel's thread answers with: raw request bytes → raw reply bytes, and
    the gRPC status of an exception (draft_service/server.py builds both)."""

    handler: Handler
    error_status: ErrorStatus


MAX_CHANNEL_CAPACITY = 64 * MiB  # a layout asking for more is refused (the pool is the target's, the bound ours)


@dataclass
class _Negotiated:
    target_id: str
    target: TargetInfo


def _draft_layer_key(spec: LayerSpec) -> tuple:
    return (spec.index, spec.num_kv_heads, spec.head_dim, spec.k_scale, spec.v_scale)


# ---------------------------------------------------------------- the state machine


class DrafterHost:
    """The drafter plus its handshake state; its calls hold `lock` (the event loop's thread and
    the shm channel's call in)."""

    def __init__(self, metrics: DrafterMetrics | None = None) -> None:
        self.drafter: Drafter | None = None
        self.negotiated: _Negotiated | None = None
        self.max_model_len = 0
        self.metrics = metrics or DrafterMetrics()
        self.mapped_exports = MappedExports()  # which exports it mapped, for the target's IPC accounting
        # The shm channel's thread calls in beside the event loop: every call holds `lock`
        # (draft_service/server.py), and the channel is stopped before one that replaces
        # what it serves (Negotiate, Attach, a detach), never while holding the lock.
        self.lock = threading.Lock()
        self.channel_service: ChannelService | None = None  # set by the server; None: Propose over gRPC only
        self._channel: ChannelServer | None = None

    def serve(self, drafter: Drafter) -> None:
        """The draft model is loaded: from now on the host answers."""
        self.drafter = drafter
        self.metrics.set_state("waiting")

    def require(self) -> Drafter:
        if self.drafter is None:
            raise NotReadyError("the draft model is still loading; watch grpc.health.v1.Health for SERVING")
        return self.drafter

    # -- Negotiate -------------------------------------------------------------------------

    def negotiate(self, args: NegotiateArgs) -> DrafterFacts:
        drafter = self.require()
        if not args.target_id:
            raise InvalidArgumentError("target_id", "is required")
        if drafter.cache_config.is_layout_resolved and drafter.layout.target_id != args.target_id:
            log.info("target %s replaces %s: dropping the old mapping", args.target_id, drafter.layout.target_id)
            drafter.unbind()
            self.metrics.mapped_bytes.set(0)
        drafter.check_target(args.target)
        self._check_cache_wishes(drafter, args.target)
        resolve_order(args.requested_order, target_supported=args.target_orders,
                      target_preferred=args.target_preferred, drafter_supported=drafter.supported_orders())
        self.negotiated = _Negotiated(args.target_id, args.target)
        if not drafter.cache_config.is_layout_resolved:
            self.metrics.set_state("negotiated")
        log.info("negotiated with target %s (%s): %s, K=%d", args.target_id, args.target.architecture or "?",
                 drafter.kind, drafter.num_speculative_tokens)
        return DrafterFacts(kind=drafter.kind, layers=tuple(drafter.layer_specs()),
                            target_layer_ids=tuple(drafter.target_layer_ids()),
                            supported_orders=tuple(drafter.supported_orders()),
                            num_speculative_tokens=drafter.num_speculative_tokens, model_id=drafter.model_id,
                            torch_build=TorchBuild.here())

    @staticmethod
    def _check_cache_wishes(drafter: Drafter, target: TargetInfo) -> None:
        problems = []
        wish = drafter.cache_config.cache_dtype
        if wish != "auto" and target.kv_dtype and canonical_kv_dtype(wish, torch.float32) != target.kv_dtype:
            problems.append(mismatch("kv_dtype", target.kv_dtype, canonical_kv_dtype(wish, torch.float32)))
        if drafter.needs_pool and target.device_type != drafter.device.type:
            problems.append(mismatch("device_type", target.device_type, drafter.device.type))
        if drafter.needs_pool and target.device_type == "cuda":  # before any CUDA IPC handle is sent
            problems += filter(None, [ipc_build_mismatch(target.torch_build, TorchBuild.here())])
        raise_mismatches(problems)

    # -- Attach ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def attach_attempt(self) -> Iterator[None]:
        """Around a whole Attach call, its conversion included: a failed one is counted, and
        the state gauges fall back to what the host still holds."""
        try:
            yield
        except Exception:
            self.metrics.attaches.labels(result="error").inc()
            self.metrics.set_state("negotiated" if self.negotiated else "waiting")
            self.metrics.mapped_bytes.set(0)
            raise

    def attach(self, args: AttachArgs) -> AttachReply:
        drafter = self.require()
        layout = args.layout
        if not layout.target_id:
            raise InvalidArgumentError("layout.target_id", "is required")
        if self.negotiated is None or self.negotiated.target_id != layout.target_id:
            raise HandshakeError(f"Attach for target {layout.target_id!r} before its Negotiate; call Negotiate first")
        drafter.unbind()  # any Attach starts a fresh epoch: old mappings and sequences go first
        self._check_layout(drafter, layout)
        pool = None
        if drafter.needs_pool:
            pool = self._map_pool(drafter, args)
        elif layout.channel is not None and self.channel_service is not None:
            pool = self._map_pool_for_channel(drafter, args)
        drafter.bind(pool if drafter.needs_pool else None, layout)
        self.metrics.warmup_seconds.observe(drafter.warmup())  # kernels compiled now, not in a Propose
        frozen = freeze_startup_heap()  # after the last epoch's mappings went (unbind above)
        self.max_model_len = self.negotiated.target.max_model_len
        mapped = layout.total_bytes if pool is not None else 0
        log.info("attached to target %s epoch %d: %s pages of %d tokens, %s %s, %.1f MiB mapped; %d objects "
                 "frozen", layout.target_id, layout.epoch, layout.num_pages, layout.page_size, layout.kv_dtype,
                 layout.order, mapped / MiB, frozen)
        self.metrics.attaches.labels(result="ok").inc()
        self.metrics.set_state("attached")
        self.metrics.mapped_bytes.set(mapped)
        self.metrics.epoch.set(layout.epoch)
        mapped_epochs = self.mapped_exports.answer(layout.target_id, args.unconfirmed_epochs, layout.epoch)
        return AttachReply(target_id=layout.target_id, epoch=layout.epoch, mapped_bytes=mapped,
                           mapped_epochs=tuple(mapped_epochs), channel_serving=self._start_channel(pool, layout))

    def _start_channel(self, pool, layout: KVLayout) -> bool:
        """Serve Propose on the layout's channel, when it offers one in a CPU pool we mapped."""
        channel, service = layout.channel, self.channel_service
        if channel is None or service is None or pool is None or pool.device.type != "cpu":
            return False
        if channel.capacity > MAX_CHANNEL_CAPACITY or channel.offset + channel.nbytes > layout.trailer_offset:
            raise InvalidArgumentError("layout.channel", f"{channel.nbytes} bytes at {channel.offset} do not fit the "
                                       f"pool before its trailer ({layout.trailer_offset}), or capacity "
                                       f"{channel.capacity} exceeds {MAX_CHANNEL_CAPACITY}")
        self._channel = ChannelServer(pool.channel_buffer(), channel.capacity, service.handler,
                                      service.error_status, name=f"channel-e{layout.epoch}")
        log.info("answering Propose on the pool's shm channel too (%d KiB each way)", channel.capacity // 1024)
        return True

    def stop_channel(self) -> None:
        """Stop the channel's threads (before a call that replaces what they serve; never under `lock`)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _map_pool(self, drafter: Drafter, args: AttachArgs):
        layout = args.layout
        self._check_canary_fits(args.canary, layout)  # before the pool file is touched
        pool = map_pool(layout, args.pool_handle, drafter.cache_config.shm_dir, args.canary)
        self.mapped_exports.record(layout.target_id, layout.epoch)
        self._check_pool(drafter, pool, args.canary)
        return pool

    def _map_pool_for_channel(self, drafter: Drafter, args: AttachArgs):
        """A drafter that reads no pages (n-gram) maps the pool only for the Propose channel in
        it, with the same checks; where it cannot (another --shm-dir), Propose stays on gRPC."""
        try:
            return self._map_pool(drafter, args)
        except (PoolAccessDenied, TransportError, HandshakeError, InvalidArgumentError) as exc:
            log.info("not answering Propose on the pool's shm channel (%s); gRPC only", exc)
            return None

    @staticmethod
    def _check_layout(drafter: Drafter, layout: KVLayout) -> None:
        mine = sorted(_draft_layer_key(s) for s in drafter.layer_specs())
        theirs = sorted(_draft_layer_key(s) for s in layout.layers if s.owner == "draft")
        if mine != theirs:
            raise HandshakeError(f"the layout's draft layers {theirs} are not the drafter's {mine} "
                                 "(index, kv heads, head dim, k scale, v scale)")
        if layout.order not in drafter.supported_orders():
            raise HandshakeError(f"layout order {layout.order} is not supported by the drafter "
                                 f"({', '.join(drafter.supported_orders())})")
        wish = drafter.cache_config.cache_dtype
        wanted = canonical_kv_dtype(wish, torch.float32) if wish != "auto" else layout.kv_dtype
        if wanted != layout.kv_dtype:
            raise HandshakeError(f"kv_dtype: target {layout.kv_dtype}, drafter {wanted}")
        for spec in layout.layers:
            if spec.offset + layout.region_bytes(spec) > layout.total_bytes:
                raise InvalidArgumentError("layout.layers", f"{spec.owner} layer {spec.index} ends past total_bytes")
        if drafter.feature_width:
            staging = layout.staging
            if staging is None:
                raise HandshakeError(f"the {drafter.kind} drafter needs a staging buffer; the layout has none")
            if staging.width != drafter.feature_width:
                raise HandshakeError(f"staging width: target {staging.width}, drafter {drafter.feature_width} "
                                     f"(target layers {drafter.target_layer_ids()} x hidden size)")
            if staging.rows == 0 or staging.offset + staging.nbytes > layout.total_bytes:
                raise InvalidArgumentError("layout.staging", "rows must be positive and end within total_bytes")

    @staticmethod
    def _check_canary_fits(canary: Canary, layout: KVLayout) -> None:
        if not canary.value:
            raise InvalidArgumentError("canary.value", "is required")
        if canary.offset + len(canary.value) > layout.total_bytes:
            message = f"{canary.offset} + {len(canary.value)} bytes pass the pool's end"
            raise InvalidArgumentError("canary.offset", message)

    @staticmethod
    def _check_pool(drafter: Drafter, pool, canary: Canary) -> None:
        if pool.device.type != drafter.device.type or (
            drafter.device.index is not None and pool.device.index != drafter.device.index
        ):
            raise HandshakeError(f"the pool lives on {pool.device}, the drafter runs on {drafter.device}")
        if not read_canary(pool, canary):
            raise HandshakeError(f"canary mismatch at byte {canary.offset}: the mapped pool is not the target's "
                                 "(wrong shm file or device?)")

    # -- Propose ---------------------------------------------------------------------------

    def propose(self, args: ProposeArgs) -> dict[int, list[int]]:
        """Drafts by seq id (sequences given none are absent or empty)."""
        started = time.monotonic()
        drafts = self._propose(args)
        self.metrics.propose_latency.observe(time.monotonic() - started)
        return drafts

    def _propose(self, args: ProposeArgs) -> dict[int, list[int]]:
        drafter = self.require()
        layout = drafter.layout  # LayoutNotResolvedError before Attach
        if (args.target_id, args.epoch) != (layout.target_id, layout.epoch):
            raise LayoutNotResolvedError(
                f"Propose for target {args.target_id!r} epoch {args.epoch}, but the drafter is attached to "
                f"target {layout.target_id!r} epoch {layout.epoch}; Negotiate and Attach again"
            )
        updates = args.updates
        self._validate(drafter, layout, updates)
        rows = self._copy_staging_rows(drafter, updates)  # first: the target reuses staging next step
        for seq_id in args.released_seq_ids:
            drafter.forget(seq_id)
        items = []
        for update, new_rows in zip(updates, rows):
            seq = drafter.update(update)
            if seq is not None:
                items.append((seq, new_rows, self._num_drafts(drafter, update, seq)))
        self.metrics.propose_batch.observe(sum(1 for _, _, k in items if k > 0))
        try:
            drafts = drafter.propose(items)
        except Exception:
            for seq, _, _ in items:  # their draft state is unknown now
                drafter.forget(seq.seq_id)
            raise
        sync_for_handoff(drafter.device)  # draft-page writes land before the target's next step
        self.metrics.draft_tokens.inc(sum(len(t) for t in drafts.values()))
        return drafts

    def _num_drafts(self, drafter: Drafter, update: Update, seq: DraftSequence) -> int:
        """The drafter side's one bound on k: what the target asked, the drafter's K, the model
        length and the KV slots the sequence's pages hold (`Drafter.draft_room`)."""
        k = min(update.num_speculative_tokens, drafter.num_speculative_tokens, drafter.draft_room(seq))
        if self.max_model_len:
            k = min(k, self.max_model_len - 1 - seq.last_position)
        return max(k, 0)

    @staticmethod
    def _validate(drafter: Drafter, layout: KVLayout, updates: tuple[Update, ...]) -> None:
        """Every field, before any state changes: a bad request changes nothing."""
        seen: set[int] = set()
        vocab = drafter.vocab_size
        for i, u in enumerate(updates):
            where = f"sequences[{i}]"
            if u.seq_id in seen:
                raise InvalidArgumentError(f"{where}.seq_id", f"{u.seq_id} appears twice")
            seen.add(u.seq_id)
            if u.cached_context_tokens and u.context_start != 0:
                raise InvalidArgumentError(f"{where}.cached_context_tokens", "is only allowed with context_start 0")
            if u.cached_context_tokens > len(u.context_token_ids):
                message = (f"{u.cached_context_tokens} exceeds the {len(u.context_token_ids)} context tokens")
                raise InvalidArgumentError(f"{where}.cached_context_tokens", message)
            for name, ids in (("context_token_ids", u.context_token_ids), ("last_token_id", (u.last_token_id,))):
                bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
                if bad:
                    limit = vocab if vocab is not None else "inf"
                    raise InvalidArgumentError(f"{where}.{name}", f"token id {bad[0]} is outside [0, {limit})")
            if not drafter.needs_pool:
                continue
            bad_pages = [p for p in u.new_pages if p >= layout.num_pages]
            if bad_pages:
                message = f"page id {bad_pages[0]} >= num_pages {layout.num_pages}"
                raise InvalidArgumentError(f"{where}.new_pages", message)
            if drafter.feature_width and u.num_staged_rows:
                end = u.staging_row + u.num_staged_rows
                if end > layout.staging.rows:
                    message = f"rows [{u.staging_row}, {end}) exceed the {layout.staging.rows} staging rows"
                    raise InvalidArgumentError(f"{where}.staging_row", message)
            DrafterHost._validate_pages(drafter, layout, u, where)

    @staticmethod
    def _validate_pages(drafter: Drafter, layout: KVLayout, u: Update, where: str) -> None:
        """The page table of an in-sync sequence must cover its context tokens."""
        if u.context_start == 0:
            num_pages = len(u.new_pages)
        elif (seq := drafter.sequences.get(u.seq_id)) is not None and seq.context_len == u.context_start:
            num_pages = len(seq.page_table) + len(u.new_pages)
        else:
            return  # out of sync: it will be dropped, not read
        needed = u.context_start + len(u.context_token_ids)
        if num_pages * layout.page_size < needed:
            message = f"the page table's {num_pages} pages hold fewer than the {needed} context tokens"
            raise InvalidArgumentError(f"{where}.new_pages", message)

    @staticmethod
    def _copy_staging_rows(drafter: Drafter, updates: tuple[Update, ...]) -> list[torch.Tensor | None]:
        if not drafter.feature_width or drafter.pool is None:
            return [None] * len(updates)
        staging = drafter.pool.staging()  # [rows, width]
        return [
            staging[u.staging_row : u.staging_row + u.num_staged_rows].clone() if u.num_staged_rows else None
            for u in updates
        ]

    def written_context(self, updates: tuple[Update, ...]) -> dict[int, int]:
        """Per sequence of a Propose, how far its draft KV is written (empty for a drafter
        without layers, or before Attach)."""
        drafter = self.require()
        if not drafter.cache_config.is_layout_resolved:
            return {}
        return drafter.written_context(u.seq_id for u in updates)

    # -- Release ---------------------------------------------------------------------------

    def release(self, args: ReleaseArgs) -> None:
        drafter = self.require()
        if not drafter.cache_config.is_layout_resolved:
            return
        layout = drafter.layout
        if (args.target_id, args.epoch) != (layout.target_id, layout.epoch):
            return  # that epoch's sequences are gone already
        if args.detach:  # the target is shutting down: let its pool's memory go now
            log.info("target %s detached (epoch %d): unmapping its pool", layout.target_id, layout.epoch)
            drafter.unbind()
            self.negotiated = None
            self.metrics.set_state("waiting")
            self.metrics.mapped_bytes.set(0)
            return
        if not args.seq_ids:
            drafter.forget_all()
        for seq_id in args.seq_ids:
            drafter.forget(seq_id)

    def close(self) -> None:
        self.stop_channel()
        if self.drafter is not None:
            self.drafter.unbind()
