"""The gRPC plumbing both services share: where and how to listen, health and
reflection, and the signals that stop them."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check_listen_config(port: int, max_message_bytes: int, shutdown_grace_s: float) -> None:
    """ValueError naming the first bad setting."""
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if shutdown_grace_s < 0:
        raise ValueError(f"shutdown grace must be >= 0, got {shutdown_grace_s}")
    if max_message_bytes <= 0:
        raise ValueError(f"max message size must be positive, got {max_message_bytes}")


def listen_address(host: str, port: int) -> str:
    """host:port (IPv6 hosts bracketed), or a "unix:" host as it is (no port)."""
    if host.startswith("unix:"):
        return host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{port}"


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
    ]


class HealthReporter:
    """grpc.health.v1.Health for "" and `service_name`, plus reflection of all three services."""

    def __init__(self, server: grpc.aio.Server, service_name: str) -> None:
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        names = (service_name, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        self._services = ("", service_name)

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for service in self._services:
            await self.servicer.set(service, status)


def install_stop_signals(stop: asyncio.Event, log: logging.Logger) -> Callable[[], None]:
    """SIGTERM and SIGINT set `stop`; returns the function that removes the handlers."""
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
