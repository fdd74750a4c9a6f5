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
from collections.abc import AsyncIterator, Callable
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
    TEXT_PLACEHOLDER,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
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
    echo: bool = False  # completions: the prompt before each choice's text

    @classmethod
    def of(cls, req: CompletionRequest | ChatCompletionRequest, request: pb.GenerateRequest) -> Plan:
        include_usage = req.stream and req.stream_options is not None and req.stream_options.include_usage
        return cls(req.model, request, req.stream, include_usage, param_aliases(req),
                   echo=isinstance(req, CompletionRequest) and req.echo)

    def shape(self) -> Shape:
        request = self.request
        return Shape(request.n or 1, request.logprobs.completion, self.echo,
                     request.text if request.WhichOneof("input") == "text" else None)


@dataclass(frozen=True)
class Shape:
    """What a response holds besides text: how many choices, logprobs, an echoed prompt."""

    choices: int = 1
    logprobs: bool = False
    echo: bool = False
    prompt_text: str | None = None  # the prompt as sent, when it was text (else its tokens' text is echoed)

    @property
    def plain(self) -> bool:
        """One choice of text alone: streamed through the pre-rendered `TextChunks`."""
        return self.choices == 1 and not self.logprobs and not self.echo


@dataclass
class Choice:
    """What the target sent for one choice."""

    text: list[str] = field(default_factory=list)
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    complete: pb.Complete | None = None


@dataclass
class Collected:
    """A whole call: every choice and the prompt's logprobs (with echo)."""

    choices: list[Choice]
    prompt_logprobs: list[pb.PositionLogprobs] = field(default_factory=list)

    def add(self, chunk: pb.Chunk) -> None:
        choice = self.choices[chunk.index]
        choice.text.append(chunk.text)
        choice.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)

    def completes(self) -> list[pb.Complete]:
        return [c.complete for c in self.choices if c.complete is not None]


def merged_complete(completes: list[pb.Complete]) -> pb.Complete | None:
    """One Complete for a request's metrics: the prompt once, every choice's completion tokens."""
    if not completes:
        return None
    usage = pb.Usage(prompt_tokens=completes[0].usage.prompt_tokens,
                     completion_tokens=sum(c.usage.completion_tokens for c in completes))
    return pb.Complete(finish_reason=completes[0].finish_reason, usage=usage)


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

    def take_chunk(self, chunk: pb.Chunk, shape: Shape) -> None:
        """A chunk of a choice the request did not ask for is the target's fault (502); text is
        timed as the first text."""
        if chunk.index >= shape.choices:
            raise OpenAIError(502, f"the target sent choice {chunk.index} of {shape.choices}", "upstream_error")
        if chunk.text:
            self.saw_text()

    def target_error(self, exc: grpc.aio.AioRpcError) -> OpenAIError:
        """The target's failure, counted, as the OpenAI error it maps to."""
        self.gateway.metrics.target_errors.labels(exc.code().name).inc()
        return from_rpc_error(exc, self.aliases)

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


async def collect(gen: Generation, shape: Shape) -> Collected:
    """Read the whole call: every choice's text, logprobs and Complete (OpenAIError when it fails)."""
    collected = Collected([Choice() for _ in range(shape.choices)])
    try:
        async for response in gen.call:
            if response.HasField("chunk"):
                gen.take_chunk(response.chunk, shape)
                collected.add(response.chunk)
            elif response.complete.index < shape.choices:
                collected.choices[response.complete.index].complete = response.complete
    except grpc.aio.AioRpcError as exc:
        raise gen.target_error(exc) from None
    check_completes(collected.completes(), shape)
    return collected


def check_completes(completes: list[pb.Complete], shape: Shape) -> None:
    """Every choice ended with its Complete, or the target's stream was cut short (502)."""
    if len(completes) != shape.choices:
        raise OpenAIError(502, "the target ended the stream without a Complete message", "upstream_error")


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_unless_disconnected(request: Request, gen: Generation, shape: Shape) -> Collected | None:
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
            result = await collect(gen, shape)
        except Exception as exc:  # noqa: BLE001 (re-raised below, outside the group)
            failure = exc
        finally:
            group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


async def respond_whole(request: Request, gen: Generation, shape: Shape, build) -> Response:
    complete = None
    try:
        result = await collect_unless_disconnected(request, gen, shape)
        if result is None:
            gen.gateway.metrics.disconnects.labels(gen.endpoint).inc()
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        complete = merged_complete(result.completes())
        body = build(gen, shape, result)
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


