"""Sharing the pool: shm on the CPU (tested here), CUDA IPC (marked cuda).

On the CPU also: torch's CUDA IPC handle round-trips, byte for byte, into the arguments
torch's own rebuild takes; torch's reference counters across re-attaches (modeled as
torch keeps them); the torch build check. Between two processes on a GPU:
tests/gpu/ipc_check.py (the GPU run's ipc section).
"""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import torch

from common.kv_layout import LayerSpec, StagingSpec, build_layout
from common.kv_pool import PagePool
from common.shm_file import PoolAccessDenied
from common.pool_exports import MAX_UNCONFIRMED_EPOCHS, MappedExports, PoolExports
from common.pool_transport import (
    SHARE_CUDA_FIELDS,
    Canary,
    TorchBuild,
    TransportError,
    check_cuda_handle,
    check_ipc_allocator,
    explain_ipc_failure,
    export_pool,
    exported_by_this_process,
    handle_from_share,
    ipc_build_mismatch,
    map_pool,
    parse_alloc_conf,
    read_canary,
    rebuild_args,
    refuse_expandable_segment,
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


def torch_shaped_handle(version: int = 3, kind: bytes = b"c") -> bytes:
    """A storage handle laid out byte for byte as CUDACachingAllocator::shareIpcHandle writes it:
    SHAREABLE_HANDLE_VERSION, the type byte ('c': a cudaMalloc block), the 64-byte
    cudaIpcMemHandle_t (binary: zero bytes included)."""
    return bytes([version]) + kind + bytes((i * 37) % 256 for i in range(64))


def torch_shaped_share(**overrides) -> tuple:
    """What `UntypedStorage._share_cuda_()` returns for a pool (StorageSharing.cpp)."""
    fields = {"device_index": 0, "handle": torch_shaped_handle(), "storage_size": 1 << 20, "storage_offset": 4096,
              "ref_counter_handle": b"/torch_4242_1234567_0", "ref_counter_offset": 17,
              "event_handle": bytes(range(64)), "event_sync_required": True, **overrides}
    return tuple(fields[name] for name in SHARE_CUDA_FIELDS)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _call_of(node: ast.AST, attribute: str) -> ast.Call:
    return next(n for n in ast.walk(node)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attribute)


def test_torch_rebuilds_a_storage_from_share_cuda_fields_in_their_order():
    """Read in the installed torch's own reductions.py: reduce_tensor sends `_share_cuda_()`'s
    tuple to rebuild_cuda_tensor, which hands those eight fields to `_new_shared_cuda` in
    the same order. That is the contract `rebuild_args` relies on."""
    import torch.multiprocessing.reductions as reductions

    tree = ast.parse(inspect.getsource(reductions))
    reduce_tensor, rebuild = _function(tree, "reduce_tensor"), _function(tree, "rebuild_cuda_tensor")
    unpacked = next(n for n in ast.walk(reduce_tensor) if isinstance(n, ast.Assign)
                    and isinstance(n.value, ast.Call) and getattr(n.value.func, "attr", "") == "_share_cuda_")
    shared = [elt.id for elt in unpacked.targets[0].elts]  # _share_cuda_()'s fields, torch's names
    sent = next(n.value.elts[1].elts for n in ast.walk(reduce_tensor) if isinstance(n, ast.Return)
                and isinstance(n.value, ast.Tuple) and getattr(n.value.elts[0], "id", "") == "rebuild_cuda_tensor")
    params = [a.arg for a in rebuild.args.args]
    passed = [a.id for a in _call_of(rebuild, "_new_shared_cuda").args]
    order = [shared.index(sent[params.index(name)].id) for name in passed]
    assert len(shared) == len(passed) == len(SHARE_CUDA_FIELDS) == 8
    assert order == list(range(8)), (shared, passed)


def test_a_torch_shaped_handle_round_trips_into_torchs_rebuild_arguments():
    shared = torch_shaped_share()
    assert len(shared[1]) == 66  # version byte, type byte, cudaIpcMemHandle_t
    handle = handle_from_share(shared, "GPU-1234abcd-0000-1111-2222-333344445555")
    wire = dpb.PoolHandle.FromString(dpb.PoolHandle(cuda_ipc=handle).SerializeToString())
    check_cuda_handle(_layout(), wire.cuda_ipc)  # passes before any CUDA call
    args = rebuild_args(wire.cuda_ipc, device_index=2)
    assert args == (2, *shared[1:])  # every field unchanged; the drafter's own index of the target's GPU
    # the types THPStorage_newSharedCuda checks: int, bytes, int, int, bytes, int, bytes, bool
    assert [type(a) for a in args] == [int, bytes, int, int, bytes, int, bytes, bool]
    big = torch_shaped_share(storage_size=123_456_789_012, storage_offset=0, event_sync_required=False)
    assert rebuild_args(handle_from_share(big, "GPU-x"), 0)[1:] == big[1:]


def test_share_cuda_results_torch_does_not_promise_are_refused():
    with pytest.raises(TransportError, match="returned 7 fields, expected 8"):
        handle_from_share(torch_shaped_share()[:7], "GPU-x")
    with pytest.raises(TransportError, match="storage is empty"):
        handle_from_share(torch_shaped_share(handle=None), "GPU-x")


def test_an_expandable_segment_is_refused_at_export(monkeypatch):
    import common.pool_transport as transport

    refuse_expandable_segment(torch_shaped_handle(kind=b"c"))
    with pytest.raises(TransportError, match="expandable segment") as info:
        refuse_expandable_segment(torch_shaped_handle(kind=b"e"))
    assert "expandable_segments:True" in str(info.value)

    class Storage:
        def _share_cuda_(self):
            return torch_shaped_share(handle=torch_shaped_handle(kind=b"e"), ref_counter_offset=5)

    class CudaPool:  # a pool the caching allocator placed in an expandable segment
        device, storage = torch.device("cuda", 0), Storage()

    returned = []
    monkeypatch.setattr(transport, "sync_for_handoff", lambda device: None)
    monkeypatch.setattr(transport, "device_uuid", lambda device: "GPU-x")
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        lambda name, offset: returned.append((name, offset)), raising=False)
    with pytest.raises(TransportError, match="expandable segment"):
        export_pool(CudaPool())
    assert returned == [(b"/torch_4242_1234567_0", 5)], "the refused export's reference was not returned"


