"""The drafter's gRPC server: splitspec.v1.Drafter, health and reflection.

State machine (DESIGN.md §3): Negotiate (facts) → Attach (layout, pool, canary) →
Propose / Release. Every call — handshakes, forwards — runs on the event loop's thread,
one at a time in arrival order, so the drafter needs no locks; only model loading (before
the drafter is handed to the host) and the final close run on a helper thread.
Exceptions become status codes through `ERRORS` (common/grpc_errors.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch

from common.auth import TokenAuthInterceptor
from common.grpc_errors import ErrorMapper, ErrorMappingInterceptor, ErrorTable
from common.grpc_server import (
    HealthReporter,
    check_listen_config,
    install_stop_signals,
    listen_address,
    server_options,
)
from common.kv_layout import (
    KVLayout,
    LayerSpec,
    LayoutNotResolvedError,
    LayoutResolutionError,
    canonical_kv_dtype,
    resolve_order,
)
from common.layout_proto import (
    drafter_kind_to_proto,
    kv_dtype_from_proto,
    kv_layout_from_proto,
    layer_spec_to_proto,
    order_from_proto,
    order_to_proto,
    orders_from_proto,
)
from common.metrics_http import metrics_host, start_metrics_server
from common.pool_transport import Canary, TransportError, map_pool, read_canary, sync_for_handoff
from common.shm_file import PoolAccessDenied
from common.threads import apply_threads, drafter_threads
from draft_service.drafters import (
    Drafter,
    DrafterConfig,
    IncompatibleTargetError,
    TargetInfo,
    Update,
    load_drafter,
)
from draft_service.drafters.base import mismatch, raise_mismatches
from draft_service.metrics import DrafterMetrics
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = dpb.DESCRIPTOR.services_by_name["Drafter"].full_name  # "splitspec.v1.Drafter"
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


ERROR_STATUS: ErrorTable = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (IncompatibleTargetError, grpc.StatusCode.FAILED_PRECONDITION),
    (LayoutNotResolvedError, grpc.StatusCode.FAILED_PRECONDITION),
    (LayoutResolutionError, grpc.StatusCode.FAILED_PRECONDITION),
    (TransportError, grpc.StatusCode.FAILED_PRECONDITION),
    (PoolAccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (HandshakeError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE),
)
ERRORS = ErrorMapper(ERROR_STATUS, log, log_name="drafter", mapped_level=logging.INFO)


# ---------------------------------------------------------------- proto → plain values


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
    )


def _update(msg: dpb.SequenceUpdate) -> Update:
    return Update(
        seq_id=msg.seq_id,
        context_start=msg.context_start,
        context_token_ids=tuple(msg.context_token_ids),
        last_token_id=msg.last_token_id,
        new_pages=tuple(msg.new_pages),
        staging_row=msg.staging_row,
        num_speculative_tokens=msg.num_speculative_tokens,
    )


def _draft_layer_key(spec: LayerSpec) -> tuple:
    return (spec.index, spec.num_kv_heads, spec.head_dim, spec.k_scale, spec.v_scale)


# ---------------------------------------------------------------- the state machine


@dataclass
class _Negotiated:
    target_id: str
    target: TargetInfo


class DrafterHost:
    """The drafter plus its handshake state; every method runs on the event loop's thread."""

    def __init__(self, metrics: DrafterMetrics | None = None) -> None:
        self.drafter: Drafter | None = None
        self.negotiated: _Negotiated | None = None
        self.max_model_len = 0
        self.metrics = metrics or DrafterMetrics()

    def require(self) -> Drafter:
        if self.drafter is None:
            raise NotReadyError("the draft model is still loading; watch grpc.health.v1.Health for SERVING")
        return self.drafter

    # -- Negotiate -------------------------------------------------------------------------

    def negotiate(self, request: dpb.NegotiateRequest) -> dpb.NegotiateResponse:
        drafter = self.require()
        if not request.target_id:
            raise InvalidArgumentError("target_id", "is required")
        target = target_info(request.target)
        if drafter.cache_config.is_layout_resolved and drafter.layout.target_id != request.target_id:
            log.info("target %s replaces %s: dropping the old mapping", request.target_id, drafter.layout.target_id)
            drafter.unbind()
            self.metrics.mapped_bytes.set(0)
        drafter.check_target(target)
        self._check_cache_wishes(drafter, target)
        resolve_order(
            request.requested_order or "auto",
            target_supported=orders_from_proto(request.target.supported_orders),
            target_preferred=order_from_proto(request.target.preferred_order, default=""),
            drafter_supported=drafter.supported_orders(),
        )
        self.negotiated = _Negotiated(request.target_id, target)
        if not drafter.cache_config.is_layout_resolved:
            self.metrics.set_state("negotiated")
        log.info("negotiated with target %s (%s): %s, K=%d", request.target_id, target.architecture or "?",
                 drafter.kind, drafter.num_speculative_tokens)
        return dpb.NegotiateResponse(
            kind=drafter_kind_to_proto(drafter.kind),
            layers=[layer_spec_to_proto(spec) for spec in drafter.layer_specs()],
            target_layer_ids=drafter.target_layer_ids(),
            supported_orders=[order_to_proto(o) for o in drafter.supported_orders()],
            num_speculative_tokens=drafter.num_speculative_tokens,
            model_id=drafter.model_id,
        )

    @staticmethod
    def _check_cache_wishes(drafter: Drafter, target: TargetInfo) -> None:
        problems = []
        wish = drafter.cache_config.cache_dtype
        if wish != "auto" and target.kv_dtype and canonical_kv_dtype(wish, torch.float32) != target.kv_dtype:
            problems.append(mismatch("kv_dtype", target.kv_dtype, canonical_kv_dtype(wish, torch.float32)))
        if drafter.needs_pool and target.device_type != drafter.device.type:
            problems.append(mismatch("device_type", target.device_type, drafter.device.type))
        raise_mismatches(problems)

    # -- Attach ----------------------------------------------------------------------------

    def attach(self, request: dpb.AttachRequest) -> dpb.AttachResponse:
        try:
            reply = self._attach(request)
        except Exception:
            self.metrics.attaches.labels(result="error").inc()
            self.metrics.set_state("negotiated" if self.negotiated else "waiting")
            self.metrics.mapped_bytes.set(0)
            raise
        self.metrics.attaches.labels(result="ok").inc()
        self.metrics.set_state("attached")
        self.metrics.mapped_bytes.set(reply.mapped_bytes)
        self.metrics.epoch.set(reply.epoch)
        return reply

    def _attach(self, request: dpb.AttachRequest) -> dpb.AttachResponse:
        drafter = self.require()
        try:
            layout = kv_layout_from_proto(request.layout)
        except ValueError as exc:
            raise InvalidArgumentError("layout", str(exc)) from exc
        if not layout.target_id:
            raise InvalidArgumentError("layout.target_id", "is required")
        if self.negotiated is None or self.negotiated.target_id != layout.target_id:
            raise HandshakeError(f"Attach for target {layout.target_id!r} before its Negotiate; call Negotiate first")
        drafter.unbind()  # any Attach starts a fresh epoch: old mappings and sequences go first
        self._check_layout(drafter, layout)
        pool = None
        if drafter.needs_pool:
            canary = self._requested_canary(request, layout)  # before the pool file is touched
            pool = map_pool(layout, request.pool, drafter.cache_config.shm_dir, canary)
            self._check_pool(drafter, pool, canary)
        drafter.bind(pool, layout)
        self.max_model_len = self.negotiated.target.max_model_len
        mapped = layout.total_bytes if pool is not None else 0
        log.info("attached to target %s epoch %d: %s pages of %d tokens, %s %s, %.1f MiB mapped",
                 layout.target_id, layout.epoch, layout.num_pages, layout.page_size, layout.kv_dtype, layout.order,
                 mapped / MiB)
        return dpb.AttachResponse(target_id=layout.target_id, epoch=layout.epoch, mapped_bytes=mapped)

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
    def _requested_canary(request: dpb.AttachRequest, layout: KVLayout) -> Canary:
        canary = request.canary
        if not canary.value:
            raise InvalidArgumentError("canary.value", "is required")
        if canary.offset + len(canary.value) > layout.total_bytes:
            message = f"{canary.offset} + {len(canary.value)} bytes pass the pool's end"
            raise InvalidArgumentError("canary.offset", message)
        return Canary(canary.offset, canary.value)

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

    def propose(self, request: dpb.ProposeRequest) -> dpb.ProposeResponse:
        started = time.monotonic()
        reply = self._propose(request)
        self.metrics.propose_latency.observe(time.monotonic() - started)
        return reply

    def _propose(self, request: dpb.ProposeRequest) -> dpb.ProposeResponse:
        drafter = self.require()
        layout = drafter.layout  # LayoutNotResolvedError before Attach
        if (request.target_id, request.epoch) != (layout.target_id, layout.epoch):
            raise LayoutNotResolvedError(
                f"Propose for target {request.target_id!r} epoch {request.epoch}, but the drafter is attached to "
                f"target {layout.target_id!r} epoch {layout.epoch}; Negotiate and Attach again"
            )
        updates = [_update(msg) for msg in request.sequences]
        self._validate(drafter, layout, updates)
        rows = self._copy_staging_rows(drafter, updates)  # first: the target reuses staging next step
        for seq_id in request.released_seq_ids:
            drafter.forget(seq_id)
        items = []
        for update, new_rows in zip(updates, rows):
            seq = drafter.update(update)
            if seq is not None:
                items.append((seq, new_rows, self._num_drafts(drafter, update, seq.last_position)))
        self.metrics.propose_batch.observe(sum(1 for _, _, k in items if k > 0))
        try:
            drafts = drafter.propose(items)
        except Exception:
            for seq, _, _ in items:  # their draft state is unknown now
                drafter.forget(seq.seq_id)
            raise
        sync_for_handoff(drafter.device)  # draft-page writes land before the target's next step
        self.metrics.draft_tokens.inc(sum(len(t) for t in drafts.values()))
        return dpb.ProposeResponse(drafts=[dpb.Draft(seq_id=s, token_ids=t) for s, t in drafts.items() if t])

    def _num_drafts(self, drafter: Drafter, update: Update, last_position: int) -> int:
        k = min(update.num_speculative_tokens, drafter.num_speculative_tokens)
        if self.max_model_len:
            k = min(k, self.max_model_len - 1 - last_position)
        return max(k, 0)

    @staticmethod
    def _validate(drafter: Drafter, layout: KVLayout, updates: list[Update]) -> None:
        """Every field, before any state changes: a bad request changes nothing."""
        seen: set[int] = set()
        vocab = drafter.vocab_size
        for i, u in enumerate(updates):
            where = f"sequences[{i}]"
            if u.seq_id in seen:
                raise InvalidArgumentError(f"{where}.seq_id", f"{u.seq_id} appears twice")
            seen.add(u.seq_id)
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
            if drafter.feature_width and u.context_token_ids:
                end = u.staging_row + len(u.context_token_ids)
                if end > layout.staging.rows:
                    message = f"rows [{u.staging_row}, {end}) exceed the {layout.staging.rows} staging rows"
                    raise InvalidArgumentError(f"{where}.staging_row", message)
            DrafterHost._validate_pages(drafter, layout, u, where)

    @staticmethod
    def _validate_pages(drafter: Drafter, layout: KVLayout, u: Update, where: str) -> None:
        """The block table of an in-sync sequence must cover its context tokens."""
        if u.context_start == 0:
            num_pages = len(u.new_pages)
        elif (seq := drafter.sequences.get(u.seq_id)) is not None and seq.context_len == u.context_start:
            num_pages = len(seq.block_table) + len(u.new_pages)
        else:
            return  # out of sync: it will be dropped, not read
        needed = u.context_start + len(u.context_token_ids)
        if num_pages * layout.page_size < needed:
            message = f"the block table's {num_pages} pages hold fewer than the {needed} context tokens"
            raise InvalidArgumentError(f"{where}.new_pages", message)

    @staticmethod
    def _copy_staging_rows(drafter: Drafter, updates: list[Update]) -> list[torch.Tensor | None]:
        if not drafter.feature_width or drafter.pool is None:
            return [None] * len(updates)
        staging = drafter.pool.staging()  # [rows, width]
        return [
            staging[u.staging_row : u.staging_row + len(u.context_token_ids)].clone() if u.context_token_ids else None
            for u in updates
        ]

    # -- Release ---------------------------------------------------------------------------

    def release(self, request: dpb.ReleaseRequest) -> dpb.ReleaseResponse:
        drafter = self.require()
        if not drafter.cache_config.is_layout_resolved:
            return dpb.ReleaseResponse()
        layout = drafter.layout
        if (request.target_id, request.epoch) != (layout.target_id, layout.epoch):
            return dpb.ReleaseResponse()  # that epoch's sequences are gone already
        if request.detach:  # the target is shutting down: let its pool's memory go now
            log.info("target %s detached (epoch %d): unmapping its pool", layout.target_id, layout.epoch)
            drafter.unbind()
            self.negotiated = None
            self.metrics.set_state("waiting")
            self.metrics.mapped_bytes.set(0)
            return dpb.ReleaseResponse()
        if not request.seq_ids:
            drafter.forget_all()
        for seq_id in request.seq_ids:
            drafter.forget(seq_id)
        return dpb.ReleaseResponse()

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.unbind()


