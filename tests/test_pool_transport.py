"""Sharing the pool: shm on the CPU (tested here), CUDA IPC (marked cuda).

`two_process_ipc_check` is also run by tests/gpu/run_gpu_checks.py, which reports what
it observed.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from common.kv_layout import LayerSpec, StagingSpec, build_layout
from common.kv_pool import PagePool
from common.shm_file import PoolAccessDenied
from common.pool_transport import (
    Canary,
    PoolExports,
    TransportError,
    check_cuda_handle,
    check_ipc_allocator,
    explain_ipc_failure,
    export_pool,
    exported_by_this_process,
    map_pool,
    parse_alloc_conf,
    read_canary,
    sync_for_handoff,
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
    mapped = map_pool(pool.layout, handle, tmp_path, canary)
    assert read_canary(mapped, canary)
    assert not read_canary(mapped, Canary(canary.offset, bytes(16)))
    mapped.region(pool.layout.layer("draft", 0))[5].fill_(2.0)  # the drafter writes its pages ...
    assert pool.region(pool.layout.layer("draft", 0))[5].float().eq(2.0).all()  # ... the target sees them
    assert canary.offset >= max(s.offset + pool.layout.region_bytes(s) for s in pool.layout.layers)
    pool.close()


def test_shm_map_errors_name_the_problem(tmp_path):
    layout = _layout()
    canary = Canary(layout.trailer_offset, b"c" * 16)
    missing = dpb.PoolHandle(shm=dpb.ShmHandle(path=str(tmp_path / "gone.kv"), size=layout.total_bytes))
    with pytest.raises(PoolAccessDenied) as denied:  # the file's fate is the drafter's log's business only
        map_pool(layout, missing, tmp_path, canary)
    assert str(denied.value) == PoolAccessDenied.MESSAGE
    with pytest.raises(TransportError, match="only with the target's canary"):
        map_pool(layout, missing, tmp_path)
    short = dpb.PoolHandle(shm=dpb.ShmHandle(path=str(tmp_path / "x"), size=10))
    with pytest.raises(TransportError, match="layout needs"):
        map_pool(layout, short, tmp_path, canary)
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


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("conf,problem", [
    ("expandable_segments:True", "expandable_segments:True"),
    ("max_split_size_mb:512, expandable_segments: true", "expandable_segments:True"),
    ("backend:cudaMallocAsync", "cudaMallocAsync"),
])
def test_allocator_settings_that_break_ipc_name_the_variable(var, conf, problem):
    with pytest.raises(TransportError, match=problem) as info:
        check_ipc_allocator({var: conf})
    assert var in str(info.value)


def test_allocator_settings_that_keep_ipc_working():
    check_ipc_allocator({})
    check_ipc_allocator({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:128"})
    assert parse_alloc_conf(" a:1 ,B: x,junk,") == {"a": "1", "b": "x"}


def _cuda_handle(**overrides) -> dpb.CudaIpcHandle:
    fields = {"device_uuid": "GPU-1", "handle": bytes(64), "storage_size": 1 << 20,
              "ref_counter_handle": b"/torch_1_2_3", "event_handle": bytes(64), "event_sync_required": True}
    fields.update(overrides)
    return dpb.CudaIpcHandle(**fields)


@pytest.mark.parametrize("overrides,message", [
    ({"device_uuid": ""}, "no device UUID"),
    ({"handle": b"short"}, "memory handle is 5 bytes, expected 64"),
    ({"event_handle": b""}, "event handle is 0 bytes"),
    ({"ref_counter_handle": b""}, "reference-counter"),
    ({"storage_size": 100}, "is 100 bytes, the layout needs"),
])
def test_cuda_handle_fields_are_checked_before_any_cuda_call(overrides, message):
    check_cuda_handle(_layout(), _cuda_handle())
    check_cuda_handle(_layout(), _cuda_handle(event_handle=b"", event_sync_required=False))
    with pytest.raises(TransportError, match=message):
        check_cuda_handle(_layout(), _cuda_handle(**overrides))


def test_a_handle_exported_by_this_process_is_recognized():
    assert exported_by_this_process(_cuda_handle(ref_counter_handle=f"/torch_{os.getpid()}_99_0".encode()))
    assert not exported_by_this_process(_cuda_handle(ref_counter_handle=f"/torch_{os.getpid() + 1}_9_0".encode()))
    assert not exported_by_this_process(_cuda_handle(ref_counter_handle=b"/elsewhere"))


@pytest.mark.parametrize("error,hint", [
    ("CUDA error: invalid resource handle", "stale"),
    ("CUDA error: mapping of buffer object failed", "ipc: host and pid: host"),
    ("cudaErrorMapBufferObjectFailed", "--ipc=container:"),
    ("CUDA error: operation not permitted", "PID namespaces"),
    ("CUDA error: invalid device context", "GPU-abc"),
    ("CUDA error: out of memory", "--kv-cache-memory-fraction"),
    ("something new", "same GPU of the same host"),
])
def test_ipc_failures_tell_the_operator_what_to_fix(error, hint):
    message = explain_ipc_failure(error, "GPU-abc")
    assert message.startswith(f"cudaIpcOpenMemHandle failed ({error})")
    assert hint in message


def test_sync_for_handoff_is_a_no_op_on_the_cpu():
    sync_for_handoff(torch.device("cpu"))


def test_pool_exports_keep_replaced_pools_until_the_drafter_attaches_again(tmp_path):
    import dataclasses

    exports = PoolExports()
    first = PagePool.create(_layout(epoch=1), torch.device("cpu"), tmp_path)
    canary = write_canary(first)
    mapped = map_pool(first.layout, exports.export(first), tmp_path, canary)  # the drafter maps epoch 1
    exports.attached("beef", 1)
    assert exports.live == [("beef", 1)]
    first.layout = dataclasses.replace(first.layout, epoch=2)  # a re-handshake that keeps the pool
    exports.export(first)
    exports.attached("beef", 2)
    assert exports.live == [("beef", 2)] and first.path.exists(), "the live pool must stay"
    second = PagePool.create(_layout(epoch=3), torch.device("cpu"), tmp_path)  # a re-plan replaces it
    first.close()  # the engine lets go of the old pool ...
    exports.export(second)
    assert exports.holds(first) and read_canary(mapped, canary)  # ... the drafter still reads it
    exports.attached("beef", 3)  # the drafter dropped epoch 2 before attaching to 3
    assert exports.live == [("beef", 3)] and not exports.holds(first)
    with pytest.raises(ValueError, match="epoch 7"):
        exports.attached("beef", 7)
    exports.close()
    assert exports.live == [] and not list(tmp_path.glob("splitspec-*.kv"))


# ---------------------------------------------------------------------------------------
# CUDA IPC between two processes (here under pytest on a GPU; also run by tests/gpu/)


def _drafter_process(layout, handle_bytes: bytes, canary: Canary, conn) -> None:
    """Plays the drafter: map, read canary and a target page, write a draft page, and again
    after the target has let go of its own reference to the pool."""
    try:
        pool = map_pool(layout, dpb.PoolHandle.FromString(handle_bytes))
        first = (read_canary(pool, canary), pool.region(layout.layer("target", 0))[2].float().sum().item(),
                 str(pool.device), pool.raw_bytes().data_ptr() != 0)
        pool.region(layout.layer("draft", 0))[1].fill_(3.0)
        sync_for_handoff(pool.device)
        conn.send(("mapped", first))
        assert conn.recv() == "again"
        again = (read_canary(pool, canary), pool.region(layout.layer("target", 0))[2].float().sum().item())
        del pool
        torch.cuda.synchronize()
        conn.send(("again", again))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def two_process_ipc_check(device: torch.device, timeout: float = 120.0) -> dict:
    """Target here, drafter in a spawned process; what each side saw."""
    import time

    layout = _layout()
    pool = PagePool.create(layout, device)
    pool.region(layout.layer("target", 0))[2].fill_(1.0)
    canary = write_canary(pool)
    exports = PoolExports()
    handle = exports.export(pool)
    report = {"device_uuid": handle.cuda_ipc.device_uuid, "handle_bytes": len(handle.cuda_ipc.handle),
              "pool_bytes": layout.total_bytes, "page_values": pool.region(layout.layer("target", 0))[2].numel()}
    ctx = multiprocessing.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_drafter_process, args=(layout, handle.SerializeToString(), canary, child_end))
    start = time.monotonic()
    child.start()
    try:
        kind, first = _receive(parent, timeout)
        report["mapped_s"] = round(time.monotonic() - start, 3)
        if kind == "error":
            raise TransportError(first)
        report["canary_ok"], report["target_page_sum"], report["drafter_device"], _ = first
        sync_for_handoff(device)
        report["draft_page_written"] = bool(pool.region(layout.layer("draft", 0))[1].float().eq(3.0).all())
        del pool  # the target lets go; the exports keep the storage alive for the drafter
        junk = [torch.full((1 << 20,), 0xAB, dtype=torch.uint8, device=device) for _ in range(8)]
        parent.send("again")
        kind, again = _receive(parent, timeout)
        if kind == "error":
            raise TransportError(again)
        report["canary_ok_after_target_let_go"], report["target_page_sum_after"] = again
        del junk
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        exports.close()
    report["drafter_exit_code"] = child.exitcode
    return report


def _receive(conn, timeout: float):
    if not conn.poll(timeout):
        raise TimeoutError(f"the drafter process said nothing within {timeout} s")
    return conn.recv()


@pytest.mark.cuda
def test_cuda_ipc_between_two_processes():
    report = two_process_ipc_check(torch.device("cuda", 0))
    assert report["device_uuid"] and report["handle_bytes"] == 64
    assert report["canary_ok"] and report["target_page_sum"] == report["page_values"]  # every value 1.0
    assert report["draft_page_written"]
    assert report["canary_ok_after_target_let_go"] and report["target_page_sum_after"] == report["page_values"]
    assert report["drafter_exit_code"] == 0


@pytest.mark.cuda
def test_cuda_ipc_in_the_exporting_process_is_a_clear_error():
    pool = PagePool.create(_layout(), torch.device("cuda", 0))
    handle = export_pool(pool)
    with pytest.raises(TransportError, match="this very process"):
        map_pool(pool.layout, handle)
