"""uvicorn's httptools protocol with the two bounds uvicorn lacks: a deadline for a
request's headers, and a cap on open connections.

uvicorn arms no timer on a fresh connection, nor while a request's headers trickle in,
so a client that opens connections and sends half a request line holds them for ever
(file descriptors, one protocol object each). Here a request's headers must be complete
within `header_timeout_s` of the connection (or of the first byte of a keep-alive
connection's next request): else the client gets a 408 and the connection is closed. Past
`max_connections` open connections a new one gets a 503 and is closed at once. The body's
deadline is the app's (`read_body`), which answers 408 the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

Refused = Callable[[int], None]  # called with the status of each connection refused here


def error_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "service_unavailable", "param": None, "code": code}}).encode()
    head = (b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return STATUS_LINE[status] + head + body


def guarded_protocol(header_timeout_s: float, max_connections: int, on_refused: Refused) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these bounds."""

    class GuardedProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            over = len(self.connections) >= max_connections
            super().connection_made(transport)
            if over:
                self._refuse(503, f"the gateway holds {max_connections} connections already (--max-connections); "
                                  "retry later", "too_many_connections")
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self.transport.close()  # a pipelined request behind a response still being sent
                return
            self._refuse(408, f"the request's headers did not arrive within {header_timeout_s:g} s "
                              "(--header-timeout-s)", "request_timeout")

        def _refuse(self, status: int, message: str, code: str) -> None:
            on_refused(status)
            self.transport.write(error_bytes(status, message, code))
            self.transport.close()

    return GuardedProtocol
