"""Run the gateway: bind the HTTP socket (logging the port it got), then uvicorn until a signal.

Connections are bounded (`guarded_protocol`: a deadline for headers, a cap on how many).
SIGTERM/SIGINT: uvicorn stops accepting, and in-flight requests (streams too) get
`--shutdown-grace-s` to finish; what is still running then is cancelled, which aborts
it on the target.
"""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

from splitspec.gateway.app import create_app
from splitspec.gateway.config import GatewayConfig
from splitspec.gateway.http_protocol import guarded_protocol
from splitspec.gateway.memory import fix_mmap_threshold

log = logging.getLogger("splitspec.gateway")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: any free port); OSError when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


def display_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _drained(signum, frame) -> None:
    log.info("stopped on %s", signal.Signals(signum).name)


async def serve(config: GatewayConfig) -> int:
    sock = bind(config.host, config.port)
    fix_mmap_threshold()
    app = create_app(config)
    requests = app.state.gateway.metrics.requests

    def refused(status: int) -> None:  # answered by the protocol, before any route
        requests.labels("other", str(status)).inc()

    protocol = guarded_protocol(config.header_timeout_s, config.max_connections, refused)
    uv_config = uvicorn.Config(app, http=protocol, log_config=None, log_level=config.log_level, access_log=False,
                               timeout_graceful_shutdown=max(1, round(config.shutdown_grace_s)),
                               server_header=False)
    server = uvicorn.Server(uv_config)
    log.info("OpenAI API for %s listening on %s", config.target, display_address(sock))
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again for the handler it
    # found: make that one a no-op, so a drained stop exits 0 (as the target and drafter do).
    previous = {sig: signal.signal(sig, _drained) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
