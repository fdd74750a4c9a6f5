"""Sharing the pool between two unrelated processes, as the target and the drafter do.

The target's side runs here (`run_ipc_check`); the drafter's side is a separate Python
process (`python -m tests.gpu.ipc_check --peer`, not a fork or a multiprocessing child)
driven over its stdin/stdout, one JSON object per line. Both use the production code:
`PoolExports`, `export_pool`, `map_pool`, `MappedExports`, the canary.

Steps: the peer maps the pool, reads the canary and a page the target wrote, writes a
draft page the target reads; it still reads them after the target dropped its own
reference (the exports keep the pool alive). Then two re-attach cycles: the peer moves
to a new pool (its unmapping returns its reference), and a pool exported but never sent
is settled by the target; on CUDA, `torch.cuda.mem_get_info` must show each old pool's
memory returned to the device. On a CPU the pools are shm files and the memory is not
measured; everything else runs.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.kv_layout import LayerSpec, build_layout
from common.kv_pool import PagePool
from common.layout_proto import kv_layout_from_proto, kv_layout_to_proto
from common.pool_exports import MappedExports, PoolExports
from common.pool_transport import Canary, map_pool, read_canary, sync_for_handoff, write_canary
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import kv_layout_pb2 as kv_pb

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET_ID = "ipccheck"
PAGE_SIZE = 16
HEADS, HEAD_DIM = 8, 128
TARGET_PAGE, DRAFT_PAGE = 2, 1
RETURNED_FRACTION = 0.9  # of a pool's bytes that mem_get_info must see come back


def pool_layout(epoch: int, pool_mib: float):
    """A target layer and a draft layer, fp8 pages, about `pool_mib` MiB in all."""
    layers = [LayerSpec("target", 0, HEADS, HEAD_DIM), LayerSpec("draft", 0, HEADS, HEAD_DIM)]
    per_page = 2 * 2 * PAGE_SIZE * HEADS * HEAD_DIM  # two layers, K and V, one byte each
    num_pages = max(4, int(pool_mib * 2**20) // per_page)
    return build_layout(order="HND", page_size=PAGE_SIZE, kv_dtype="fp8_e4m3", num_pages=num_pages, layers=layers,
                        target_id=TARGET_ID, epoch=epoch)


# ---------------------------------------------------------------------------------------
# The drafter's side


class Peer:
    """Maps what it is sent, one pool at a time, like the drafter's Attach."""

    def __init__(self) -> None:
        self.pool: PagePool | None = None
        self.mapped = MappedExports()

    def attach(self, msg: dict) -> dict:
        self.drop()  # as the drafter: every Attach unmaps the previous pool first
        layout = kv_layout_from_proto(kv_pb.KVLayout.FromString(bytes.fromhex(msg["layout"])))
        canary = msg["canary"]
        self.pool = map_pool(layout, dpb.PoolHandle.FromString(bytes.fromhex(msg["pool"])), msg["shm_dir"],
                             Canary(canary["offset"], bytes.fromhex(canary["value"])))
        self.mapped.record(layout.target_id, layout.epoch)
        answer = self.read(canary)
        self.pool.region(layout.layer("draft", 0))[DRAFT_PAGE].fill_(3.0)
        sync_for_handoff(self.pool.device)
        answer["device"] = str(self.pool.device)
        answer["mapped_epochs"] = self.mapped.answer(layout.target_id, msg.get("unconfirmed", []), layout.epoch)
        return answer

    def read(self, canary: dict) -> dict:
        layout = self.pool.layout
        ok = read_canary(self.pool, Canary(canary["offset"], bytes.fromhex(canary["value"])))
        page_sum = self.pool.region(layout.layer("target", 0))[TARGET_PAGE].float().sum().item()
        return {"canary_ok": ok, "target_page_sum": page_sum}

    def drop(self) -> None:
        if self.pool is not None:
            device = self.pool.device
            self.pool = None
            gc.collect()  # the storage's deleter returns torch's IPC reference now
            sync_for_handoff(device)


def serve_peer() -> int:
    peer = Peer()
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "attach":
                reply = peer.attach(msg)
            elif msg["op"] == "read":
                reply = peer.read(msg["canary"])
            else:
                peer.drop()
                reply = {"bye": True}
        except Exception as exc:  # noqa: BLE001 - reported to the target's side, which fails with it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
        if msg["op"] == "exit":
            return 0
    return 0


# ---------------------------------------------------------------------------------------
# The target's side