def test_the_torch_builds_must_match_for_cuda_ipc():
    here = TorchBuild.here()
    assert here == TorchBuild(torch.__version__, torch.version.cuda or "")
    assert ipc_build_mismatch(here, TorchBuild.here()) is None
    problem = ipc_build_mismatch(TorchBuild("2.13.0+cu130", "13.0"), TorchBuild("2.11.0+cu130", "13.0"))
    assert "target torch 2.13.0+cu130 (CUDA 13.0), drafter torch 2.11.0+cu130 (CUDA 13.0)" in problem
    assert "CUDA 12.8" in ipc_build_mismatch(TorchBuild("2.13.0", "13.0"), TorchBuild("2.13.0", "12.8"))
    assert "(not reported)" in ipc_build_mismatch(TorchBuild(""), here)  # an older target says nothing


def test_cuda_ipc_handle_protobuf_round_trip():
    handle = dpb.CudaIpcHandle(
        device_uuid="GPU-1234abcd-0000-1111-2222-333344445555", device_index=3,
        handle=torch_shaped_handle(), storage_size=123_456_789_012, storage_offset=4096,
        ref_counter_handle=b"/torch_123_456\x00", ref_counter_offset=7, event_handle=b"\x00\xff" * 32,
        event_sync_required=True,
    )
    parsed = dpb.PoolHandle.FromString(dpb.PoolHandle(cuda_ipc=handle).SerializeToString())
    assert parsed.WhichOneof("transport") == "cuda_ipc"
    assert parsed.cuda_ipc == handle
    assert parsed.cuda_ipc.handle == torch_shaped_handle()  # binary-safe, zero bytes included


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
    fields = {"device_uuid": "GPU-1", "handle": torch_shaped_handle(), "storage_size": 1 << 20,
              "ref_counter_handle": b"/torch_1_2_3", "event_handle": bytes(64), "event_sync_required": True}
    fields.update(overrides)
    return dpb.CudaIpcHandle(**fields)


