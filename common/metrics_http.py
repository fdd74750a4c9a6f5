"""The /metrics HTTP endpoint each service serves beside its gRPC port."""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


def check_metrics_port(port: int) -> None:
    """0 turns the endpoint off."""
    if not 0 <= port < 65536:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> Callable[[], None]:
    """Serve `registry` on http://host:port/metrics in a daemon thread; returns the stopper."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop


def metrics_host(grpc_host: str, metrics_host: str | None) -> str:
    """Default to the gRPC interface; a Unix-socket service falls back to loopback."""
    if metrics_host:
        return metrics_host
    return "127.0.0.1" if grpc_host.startswith("unix:") else grpc_host
