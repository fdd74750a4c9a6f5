"""Exporting the pool to the drafter and mapping it there: shm on a CPU, CUDA IPC on a GPU.

Handles travel as explicit protobuf fields (splitspec.v1.PoolHandle). A canary written
by the target and read back by the drafter proves both see the same bytes.

CUDA IPC, in order of what can go wrong:
- allocator: `cudaIpcGetMemHandle` exports plain `cudaMalloc` blocks only, so the target's
  caching allocator must not use expandable segments or the cudaMallocAsync backend
  (`check_ipc_allocator`, run at start);
- export: `storage._share_cuda_()` gives the block's handle, the storage's offset in it,
  and torch's cross-process reference counter; all become `CudaIpcHandle` fields;
- map: the drafter finds the device by UUID (indices differ under CUDA_VISIBLE_DEVICES)
  and opens the handle with `_new_shared_cuda`; failures are explained to the operator
  (`explain_ipc_failure`);
- ordering: the two processes' streams are unordered, so the target synchronizes before
  each Propose and the drafter before answering (`sync_for_handoff`);
- lifetime: the target keeps every pool it exported alive until the drafter has detached
  from it (attached to a later epoch) or the target stops (`PoolExports`).
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
from splitspec.v1 import drafter_pb2 as dpb

log = logging.getLogger(__name__)

CANARY_BYTES = 16
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# torch names its IPC reference-counter files /torch_<pid>_<random>_<n>
_REF_COUNTER_PID = re.compile(rb"torch_(\d+)_")


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
    (device_index, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = pool.storage._share_cuda_()
    return dpb.CudaIpcHandle(
        device_uuid=device_uuid(pool.device),
        device_index=device_index,
        handle=handle,
        storage_size=size,
        storage_offset=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=bool(event_sync),
    )


@dataclass(eq=False)
class _Export:
    pool: PagePool
    target_id: str
    epoch: int
    handle: dpb.PoolHandle


class PoolExports:
    """The target's record of the pools it handed to the drafter, keeping them alive.

    A pool that the target replaces (a re-plan for another drafter) may still be mapped
    by the drafter until the drafter attaches to the new one: its Attach drops every old
    mapping first (DESIGN.md §3). Until then the old pool stays referenced here, so its
    memory is never handed to another tensor under the drafter's feet (on CUDA the caching
    allocator would reuse the block at once).

    `attached(target_id, epoch)` (after a successful Attach) releases every older export;
    on CUDA it also returns the drafter's reference on torch's IPC counter for them, so
    that a drafter that died without unmapping (SIGKILL) does not pin an old pool in
    torch's limbo for the target's lifetime. `close()` (target stop) releases everything.
    """

    def __init__(self) -> None:
        self._exports: list[_Export] = []

    def export(self, pool: PagePool) -> dpb.PoolHandle:
        handle = export_pool(pool)
        self._exports.append(_Export(pool, pool.layout.target_id, pool.layout.epoch, handle))
        return handle

    def attached(self, target_id: str, epoch: int) -> None:
        """The drafter attached to (target_id, epoch): it has dropped every older mapping."""
        current = [e for e in self._exports if (e.target_id, e.epoch) == (target_id, epoch)]
        if not current:
            raise ValueError(f"no pool was exported for target {target_id!r} epoch {epoch}")
        older = [e for e in self._exports if e.epoch < epoch or e.target_id != target_id]
        self._exports = [e for e in self._exports if all(e is not o for o in older)]
        self._release(older, live_pools=[e.pool for e in self._exports], consumer_detached=True)

    def close(self) -> None:
        """The target stops: let go of every exported pool."""
        exports, self._exports = self._exports, []
        self._release(exports, live_pools=[], consumer_detached=False)

    @property
    def live(self) -> list[tuple[str, int]]:
        """(target_id, epoch) of the exports still held, oldest first."""
        return [(e.target_id, e.epoch) for e in self._exports]

    def holds(self, pool: PagePool) -> bool:
        return any(e.pool is pool for e in self._exports)

    @staticmethod
    def _release(exports: list[_Export], live_pools: list[PagePool], consumer_detached: bool) -> None:
        cuda_devices = set()
        for e in exports:
            if e.handle.WhichOneof("transport") == "cuda_ipc":
                cuda_devices.add(e.pool.device)
                if consumer_detached:
                    _return_consumer_reference(e.handle.cuda_ipc)
            if all(e.pool is not live for live in live_pools):
                e.pool.close()  # unlinks a CPU pool's file once nothing exported it any more
        for device in cuda_devices:
            sync_for_handoff(device)
            torch.cuda.ipc_collect()  # free blocks no process references any more
        if exports:
            log.info("released %d exported KV pool handle(s)", len(exports))


def _return_consumer_reference(h: dpb.CudaIpcHandle) -> None:
    """Drop the drafter's count on torch's IPC reference counter for one export.

    The drafter decrements it itself when it unmaps; one that died never does. Decrementing
    once more is harmless (a count at or below zero means "free"), and it is only done once
    the drafter has attached to a later epoch, so it maps none of the old storage."""
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(bytes(h.ref_counter_handle), int(h.ref_counter_offset))
    except Exception as exc:  # noqa: BLE001 - best effort, as in torch itself
        log.debug("could not release an IPC reference counter: %s", exc)


# ---------------------------------------------------------------------------------------
# The drafter's side: map


def map_pool(layout: KVLayout, handle: dpb.PoolHandle, shm_dir: str | Path = "/dev/shm",
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
    """The handle's fields, before any CUDA call: sizes and the pieces torch needs."""
    if not h.device_uuid:
        raise TransportError("the CUDA IPC handle names no device UUID (is the target older than the drafter?)")
    if len(h.handle) != CUDA_IPC_HANDLE_BYTES:
        raise TransportError(f"the CUDA IPC memory handle is {len(h.handle)} bytes, expected {CUDA_IPC_HANDLE_BYTES}")
    if h.event_sync_required and len(h.event_handle) != CUDA_IPC_HANDLE_BYTES:
        raise TransportError(f"the CUDA IPC event handle is {len(h.event_handle)} bytes, "
                             f"expected {CUDA_IPC_HANDLE_BYTES}")
    if not h.ref_counter_handle:
        raise TransportError("the CUDA IPC handle has no reference-counter file name")
    if h.storage_size < layout.total_bytes:
        raise TransportError(f"the target's CUDA pool is {h.storage_size} bytes, the layout needs {layout.total_bytes}")


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
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, bytes(h.handle), int(h.storage_size), int(h.storage_offset),
            bytes(h.ref_counter_handle), int(h.ref_counter_offset), bytes(h.event_handle),
            bool(h.event_sync_required),
        )
    except RuntimeError as exc:
        raise TransportError(explain_ipc_failure(str(exc), h.device_uuid)) from exc
    if storage.nbytes() < layout.total_bytes:
        raise TransportError(f"mapped CUDA pool is {storage.nbytes()} bytes, the layout needs {layout.total_bytes}")
    return PagePool(layout, storage, device)
