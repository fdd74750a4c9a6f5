"""Exporting the pool to the drafter and mapping it there: shm on a CPU, CUDA IPC on a GPU.

Handles travel as explicit protobuf fields (splitspec.v1.PoolHandle). A canary written
by the target and read back by the drafter proves both see the same bytes.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import torch

from common.kv_layout import KVLayout
from common.kv_pool import PagePool
from splitspec.v1 import drafter_pb2 as dpb

CANARY_BYTES = 16


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
    if raw.is_cuda:
        torch.cuda.synchronize(raw.device)
    return Canary(offset, value)


def read_canary(pool: PagePool, canary: Canary) -> bool:
    got = pool.raw_bytes()[canary.offset : canary.offset + len(canary.value)].cpu()
    return bytes(got.tolist()) == canary.value


def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pool(pool: PagePool) -> dpb.PoolHandle:
    if pool.device.type == "cpu":
        if pool.path is None:
            raise TransportError("a CPU pool must live in a shm file to be shared")
        return dpb.PoolHandle(shm=dpb.ShmHandle(path=str(pool.path), size=pool.layout.total_bytes))
    return dpb.PoolHandle(cuda_ipc=_export_cuda(pool))


def _export_cuda(pool: PagePool) -> dpb.CudaIpcHandle:
    check_ipc_allocator()
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
        event_sync_required=event_sync,
    )


def check_ipc_allocator() -> None:
    """CUDA IPC needs plain cudaMalloc blocks; expandable segments cannot be exported."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:True" in conf.replace(" ", ""):
        raise TransportError(
            "CUDA IPC cannot export expandable segments: unset expandable_segments in "
            "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF for the target"
        )


def map_pool(layout: KVLayout, handle: dpb.PoolHandle) -> PagePool:
    """The drafter's side: map the target's storage described by `handle`."""
    kind = handle.WhichOneof("transport")
    if kind == "shm":
        if handle.shm.size < layout.total_bytes:
            raise TransportError(f"shm pool is {handle.shm.size} bytes, the layout needs {layout.total_bytes}")
        try:
            return PagePool.open_shm(layout, handle.shm.path)
        except OSError as exc:
            raise TransportError(
                f"cannot map the target's KV pool {handle.shm.path}: {exc}; the drafter must share the target's "
                "/dev/shm (same host, or ipc: host between containers) and run as the same user"
            ) from exc
    if kind == "cuda_ipc":
        return _map_cuda(layout, handle.cuda_ipc)
    raise TransportError("the pool handle names no transport")


def _find_device_by_uuid(uuid: str) -> torch.device:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return torch.device("cuda", index)
    raise TransportError(
        f"the target's GPU {uuid} is not visible to the drafter; run both services on the same GPU "
        "(same CUDA_VISIBLE_DEVICES device / the same device reservation)"
    )


def _map_cuda(layout: KVLayout, h: dpb.CudaIpcHandle) -> PagePool:
    if not torch.cuda.is_available():
        raise TransportError("the target shares its pool over CUDA IPC, but the drafter sees no CUDA device")
    device = _find_device_by_uuid(h.device_uuid)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, h.handle, h.storage_size, h.storage_offset,
            h.ref_counter_handle, h.ref_counter_offset, h.event_handle or None, h.event_sync_required,
        )
    except RuntimeError as exc:
        raise TransportError(
            f"cudaIpcOpenMemHandle failed ({exc}). Target and drafter must run on the same GPU, and in "
            "containers share the IPC and PID namespaces (ipc: host and pid: host)"
        ) from exc
    if storage.nbytes() < layout.total_bytes:
        raise TransportError(f"mapped CUDA pool is {storage.nbytes()} bytes, the layout needs {layout.total_bytes}")
    return PagePool(layout, storage, device)