@pytest.mark.parametrize("overrides,message", [
    ({"device_uuid": ""}, "no device UUID"),
    ({"handle": b""}, "memory handle is 0 bytes"),
    ({"handle": bytes(4097)}, "memory handle is 4097 bytes"),
    ({"event_handle": b""}, "event handle is 0 bytes but the target asks to wait on it"),
    ({"event_handle": bytes(5000)}, "event handle is 5000 bytes"),
    ({"ref_counter_handle": b""}, "reference-counter file name is 0 bytes"),
    ({"ref_counter_handle": b"/x" * 200}, "reference-counter file name is 400 bytes"),
    ({"ref_counter_offset": 10_000}, "offset 10000 is past torch's 10000 counters"),
    ({"storage_size": 100}, "is 100 bytes, the layout needs"),
])
def test_cuda_handle_fields_are_checked_before_any_cuda_call(overrides, message):
    check_cuda_handle(_layout(), _cuda_handle())  # torch's 66-byte handle
    check_cuda_handle(_layout(), _cuda_handle(event_handle=b"", event_sync_required=False))
    check_cuda_handle(_layout(), _cuda_handle(handle=bytes(64)))  # opaque: any length torch may write
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
# torch's CUDA IPC reference counters across re-attaches (the arithmetic, on the CPU)


class TorchIpcCounters:
    """torch's per-export reference counters, as torch/csrc/CudaIPCTypes.cpp and
    StorageSharing.cpp keep them: `_share_cuda_()` sets a fresh int64 counter to 1; the
    consumer's storage deleter and `_release_ipc_counter_cuda` each decrement it as an
    int64; the producer frees the memory once every counter reads 0, read as uint64
    (`CudaIPCSentData::counter_value()` returns uint64_t and limbo keeps a block while it
    is > 0)."""

    def __init__(self) -> None:
        self.values: dict[int, int] = {}

    def share(self) -> int:
        key = len(self.values)
        self.values[key] = 1
        return key

    def decrement(self, key: int) -> None:
        self.values[key] -= 1

    def freed(self, key: int) -> bool:
        return self.values[key] % 2**64 == 0


@pytest.fixture
def fake_cuda_exports(monkeypatch, tmp_path):
    """PoolExports over real (CPU) pools whose exports look like CUDA ones, with torch's
    counters modeled: (exports, counters, make_pool(epoch), counter_of(pool handle))."""
    import common.pool_transport as transport

    counters = TorchIpcCounters()

    def fake_export(pool: PagePool) -> dpb.PoolHandle:
        key = counters.share()
        return dpb.PoolHandle(cuda_ipc=dpb.CudaIpcHandle(
            device_uuid="GPU-x", handle=torch_shaped_handle(), storage_size=pool.layout.total_bytes,
            ref_counter_handle=b"/torch_1_2_0", ref_counter_offset=key, event_handle=bytes(64)))

    monkeypatch.setattr(transport, "export_pool", fake_export)
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        lambda name, offset: counters.decrement(offset), raising=False)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    exports = PoolExports()
    yield exports, counters, lambda epoch: PagePool.create(_layout(epoch=epoch), torch.device("cpu"), tmp_path)
    exports.close()


def test_a_reattach_returns_the_references_of_exports_the_drafter_never_mapped(fake_cuda_exports):
    """The drafter's unmapping returns its own reference; the target returns only those of
    exports it never mapped. Returning one twice leaves it at -1: pinned for good."""
    exports, counters, make_pool = fake_cuda_exports
    first = exports.export(make_pool(1)).cuda_ipc.ref_counter_offset
    exports.attached("beef", 1)  # the drafter mapped epoch 1
    second = exports.export(make_pool(2)).cuda_ipc.ref_counter_offset  # a re-plan: a new pool
    counters.decrement(first)  # the drafter's Attach to epoch 2 unmaps epoch 1: its deleter
    exports.attached("beef", 2)
    assert counters.freed(first), f"epoch 1's counter is {counters.values[first]}: the old pool is never freed"
    third = exports.export(make_pool(3)).cuda_ipc.ref_counter_offset  # its Attach is refused before mapping
    fourth = exports.export(make_pool(4)).cuda_ipc.ref_counter_offset
    counters.decrement(second)  # the drafter unmaps epoch 2 as it attaches to 4
    exports.attached("beef", 4)
    assert counters.freed(second) and counters.freed(third)
    assert counters.values[fourth] == 1  # still mapped by the drafter
    assert exports.live == [("beef", 4)]