class DrafterServicer(dpb_grpc.DrafterServicer):
    """Runs every call on the event loop's thread, one at a time.

    The drafter serves one target whose engine thread calls it serially, so there is
    nothing to overlap; a worker thread would cost two GIL handoffs per call (0.4 ms of a
    6 ms Propose on the demo pair). While a call runs the loop answers nothing else, health
    checks included: they wait for at most one call.
    """

    def __init__(self, host: DrafterHost) -> None:
        self._host = host

    async def Negotiate(self, request, context):
        return self._host.negotiate(request)

    async def Attach(self, request, context):
        return self._host.attach(request)

    async def Propose(self, request, context):
        return self._host.propose(request)

    async def Release(self, request, context):
        return self._host.release(request)


# ---------------------------------------------------------------- server assembly


@dataclass
class DraftServeConfig:
    drafter: DrafterConfig
    token: str = field(repr=False, default="")
    host: str = "127.0.0.1"  # or "unix:///path/to.sock" (the port is then ignored)
    port: int = 50061  # 0 → any free port (logged)
    max_message_bytes: int = 64 * MiB
    shutdown_grace_s: float = 5.0
    metrics_host: str | None = None  # None → the gRPC host (loopback for a unix: host)
    metrics_port: int = 9401  # 0 → no metrics endpoint
    threads: int | None = None  # torch CPU threads; None → 1 on a CPU, torch's default on a GPU

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in [0, 65535], got {self.metrics_port}")
        if not self.token:
            raise ValueError("the internal token is required (KV pages hold users' prompts)")
        check_listen_config(self.port, self.max_message_bytes, self.shutdown_grace_s)

    @property
    def address(self) -> str:
        return listen_address(self.host, self.port)