async def stream_events(gen: Generation, shape: Shape, chunk_events, finish_event, usage_event,
                        include_usage: bool) -> AsyncIterator[str]:
    """SSE data: the events of each chunk, each choice's finish as it comes, the usage if asked,
    then [DONE]. Closing this generator early (the client went away) cancels the call."""
    completes: list[pb.Complete] = []
    failed = False
    try:
        async for response in gen.call:
            if response.HasField("chunk"):
                gen.take_chunk(response.chunk, shape)
                for event in chunk_events(response.chunk):
                    yield event
            else:
                completes.append(response.complete)
                yield finish_event(response.complete)
        check_completes(completes, shape)
        if include_usage:
            yield usage_event(convert.usage(*(c.usage for c in completes)))
        yield "[DONE]"
    except grpc.aio.AioRpcError as exc:
        failed = True
        yield _error_event(gen.target_error(exc))
    except OpenAIError as exc:
        failed = True
        yield _error_event(exc)
    finally:
        finished = len(completes) == shape.choices
        if not finished and not failed:  # closed or cancelled early: the client went away
            gen.gateway.metrics.disconnects.labels(gen.endpoint).inc()
        gen.done(merged_complete(completes) if finished else None)


def _error_event(exc: OpenAIError) -> str:
    return json.dumps(exc.body())


# ---------------------------------------------------------------- the two endpoints


def echoed_prompt(shape: Shape, prompt_logprobs: list[pb.PositionLogprobs]) -> str:
    if not shape.echo:
        return ""
    return shape.prompt_text if shape.prompt_text is not None else "".join(e.chosen.token for e in prompt_logprobs)


def completion_choice_logprobs(shape: Shape, choice: Choice,
                               prompt_logprobs: list[pb.PositionLogprobs]) -> CompletionLogprobs | None:
    if not shape.logprobs:
        return None
    return convert.completion_logprobs((prompt_logprobs if shape.echo else []) + choice.logprobs)


def completion_body(gen: Generation, shape: Shape, result: Collected) -> CompletionResponse:
    prompt = echoed_prompt(shape, result.prompt_logprobs)
    choices = [CompletionChoice(index=i, text=prompt + "".join(c.text),
                                logprobs=completion_choice_logprobs(shape, c, result.prompt_logprobs),
                                finish_reason=convert.finish_reason(c.complete))
               for i, c in enumerate(result.choices)]
    return CompletionResponse(id=gen.request_id, created=gen.created, model=gen.model, choices=choices,
                              usage=convert.usage(*(c.usage for c in result.completes())))


def chat_body(gen: Generation, shape: Shape, result: Collected) -> ChatCompletionResponse:
    choices = [ChatChoice(index=i, message=AssistantMessage(content="".join(c.text)),
                          logprobs=convert.chat_logprobs(c.logprobs) if shape.logprobs else None,
                          finish_reason=convert.finish_reason(c.complete))
               for i, c in enumerate(result.choices)]
    return ChatCompletionResponse(id=gen.request_id, created=gen.created, model=gen.model, choices=choices,
                                  usage=convert.usage(*(c.usage for c in result.completes())))


def completion_events(gen: Generation, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    def event(choices: list[CompletionChoice], usage=None) -> str:
        return CompletionResponse(id=gen.request_id, created=gen.created, model=gen.model, choices=choices,
                                  usage=usage).model_dump_json()

    plain = TextChunks(CompletionResponse(
        id=gen.request_id, created=gen.created, model=gen.model,
        choices=[CompletionChoice(text=TEXT_PLACEHOLDER, finish_reason=None)])) if shape.plain else None
    offsets = [0] * shape.choices  # text offsets of each choice's next logprob
    prompt_logprobs: list[pb.PositionLogprobs] = []  # gathered over the first chunks, for the echo
    echo_pending = [shape.echo]

    def chunk_events(chunk: pb.Chunk) -> list[str]:
        if plain is not None:
            return [plain(chunk.text)] if chunk.text else []
        prompt_logprobs.extend(chunk.prompt_logprobs)
        if not (chunk.text or chunk.logprobs):
            return []
        events = echo_events() if echo_pending[0] else []
        logprobs = None
        if shape.logprobs:
            logprobs = convert.completion_logprobs(list(chunk.logprobs), offsets[chunk.index])
            offsets[chunk.index] += sum(len(e.chosen.token) for e in chunk.logprobs)
        events.append(event([CompletionChoice(index=chunk.index, text=chunk.text, logprobs=logprobs,
                                              finish_reason=None)]))
        return events

    def echo_events() -> list[str]:
        """The echoed prompt, once per choice, before the first text (the prompt's logprobs come
        first, possibly over several chunks)."""
        echo_pending[0] = False
        text = echoed_prompt(shape, prompt_logprobs)
        logprobs = convert.completion_logprobs(prompt_logprobs) if shape.logprobs else None
        for i in range(shape.choices):
            offsets[i] = len(text) if logprobs is None else sum(len(e.chosen.token) for e in prompt_logprobs)
        return [event([CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=None)])
                for i in range(shape.choices)]

    def finish_event(complete: pb.Complete) -> str:
        return event([CompletionChoice(index=complete.index, text="", finish_reason=convert.finish_reason(complete))])

    def usage_event(usage) -> str:
        return event([], usage)

    return stream_events(gen, shape, chunk_events, finish_event, usage_event, include_usage)


