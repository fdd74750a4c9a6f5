"""Where a benchmark puts the KV pool files of the engines and services it starts: the services'
default shm dir (a tmpfs, as deployed), never a temp dir that may sit on a disk, whose writeback
would tax every KV write and skew the figures; where that dir is missing, the system's temp dir."""

from __future__ import annotations

import os

from splitspec.cli_args import DEFAULT_SHM_DIR


def pool_folder() -> str | None:
    """The folder to make a benchmark's pool dir in (`tempfile`'s `dir=`); None: the temp dir."""
    return DEFAULT_SHM_DIR if os.path.isdir(DEFAULT_SHM_DIR) and os.access(DEFAULT_SHM_DIR, os.W_OK) else None
