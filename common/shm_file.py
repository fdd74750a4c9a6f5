"""The drafter's side of a CPU pool file: map it only where the target's pool can be.

An `Attach` names the pool file by path, and the drafter writes its draft pages into
what it maps, so the path is hostile input even behind the internal token: without
these checks a token holder could aim the drafter at any file its user can write. The
drafter maps only a regular file directly inside its own shm dir (`--shm-dir`), opened
relative to that folder without following links and without blocking (a FIFO cannot
stall the event loop), owned by the drafter's own user, mode 0600, with one link, of
exactly the size the layout needs, holding the canary the target wrote. Every refusal
is the same `PoolAccessDenied`, raised before the canary is read when any other check
fails, so the answer tells the caller nothing about the file (whether it exists, its
type, owner, size or bytes); the reason goes to the drafter's log only.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat

import torch

log = logging.getLogger(__name__)

POOL_FILE_MODE = 0o600
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class PoolAccessDenied(PermissionError):
    """The one answer to every pool file the drafter will not map (PERMISSION_DENIED)."""

    MESSAGE = ("the drafter maps only a KV pool file its target created: a regular 0600 file of the drafter's own "
               "user, directly in the drafter's --shm-dir, of the layout's size, holding the canary (run both "
               "services as one user with the same --shm-dir)")

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class _Refused(Exception):
    """Why a pool file was refused: for the drafter's log, never for the caller."""


def pool_file_name(path: str, shm_dir: str | os.PathLike) -> str:
    """The file name `path` gives inside `shm_dir`; _Refused for any other place.

    Pure string work: the caller's path is never resolved, so a path into a hung mount
    or through a link costs nothing and reveals nothing."""
    if "\0" in path:
        raise _Refused("the path holds a NUL byte")
    parent, name = os.path.split(path)
    if not name or ".." in path.split(os.sep) or name == ".":
        raise _Refused("the path names no file, or climbs with '..'")
    if parent and os.path.normpath(os.path.abspath(parent)) != os.path.normpath(os.path.abspath(shm_dir)):
        raise _Refused(f"the file is not directly in the shm dir {os.fspath(shm_dir)}")
    return name


def check_pool_file_stat(st: os.stat_result, size: int) -> None:
    """_Refused unless `st` is what a target's pool file looks like to its own drafter."""
    if not stat.S_ISREG(st.st_mode):
        raise _Refused("not a regular file")
    if st.st_uid != os.geteuid():
        raise _Refused(f"owned by uid {st.st_uid}, not the drafter's {os.geteuid()}")
    if st.st_mode & 0o7777 != POOL_FILE_MODE:
        raise _Refused(f"mode {st.st_mode & 0o7777:o}, not {POOL_FILE_MODE:o}")
    if st.st_nlink != 1:
        raise _Refused(f"{st.st_nlink} links to it")
    if st.st_size != size:
        raise _Refused(f"{st.st_size} bytes, the layout needs {size}")


def _open_in(shm_dir: str | os.PathLike, name: str) -> int:
    dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _map_checked(shm_dir: str | os.PathLike, path: str, size: int, canary_offset: int, canary: bytes) -> mmap.mmap:
    if not canary or canary_offset < 0 or canary_offset + len(canary) > size:
        raise _Refused("no canary inside the pool")
    name = pool_file_name(path, shm_dir)
    try:
        fd = _open_in(shm_dir, name)
    except OSError as exc:
        raise _Refused(f"cannot open it: {exc.strerror}") from exc
    try:
        check_pool_file_stat(os.fstat(fd), size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise _Refused(f"cannot map it: {exc.strerror}") from exc
    finally:
        os.close(fd)  # the mapping keeps the file
    if mapped[canary_offset : canary_offset + len(canary)] != canary:
        mapped.close()
        raise _Refused("the canary does not match")
    return mapped


def map_pool_file(shm_dir: str | os.PathLike, path: str, size: int, canary_offset: int,
                  canary: bytes) -> torch.UntypedStorage:
    """The pool file `path` names, mapped shared (`size` bytes), after every check above.

    PoolAccessDenied for anything else, whatever the reason."""
    try:
        mapped = _map_checked(shm_dir, path, size, canary_offset, canary)
    except _Refused as reason:
        log.warning("refused the KV pool file %r: %s", path, reason)
        raise PoolAccessDenied() from None
    # the tensor holds a reference to the mapping: it is unmapped when the last view goes
    return torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()
