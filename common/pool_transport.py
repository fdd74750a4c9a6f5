"""Exporting the pool to the drafter and mapping it there: shm on a CPU, CUDA IPC on a GPU.

Handles travel as explicit protobuf fields (splitspec.v1.PoolHandle). A canary written
by the target and read back by the drafter proves both see the same bytes.

CUDA IPC, in order of what can go wrong:
- allocator: `cudaIpcGetMemHandle` exports plain `cudaMalloc` blocks only, so the target's
  caching allocator must not use expandable segments or the cudaMallocAsync backend
  (`check_ipc_allocator`, run at start);
- builds: the handle is torch's own format (`CUDACachingAllocator::shareIpcHandle` writes a
  version byte, a type byte, then the 64-byte cudaIpcMemHandle_t; the version changes
  between torch releases), so both services must run the same torch build: the handshake
  compares them (`TorchBuild`) before any handle is sent;
- export: every field `storage._share_cuda_()` returns travels unchanged in a
  `CudaIpcHandle` (`handle_from_share`); nothing of ours parses the handle, except the one
  type byte that marks an expandable segment, refused at export;
- map: the drafter finds the device by UUID (indices differ under CUDA_VISIBLE_DEVICES)
  and hands the fields to torch's own `_new_shared_cuda` (`rebuild_args`); failures are
  explained to the operator (`explain_ipc_failure`);
- ordering: the two processes' streams are unordered, so the target synchronizes before
  each Propose and the drafter before answering (`sync_for_handoff`);
- lifetime: the target keeps every pool it exported alive until the drafter has detached
  from it (attached to a later epoch) or the target stops (`PoolExports`), and returns
  torch's IPC reference for exactly the exports the drafter never mapped
  (`references_to_return`; the drafter reports what it mapped: `MappedExports`).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from common.kv_layout import KVLayout
from common.kv_pool import PagePool
from common.shm_file import map_pool_file
from splitspec.cli_args import DEFAULT_SHM_DIR
from splitspec.v1 import drafter_pb2 as dpb

log = logging.getLogger(__name__)

CANARY_BYTES = 16
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# torch names its IPC reference-counter files /torch_<pid>_<random>_<n>
_REF_COUNTER_PID = re.compile(rb"torch_(\d+)_")
# What UntypedStorage._share_cuda_() returns, in its order (torch/csrc/StorageSharing.cpp,
# THPStorage_shareCuda); UntypedStorage._new_shared_cuda takes the same eight, in the same
# order (THPStorage_newSharedCuda; torch/multiprocessing/reductions.py passes them so).
SHARE_CUDA_FIELDS = ("device_index", "handle", "storage_size", "storage_offset", "ref_counter_handle",
                     "ref_counter_offset", "event_handle", "event_sync_required")
# Bounds on what a (possibly crafted) handle may carry, checked before any CUDA call.
MAX_HANDLE_BYTES = 4096
MAX_REF_COUNTER_NAME_BYTES = 255  # a POSIX shm name
# The drafter's unmapping decrements the int64 at this offset of the counter file, which
# holds CUDA_IPC_REF_COUNTER_FILE_SIZE of them (torch/csrc/CudaIPCTypes.h).
REF_COUNTER_SLOTS = 10000


class TransportError(RuntimeError):
    """The drafter could not map the target's pool; the message says what to fix."""


@dataclass(frozen=True)
class Canary:
    offset: int
    value: bytes


def write_canary(pool: PagePool) -> Canary:
    """Random bytes in the pool's trailer (past every region) that the drafter must read back."""
    offset = pool.layout.trailer_offset
    value = secrets.token_bytes(CANARY_BYTES)
    raw = pool.raw_bytes()
    raw[offset : offset + CANARY_BYTES].copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
    sync_for_handoff(raw.device)
    return Canary(offset, value)


def read_canary(pool: PagePool, canary: Canary) -> bool:
    got = pool.raw_bytes()[canary.offset : canary.offset + len(canary.value)].cpu()
    return bytes(got.tolist()) == canary.value


