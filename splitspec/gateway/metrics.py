"""The gateway's own Prometheus metrics (`splitspec_gateway_*`), in a registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitspec_gateway_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("splitspec_gateway_requests_in_flight", "generation requests being served",
                               ["endpoint"], registry=r)
        self.duration = Histogram("splitspec_gateway_request_duration_seconds",
                                  "arrival to the last byte of a generation request", ["endpoint"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("splitspec_gateway_time_to_first_token_seconds",
                              "arrival to the first generated text", ["endpoint"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.prompt_tokens = Counter("splitspec_gateway_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("splitspec_gateway_generation_tokens",
                                         "tokens generated for finished requests", registry=r)
        self.disconnects = Counter("splitspec_gateway_client_disconnects",
                                   "requests ended before their finish because the client went away (or the gateway stopped): aborted on the target",
                                   ["endpoint"], registry=r)
        self.target_errors = Counter("splitspec_gateway_target_errors",
                                     "failed calls to the target, by gRPC status code", ["code"], registry=r)
