"""The public gRPC server: splitspec.v1.Generation, health and reflection.

The server listens (health NOT_SERVING) before the model loads, so orchestrators can
watch it come up; it flips to SERVING after the engine is built and warmed up, and back
to NOT_SERVING on SIGTERM/SIGINT before draining. Exceptions become status codes in one
place: `ERRORS` (common/grpc_errors.py) applied by an `ErrorMappingInterceptor`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from common.grpc_errors import ErrorMapper, ErrorMappingInterceptor, ErrorTable
from common.grpc_server import (
    HealthReporter,
    check_listen_config,
    install_stop_signals,
    listen_address,
    server_options,
)
from common.kv_layout import LayoutNotResolvedError
from common.metrics_http import check_metrics_port, metrics_host, start_metrics_server
from splitspec.contract import REQUEST_ID_METADATA
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from target_service import convert
from target_service.api_types import (
    EngineClient,
    EngineRequest,
    InvalidRequestError,
    QueueFullError,
    ShuttingDownError,
)
from target_service.async_engine import AsyncEngine
from target_service.config import EngineConfig
from target_service.prompt_tokens import PromptTokenizer
from target_service.structured_output import GrammarCompiler

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "splitspec.v1.Generation"
MiB = 1 << 20


class EngineNotReadyError(RuntimeError):
    """The model is still loading or warming up."""


# ---------------------------------------------------------------- errors → status codes

ERROR_STATUS: ErrorTable = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (EngineNotReadyError, grpc.StatusCode.UNAVAILABLE),
    (LayoutNotResolvedError, grpc.StatusCode.FAILED_PRECONDITION),
)
ERRORS = ErrorMapper(ERROR_STATUS, log, log_name="server")


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


class PromptReader:
    """GenerateRequest → EngineRequest, tokenizing (and compiling a structured output's grammar)
    on a few threads of its own.

    Never on the event loop: a 12 MB text once took 12 s to tokenize there, and every
    stream stopped meanwhile; on a thread the others go on (the tokenizer releases the
    GIL). At most `threads` prompts are tokenized at once, so a flood of long texts waits
    in line instead of fanning memory out; text that cannot fit the model is refused
    before it is tokenized. A grammar is compiled there too (its size bounded first), and kept
    in the compiler's bounded cache."""

    def __init__(self, defaults: convert.RequestDefaults, threads: int = 2) -> None:
        self._defaults = defaults
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._limits: convert.PromptLimits | None = None
        self._tokenizer: PromptTokenizer | None = None
        self._grammars: GrammarCompiler | None = None

    async def read(self, msg: pb.GenerateRequest, engine: EngineClient) -> EngineRequest:
        if msg.WhichOneof("input") not in ("text", "chat") and not msg.HasField("structured_output"):
            return self._convert(msg, engine)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._convert, msg, engine)

    def _convert(self, msg: pb.GenerateRequest, engine: EngineClient) -> EngineRequest:
        if self._limits is None:  # once per server; racing threads compute the same value
            self._limits = convert.PromptLimits.of(engine.tokenizer(), engine.model_info)
        if self._tokenizer is None:  # likewise
            self._tokenizer = PromptTokenizer(engine.tokenizer())
        request = convert.engine_request(msg, self._tokenizer, engine.model_info, self._defaults, self._limits)
        if request.structured_output is None:
            return request
        grammar = self.grammars(engine).compile(request.structured_output)
        return dataclasses.replace(request, grammar=grammar)

    def grammars(self, engine: EngineClient) -> GrammarCompiler:
        if self._grammars is None:  # once per server (a racing thread's copy is dropped)
            info = engine.model_info
            self._grammars = GrammarCompiler(engine.tokenizer(), info.vocab_size, info.eos_token_ids)
        return self._grammars

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, slot: EngineSlot, defaults: convert.RequestDefaults, tokenize_threads: int = 2) -> None:
        self._slot = slot
        self.prompts = PromptReader(defaults, tokenize_threads)
        self._token_texts: convert.TokenTexts | None = None  # once the engine (its tokenizer) is there

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        engine = self._slot.require()
        engine_request = await self.prompts.read(request, engine)
        outputs = engine.generate(engine_request)
        if self._token_texts is None:
            self._token_texts = convert.TokenTexts(engine.tokenizer())
        # Closing the engine's iterator (on cancel, deadline or a failed write) frees the
        # sequence and its pages at the next step.
        async with contextlib.aclosing(outputs):
            await context.send_initial_metadata(((REQUEST_ID_METADATA, engine_request.request_id),))
            async for output in outputs:
                for response in convert.responses(output, self._token_texts):
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


