"""Exceptions → gRPC status codes, in one place for both services (docs/design.md#error-model).

Each service gives an `ErrorMapper` its own table of (exception type, status code); a
handler's exception found in the table aborts the call with that code and the
exception's message, anything else is INTERNAL with a message that hides the details
and points at the service's log, where the traceback goes. `ErrorMappingInterceptor`
applies a mapper to every handler of the named services.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

ErrorTable = tuple[tuple[type[BaseException], grpc.StatusCode], ...]


@dataclass(frozen=True)
class ErrorMapper:
    table: ErrorTable
    log: logging.Logger  # the service's logger: INTERNAL errors go there with their traceback
    log_name: str = "server"  # INTERNAL details say "see the <log_name> log"
    mapped_level: int = logging.DEBUG  # the level at which errors found in the table are logged

    def status_for(self, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status code and details for an exception a handler raised."""
        for exc_type, code in self.table:
            if isinstance(exc, exc_type):
                return code, str(exc)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__} (see the {self.log_name} log)"

    async def abort(self, exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
        code, details = self.status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            self.log.error("%s failed", method, exc_info=exc)
        else:
            self.log.log(self.mapped_level, "%s: %s: %s", method, code.name, details)
        await context.abort(code, details)

    def wrap_unary(self, behavior: Callable[..., Awaitable], method: str):
        async def wrapper(request, context):
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self.abort(exc, context, method)

        return wrapper

    def wrap_stream(self, behavior: Callable[..., AsyncIterator], method: str):
        async def wrapper(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self.abort(exc, context, method)

        return wrapper


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary and async-generator handler of `services` with `mapper`."""

    def __init__(self, mapper: ErrorMapper, services: tuple[str, ...]) -> None:
        self._mapper = mapper
        self._prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._mapper.wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._mapper.wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
