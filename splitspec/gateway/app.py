"""The gateway's routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Each generation request is one `Generate` call on the target. A streaming response
starts only once the target has admitted the request, so a refused request gets its
HTTP status (400, 429, 503) instead of a 200 stream that fails; a client that goes
away cancels the call, which aborts the request on the target and frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from splitspec.gateway import convert
from splitspec.gateway.config import GatewayConfig
from splitspec.gateway.errors import OpenAIError, from_rpc_error
from splitspec.gateway.memory import HeapTrimmer
from splitspec.gateway.metrics import GatewayMetrics
from splitspec.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    TEXT_PLACEHOLDER,
    ModelList,
    TextChunks,
)
from splitspec.gateway.target import TargetClient
from splitspec.gateway.validation import check_chat, check_completion, param_aliases, validation_error
from splitspec.v1 import generation_pb2 as pb


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTES = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")
SSE_PING_S = 15
IDENTITY_ENCODINGS = ("", "identity")
log = logging.getLogger("splitspec.gateway")


@dataclass
class Gateway:
    """What the routes share: settings, the target connection, metrics."""

    config: GatewayConfig
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    target: TargetClient | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    answered: int = 0  # HTTP responses started (the heap trimmer's sign of activity)

    def client(self) -> TargetClient:
        if self.target is None:
            raise OpenAIError(503, "the gateway is starting", "service_unavailable")
        return self.target


# ---------------------------------------------------------------- request bodies


def check_encoding(request: Request) -> None:
    """Bodies are plain JSON: any Content-Encoding (gzip, ...) is refused with 415 rather than
    parsed as if it were plain (decompressing would let 2 MiB on the wire become gigabytes)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in IDENTITY_ENCODINGS:
        raise OpenAIError(415, f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed",
                          "invalid_request_error", None, "unsupported_media_type")


def body_too_large(limit: int, declared: str | None = None) -> OpenAIError:
    size = f" ({declared} bytes)" if declared is not None else ""
    return OpenAIError(413, f"the request body{size} is larger than {limit} bytes (--max-body-bytes)",
                       "invalid_request_error", None, "request_too_large")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, or while it streams
    in), with 408 (and the connection closed) when it takes longer than `timeout_s`."""
    check_encoding(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, declared)
    parts, size = [], 0
    with anyio.move_on_after(timeout_s) as scope:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            parts.append(chunk)
    if scope.cancelled_caught:
        raise OpenAIError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout-s)",
                          "invalid_request_error", None, "request_timeout", close=True)
    return b"".join(parts)


async def parse(request: Request, model: type[pydantic.BaseModel], config: GatewayConfig):
    body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc) from None


# ---------------------------------------------------------------- generation


@dataclass(frozen=True)
class Plan:
    """What a route keeps of a parsed request once it is a GenerateRequest: parsed and
    converted with no await in between, so one request's Python objects (300,000 ints for
    a prompt of token ids) are alive at a time however many wait on the target."""

    model: str
    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    aliases: dict[str, str]

    @classmethod
    def of(cls, req: CompletionRequest | ChatCompletionRequest, request: pb.GenerateRequest) -> Plan:
        include_usage = req.stream and req.stream_options is not None and req.stream_options.include_usage
        return cls(req.model, request, req.stream, include_usage, param_aliases(req))


@dataclass
class Generation:
    """One request in flight: its OpenAI id, endpoint, the admitted call and timings."""

    gateway: Gateway
    endpoint: str
    request_id: str
    model: str
    call: grpc.aio.UnaryStreamCall
    arrival: float
    created: int = field(default_factory=lambda: int(time.time()))
    first_text_at: float | None = None
    finished: bool = False
    aliases: dict[str, str] = field(default_factory=dict)  # the target's OpenAI param name → the one sent

    def saw_text(self) -> None:
        if self.first_text_at is None:
            self.first_text_at = time.perf_counter()
            self.gateway.metrics.ttft.labels(self.endpoint).observe(self.first_text_at - self.arrival)

    def done(self, complete: pb.Complete | None) -> None:
        """Record the end, once (complete is None: the client went away or the call failed)."""
        if self.finished:
            return
        self.finished = True
        m = self.gateway.metrics
        self.call.cancel()  # a no-op when the call has ended; else the target aborts the request
        m.in_flight.labels(self.endpoint).dec()
        m.duration.labels(self.endpoint).observe(time.perf_counter() - self.arrival)
        if complete is not None:
            m.prompt_tokens.inc(complete.usage.prompt_tokens)
            m.generation_tokens.inc(complete.usage.completion_tokens)


async def check_model(gateway: Gateway, name: str) -> str:
    """The served model name; 404 (as OpenAI and vLLM) for any other."""
    try:
        info = await gateway.client().model_info()
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from None
    served = gateway.config.served_model_name or info.model_id
    if name not in (served, info.model_id):
        raise OpenAIError(404, f"The model `{name}` does not exist (this gateway serves `{served}`).",
                          "not_found_error", "model", "model_not_found")
    return served


async def start(gateway: Gateway, endpoint: str, request_id: str, model: str, request: pb.GenerateRequest,
                arrival: float, aliases: dict[str, str]) -> Generation:
    try:
        call = await gateway.client().start(request, gateway.config.request_timeout_s or None)
    except grpc.aio.AioRpcError as exc:
        gateway.metrics.target_errors.labels(exc.code().name).inc()
        raise from_rpc_error(exc, aliases) from None
    gateway.metrics.in_flight.labels(endpoint).inc()
    return Generation(gateway, endpoint, request_id, model, call, arrival, aliases=aliases)


async def collect(gen: Generation) -> tuple[str, pb.Complete]:
    """Read the whole call: its text and Complete (OpenAIError when it fails)."""
    parts: list[str] = []
    try:
        async for response in gen.call:
            if response.HasField("chunk"):
                if response.chunk.text:
                    gen.saw_text()
                    parts.append(response.chunk.text)
            else:
                return "".join(parts), response.complete
    except grpc.aio.AioRpcError as exc:
        gen.gateway.metrics.target_errors.labels(exc.code().name).inc()
        raise from_rpc_error(exc, gen.aliases) from None
    raise OpenAIError(502, "the target ended the stream without a Complete message", "upstream_error")


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_unless_disconnected(request: Request, gen: Generation) -> tuple[str, pb.Complete] | None:
    """`collect`, or None as soon as the client disconnects (the call is then cancelled).
    collect's error (an OpenAIError: the target died, a deadline) is raised as itself, not
    wrapped in the task group's ExceptionGroup, which no handler would map."""
    result, failure = None, None
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            await wait_disconnect(request)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await collect(gen)
        except Exception as exc:  # noqa: BLE001 (re-raised below, outside the group)
            failure = exc
        finally:
            group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


