"""Sharing the pool: shm on the CPU (tested here), CUDA IPC (marked cuda)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from common.kv_layout import LayerSpec, StagingSpec, build_layout
from common.kv_pool import PagePool
from common.pool_transport import (
    Canary,
    TransportError,
    check_ipc_allocator,
    export_pool,
    map_pool,
    read_canary,
    write_canary,
)
from splitspec.v1 import drafter_pb2 as dpb


def _layout(**kw):
    layers = [LayerSpec("target", 0, 2, 16), LayerSpec("draft", 0, 1, 16)]
    return build_layout(order="HND", page_size=4, kv_dtype="fp8_e4m3", num_pages=6, layers=layers,
                        staging=StagingSpec(rows=4, width=8), target_id="beef", **kw)


def test_shm_export_map_and_canary(tmp_path):
    pool = PagePool.create(_layout(), torch.device("cpu"), tmp_path)
    canary = write_canary(pool)
    handle = dpb.PoolHandle.FromString(export_pool(pool).SerializeToString())
    assert handle.WhichOneof("transport") == "shm" and handle.shm.path == str(pool.path)
    mapped = map_pool(pool.layout, handle)
    assert read_canary(mapped, canary)
    assert not read_canary(mapped, Canary(canary.offset, bytes(16)))
    mapped.region(pool.layout.layer("draft", 0))[5].fill_(2.0)  # the drafter writes its pages ...
    assert pool.region(pool.layout.layer("draft", 0))[5].float().eq(2.0).all()  # ... the target sees them
    assert canary.offset >= max(s.offset + pool.layout.region_bytes(s) for s in pool.layout.layers)
    pool.close()


def test_shm_map_errors_name_the_problem(tmp_path):
    layout = _layout()
    missing = dpb.PoolHandle(shm=dpb.ShmHandle(path=str(tmp_path / "gone.kv"), size=layout.total_bytes))
    with pytest.raises(TransportError, match="cannot map the target's KV pool"):
        map_pool(layout, missing)
    short = dpb.PoolHandle(shm=dpb.ShmHandle(path=str(tmp_path / "x"), size=10))
    with pytest.raises(TransportError, match="layout needs"):
        map_pool(layout, short)
    with pytest.raises(TransportError, match="names no transport"):
        map_pool(layout, dpb.PoolHandle())


def test_cuda_ipc_handle_protobuf_round_trip():
    handle = dpb.CudaIpcHandle(
        device_uuid="GPU-1234abcd-0000-1111-2222-333344445555", device_index=3,
        handle=bytes(range(64)), storage_size=123_456_789_012, storage_offset=4096,
        ref_counter_handle=b"/torch_123_456\x00", ref_counter_offset=7, event_handle=b"\x00\xff" * 32,
        event_sync_required=True,
    )
    parsed = dpb.PoolHandle.FromString(dpb.PoolHandle(cuda_ipc=handle).SerializeToString())
    assert parsed.WhichOneof("transport") == "cuda_ipc"
    assert parsed.cuda_ipc == handle
    assert parsed.cuda_ipc.handle == bytes(range(64))  # binary-safe, zero bytes included


def test_cuda_ipc_on_a_machine_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    handle = dpb.PoolHandle(cuda_ipc=dpb.CudaIpcHandle(device_uuid="GPU-x", handle=b"h"))
    with pytest.raises(TransportError, match="sees no CUDA device"):
        map_pool(_layout(), handle)


def test_expandable_segments_are_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(TransportError, match="expandable segments"):
        check_ipc_allocator()


def _child_reads_pool(layout, handle_bytes: bytes, canary: Canary, queue) -> None:
    pool = map_pool(layout, dpb.PoolHandle.FromString(handle_bytes))
    ok = read_canary(pool, canary)
    page = pool.region(layout.layer("target", 0))[2].float().sum().item()
    pool.region(layout.layer("draft", 0))[1].fill_(3.0)
    torch.cuda.synchronize()
    queue.put((ok, page))


@pytest.mark.cuda
def test_cuda_ipc_between_two_processes():
    device = torch.device("cuda", 0)
    layout = _layout()
    pool = PagePool.create(layout, device)
    pool.region(layout.layer("target", 0))[2].fill_(1.0)
    canary = write_canary(pool)
    handle = export_pool(pool)
    assert handle.cuda_ipc.device_uuid
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_reads_pool, args=(layout, handle.SerializeToString(), canary, queue))
    child.start()
    ok, page_sum = queue.get(timeout=120)
    child.join(60)
    assert ok and page_sum == pool.region(layout.layer("target", 0))[2].numel()  # every value 1.0
    torch.cuda.synchronize()
    assert pool.region(layout.layer("draft", 0))[1].float().eq(3.0).all()
