"""The gateway's settings, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class GatewayConfig:
    target: str  # the target's public gRPC address (host:port, dns:///host:port, unix:PATH)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (logged)
    tls_ca: str | None = None  # reach the target over TLS, trusting this CA bundle
    served_model_name: str | None = None  # the `model` clients name (default: the target's model id)
    max_body_bytes: int = 2 * MiB  # larger request bodies are refused (413) before they are parsed
    max_message_bytes: int = 64 * MiB  # gRPC receive limit towards the target
    health_timeout_s: float = 2.0  # deadline of the target health check behind GET /health
    shutdown_grace_s: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (else 408, closed)
    body_timeout_s: float = 30.0  # a request's body must arrive within this once its headers did (else 408)
    max_connections: int = 2048  # open HTTP connections; past it a new one gets 503 and is closed
    request_timeout_s: float = 0.0  # a generation's deadline on the target (0: none); past it 504
    trim_interval_s: float = 10.0  # give freed heap back to the OS this often while busy (0: never)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.target.strip():
            raise ValueError("--target is required: the splitspec-target gRPC address")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_message_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("health_timeout_s", "shutdown_grace_s", "request_timeout_s", "trim_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