def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def sync_for_handoff(device: torch.device) -> None:
    """Wait until every kernel this process queued on `device` has finished.

    The target calls it before each Propose (the drafter reads the staging rows and
    pages the step just wrote), the drafter before answering (its draft-page writes must
    land before the target's next step reuses the staging buffer or frees pages). The two
    processes' streams are otherwise unordered. A no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class TorchBuild:
    """The torch build a service runs: CUDA IPC handles only open under the same one.

    torch versions its IPC handle (`SHAREABLE_HANDLE_VERSION` in CUDACachingAllocator.cpp)
    and refuses one from a newer torch ("received sharable handle from a future version of
    torch"); the handshake refuses a mismatch first, naming both builds."""

    torch: str
    cuda: str = ""  # torch.version.cuda; "" for a CPU-only build

    @classmethod
    def here(cls) -> TorchBuild:
        return cls(torch.__version__, torch.version.cuda or "")

    def __str__(self) -> str:
        return f"torch {self.torch or '(not reported)'} (CUDA {self.cuda or 'none'})"


def ipc_build_mismatch(target: TorchBuild, drafter: TorchBuild) -> str | None:
    """Why the two builds cannot share a pool over CUDA IPC (None: they can)."""
    if target == drafter:
        return None
    return (f"torch build: target {target}, drafter {drafter}; CUDA IPC handles are torch's own format, "
            "which changes between releases: run both services on the same torch build")


# ---------------------------------------------------------------------------------------
# The target's side: allocator check, export, lifetime


def parse_alloc_conf(text: str) -> dict[str, str]:
    """`key:value,key:value` (PYTORCH_CUDA_ALLOC_CONF syntax) → {key: value}, keys lowercased."""
    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition(":")
        if sep and key.strip():
            pairs[key.strip().lower()] = value.strip()
    return pairs


def check_ipc_allocator(environ: Mapping[str, str] | None = None) -> None:
    """Raise TransportError unless the caching allocator hands out exportable cudaMalloc blocks."""
    environ = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        conf = parse_alloc_conf(environ.get(var, ""))
        if conf.get("expandable_segments", "").lower() == "true":
            raise TransportError(
                f"CUDA IPC cannot export expandable segments: remove expandable_segments:True from {var} "
                "for the target (the KV pool must be plain cudaMalloc memory)"
            )
        if conf.get("backend", "").lower() == "cudamallocasync":
            raise TransportError(
                f"CUDA IPC cannot export cudaMallocAsync memory: remove backend:cudaMallocAsync from {var} "
                "for the target"
            )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        backend = torch.cuda.get_allocator_backend()
        if backend != "native":
            raise TransportError(f"CUDA IPC needs torch's native caching allocator, this process uses {backend!r}")


def export_pool(pool: PagePool) -> dpb.PoolHandle:
    if pool.device.type == "cpu":
        if pool.path is None:
            raise TransportError("a CPU pool must live in a shm file to be shared")
        return dpb.PoolHandle(shm=dpb.ShmHandle(path=str(pool.path), size=pool.layout.total_bytes))
    return dpb.PoolHandle(cuda_ipc=_export_cuda(pool))


def _export_cuda(pool: PagePool) -> dpb.CudaIpcHandle:
    check_ipc_allocator()
    sync_for_handoff(pool.device)  # the drafter must see the zeroed pool and the canary
    handle = handle_from_share(pool.storage._share_cuda_(), device_uuid(pool.device))
    try:
        refuse_expandable_segment(handle.handle)
    except TransportError:
        return_reference(handle)  # this export was counted for a drafter that will never map it
        raise
    return handle


def handle_from_share(shared: tuple, uuid: str) -> dpb.CudaIpcHandle:
    """`storage._share_cuda_()`'s eight fields, unchanged, plus the device's UUID."""
    if len(shared) != len(SHARE_CUDA_FIELDS):
        raise TransportError(f"torch's _share_cuda_() returned {len(shared)} fields, expected "
                             f"{len(SHARE_CUDA_FIELDS)} ({', '.join(SHARE_CUDA_FIELDS)}); this torch build is "
                             "not one splitspec knows")
    fields = dict(zip(SHARE_CUDA_FIELDS, shared))
    if fields["handle"] is None:
        raise TransportError("the KV pool storage is empty: torch has no CUDA IPC handle for it")
    return dpb.CudaIpcHandle(device_uuid=uuid, **fields)


def return_reference(h: dpb.CudaIpcHandle) -> None:
    """Decrement torch's IPC reference counter of one export, as the drafter's unmapping would."""
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(bytes(h.ref_counter_handle), int(h.ref_counter_offset))
    except Exception as exc:  # noqa: BLE001 - best effort, as in torch itself
        log.warning("could not return a CUDA IPC reference (%s): that pool stays allocated", exc)


def refuse_expandable_segment(handle: bytes) -> None:
    """Raise TransportError for the handle of an expandable segment.

    The one byte of torch's handle we read: CUDACachingAllocator::shareIpcHandle writes
    [version][type][payload] with type 'c' for a cudaMalloc block and 'e' for an expandable
    segment. An 'e' payload is a list of POSIX file descriptors of cuMem allocations that
    the drafter would have to pull out of the target with pidfd_getfd (ptrace rights over
    the target), so it fails there, far from the setting that causes it. The allocator's
    settings can change at run time (torch.cuda.memory._set_allocator_settings), so the
    start-up check of the environment (`check_ipc_allocator`) cannot rule it out alone."""
    if handle[1:2] == b"e":
        raise TransportError(
            "the KV pool was allocated in an expandable segment, which CUDA IPC cannot share with the drafter: "
            "start the target without expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF) "
            "and without enabling it at run time"
        )


# ---------------------------------------------------------------------------------------
# The drafter's side: map


def map_pool(layout: KVLayout, handle: dpb.PoolHandle, shm_dir: str | Path = DEFAULT_SHM_DIR,
             canary: Canary | None = None) -> PagePool:
    """The drafter's side: map the target's storage described by `handle`.

    A shm file is mapped only from `shm_dir` and only when it holds `canary`
    (common/shm_file.py); any other file is PoolAccessDenied."""
    kind = handle.WhichOneof("transport")
    if kind == "shm":
        if handle.shm.size != layout.total_bytes:
            raise TransportError(f"shm pool is {handle.shm.size} bytes, the layout needs {layout.total_bytes}")
        if canary is None:
            raise TransportError("a shm pool is mapped only with the target's canary")
        storage = map_pool_file(shm_dir, handle.shm.path, layout.total_bytes, canary.offset, canary.value)
        return PagePool(layout, storage, torch.device("cpu"))
    if kind == "cuda_ipc":
        return _map_cuda(layout, handle.cuda_ipc)
    raise TransportError("the pool handle names no transport")


def check_cuda_handle(layout: KVLayout, h: dpb.CudaIpcHandle) -> None:
    """The handle's fields, before any CUDA call: present, bounded, and big enough for the layout.
    torch's handle bytes themselves are opaque here (torch checks them when mapping)."""
    if not h.device_uuid:
        raise TransportError("the CUDA IPC handle names no device UUID (is the target older than the drafter?)")
    if not h.handle or len(h.handle) > MAX_HANDLE_BYTES:
        raise TransportError(f"the CUDA IPC memory handle is {len(h.handle)} bytes; expected torch's handle "
                             f"(1 to {MAX_HANDLE_BYTES} bytes)")
    if len(h.event_handle) > MAX_HANDLE_BYTES or (h.event_sync_required and not h.event_handle):
        raise TransportError(f"the CUDA IPC event handle is {len(h.event_handle)} bytes"
                             + (" but the target asks to wait on it" if h.event_sync_required else ""))
    if not h.ref_counter_handle or len(h.ref_counter_handle) > MAX_REF_COUNTER_NAME_BYTES:
        raise TransportError(f"the CUDA IPC handle's reference-counter file name is {len(h.ref_counter_handle)} "
                             f"bytes (1 to {MAX_REF_COUNTER_NAME_BYTES})")
    if h.ref_counter_offset >= REF_COUNTER_SLOTS:
        raise TransportError(f"the CUDA IPC reference-counter offset {h.ref_counter_offset} is past torch's "
                             f"{REF_COUNTER_SLOTS} counters per file")
    if h.storage_size < layout.total_bytes:
        raise TransportError(f"the target's CUDA pool is {h.storage_size} bytes, the layout needs {layout.total_bytes}")


def rebuild_args(h: dpb.CudaIpcHandle, device_index: int) -> tuple:
    """The arguments of `UntypedStorage._new_shared_cuda`: `_share_cuda_()`'s fields as the
    target's torch returned them, with this process's index of the target's device."""
    return (int(device_index), bytes(h.handle), int(h.storage_size), int(h.storage_offset),
            bytes(h.ref_counter_handle), int(h.ref_counter_offset), bytes(h.event_handle),
            bool(h.event_sync_required))


def exported_by_this_process(h: dpb.CudaIpcHandle) -> bool:
    match = _REF_COUNTER_PID.search(bytes(h.ref_counter_handle))
    return match is not None and int(match[1]) == os.getpid()


def explain_ipc_failure(error: str, target_uuid: str = "") -> str:
    """What an operator should change when cudaIpcOpenMemHandle fails with `error`."""
    text = error.lower()
    hints = []
    if "invalid resource handle" in text or "invalidresourcehandle" in text:
        hints.append("the handle is stale: the target restarted or freed that pool; the target re-handshakes "
                     "on its own, so this clears up unless it repeats")
    if ("mapping of buffer object failed" in text or "mapbufferobjectfailed" in text
            or "not permitted" in text or "not supported" in text):
        hints.append("the drafter's container does not share the target's IPC and PID namespaces: run both "
                     "with ipc: host and pid: host (docker run --ipc=host --pid=host), or put the drafter in "
                     "the target's namespaces (--ipc=container:<target> --pid=container:<target>)")
    if "invalid device" in text or "invalid argument" in text or "peer" in text:
        hints.append(f"the drafter is not on the target's GPU {target_uuid or '(uuid unknown)'}: give both "
                     "services the same device (CUDA_VISIBLE_DEVICES / device reservation) and the same "
                     "--device")
    if "out of memory" in text:
        hints.append("the drafter's GPU has no memory left to map the pool: lower the target's "
                     "--kv-cache-memory-fraction or the drafter's own allocations")
    if not hints:
        hints.append("run the target and the drafter on the same GPU of the same host; between containers "
                     "share the IPC and PID namespaces (ipc: host, pid: host); keep expandable_segments off "
                     "in the target's PYTORCH_CUDA_ALLOC_CONF")
    return f"cudaIpcOpenMemHandle failed ({error.strip()}). " + " Or: ".join(hints)


def _find_device_by_uuid(uuid: str) -> torch.device:
    visible = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        if str(props.uuid) == uuid:
            return torch.device("cuda", index)
        visible.append(f"cuda:{index} {props.name} {props.uuid}")
    raise TransportError(
        f"the target's GPU {uuid} is not visible to the drafter (it sees {'; '.join(visible) or 'no GPU'}); "
        "run both services on the same GPU (same CUDA_VISIBLE_DEVICES device / the same device reservation)"
    )


def _map_cuda(layout: KVLayout, h: dpb.CudaIpcHandle) -> PagePool:
    if not torch.cuda.is_available():
        raise TransportError("the target shares its pool over CUDA IPC, but the drafter sees no CUDA device")
    check_cuda_handle(layout, h)
    if exported_by_this_process(h):
        raise TransportError("the pool was exported by this very process: CUDA IPC cannot map a process's own "
                             "memory; run the drafter as its own process (splitspec-draft)")
    device = _find_device_by_uuid(h.device_uuid)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(*rebuild_args(h, device.index))
    except RuntimeError as exc:
        raise TransportError(explain_ipc_failure(str(exc), h.device_uuid)) from exc
    if storage.nbytes() < layout.total_bytes:
        raise TransportError(f"mapped CUDA pool is {storage.nbytes()} bytes, the layout needs {layout.total_bytes}")
    return PagePool(layout, storage, device)
