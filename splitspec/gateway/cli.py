"""`splitspec-gateway`: an OpenAI-compatible HTTP endpoint in front of a splitspec-target."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from splitspec.cli_args import LOG_FORMAT, HelpFormatter, add_log_level, parse_bytes, stop_with_parent
from splitspec.gateway.config import GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitspec-gateway",
        description="Serve OpenAI's /v1/completions and /v1/chat/completions (streaming and not), /v1/models, "
                    "/health and /metrics over HTTP, backed by a splitspec-target's public gRPC API.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--target", required=True, metavar="ADDR",
                   help="the target's gRPC address: host:port, dns:///name:port (every replica), unix:PATH")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="reach the target over TLS, trusting this CA")
    p.add_argument("--host", default="127.0.0.1", help="HTTP interface (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port, logged)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients pass (default: the target's model id; that id is accepted too)")
    p.add_argument("--max-body-bytes", type=parse_bytes, default="2MiB",
                   help="larger request bodies are refused with 413 before they are parsed (this bounds the time "
                        "one parse holds the event loop: ~10 ms per MiB)")
    p.add_argument("--max-message-bytes", type=parse_bytes, default="64MiB", help="gRPC message limit")
    p.add_argument("--health-timeout-s", type=float, default=2.0, help="deadline of the target check of /health")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a request's headers must arrive within this many seconds of the connection (or of the first "
                        "byte of a keep-alive connection's next request); else 408 and the connection is closed")
    p.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="a request's body must arrive within this many seconds of its headers; else 408 and the "
                        "connection is closed")
    p.add_argument("--max-connections", type=int, default=2048,
                   help="open HTTP connections at most; past it a new connection gets 503 and is closed")
    p.add_argument("--request-timeout-s", type=float, default=0.0,
                   help="deadline of a generation on the target (0: none); past it the request is aborted and "
                        "answered 504 (a stream ends with an error event)")
    p.add_argument("--trim-interval-s", type=float, default=10.0,
                   help="every this many seconds in which requests were answered, give the heap freed since back "
                        "to the OS (malloc_trim; 0: never)")
    add_log_level(p)
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(target=args.target, host=args.host, port=args.port, tls_ca=args.tls_ca,
                         served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                         max_message_bytes=args.max_message_bytes, health_timeout_s=args.health_timeout_s,
                         shutdown_grace_s=args.shutdown_grace_s, header_timeout_s=args.header_timeout_s,
                         body_timeout_s=args.body_timeout_s, max_connections=args.max_connections,
                         request_timeout_s=args.request_timeout_s, trim_interval_s=args.trim_interval_s,
                         log_level=args.log_level)


def main(argv: list[str] | None = None) -> int:
    stop_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        config = config_from_args(args)
        if config.tls_ca is not None:
            from splitspec.channel import tls_credentials

            tls_credentials(config.tls_ca)  # an unreadable CA is a usage error now, not a 503 later
    except ValueError as exc:
        parser.error(str(exc))
    from splitspec.gateway.server import serve

    try:
        return asyncio.run(serve(config))
    except OSError as exc:  # the port is taken, the interface does not exist
        print(f"splitspec-gateway: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
