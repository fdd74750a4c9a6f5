"""What `splitspec-target` and `splitspec-draft` share beyond the argument types: `run_service` and the
threads and metrics flags."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from collections.abc import Awaitable, Callable

from splitspec.cli_args import LOG_FORMAT, positive_int, stop_with_parent


def run_service(
    parser: argparse.ArgumentParser,
    build_config: Callable[[argparse.Namespace], object],
    server_module: str,
    argv: list[str] | None = None,
) -> int:
    """Parse, set up logging, build the config (a bad value is a usage error), then run
    `server_module.serve(config)` until it stops; the exit code. The server module is
    imported only once the arguments are good."""
    stop_with_parent()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        config = build_config(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    serve: Callable[[object], Awaitable[int]] = importlib.import_module(server_module).serve
    return asyncio.run(serve(config))


def add_threads_arg(group, default: str) -> None:
    """--threads: torch's CPU thread pool for this process."""
    group.add_argument("--threads", type=positive_int, default=None, help=f"torch CPU threads (default: {default})")


def add_metrics_args(group, default_port: int) -> None:
    """--metrics-host/--metrics-port: the Prometheus endpoint beside the gRPC port."""
    group.add_argument("--metrics-port", type=int, default=default_port,
                       help="port of the Prometheus /metrics endpoint (0: none)")
    group.add_argument("--metrics-host", default=None,
                       help="interface of the metrics endpoint (default: --host; loopback for a unix: host)")
