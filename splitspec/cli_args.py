"""Argument types and help conventions every splitspec command line shares (the two services,
the gateway, the client). Plain argparse, no torch: it sits beside the contract, below
everything that parses a command line.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PARENT_PID_ENV = "SPLITSPEC_PARENT_PID"  # set by `splitspec up` for the services it starts
PR_SET_PDEATHSIG = 1
# where a CPU KV pool's shared-memory file lives unless --shm-dir says otherwise: a tmpfs, so KV
# writes never wait on a disk's writeback
DEFAULT_SHM_DIR = "/dev/shm"


def stop_with_parent() -> None:
    """Under `splitspec up` (it names itself in SPLITSPEC_PARENT_PID): have Linux send this
    process SIGTERM when `up` dies, however it dies, so no service outlives it; if `up` is
    already gone, SIGTERM now. Each service asks this for itself at startup: `up` starts them
    without a `preexec_fn`, which Python documents as unsafe with threads and which let
    gRPC's fork handlers crash a child between fork and exec (common/cli.py, the gateway)."""
    parent = os.environ.get(PARENT_PID_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # died before the line above: the signal will never come
        os.kill(os.getpid(), signal.SIGTERM)


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
