"""The pool file cannot be aimed elsewhere: a real `splitspec-draft` process (a draft
LM, so it maps the pool and writes draft pages into it) and a test client holding the
internal token that plays a hostile target.

Every `Attach` naming something other than a target's pool file in the drafter's
`--shm-dir` — a pool file outside it, `../../etc/passwd`, a link inside it pointing out,
a FIFO, a file of the wrong mode, size, owner or link count, a canary that does not
match, a file that does not exist — gets the same PERMISSION_DENIED with the same
details, each file keeps its bytes through the following `Propose`, and the drafter
keeps serving and still attaches a legitimate pool.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import auth_metadata
from common.kv_layout import KVLayout, LayerSpec, build_layout
from common.kv_pool import PagePool
from common.layout_proto import kv_layout_to_proto, layer_spec_from_proto
from common.pool_transport import CANARY_BYTES, write_canary
from common.shm_file import PoolAccessDenied
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc
from splitspec.v1 import kv_layout_pb2 as kv_pb
from tests.procs import TOKEN, Service, private_shm_dir
from tests.tiny_models import make_qwen3

PAGE_SIZE = 4
NUM_PAGES = 32
RPC_TIMEOUT = 60.0


@dataclass
class Drafter:
    proc: Service
    shm: Path
    vocab_size: int


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A draft_model drafter confined to a private shm dir."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("confinement")
    draft = make_qwen3(root / "draft", seed=1, num_hidden_layers=1)
    shm = private_shm_dir()
    proc = Service("draft_service.cli", ["--model", str(draft), "--kind", "draft_model", "--port", "0",
                                         "--num-speculative-tokens", "3", "--shm-dir", str(shm)], root / "drafter.log")
    try:
        proc.wait_serving()
        yield Drafter(proc, shm, len(AutoTokenizer.from_pretrained(draft)))
        assert proc.stop() == 0, proc.log()
    finally:
        proc.kill()
        leftovers = list(shm.iterdir())
        shutil.rmtree(shm, ignore_errors=True)
        assert not leftovers, f"files left in the drafter's shm dir: {leftovers}"


class HostileTarget:
    """Holds the token; negotiates honestly, then names whatever file it likes in Attach."""

    def __init__(self, drafter: Drafter) -> None:
        self.channel = grpc.insecure_channel(drafter.proc.address)
        self.stub = dpb_grpc.DrafterStub(self.channel)
        self.metadata = auth_metadata(TOKEN)
        self.vocab_size = drafter.vocab_size
        self.target_id = uuid.uuid4().hex
        self.epoch = 0

    def close(self) -> None:
        self.channel.close()

    def negotiate(self) -> list[LayerSpec]:
        facts = dpb.TargetFacts(
            architecture="Qwen3ForCausalLM", hidden_size=64, vocab_size=self.vocab_size, num_layers=2,
            supported_orders=[kv_pb.PAGE_ORDER_NHD], preferred_order=kv_pb.PAGE_ORDER_NHD,
            kv_dtype=kv_pb.KV_DTYPE_FLOAT32, page_size=PAGE_SIZE, max_num_seqs=8, max_tokens_per_step=64,
            device_type="cpu", max_model_len=512)
        answer = self.stub.Negotiate(dpb.NegotiateRequest(target_id=self.target_id, target=facts),
                                     metadata=self.metadata, timeout=RPC_TIMEOUT)
        return [layer_spec_from_proto(spec) for spec in answer.layers]

    def layout(self, num_pages: int = NUM_PAGES) -> KVLayout:
        """A fresh epoch's layout: the target's two layers and the drafter's."""
        self.epoch += 1
        layers = [LayerSpec("target", i, 2, 16) for i in range(2)] + self.negotiate()
        return build_layout(order="NHD", page_size=PAGE_SIZE, kv_dtype="float32", num_pages=num_pages,
                            layers=layers, staging=None, target_id=self.target_id, epoch=self.epoch)

    def attach(self, layout: KVLayout, path: str | Path, canary: bytes) -> None:
        request = dpb.AttachRequest(
            layout=kv_layout_to_proto(layout),
            pool=dpb.PoolHandle(shm=dpb.ShmHandle(path=str(path), size=layout.total_bytes)),
            canary=dpb.Canary(offset=layout.trailer_offset, value=canary))
        self.stub.Attach(request, metadata=self.metadata, timeout=RPC_TIMEOUT)

    def propose(self, layout: KVLayout) -> dpb.ProposeResponse:
        """A sequence whose draft pages (0-2) the drafter writes: into the pool it mapped, if any."""
        update = dpb.SequenceUpdate(seq_id=1, context_token_ids=[5, 6, 7, 8, 9], last_token_id=10,
                                    new_pages=[0, 1, 2], num_speculative_tokens=3)
        request = dpb.ProposeRequest(target_id=layout.target_id, epoch=layout.epoch, sequences=[update])
        return self.stub.Propose(request, metadata=self.metadata, timeout=RPC_TIMEOUT)


@pytest.fixture
def hostile(drafter):
    target = HostileTarget(drafter)
    yield target
    target.close()


def pool_with_canary(layout: KVLayout, folder: Path) -> tuple[PagePool, bytes]:
    """A real pool file, made as the target makes it, and the canary in it."""
    pool = PagePool.create(layout, torch.device("cpu"), folder)
    return pool, write_canary(pool).value


