"""The public gRPC server: splitspec.v1.Generation, health and reflection.

The server listens (health NOT_SERVING) before the model loads, so orchestrators can
watch it come up; it flips to SERVING after the engine is built and warmed up, and back
to NOT_SERVING on SIGTERM/SIGINT before draining. Exceptions become status codes in one
place, `ErrorMappingInterceptor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.kv_layout import LayoutNotResolvedError
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from target_service import convert
from target_service.api_types import EngineClient, InvalidRequestError, QueueFullError, ShuttingDownError
from target_service.engine import AsyncEngine, EngineConfig

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "splitspec.v1.Generation"
HEALTH_SERVICES = ("", SERVICE_NAME)
HEALTH_SERVING = health_pb2.HealthCheckResponse.SERVING
HEALTH_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REQUEST_ID_METADATA = "splitspec-request-id"
MiB = 1 << 20


class EngineNotReadyError(RuntimeError):
    """The model is still loading or warming up."""


# ---------------------------------------------------------------- errors → status codes

ERROR_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (EngineNotReadyError, grpc.StatusCode.UNAVAILABLE),
    (LayoutNotResolvedError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details for an exception a handler raised."""
    for exc_type, code in ERROR_STATUS:
        if isinstance(exc, exc_type):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__} (see the server log)"


async def _abort_with(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    code, details = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    else:
        log.debug("%s: %s: %s", method, code.name, details)
    await context.abort(code, details)


def _wrap_unary(behavior, method: str):
    async def wrapper(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with(exc, context, method)

    return wrapper


def _wrap_stream(behavior, method: str):
    async def wrapper(request, context):
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with(exc, context, method)

    return wrapper


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions from this project's services to status codes (see ERROR_STATUS)."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self._prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


# ---------------------------------------------------------------- the service


class EngineSlot:
    """Holds the engine once it is ready; handlers ask it instead of a module global."""

    def __init__(self) -> None:
        self._engine: EngineClient | None = None

    def set(self, engine: EngineClient | None) -> None:
        self._engine = engine

    def require(self) -> EngineClient:
        if self._engine is None:
            raise EngineNotReadyError("the model is still loading; watch grpc.health.v1.Health for SERVING")
        return self._engine


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, slot: EngineSlot, defaults: convert.RequestDefaults) -> None:
        self._slot = slot
        self._defaults = defaults

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        engine = self._slot.require()
        tokenizer, info = engine.tokenizer(), engine.model_info
        engine_request = convert.engine_request(request, tokenizer, info, self._defaults)
        outputs = engine.generate(engine_request)
        # Closing the engine's iterator (on cancel, deadline or a failed write) frees the
        # sequence and its pages at the next step.
        async with contextlib.aclosing(outputs):
            await context.send_initial_metadata(((REQUEST_ID_METADATA, engine_request.request_id),))
            async for output in outputs:
                for response in convert.responses(output):
                    yield response

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            raise InvalidRequestError("request_id", "is required")
        return pb.AbortResponse(found=self._slot.require().abort(request.request_id))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return convert.model_info(self._slot.require().model_info)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        return convert.server_info(self._slot.require().server_info())


# ---------------------------------------------------------------- server assembly


@dataclass
class ServeConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0 → any free port (logged)
    shutdown_grace_s: float = 30.0
    max_message_bytes: int = 64 * MiB
    defaults: convert.RequestDefaults = field(default_factory=convert.RequestDefaults)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown grace must be >= 0, got {self.shutdown_grace_s}")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max message size must be positive, got {self.max_message_bytes}")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    slot: EngineSlot
    port: int

    async def set_serving(self, serving: bool) -> None:
        status = HEALTH_SERVING if serving else HEALTH_NOT_SERVING
        for service in HEALTH_SERVICES:
            await self.health.set(service, status)


def _channel_options(config: ServeConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
    ]


async def start_server(config: ServeConfig) -> RunningServer:
    """Listen with every service registered and health NOT_SERVING."""
    interceptors = [ErrorMappingInterceptor((SERVICE_NAME,))]
    server = grpc.aio.server(interceptors=interceptors, options=_channel_options(config))
    slot = EngineSlot()
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(slot, config.defaults), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(config.address)
    running = RunningServer(server, health_servicer, slot, port)
    await running.set_serving(False)
    await server.start()
    log.info("splitspec-target listening on %s:%d", config.host, port)
    return running


def _install_stop_signals(stop: asyncio.Event) -> Callable[[], None]:
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(signum: int) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    def remove() -> None:
        for signum in signals:
            loop.remove_signal_handler(signum)

    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    return remove


async def _build_engine(config: EngineConfig, stop: asyncio.Event, build) -> AsyncEngine | None:
    """Build in a thread (it cannot be interrupted); None when a stop signal came first."""
    build_task = asyncio.ensure_future(asyncio.to_thread(build, config))
    stop_task = asyncio.ensure_future(stop.wait())
    await asyncio.wait((build_task, stop_task), return_when=asyncio.FIRST_COMPLETED)
    stop_task.cancel()
    engine = await build_task  # a stop mid-load still waits for the pool, so it can be freed
    if stop.is_set():
        log.info("stopped while loading; releasing the engine")
        await engine.shutdown(0)
        return None
    return engine


async def _drain(running: RunningServer, engine: AsyncEngine | None, grace_s: float) -> None:
    """NOT_SERVING, stop admitting, let in-flight streams finish within grace_s, stop."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    await running.set_serving(False)
    if engine is not None:
        engine.stop_admitting()
        reserve = min(1.0, grace_s / 10)  # time left for the aborted streams to send Complete
        await engine.shutdown(max(0.0, grace_s - reserve))
    await running.server.stop(max(0.0, started + grace_s - loop.time()))
    log.info("drained in %.2f s (grace %.1f s)", loop.time() - started, grace_s)


async def serve(config: ServeConfig, build: Callable[[EngineConfig], AsyncEngine] = AsyncEngine.build) -> int:
    """Run the server until SIGTERM/SIGINT; the process exit code."""
    try:
        running = await start_server(config)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        log.error("cannot serve on %s: %s", config.address, exc)
        return 1
    stop = asyncio.Event()
    remove_signals = _install_stop_signals(stop)
    engine = None
    try:
        engine = await _build_engine(config.engine, stop, build)
        if engine is not None:
            await engine.start()
            running.slot.set(engine)
            await running.set_serving(True)
            log.info("serving %s", engine.model_info.model_id)
            await stop.wait()
        return 0
    except Exception:
        log.exception("the target failed to start")
        return 1
    finally:
        await _drain(running, engine, config.shutdown_grace_s)
        remove_signals()
        log.info("stopped")