@dataclass
class RunningDrafter:
    server: grpc.aio.Server
    health: HealthReporter
    host: DrafterHost
    executor: concurrent.futures.ThreadPoolExecutor
    port: int


async def start_server(config: DraftServeConfig) -> RunningDrafter:
    """Listen with every service registered and health NOT_SERVING; the drafter loads later."""
    auth = TokenAuthInterceptor(config.token, protected=(SERVICE_NAME,))
    errors = ErrorMappingInterceptor(ERRORS, (SERVICE_NAME,))
    server = grpc.aio.server(interceptors=[auth, errors], options=server_options(config.max_message_bytes))
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter-load")
    host = DrafterHost()
    dpb_grpc.add_DrafterServicer_to_server(DrafterServicer(host), server)
    health = HealthReporter(server, SERVICE_NAME)
    port = server.add_insecure_port(config.address)
    running = RunningDrafter(server, health, host, executor, port)
    await running.health.set_serving(False)
    await server.start()
    where = config.host if config.host.startswith("unix:") else f"{config.host}:{port}"
    log.info("splitspec-draft listening on %s", where)
    return running


async def serve(config: DraftServeConfig) -> int:
    """Run until SIGTERM/SIGINT; the process exit code."""
    stop = asyncio.Event()
    remove_signals = install_stop_signals(stop, log)
    running = await start_server(config)
    loop = asyncio.get_running_loop()
    stop_metrics = None
    try:
        if config.metrics_port:
            stop_metrics = start_metrics_server(metrics_host(config.host, config.metrics_host), config.metrics_port,
                                                running.host.metrics.registry)
        apply_threads(drafter_threads(config.threads, config.drafter.device), log)
        load = loop.run_in_executor(running.executor, load_drafter, config.drafter)
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((load, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            drafter = load.result()
            running.host.drafter = drafter
            running.host.metrics.set_state("waiting")
            await running.health.set_serving(True)
            log.info("serving %s drafter %s (K=%d, device %s)", drafter.kind, drafter.model_id or "-",
                     drafter.num_speculative_tokens, drafter.device)
            await stopping
        return 0
    except Exception:
        log.exception("the drafter failed to start")
        return 1
    finally:
        await running.health.set_serving(False)
        await running.server.stop(config.shutdown_grace_s)
        await loop.run_in_executor(running.executor, running.host.close)
        running.executor.shutdown(wait=True, cancel_futures=True)
        if stop_metrics is not None:
            stop_metrics()
        remove_signals()
        log.info("stopped")