def plant_canary(path: Path, offset: int, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


def denied(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    return info.value


# ---------------------------------------------------------------- the cases


def case_pool_outside(hostile, shm, tmp_path):
    """A well-formed pool file, canary and all, one folder away from the shm dir."""
    layout = hostile.layout()
    pool, canary = pool_with_canary(layout, tmp_path)
    return layout, pool.path, canary, [pool.path], pool.close


def case_etc_passwd_relative(hostile, shm, tmp_path):
    layout = hostile.layout()
    return layout, "../../etc/passwd", b"root:x:0:0:root" + b"\n", [Path("/etc/passwd")], None


def case_etc_passwd_through_the_shm_dir(hostile, shm, tmp_path):
    layout = hostile.layout()
    return layout, f"{shm}/../../etc/passwd", b"r" * CANARY_BYTES, [Path("/etc/passwd")], None


def case_etc_passwd_absolute(hostile, shm, tmp_path):
    layout = hostile.layout()
    return layout, "/etc/passwd", b"r" * CANARY_BYTES, [Path("/etc/passwd")], None


def case_symlink_inside_pointing_out(hostile, shm, tmp_path):
    layout = hostile.layout()
    pool, canary = pool_with_canary(layout, tmp_path)
    link = shm / "splitspec-link.kv"
    link.symlink_to(pool.path)
    return layout, link, canary, [pool.path], lambda: (link.unlink(), pool.close())


def case_fifo(hostile, shm, tmp_path):
    layout = hostile.layout()
    fifo = shm / "splitspec-fifo.kv"
    os.mkfifo(fifo, 0o600)
    return layout, fifo, b"f" * CANARY_BYTES, [], fifo.unlink


def case_wrong_mode(hostile, shm, tmp_path):
    layout = hostile.layout()
    pool, canary = pool_with_canary(layout, shm)
    pool.path.chmod(0o644)
    return layout, pool.path, canary, [pool.path], pool.close


def case_wrong_size(hostile, shm, tmp_path):
    """The file of a larger layout, the canary planted where the smaller layout keeps it."""
    big = hostile.layout(NUM_PAGES + 1)
    pool, canary = pool_with_canary(big, shm)
    layout = hostile.layout()
    plant_canary(pool.path, layout.trailer_offset, canary)
    return layout, pool.path, canary, [pool.path], pool.close


def case_second_link(hostile, shm, tmp_path):
    """A hard link in the shm dir to a pool file elsewhere on the same file system."""
    layout = hostile.layout()
    elsewhere = shm / "elsewhere"
    elsewhere.mkdir()
    pool, canary = pool_with_canary(layout, elsewhere)
    link = shm / "splitspec-hardlink.kv"
    os.link(pool.path, link)
    return layout, link, canary, [pool.path], lambda: (link.unlink(), pool.close(), elsewhere.rmdir())


def case_wrong_canary(hostile, shm, tmp_path):
    layout = hostile.layout()
    pool, canary = pool_with_canary(layout, shm)
    return layout, pool.path, bytes(b ^ 0xFF for b in canary), [pool.path], pool.close


def case_missing_file(hostile, shm, tmp_path):
    layout = hostile.layout()
    return layout, shm / "splitspec-nothing-here.kv", b"m" * CANARY_BYTES, [], None


def case_other_owner(hostile, shm, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("crafting a file of another user needs root")
    layout = hostile.layout()
    pool, canary = pool_with_canary(layout, shm)
    os.chown(pool.path, 65534, 65534)  # nobody
    return layout, pool.path, canary, [pool.path], pool.close


CASES = [case_pool_outside, case_etc_passwd_relative, case_etc_passwd_through_the_shm_dir, case_etc_passwd_absolute,
         case_symlink_inside_pointing_out, case_fifo, case_wrong_mode, case_wrong_size, case_second_link,
         case_wrong_canary, case_missing_file, case_other_owner]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.removeprefix("case_") for c in CASES])
def test_an_attach_naming_anything_but_a_pool_in_the_shm_dir_is_denied_and_writes_nothing(case, hostile, drafter,
                                                                                          tmp_path):
    layout, path, canary, watched, cleanup = case(hostile, drafter.shm, tmp_path)
    try:
        before = {p: p.read_bytes() for p in watched}
        error = denied(lambda: hostile.attach(layout, path, canary))
        with pytest.raises(grpc.RpcError) as info:  # not attached: the drafter writes no page anywhere
            hostile.propose(layout)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert {p: p.read_bytes() for p in watched} == before
    finally:
        if cleanup is not None:
            cleanup()
    # one answer for every case: nothing in it depends on the file
    assert error.details() == PoolAccessDenied.MESSAGE, error.details()



def test_after_every_refusal_the_drafter_serves_and_attaches_a_real_pool(hostile, drafter):
    layout = hostile.layout()
    pool, canary = pool_with_canary(layout, drafter.shm)
    try:
        assert stat.S_IMODE(pool.path.stat().st_mode) == 0o600
        hostile.attach(layout, pool.path, canary)
        before = pool.path.read_bytes()
        drafts = hostile.propose(layout).drafts
        assert [d.seq_id for d in drafts] == [1] and len(drafts[0].token_ids) == 3
        assert pool.path.read_bytes() != before, "the drafter writes its draft pages into the real pool"
        with grpc.insecure_channel(drafter.proc.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        release = dpb.ReleaseRequest(target_id=layout.target_id, epoch=layout.epoch, detach=True)
        hostile.stub.Release(release, metadata=hostile.metadata, timeout=RPC_TIMEOUT)
    finally:
        pool.close()
    assert "refused the KV pool file" in drafter.proc.log()  # the reasons are the operator's, in the log
