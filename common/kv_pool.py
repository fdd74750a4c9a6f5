"""One storage for every KV layer region (and the staging buffer), owned by the target.

On the CPU the storage is a 0600 file under /dev/shm (named after the target id, so a
drafter can map it and a restarted target can remove stale ones); on CUDA it is one
device allocation. Layers get views of it; nothing else allocates KV memory.

A pool file is stale when its owner is dead: the pid in its name is gone *and* nobody
holds the exclusive `flock` its owner takes at creation and keeps until it exits (the
kernel drops it on SIGKILL too). The lock covers what the pid cannot: targets in other
pid namespaces sharing one /dev/shm (containers with `ipc: host` but their own pids).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.kv_layout import KVLayout, LayerSpec, KV_DTYPES

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


def _owner_holds_lock(path: Path) -> bool:
    """True while some process holds the pool file's lock (or the file cannot be checked)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to judge (another user's file)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the lock we may have taken
    return False


def remove_stale_shm_files(shm_dir: str | Path) -> list[Path]:
    """Remove pool files whose owning target process is gone; leave everything else."""
    removed = []
    for path in Path(shm_dir).glob(f"{SHM_PREFIX}*{SHM_SUFFIX}"):
        match = _SHM_NAME.match(path.name)
        if match is None or _pid_alive(int(match["pid"])) or _owner_holds_lock(path):
            continue
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d stale KV pool file(s) of dead targets from %s", len(removed), shm_dir)
    return removed


def _create_shm_storage(path: Path, nbytes: int) -> tuple[torch.UntypedStorage, int]:
    """The mapped storage and the open, exclusively locked fd that marks the file as owned."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, nbytes)
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

    def __post_init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
            self.storage, 0, (self.layout.total_bytes,)
        )

    @classmethod
    def create(cls, layout: KVLayout, device: torch.device, shm_dir: str | Path = "/dev/shm") -> PagePool:
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
        spec = self.layout.staging
        if spec is None:
            raise ValueError("this KV layout has no staging buffer")
        raw = self._bytes[spec.offset : spec.offset + spec.nbytes]
        return raw.view(KV_DTYPES[spec.dtype]).view(spec.rows, spec.width)

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
