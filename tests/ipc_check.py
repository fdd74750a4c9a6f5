"""CUDA IPC between two processes: the target here, the drafter in a spawned process.

Run by tests/test_pool_transport.py (marked cuda) and by tests/gpu/run_gpu_checks.py,
which reports what each side saw.
"""

from __future__ import annotations

import multiprocessing
import time

import torch

from common.kv_layout import LayerSpec, StagingSpec, build_layout
from common.kv_pool import PagePool
from common.pool_transport import (
    Canary,
    PoolExports,
    TransportError,
    map_pool,
    read_canary,
    sync_for_handoff,
    write_canary,
)
from splitspec.v1 import drafter_pb2 as dpb


def ipc_layout(**kw):
    layers = [LayerSpec("target", 0, 2, 16), LayerSpec("draft", 0, 1, 16)]
    return build_layout(order="HND", page_size=4, kv_dtype="fp8_e4m3", num_pages=6, layers=layers,
                        staging=StagingSpec(rows=4, width=8), target_id="beef", **kw)


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
    layout = ipc_layout()
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