@dataclass(frozen=True)
class TLSConfig:
    """The public API's certificate chain and private key, PEM bytes."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if b"-----BEGIN CERTIFICATE-----" not in self.cert_chain:
            raise ValueError("the TLS certificate is not a PEM certificate (no BEGIN CERTIFICATE block)")
        if not re.search(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----", self.private_key):
            raise ValueError("the TLS key is not a PEM private key (no BEGIN ... PRIVATE KEY block)")

    @classmethod
    def from_files(cls, cert_file: str | None, key_file: str | None) -> TLSConfig | None:
        """Both files or neither (plaintext); a clear error naming the flag otherwise."""
        if not cert_file and not key_file:
            return None
        if not cert_file or not key_file:
            raise ValueError("--tls-cert and --tls-key go together: give both, or neither for plaintext")
        return cls(_read_pem(cert_file, "--tls-cert"), _read_pem(key_file, "--tls-key"))

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)])


def _read_pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror or exc}") from exc


@dataclass
class ServeConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0 → any free port (logged)
    shutdown_grace_s: float = 30.0
    max_message_bytes: int = 64 * MiB
    defaults: convert.RequestDefaults = field(default_factory=convert.RequestDefaults)
    metrics_host: str | None = None  # None → the gRPC host
    metrics_port: int = 9400  # 0 → no metrics endpoint
    tls: TLSConfig | None = None  # None → plaintext
    tokenize_threads: int = 2  # prompts tokenized at once, off the event loop

    def __post_init__(self) -> None:
        check_listen_config(self.port, self.max_message_bytes, self.shutdown_grace_s)
        if self.tokenize_threads <= 0:
            raise ValueError(f"tokenize_threads must be positive, got {self.tokenize_threads}")
        check_metrics_port(self.metrics_port)

    @property
    def address(self) -> str:
        return listen_address(self.host, self.port)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: HealthReporter
    slot: EngineSlot
    port: int
    servicer: GenerationServicer


async def start_server(config: ServeConfig) -> RunningServer:
    """Listen with every service registered and health NOT_SERVING."""
    interceptors = [ErrorMappingInterceptor(ERRORS, (SERVICE_NAME,))]
    server = grpc.aio.server(interceptors=interceptors, options=server_options(config.max_message_bytes))
    slot = EngineSlot()
    servicer = GenerationServicer(slot, config.defaults, config.tokenize_threads)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    health = HealthReporter(server, SERVICE_NAME)
    if config.tls is not None:
        port = server.add_secure_port(config.address, config.tls.credentials())
    else:
        port = server.add_insecure_port(config.address)
    running = RunningServer(server, health, slot, port, servicer)
    await running.health.set_serving(False)
    await server.start()
    log.info("splitspec-target listening on %s:%d%s", config.host, running.port,
             " (TLS)" if config.tls is not None else "")
    return running


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
    await running.health.set_serving(False)
    if engine is not None:
        engine.stop_admitting()
        reserve = min(1.0, grace_s / 10)  # time left for the aborted streams to send Complete
        await engine.shutdown(max(0.0, grace_s - reserve))
    await running.server.stop(max(0.0, started + grace_s - loop.time()))
    running.servicer.prompts.close()
    log.info("drained in %.2f s (grace %.1f s)", loop.time() - started, grace_s)


async def serve(config: ServeConfig, build: Callable[[EngineConfig], AsyncEngine] = AsyncEngine.build) -> int:
    """Run the server until SIGTERM/SIGINT; the process exit code."""
    try:
        running = await start_server(config)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        log.error("cannot serve on %s: %s", config.address, exc)
        return 1
    stop = asyncio.Event()
    remove_signals = install_stop_signals(stop, log)
    engine = None
    stop_metrics = None
    try:
        engine = await _build_engine(config.engine, stop, build)
        if engine is not None:
            if config.metrics_port:
                stop_metrics = start_metrics_server(metrics_host(config.host, config.metrics_host),
                                                    config.metrics_port, engine.core.metrics.registry)
            await engine.start()
            running.slot.set(engine)
            await running.health.set_serving(True)
            log.info("serving %s", engine.model_info.model_id)
            await stop.wait()
        return 0
    except Exception:
        log.exception("the target failed to start")
        return 1
    finally:
        await _drain(running, engine, config.shutdown_grace_s)
        if stop_metrics is not None:
            stop_metrics()
        remove_signals()
        log.info("stopped")