def test_exports_whose_attach_reply_was_lost_are_settled_by_the_drafters_word(fake_cuda_exports):
    exports, counters, make_pool = fake_cuda_exports
    drafter = MappedExports()
    pool = make_pool(1)
    one = exports.export(pool).cuda_ipc.ref_counter_offset
    drafter.record("beef", 1)  # the drafter mapped epoch 1, but the target's call timed out
    pool.layout = _layout(epoch=2)  # a retry with the same pool
    two = exports.export(pool).cuda_ipc.ref_counter_offset  # refused before mapping (not recorded)
    pool.layout = _layout(epoch=3)
    three = exports.export(pool).cuda_ipc.ref_counter_offset
    asked = exports.unconfirmed_epochs("beef", before_epoch=3)
    assert asked == [1, 2]
    counters.decrement(one)  # Attach(3) unmaps epoch 1 first, then maps 3
    drafter.record("beef", 3)
    exports.attached("beef", 3, drafter.answer("beef", asked, current_epoch=3))
    assert counters.freed(one) and counters.freed(two) and counters.values[three] == 1
    assert exports.unconfirmed_epochs("beef", before_epoch=4) == []


def test_an_export_the_drafter_did_not_map_at_its_attach_is_returned_later(fake_cuda_exports):
    """An n-gram drafter attaches without mapping (mapped_bytes 0)."""
    exports, counters, make_pool = fake_cuda_exports
    one = exports.export(make_pool(1)).cuda_ipc.ref_counter_offset
    exports.attached("beef", 1, mapped=False)
    two = exports.export(make_pool(2)).cuda_ipc.ref_counter_offset
    exports.attached("beef", 2, mapped=False)
    assert counters.freed(one) and counters.values[two] == 1


def test_the_drafters_note_of_mapped_exports_is_bounded():
    mapped = MappedExports(limit=4)
    for epoch in range(1, 8):
        mapped.record("t1", epoch)
    assert mapped.answer("t1", [3, 4, 5], current_epoch=8) == [4, 5]  # it kept the 4 newest
    assert mapped.answer("t1", [5], current_epoch=8) == [5]  # asked again: still known
    assert mapped.answer("t1", [4], current_epoch=8) == []  # forgotten: the target stopped asking
    assert mapped.answer("t2", [5], current_epoch=1) == []  # another target
    mapped.record("t2", 1)
    assert mapped.answer("t1", [5], current_epoch=8) == []  # a new target replaces the old
    with pytest.raises(ValueError, match="at most 4"):
        mapped.answer("t2", range(5), current_epoch=1)
    assert MAX_UNCONFIRMED_EPOCHS == 1024


# ---------------------------------------------------------------------------------------
# CUDA IPC between two unrelated processes (tests/gpu/ipc_check.py; its shm run is in
# tests/test_gpu_run.py, the GPU run's ipc section runs it with 1 GiB pools)


@pytest.mark.cuda
def test_cuda_ipc_between_two_processes(tmp_path):
    from tests.gpu.ipc_check import run_ipc_check

    report = run_ipc_check(torch.device("cuda", 0), tmp_path, pool_mib=256)
    assert report["ok"], report
    assert report["torch_handle_bytes"] > 0  # torch's opaque handle (66 bytes in 2.11-2.13)


@pytest.mark.cuda
def test_cuda_ipc_in_the_exporting_process_is_a_clear_error():
    pool = PagePool.create(_layout(), torch.device("cuda", 0))
    handle = export_pool(pool)
    with pytest.raises(TransportError, match="this very process"):
        map_pool(pool.layout, handle)