async def respond_whole(request: Request, gen: Generation, build) -> Response:
    complete = None
    try:
        result = await collect_unless_disconnected(request, gen)
        if result is None:
            gen.gateway.metrics.disconnects.labels(gen.endpoint).inc()
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        text, complete = result
        body = build(gen, text, complete)
        return Response(body.model_dump_json(), media_type="application/json",
                        headers={"x-request-id": gen.request_id})
    finally:
        gen.done(complete)


class GenerationStream(EventSourceResponse):
    """An SSE response that ends its Generation however the response ends, even when the
    client left before the first event (the events generator then never ran)."""

    def __init__(self, gen: Generation, events: AsyncIterator[str]) -> None:
        super().__init__(events, ping=SSE_PING_S, sep="\n", headers={"x-request-id": gen.request_id},
                         shutdown_grace_period=gen.gateway.config.shutdown_grace_s)
        self.generation = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.generation.finished:
                self.generation.gateway.metrics.disconnects.labels(self.generation.endpoint).inc()
                self.generation.done(None)


def respond_stream(gen: Generation, events: AsyncIterator[str]) -> EventSourceResponse:
    return GenerationStream(gen, events)


async def stream_events(gen: Generation, chunk, final, include_usage: bool) -> AsyncIterator[str]:
    """SSE data: one event per chunk of text, the finish, the usage if asked, then [DONE].
    Closing this generator early (the client went away) cancels the call."""
    complete, failed = None, False
    try:
        async for response in gen.call:
            if response.HasField("chunk"):
                if response.chunk.text:
                    gen.saw_text()
                    yield chunk(response.chunk.text)
            else:
                complete = response.complete
        if complete is None:
            raise OpenAIError(502, "the target ended the stream without a Complete message", "upstream_error")
        for event in final(complete, include_usage):
            yield event
        yield "[DONE]"
    except grpc.aio.AioRpcError as exc:
        failed = True
        gen.gateway.metrics.target_errors.labels(exc.code().name).inc()
        yield _error_event(from_rpc_error(exc, gen.aliases))
    except OpenAIError as exc:
        failed = True
        yield _error_event(exc)
    finally:
        if complete is None and not failed:  # closed or cancelled early: the client went away
            gen.gateway.metrics.disconnects.labels(gen.endpoint).inc()
        gen.done(complete)


def _error_event(exc: OpenAIError) -> str:
    return json.dumps(exc.body())


# ---------------------------------------------------------------- the two endpoints


def completion_body(gen: Generation, text: str, complete: pb.Complete) -> CompletionResponse:
    return CompletionResponse(id=gen.request_id, created=gen.created, model=gen.model,
                              choices=[CompletionChoice(text=text, finish_reason=convert.finish_reason(complete))],
                              usage=convert.usage(complete.usage))


def chat_body(gen: Generation, text: str, complete: pb.Complete) -> ChatCompletionResponse:
    return ChatCompletionResponse(id=gen.request_id, created=gen.created, model=gen.model,
                                  choices=[ChatChoice(message=AssistantMessage(content=text),
                                                      finish_reason=convert.finish_reason(complete))],
                                  usage=convert.usage(complete.usage))


