"""What `splitspec-target` and `splitspec-draft` share: argument types, help, and `run_service`."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import re
import sys
from collections.abc import Awaitable, Callable

BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1.5gib' or a plain number of bytes."""
    match = _SIZE.match(text)
    unit = match and match[2].lower()
    if match is None or unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    value = int(float(match[1]) * BYTE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' unless X is None or the help already says what the default is."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_log_level(group) -> None:
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def run_service(
    parser: argparse.ArgumentParser,
    build_config: Callable[[argparse.Namespace], object],
    server_module: str,
    argv: list[str] | None = None,
) -> int:
    """Parse, set up logging, build the config (a bad value is a usage error), then run
    `server_module.serve(config)` until it stops; the exit code. The server module is
    imported only once the arguments are good."""
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
