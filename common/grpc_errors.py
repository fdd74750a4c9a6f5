"""Exceptions → gRPC status codes, in one place for both services (docs/design.md#error-model).

Each service gives an `ErrorMapper` its own table of (exception type, status code); a
handler's exception found in the table aborts the call with that code and the
exception's message, anything else is INTERNAL with a message that hides the details
and points at the service's log, where the traceback goes. `ErrorMappingInterceptor`
applies a mapper to every handler of the named services, and parses their requests
itself: bytes that are not the method's message are INVALID_ARGUMENT (gRPC would answer
UNKNOWN and log a traceback per call), logged once per burst. After a large request the
heap it freed goes back to the OS.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from common.memory import release_free_heap

ErrorTable = tuple[tuple[type[BaseException], grpc.StatusCode], ...]
Deserializer = Callable[[bytes], object] | None
LARGE_REQUEST_BYTES = 1 << 20  # after a request this large, freed heap memory goes back to the OS


class UndecodableRequestError(ValueError):
    """The request bytes do not parse as the method's message (INVALID_ARGUMENT)."""


@dataclass
class BurstLog:
    """Logs the first of a burst of alike events, then only counts them for `window_s`;
    the next one after the window is logged with the count of those it stood for."""

    window_s: float = 10.0
    _last: float = float("-inf")
    _unlogged: int = 0

    def log(self, logger: logging.Logger, level: int, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.window_s:
            self._unlogged += 1
            return
        if self._unlogged:
            message, args = f"{message} (and %d more in the last burst)", (*args, self._unlogged)
        logger.log(level, message, *args)
        self._last, self._unlogged = now, 0


def release_heap_after_large(raw: bytes, context: grpc.aio.ServicerContext) -> None:
    """Once the call ends, return the heap its request freed to the OS (off the event loop)."""
    if len(raw) >= LARGE_REQUEST_BYTES:
        context.add_done_callback(lambda _: asyncio.get_running_loop().run_in_executor(None, release_free_heap))


def parse_request(raw: bytes, deserialize: Deserializer):
    """The method's message from the call's bytes; UndecodableRequestError when they are not one."""
    if deserialize is None:
        return raw
    try:
        return deserialize(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or whatever a deserializer raises on bytes
        message = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
        name = message.full_name if message is not None else "the method's request message"
        raise UndecodableRequestError(f"request: the bytes are not a valid {name} ({exc})") from exc


def forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of `exc` and of the exceptions it chains to.

    grpc.aio keeps the AbortError that `context.abort` raises in a reference cycle with
    the call's state, and the exception being handled becomes that AbortError's context:
    through its traceback the handler's frames, and the request they hold, would stay
    alive until the cyclic garbage collector runs, which a large heap makes rare (each
    refused 12 MB text kept 36 MB; each refused 12 MB prompt of the old code, 1.3 GB of ids)."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending.extend((current.__cause__, current.__context__))


@dataclass(frozen=True)
class ErrorMapper:
    table: ErrorTable
    log: logging.Logger  # the service's logger: INTERNAL errors go there with their traceback
    log_name: str = "server"  # INTERNAL details say "see the <log_name> log"
    mapped_level: int = logging.DEBUG  # the level at which errors found in the table are logged

    def status_for(self, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status code and details for an exception a handler raised."""
        if isinstance(exc, UndecodableRequestError):
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        for exc_type, code in self.table:
            if isinstance(exc, exc_type):
                return code, str(exc)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__} (see the {self.log_name} log)"

    async def abort(self, exc: Exception, context: grpc.aio.ServicerContext, method: str,
                    undecodable: BurstLog | None = None) -> None:
        """Abort the call with `exc`'s status; undecodable requests are logged through
        `undecodable` (once per burst), when given."""
        code, details = self.status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            self.log.error("%s failed", method, exc_info=exc)
        elif isinstance(exc, UndecodableRequestError) and undecodable is not None:
            undecodable.log(self.log, logging.WARNING, "%s: undecodable request bytes: %s", method, details)
        else:
            self.log.log(self.mapped_level, "%s: %s: %s", method, code.name, details)
        forget_frames(exc)
        await context.abort(code, details)

    def wrap_unary(self, behavior: Callable[..., Awaitable], method: str, deserialize: Deserializer = None,
                   undecodable: BurstLog | None = None):
        async def wrapper(raw, context):
            try:
                release_heap_after_large(raw, context)
                call = behavior(parse_request(raw, deserialize), context)
                del raw  # see forget_frames: this frame outlives the call when it aborts
                return await call
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self.abort(exc, context, method, undecodable)

        return wrapper

    def wrap_stream(self, behavior: Callable[..., AsyncIterator], method: str, deserialize: Deserializer = None,
                    undecodable: BurstLog | None = None):
        async def wrapper(raw, context):
            try:
                release_heap_after_large(raw, context)
                responses = behavior(parse_request(raw, deserialize), context)
                del raw  # see forget_frames: this frame outlives the call when it aborts
                async for response in responses:
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self.abort(exc, context, method, undecodable)

        return wrapper


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary and async-generator handler of `services` with `mapper`; the
    wrapped handlers take the call's raw bytes (no deserializer) and parse them inside."""

    def __init__(self, mapper: ErrorMapper, services: tuple[str, ...]) -> None:
        self._mapper = mapper
        self._prefixes = tuple(f"/{name}/" for name in services)
        self._undecodable = BurstLog()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._mapper.wrap_unary(handler.unary_unary, method, handler.request_deserializer,
                                        self._undecodable),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._mapper.wrap_stream(handler.unary_stream, method, handler.request_deserializer,
                                         self._undecodable),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        return handler