class PeerProcess:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.gpu.ipc_check", "--peer"], cwd=REPO_ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def call(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # the peer answers every line; EOF if it died
        if not line:
            raise RuntimeError(f"the peer process exited with {self.proc.wait(self.timeout_s)}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"peer: {reply['error']}")
        return reply

    def close(self) -> int | None:
        try:
            if self.proc.poll() is None:
                self.call(op="exit")
            return self.proc.wait(self.timeout_s)
        except Exception:  # noqa: BLE001 - a hung or dead peer
            self.proc.kill()
            return self.proc.wait()


def _attach_message(exports: PoolExports, pool: PagePool, canary, handle: dpb.PoolHandle, shm_dir: Path) -> dict:
    return {"op": "attach", "layout": kv_layout_to_proto(pool.layout).SerializeToString().hex(),
            "shm_dir": str(shm_dir),  # a CPU pool file is mapped only from the drafter's shm dir
            "pool": handle.SerializeToString().hex(),
            "canary": {"offset": canary.offset, "value": canary.value.hex()},
            "unconfirmed": exports.unconfirmed_epochs(TARGET_ID, pool.layout.epoch)}


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what the caching allocator got back goes back to the device
    return torch.cuda.mem_get_info(device)[0]


def run_ipc_check(device: torch.device, shm_dir: Path, pool_mib: float = 1024.0, timeout_s: float = 60.0) -> dict:
    """Target here, drafter in its own process: what each side saw, and whether it is right."""
    report: dict = {"device": str(device), "pool_mib": pool_mib}
    checks: dict[str, bool] = {}
    exports = PoolExports()
    peer = PeerProcess(timeout_s)
    try:
        started = time.monotonic()
        pool = PagePool.create(pool_layout(1, pool_mib), device, shm_dir)
        pool.region(pool.layout.layer("target", 0))[TARGET_PAGE].fill_(1.0)
        page_values = pool.region(pool.layout.layer("target", 0))[TARGET_PAGE].numel()
        canary = write_canary(pool)
        handle = exports.export(pool)
        if handle.WhichOneof("transport") == "cuda_ipc":
            report["torch_handle_bytes"] = len(handle.cuda_ipc.handle)
        first = peer.call(**_attach_message(exports, pool, canary, handle, shm_dir))
        exports.attached(TARGET_ID, 1, first["mapped_epochs"])
        report["mapped_s"] = round(time.monotonic() - started, 3)
        report["peer_device"] = first["device"]
        checks["canary_read_by_peer"] = first["canary_ok"]
        checks["target_page_read_by_peer"] = first["target_page_sum"] == page_values
        sync_for_handoff(device)
        checks["draft_page_seen_by_target"] = bool(pool.region(pool.layout.layer("draft", 0))[DRAFT_PAGE]
                                                   .float().eq(3.0).all())
        first_bytes = pool.layout.total_bytes
        del pool  # the target lets go; the exports keep the storage alive for the peer
        junk = torch.full((8 << 20,), 0xAB, dtype=torch.uint8, device=device)  # reuse freed memory, if any
        again = peer.call(op="read", canary={"offset": canary.offset, "value": canary.value.hex()})
        checks["alive_after_target_let_go"] = again["canary_ok"] and again["target_page_sum"] == page_values
        del junk

        # re-attach: the peer moves to pool 2, unmapping pool 1 (its reference goes back)
        before = _free_bytes(device)
        second = PagePool.create(pool_layout(2, pool_mib), device, shm_dir)
        second_bytes = second.layout.total_bytes
        reply = peer.call(**_attach_message(exports, second, write_canary(second), exports.export(second), shm_dir))
        after_alloc = _free_bytes(device)
        exports.attached(TARGET_ID, 2, reply["mapped_epochs"])
        del second
        after_release = _free_bytes(device)
        checks["reattach_canary_ok"] = reply["canary_ok"]

        # an export whose Attach never reached the peer (3), then the peer moves to 4
        third = PagePool.create(pool_layout(3, pool_mib), device, shm_dir)
        third_bytes = third.layout.total_bytes
        exports.export(third)
        del third
        fourth = PagePool.create(pool_layout(4, pool_mib), device, shm_dir)
        message = _attach_message(exports, fourth, write_canary(fourth), exports.export(fourth), shm_dir)
        report["unconfirmed_sent"] = message["unconfirmed"]
        reply = peer.call(**message)
        report["peer_mapped_epochs"] = reply["mapped_epochs"]
        asked = [3] if device.type == "cuda" else []  # CPU pools hold no IPC reference to settle
        checks["never_mapped_export_reported_as_such"] = message["unconfirmed"] == asked and reply["mapped_epochs"] == []
        before_second_release = _free_bytes(device)
        exports.attached(TARGET_ID, 4, reply["mapped_epochs"])
        after_second_release = _free_bytes(device)
        checks["live_exports_after_reattach"] = exports.live == [(TARGET_ID, 4)]
        if device.type == "cuda":
            returned_1 = after_release - after_alloc
            returned_2 = after_second_release - before_second_release
            report["memory"] = {"free_before_gib": round(before / 2**30, 3),
                                "returned_after_first_reattach_gib": round(returned_1 / 2**30, 3),
                                "expected_first_gib": round(first_bytes / 2**30, 3),
                                "returned_after_second_reattach_gib": round(returned_2 / 2**30, 3),
                                "expected_second_gib": round((second_bytes + third_bytes) / 2**30, 3)}
            checks["old_pool_memory_returned"] = returned_1 >= RETURNED_FRACTION * first_bytes
            checks["mapped_and_never_mapped_pools_returned"] = (
                returned_2 >= RETURNED_FRACTION * (second_bytes + third_bytes))
        else:
            report["memory"] = "not measured: the pools are shm files"
        del fourth
    finally:
        report["peer_exit_code"] = peer.close()
        exports.close()
    checks["peer_exit_0"] = report["peer_exit_code"] == 0
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["headline"] = ", ".join(f"{k}={v}" for k, v in checks.items())
    return report


if __name__ == "__main__":
    if sys.argv[1:] == ["--peer"]:
        sys.exit(serve_peer())
    sys.exit("usage: python -m tests.gpu.ipc_check --peer (the drafter's side; run_ipc_check drives it)")
