"""One storage for every KV layer region (and the staging buffer), owned by the target.

On the CPU the storage is a 0600 file under /dev/shm (named after the target id, so a
drafter can map it and a restarted target can remove stale ones); on CUDA it is one
device allocation. Layers get views of it; nothing else allocates KV memory.

A pool file is stale when its owner is dead: the pid in its name is gone *and* nobody
holds the exclusive `flock` its owner takes at creation and keeps until it exits (the
kernel drops it on SIGKILL too). The lock covers what the pid cannot: targets in other
pid namespaces sharing one /dev/shm (containers with `ipc: host` but their own pids).
Only regular files of the target's own user are ever opened for that, without following
links and without blocking (anyone can put a FIFO named like a pool file in /dev/shm).

The pool's bytes are reserved when the file is created (`posix_fallocate`), so a shm
dir too small for it is a startup error naming the sizes, not a SIGBUS on a later write.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.kv_layout import KV_DTYPES, KVLayout, LayerSpec
from splitspec.cli_args import DEFAULT_SHM_DIR

log = logging.getLogger(__name__)

SHM_PREFIX = "splitspec-"
SHM_SUFFIX = ".kv"
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}(?P<target_id>[0-9a-f]+)-(?P<pid>\d+)-e(?P<epoch>\d+){re.escape(SHM_SUFFIX)}$")


def shm_file_name(target_id: str, epoch: int) -> str:
    return f"{SHM_PREFIX}{target_id}-{os.getpid()}-e{epoch}{SHM_SUFFIX}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_if_stale(dir_fd: int, name: str) -> bool:
    """Unlink `name` when it is a regular file of ours whose lock nobody holds.

    Anyone may create files in /dev/shm (mode 1777), so the name proves nothing: a FIFO
    would block a plain open forever and a link would lead anywhere. The file is looked
    at without following links, opened without blocking, and unlinked only while we hold
    its lock and the name still leads to the file we locked."""
    try:
        seen = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(seen.st_mode) or seen.st_uid != os.geteuid():
            return False
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False  # gone, or swapped for a link since
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives (in another pid namespace)
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the lock we took


def remove_stale_shm_files(shm_dir: str | Path) -> list[Path]:
    """Remove pool files whose owning target process is gone; leave everything else."""
    folder = Path(shm_dir)
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    removed = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            match = _SHM_NAME.match(name)
            if match is None or _pid_alive(int(match["pid"])):
                continue
            if _remove_if_stale(dir_fd, name):
                removed.append(folder / name)
    finally:
        os.close(dir_fd)
    if removed:
        log.info("removed %d stale KV pool file(s) of dead targets from %s", len(removed), shm_dir)
    return removed


class PoolSpaceError(OSError):
    """The shm dir cannot hold the pool: a startup error naming the folder and the sizes."""


def _reserve(fd: int, nbytes: int, folder: Path) -> None:
    """Back every byte of the pool now. ftruncate alone makes a sparse file: on a full
    tmpfs the first write to a page that does not fit kills the process with SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        vfs = os.statvfs(folder)
        free = vfs.f_bavail * vfs.f_frsize
        raise PoolSpaceError(
            exc.errno,
            f"the KV pool needs {nbytes / 2**20:.1f} MiB in {folder}, which has {free / 2**20:.1f} MiB free "
            f"({os.strerror(exc.errno)}): lower --kv-cache-memory, --kv-cache-memory-fraction or --num-pages, "
            "or give the folder more room (--shm-dir; docker: shm_size)",
        ) from exc


def _create_shm_storage(path: Path, nbytes: int) -> tuple[torch.UntypedStorage, int]:
    """The mapped storage and the open, exclusively locked fd that marks the file as owned."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask: the drafter maps only a 0600 file
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _reserve(fd, nbytes, path.parent)
        return torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes), fd
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise


@dataclass
class PagePool:
    """The pool storage plus typed views of its regions."""

    layout: KVLayout
    storage: torch.UntypedStorage
    device: torch.device
    path: Path | None = None  # the shm file, on the CPU
    lock_fd: int | None = field(default=None, repr=False)  # held while the file is ours (see above)
    _bytes: torch.Tensor = field(init=False, repr=False)
    _staging: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
            self.storage, 0, (self.layout.total_bytes,)
        )

    @classmethod
    def create(cls, layout: KVLayout, device: torch.device, shm_dir: str | Path = DEFAULT_SHM_DIR) -> PagePool:
        if device.type == "cpu":
            path = Path(shm_dir) / shm_file_name(layout.target_id, layout.epoch)
            storage, lock_fd = _create_shm_storage(path, layout.total_bytes)
            log.info("KV pool: %d pages, %.1f MiB in %s", layout.num_pages, layout.total_bytes / 2**20, path)
            return cls(layout, storage, device, path, lock_fd)
        # A plain device allocation: the caching allocator hands out cudaMalloc memory
        # (expandable segments must be off for CUDA IPC; checked by the IPC transport).
        # zeroed: masked attention slots must never hold NaN bit patterns
        storage = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device).untyped_storage()
        return cls(layout, storage, device)

    def region(self, spec: LayerSpec) -> torch.Tensor:
        """[num_pages, 2, page_size, H, D] (NHD) or [num_pages, 2, H, page_size, D] (HND)."""
        nbytes = self.layout.region_bytes(spec)
        raw = self._bytes[spec.offset : spec.offset + nbytes]
        return raw.view(self.layout.torch_dtype).view(self.layout.region_shape(spec))

    def kv_caches(self, owner: str = "target") -> dict[int, torch.Tensor]:
        return {spec.index: self.region(spec) for spec in self.layout.layers if spec.owner == owner}

    def staging(self) -> torch.Tensor:
        """[rows, width]; one view for the pool's life (the engine asks every step)."""
        if self._staging is None:
            spec = self.layout.staging
            if spec is None:
                raise ValueError("this KV layout has no staging buffer")
            raw = self._bytes[spec.offset : spec.offset + spec.nbytes]
            self._staging = raw.view(KV_DTYPES[spec.dtype]).view(spec.rows, spec.width)
        return self._staging

    def channel_buffer(self) -> memoryview:
        """The Propose channel's region (common/shm_channel.py) as the channel's ends take it."""
        spec = self.layout.channel
        if spec is None:
            raise ValueError("this KV layout has no Propose channel")
        return memoryview(self._bytes[spec.offset : spec.offset + spec.nbytes].numpy())

    def raw_bytes(self) -> torch.Tensor:
        return self._bytes

    def close(self) -> None:
        """Release the storage; the owner also unlinks the shm file."""
        if self.path is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.path = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