def chat_events(gen: Generation, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    def event(delta: dict[str, str] | None, finish: str | None = None, usage=None, index: int = 0,
              logprobs=None) -> str:
        choices = [ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)] \
            if delta is not None else []
        return ChatCompletionChunk(id=gen.request_id, created=gen.created, model=gen.model, choices=choices,
                                   usage=usage).model_dump_json()

    plain = TextChunks(ChatCompletionChunk(id=gen.request_id, created=gen.created, model=gen.model,
                                           choices=[ChatChunkChoice(delta={"content": TEXT_PLACEHOLDER})])) \
        if shape.plain else None

    def chunk_events(chunk: pb.Chunk) -> list[str]:
        if plain is not None:
            return [plain(chunk.text)] if chunk.text else []
        if not (chunk.text or chunk.logprobs):
            return []
        logprobs = convert.chat_logprobs(list(chunk.logprobs)) if shape.logprobs else None
        return [event({"content": chunk.text}, index=chunk.index, logprobs=logprobs)]

    def finish_event(complete: pb.Complete) -> str:
        return event({}, convert.finish_reason(complete), index=complete.index)

    def usage_event(usage) -> str:
        return event(None, usage=usage)

    async def with_role() -> AsyncIterator[str]:
        for index in range(shape.choices):
            yield event({"role": "assistant", "content": ""}, index=index)
        async with contextlib.aclosing(stream_events(gen, shape, chunk_events, finish_event, usage_event,
                                                     include_usage)) as events:
            async for data in events:
                yield data

    return with_role()


# ---------------------------------------------------------------- the app


@dataclass(frozen=True)
class Endpoint:
    """What tells the two generating endpoints apart: their request model, its checks, the
    response id's prefix, the GenerateRequest it becomes, and the response (whole or streamed)."""

    path: str
    request_model: type[pydantic.BaseModel]
    check: Callable[[pydantic.BaseModel], OpenAIError | None]
    id_prefix: str
    to_proto: Callable[[pydantic.BaseModel, str], pb.GenerateRequest]
    body: Callable[[Generation, Shape, Collected], pydantic.BaseModel]
    events: Callable[[Generation, Shape, bool], AsyncIterator[str]]


ENDPOINTS = (
    Endpoint(COMPLETIONS, CompletionRequest, check_completion, "cmpl", convert.completion_request, completion_body,
             completion_events),
    Endpoint(CHAT, ChatCompletionRequest, check_chat, "chatcmpl", convert.chat_request, chat_body, chat_events),
)


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

    async def generate(request: Request, endpoint: Endpoint) -> Response:
        arrival = time.perf_counter()
        req = await parse(request, endpoint.request_model, config)
        if (found := endpoint.check(req)) is not None:
            raise found
        request_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        plan = Plan.of(req, endpoint.to_proto(req, request_id))
        del req  # a prompt of token ids is 28 bytes a Python int: keep only the protobuf's 4 a token
        gen = await start(gateway, endpoint.path, request_id, await check_model(gateway, plan.model), plan.request,
                          arrival, plan.aliases)
        if plan.stream:
            return respond_stream(gen, endpoint.events(gen, plan.shape(), plan.include_usage))
        return await respond_whole(request, gen, plan.shape(), endpoint.body)

    def handler(endpoint: Endpoint):
        async def handle(request: Request) -> Response:
            return await generate(request, endpoint)

        return handle

    for endpoint in ENDPOINTS:
        app.post(endpoint.path)(handler(endpoint))

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
