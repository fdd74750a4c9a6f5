"""The drafter's gRPC server: splitspec.v1.Drafter, health and reflection.

Each call is convert (convert.py) → the host's state machine on plain values (host.py) →
convert back, in the four functions below, which the servicer runs on the event loop's
thread and `LocalDrafterStub` (local.py) calls in-process. Exceptions become status codes
through `ERRORS` (common/grpc_errors.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass, field

import grpc

from common.auth import TokenAuthInterceptor
from common.grpc_errors import ErrorMapper, ErrorMappingInterceptor, ErrorTable, parse_request
from common.grpc_server import (
    HealthReporter,
    check_listen_config,
    install_stop_signals,
    listen_address,
    server_options,
)
from common.kv_layout import LayoutNotResolvedError, LayoutResolutionError
from common.metrics_http import check_metrics_port, metrics_host, start_metrics_server
from common.pool_transport import TransportError
from common.shm_channel import ChannelRequestTooLarge
from common.shm_file import PoolAccessDenied
from common.threads import apply_threads, drafter_threads
from draft_service import convert
from draft_service.drafters import DrafterConfig, IncompatibleTargetError, load_drafter
from draft_service.host import (
    ChannelService,
    DrafterHost,
    HandshakeError,
    InvalidArgumentError,
    MiB,
    NotReadyError,
)
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = dpb.DESCRIPTOR.services_by_name["Drafter"].full_name  # "splitspec.v1.Drafter"

ERROR_STATUS: ErrorTable = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (ChannelRequestTooLarge, grpc.StatusCode.INVALID_ARGUMENT),
    (IncompatibleTargetError, grpc.StatusCode.FAILED_PRECONDITION),
    (LayoutNotResolvedError, grpc.StatusCode.FAILED_PRECONDITION),
    (LayoutResolutionError, grpc.StatusCode.FAILED_PRECONDITION),
    (TransportError, grpc.StatusCode.FAILED_PRECONDITION),
    (PoolAccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (HandshakeError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE),
)
ERRORS = ErrorMapper(ERROR_STATUS, log, log_name="drafter", mapped_level=logging.INFO)


# ---------------------------------------------------------------- the four calls, on protos


def negotiate(host: DrafterHost, request: dpb.NegotiateRequest) -> dpb.NegotiateResponse:
    host.stop_channel()  # a (re)negotiation precedes a new Attach: the old epoch's channel ends
    with host.lock:
        return convert.negotiate_response(host.negotiate(convert.negotiate_args(request)))


def attach(host: DrafterHost, request: dpb.AttachRequest) -> dpb.AttachResponse:
    host.stop_channel()
    with host.lock, host.attach_attempt():  # a malformed Attach counts as a failed one
        host.require()  # a loading drafter is UNAVAILABLE, whatever the message holds
        return convert.attach_response(host.attach(convert.attach_args(request)))


def propose(host: DrafterHost, request: dpb.ProposeRequest) -> dpb.ProposeResponse:
    """One batched step: the target's new context and releases in, drafts out."""
    with host.lock:
        args = convert.propose_args(request)
        drafts = host.propose(args)
        return convert.propose_response(drafts, host.written_context(args.updates))


def release(host: DrafterHost, request: dpb.ReleaseRequest) -> dpb.ReleaseResponse:
    args = convert.release_args(request)
    if args.detach:
        host.stop_channel()
    with host.lock:
        host.release(args)
    return dpb.ReleaseResponse()


def channel_service(host: DrafterHost) -> ChannelService:
    """Propose on the pool's shm channel: the bytes gRPC would carry, the same call, and the
    status gRPC would answer (common/shm_channel.py)."""

    def handle(raw: bytes) -> bytes:
        return propose(host, parse_request(raw, dpb.ProposeRequest.FromString)).SerializeToString()

    def error_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
        code, details = ERRORS.status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("Propose on the shm channel failed", exc_info=exc)
        else:
            log.info("Propose on the shm channel: %s: %s", code.name, details)
        return code, details

    return ChannelService(handle, error_status)


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
        return negotiate(self._host, request)

    async def Attach(self, request, context):
        return attach(self._host, request)

    async def Propose(self, request, context):
        return propose(self._host, request)

    async def Release(self, request, context):
        return release(self._host, request)


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
        check_metrics_port(self.metrics_port)
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
    host.channel_service = channel_service(host)
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
            running.host.serve(drafter)
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
