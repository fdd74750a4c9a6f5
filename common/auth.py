"""The shared token on the internal channel: KV pages hold users' prompts.

Both services read it from `SPLITSPEC_INTERNAL_TOKEN` or from a file flag; the drafter
rejects every call without it (UNAUTHENTICATED), comparing in constant time.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

from splitspec.contract import TOKEN_ENV

METADATA_KEY = "authorization"


def load_internal_token(token_file: str | None = None, environ: dict[str, str] | None = None) -> str:
    """The token from --internal-token-file, else the environment; a clear error if neither."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"internal token file {token_file} is empty")
        return token
    token = (environ if environ is not None else os.environ).get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"set {TOKEN_ENV} or pass --internal-token-file: the internal channel needs a shared token")
    return token


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, f"Bearer {token}"),)


def token_matches(metadata, token: str) -> bool:
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return hmac.compare_digest(value[len("Bearer "):].encode(), token.encode())
    return False


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call to `protected` services without the shared token."""

    def __init__(self, token: str, protected: tuple[str, ...]) -> None:
        self._token = token
        self._protected = tuple(f"/{name}/" for name in protected)

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(self._protected):
            return await continuation(handler_call_details)
        if token_matches(handler_call_details.invocation_metadata, self._token):
            return await continuation(handler_call_details)
        return _deny_handler(await continuation(handler_call_details))


def _deny_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """Answers UNAUTHENTICATED without parsing the request: the bytes of a caller without
    the token are never looked at (request_deserializer=None)."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token (authorization metadata)")

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token (authorization metadata)")
        yield  # pragma: no cover

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, None, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, None, handler.response_serializer if handler else None)