def completion_events(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def event(text: str | None, finish: str | None = None, usage=None, choices: bool = True) -> str:
        listed = [CompletionChoice(text=text or "", finish_reason=finish)] if choices else []
        return CompletionResponse(id=gen.request_id, created=gen.created, model=gen.model, choices=listed,
                                  usage=usage).model_dump_json()

    def final(complete: pb.Complete, with_usage: bool) -> list[str]:
        events = [event("", convert.finish_reason(complete))]
        if with_usage:
            events.append(event(None, usage=convert.usage(complete.usage), choices=False))
        return events

    return stream_events(gen, TextChunks(CompletionResponse(
        id=gen.request_id, created=gen.created, model=gen.model,
        choices=[CompletionChoice(text=TEXT_PLACEHOLDER, finish_reason=None)])), final, include_usage)


def chat_events(gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    def event(delta: dict[str, str] | None, finish: str | None = None, usage=None) -> str:
        choices = [ChatChunkChoice(delta=delta, finish_reason=finish)] if delta is not None else []
        return ChatCompletionChunk(id=gen.request_id, created=gen.created, model=gen.model, choices=choices,
                                   usage=usage).model_dump_json()

    def final(complete: pb.Complete, with_usage: bool) -> list[str]:
        events = [event({}, convert.finish_reason(complete))]
        if with_usage:
            events.append(event(None, usage=convert.usage(complete.usage)))
        return events

    async def with_role() -> AsyncIterator[str]:
        yield event({"role": "assistant", "content": ""})
        text = TextChunks(ChatCompletionChunk(id=gen.request_id, created=gen.created, model=gen.model,
                                              choices=[ChatChunkChoice(delta={"content": TEXT_PLACEHOLDER})]))
        async with contextlib.aclosing(stream_events(gen, text, final, include_usage)) as events:
            async for data in events:
                yield data

    return with_role()


# ---------------------------------------------------------------- the app


def _record_status(gateway: Gateway):
    """Pure ASGI middleware: splitspec_gateway_requests_total{endpoint, status}. An error no
    handler mapped is answered here, in OpenAI's shape, as a 500 that is counted too (past
    this middleware Starlette would answer a plain-text 500 nobody counts)."""

    def wrap(app):
        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            endpoint = scope["path"] if scope["path"] in ROUTES else "other"
            started = False

            async def recording_send(message):
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                    gateway.answered += 1
                    gateway.metrics.requests.labels(endpoint, str(message["status"])).inc()
                await send(message)

            try:
                await app(scope, receive, recording_send)
            except Exception as exc:
                if started:
                    raise
                log.exception("%s %s failed", scope.get("method"), scope["path"])
                await internal_error(exc).response()(scope, receive, recording_send)

        return middleware

    return wrap


def internal_error(exc: Exception) -> OpenAIError:
    return OpenAIError(500, f"the gateway failed: {type(exc).__name__}: {exc}"[:500], "internal_error", None,
                       "internal_error")


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.target = TargetClient(config.target, config.tls_ca, config.max_message_bytes)
        trimmer = asyncio.create_task(HeapTrimmer(lambda: gateway.answered, config.trim_interval_s).run())
        try:
            yield
        finally:
            trimmer.cancel()
            await gateway.target.close()

    app = FastAPI(title="splitspec-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.add_middleware(_record_status(gateway))

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # one quiet line: a client hanging up mid-upload is no server error
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s disconnected while sending its %s %s body", client, request.method, request.url.path)
        if request.url.path in (COMPLETIONS, CHAT):
            gateway.metrics.disconnects.labels(request.url.path).inc()
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await parse(request, CompletionRequest, config)
        if (found := check_completion(req)) is not None:
            raise found
        request_id = f"cmpl-{uuid.uuid4().hex}"
        plan = Plan.of(req, convert.completion_request(req, request_id))
        del req  # a prompt of token ids is 28 bytes a Python int: keep only the protobuf's 4 a token
        gen = await start(gateway, COMPLETIONS, request_id, await check_model(gateway, plan.model), plan.request,
                          arrival, plan.aliases)
        if plan.stream:
            return respond_stream(gen, completion_events(gen, plan.include_usage))
        return await respond_whole(request, gen, completion_body)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await parse(request, ChatCompletionRequest, config)
        if (found := check_chat(req)) is not None:
            raise found
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        plan = Plan.of(req, convert.chat_request(req, request_id))
        del req
        gen = await start(gateway, CHAT, request_id, await check_model(gateway, plan.model), plan.request, arrival,
                          plan.aliases)
        if plan.stream:
            return respond_stream(gen, chat_events(gen, plan.include_usage))
        return await respond_whole(request, gen, chat_body)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            info = await gateway.client().model_info(refresh=True)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        card = ModelCard(id=config.served_model_name or info.model_id, created=gateway.started,
                         root=info.model_id, max_model_len=info.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        status = await gateway.client().health(config.health_timeout_s)
        return JSONResponse({"status": status, "target": config.target},
                            status_code=200 if status == "SERVING" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
