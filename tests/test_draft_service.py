"""The drafter through real `splitspec-draft` processes, one per kind (ngram, draft_model,
dflash), driven by a test client that plays the target: it lays out a pool with its own
layers, the drafter's layers and a staging buffer, creates it in the private shm folder
the drafters are confined to (`--shm-dir`), writes the canary, and calls Negotiate / Attach / Propose / Release.

Expected drafts come from independent code: a hand-checked prompt lookup, a greedy
loop over the draft checkpoint in transformers, and z-lab's `dflash.model` reference
fed the hidden states of the target in transformers.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.attention_backends import select_backend
from common.auth import auth_metadata
from common.kv_layout import LAYOUT_NOT_RESOLVED, CacheConfig, LayerSpec, StagingSpec, build_layout
from common.kv_pool import PagePool
from common.layout_proto import kv_layout_to_proto, layer_spec_from_proto
from common.pool_transport import export_pool, write_canary
from draft_service.drafters import resolve_kind
from draft_service.drafters.base import Drafter, DraftSequence, Update
from draft_service.drafters.ngram import ngram_lookup
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc
from splitspec.v1 import kv_layout_pb2 as kv_pb
from tests.eagle3_reference import HeadShape, build_reference, save_speculators
from tests.procs import TOKEN, Service, free_port, pool_files, private_shm_dir, scrape_metrics
from tests.tiny_models import PROMPTS, make_qwen3, qwen3_config

PAGE_SIZE = 4
NUM_PAGES = 96
STAGING_ROWS = 64
K = 3  # every drafter here: --num-speculative-tokens 3, DFlash block_size 4
RPC_TIMEOUT = 60.0
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


# ---------------------------------------------------------------- checkpoints


@dataclass
class Checkpoints:
    target: Path
    draft: Path
    dflash: Path
    eagle3: Path
    vocab_size: int
    mask_token_id: int
    fingerprint: str


def make_dflash(out_dir: Path, vocab_size: int, mask_token_id: int) -> Path:
    """A tiny z-lab DFlash drafter for the tiny target (hidden 64, 2 target layers)."""
    from dflash.model import DFlashDraftModel

    # a wider init than 0.02, so attention over the context is sharp and drafts vary with it
    config = qwen3_config(vocab_size, num_target_layers=2, initializer_range=0.2)
    config.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": [0, 1]}
    config.block_size = K + 1
    torch.manual_seed(2)
    DFlashDraftModel(config).eval().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    from transformers import AutoTokenizer

    from common.qwen3 import Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("checkpoints")
    target = make_qwen3(root / "target", seed=0)
    draft = make_qwen3(root / "draft", seed=1, num_hidden_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(target)
    dflash = make_dflash(root / "dflash", len(tokenizer), tokenizer.mask_token_id)
    # the 2-layer target has one state an EAGLE-3 head may read: the one entering layer 1
    eagle3 = save_speculators(build_reference(HeadShape(aux_layer_ids=(1,)), target), root / "eagle3", target)
    fingerprint = Qwen3ForCausalLM.from_pretrained(target, torch.float32, "cpu").fingerprint()
    return Checkpoints(target, draft, dflash, eagle3, len(tokenizer), tokenizer.mask_token_id, fingerprint)


# ---------------------------------------------------------------- drafter processes


def start_drafter(kind: str, args: list[str], log_path: Path, token_file: Path, shm_dir: Path) -> Service:
    args = ["--port", "0", "--internal-token-file", str(token_file), "--kind", kind,
            "--num-speculative-tokens", str(K), "--shm-dir", str(shm_dir), *args]
    return Service("draft_service.cli", args, log_path, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def drafters_shm_dir():
    """The pool folder of the test targets, the one the drafters map pools from."""
    path = private_shm_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def drafters(checkpoints, tmp_path_factory, drafters_shm_dir):
    """One drafter process per kind, started together."""
    root = tmp_path_factory.mktemp("drafters")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    procs = {
        "ngram": start_drafter("ngram", ["--ngram-min", "1", "--ngram-max", "3"], root / "ngram.log", token_file,
                               drafters_shm_dir),
        "draft_model": start_drafter(
            "draft_model", ["--model", str(checkpoints.draft)], root / "draft.log", token_file, drafters_shm_dir
        ),
        "dflash": start_drafter(
            "dflash", ["--model", str(checkpoints.dflash), "--target-model", str(checkpoints.target), "--dtype",
                       "float32"],  # the reference's drafts are compared at float32
            root / "dflash.log", token_file, drafters_shm_dir,
        ),
        "eagle3": start_drafter(
            "eagle3", ["--model", str(checkpoints.eagle3), "--target-model", str(checkpoints.target), "--dtype",
                       "float32"],  # the reference's drafts are compared at float32
            root / "eagle3.log", token_file, drafters_shm_dir,
        ),
    }
    try:
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.wait_serving(timeout=120), procs.values()))
        yield procs
    finally:
        for proc in procs.values():
            proc.stop(timeout=20)
        for kind, proc in procs.items():
            assert proc.proc.returncode == 0, f"{kind} drafter exited with {proc.proc.returncode}:\n{proc.log()}"


# ---------------------------------------------------------------- the test's target


@dataclass
class Seq:
    """The test target's view of one sequence: tokens and pages."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)  # context, then the last token
    pages: list[int] = field(default_factory=list)


class FakeTarget:
    """Plays the target: facts, pool, canary, and SequenceUpdates."""

    def __init__(self, address: str, shm_dir: Path, checkpoints: Checkpoints) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = dpb_grpc.DrafterStub(self.channel)
        self.metadata = auth_metadata(TOKEN)
        self.shm_dir = shm_dir
        self.ckpt = checkpoints
        self.target_id = uuid.uuid4().hex
        self.pools: list[PagePool] = []
        self.negotiated: dpb.NegotiateResponse | None = None
        self.pool: PagePool | None = None
        self._next_page = 0

    def close(self) -> None:
        self.channel.close()
        for pool in self.pools:
            pool.close()

    def facts(self, **overrides) -> dpb.TargetFacts:
        fields = dict(
            architecture="Qwen3ForCausalLM", hidden_size=64, vocab_size=self.ckpt.vocab_size, num_layers=2,
            fingerprint=self.ckpt.fingerprint, supported_orders=[kv_pb.PAGE_ORDER_NHD, kv_pb.PAGE_ORDER_HND],
            preferred_order=kv_pb.PAGE_ORDER_NHD, kv_dtype=kv_pb.KV_DTYPE_FLOAT32, page_size=PAGE_SIZE,
            max_num_seqs=8, max_tokens_per_step=256, device_type="cpu", max_model_len=512,
        )
        fields.update(overrides)
        return dpb.TargetFacts(**fields)

    def negotiate(self, **overrides) -> dpb.NegotiateResponse:
        facts = self.facts(**overrides)
        request = dpb.NegotiateRequest(target_id=self.target_id, target=facts, requested_order="auto")
        self.negotiated = self.stub.Negotiate(request, metadata=self.metadata, timeout=RPC_TIMEOUT)
        return self.negotiated

    def attach(self, epoch: int, order: str = "NHD", bad_canary: bool = False,
               unconfirmed: tuple[int, ...] = ()) -> dpb.AttachResponse:
        draft_layers = [layer_spec_from_proto(spec) for spec in self.negotiated.layers]
        target_layers = [LayerSpec("target", i, 2, 16) for i in range(2)]
        staging = None
        if self.negotiated.target_layer_ids:
            staging = StagingSpec(rows=STAGING_ROWS, width=64 * len(self.negotiated.target_layer_ids))
        layout = build_layout(order=order, page_size=PAGE_SIZE, kv_dtype="float32", num_pages=NUM_PAGES,
                              layers=[*target_layers, *draft_layers], staging=staging,
                              target_id=self.target_id, epoch=epoch)
        self.pool = PagePool.create(layout, torch.device("cpu"), self.shm_dir)
        self.pools.append(self.pool)
        canary = write_canary(self.pool)
        value = bytes(b ^ 0xFF for b in canary.value) if bad_canary else canary.value
        request = dpb.AttachRequest(layout=kv_layout_to_proto(layout), pool=export_pool(self.pool),
                                    canary=dpb.Canary(offset=canary.offset, value=value),
                                    unconfirmed_epochs=unconfirmed)
        return self.stub.Attach(request, metadata=self.metadata, timeout=RPC_TIMEOUT)

    def cover(self, seq: Seq, num_tokens: int) -> list[int]:
        """Allocate pages so the sequence holds num_tokens slots; the new page ids."""
        new = []
        while len(seq.pages) * PAGE_SIZE < num_tokens:
            new.append(self._next_page)
            seq.pages.append(self._next_page)
            self._next_page += 1
        return new

    def update(self, seq: Seq, context: list[int], last: int, k: int = K, staging_row: int = 0) -> dpb.SequenceUpdate:
        """Advance `seq` by `context` (tokens whose target KV now exists) and a new last token."""
        start = 0 if not seq.tokens else len(seq.tokens) - 1
        seq.tokens = seq.tokens[:start] + context + [last]
        new_pages = self.cover(seq, len(seq.tokens) + k)  # the verify block: last_pos .. last_pos + K
        return dpb.SequenceUpdate(seq_id=seq.seq_id, context_start=start, context_token_ids=context,
                                  staging_row=staging_row, new_pages=new_pages, last_token_id=last,
                                  num_speculative_tokens=k)

    def propose(
        self, epoch: int, updates: list[dpb.SequenceUpdate], released: tuple[int, ...] = ()
    ) -> dict[int, list[int]]:
        request = dpb.ProposeRequest(target_id=self.target_id, epoch=epoch, sequences=updates,
                                     released_seq_ids=released)
        response = self.stub.Propose(request, metadata=self.metadata, timeout=RPC_TIMEOUT)
        return {draft.seq_id: list(draft.token_ids) for draft in response.drafts}

    def release(self, epoch: int, seq_ids: tuple[int, ...] = ()) -> None:
        request = dpb.ReleaseRequest(target_id=self.target_id, epoch=epoch, seq_ids=seq_ids)
        self.stub.Release(request, metadata=self.metadata, timeout=RPC_TIMEOUT)


@pytest.fixture
def target_for(drafters, checkpoints, drafters_shm_dir):
    made: list[FakeTarget] = []

    def make(kind: str) -> FakeTarget:
        fake = FakeTarget(drafters[kind].address, drafters_shm_dir, checkpoints)
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.close()
    assert not pool_files(drafters_shm_dir), "the test target left pool files behind"


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoints.target)


# ---------------------------------------------------------------- in-process units


def test_ngram_lookup_prefers_longer_ngrams_and_the_most_recent_match():
    assert ngram_lookup([5, 6, 7, 8, 9, 5, 6, 7, 8], 3) == [9, 5, 6]
    assert ngram_lookup([1, 2, 9, 1, 2, 7, 1, 2], 2) == [7, 1]  # most recent [1, 2], not the first
    assert ngram_lookup([4, 1, 2, 5, 3, 1, 2, 6, 4, 1, 2], 3) == [5, 3, 1]  # [4, 1, 2] beats a later [1, 2]
    assert ngram_lookup([1, 2, 3, 4], 3) == []
    assert ngram_lookup([7, 7], 3) == [7]  # fewer than K tokens follow
    assert ngram_lookup([1, 2, 3, 1, 2], 3, min_n=3) == []


def test_sequence_bookkeeping_resets_appends_and_drops_out_of_sync():
    drafter = Drafter(CacheConfig())
    seq = drafter.update(Update(1, 0, (10, 11, 12), 13, new_pages=(4,)))
    assert (seq.token_ids, seq.page_table, seq.context_len) == ([10, 11, 12, 13], [4], 3)
    seq.num_context, seq.scratch_token_ids = 4, [20, 21]  # a draft LM wrote KV for 13, then 20, 21
    seq = drafter.update(Update(1, 3, (13, 20), 30, new_pages=(5,)))
    assert (seq.token_ids, seq.page_table, seq.num_context) == ([10, 11, 12, 13, 20, 30], [4, 5], 5)
    assert drafter.update(Update(1, 3, (13,), 5)) is None and 1 not in drafter.sequences  # rewinds: dropped
    assert drafter.update(Update(2, 4, (1,), 2)) is None  # never seen from its first token
    seq = drafter.update(Update(3, 0, (1, 2), 3, new_pages=(7,)))
    assert drafter.update(Update(3, 2, (9,), 4)) is None  # the old last token was 3, not 9
    assert isinstance(seq, DraftSequence)


def test_auto_kind_comes_from_the_checkpoint_architectures(checkpoints):
    assert resolve_kind("auto", str(checkpoints.dflash)) == "dflash"
    assert resolve_kind("auto", str(checkpoints.draft)) == "draft_model"
    assert resolve_kind("auto", None) == "ngram"
    assert resolve_kind("ngram", str(checkpoints.draft)) == "ngram"


# ---------------------------------------------------------------- every kind


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "dflash", "eagle3"])
def test_health_reflection_and_auth(kind, drafters):
    with grpc.insecure_channel(drafters[kind].address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "splitspec.v1.Drafter"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"splitspec.v1.Drafter", "grpc.health.v1.Health"} <= names
        stub = dpb_grpc.DrafterStub(channel)
        request = dpb.NegotiateRequest(target_id="abc")
        for metadata in (None, auth_metadata("wrong-token")):
            error = rpc_error(lambda: stub.Negotiate(request, metadata=metadata, timeout=RPC_TIMEOUT))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "dflash", "eagle3"])
def test_negotiate_then_propose_before_attach_is_failed_precondition(kind, target_for):
    fake = target_for(kind)
    answer = fake.negotiate()
    expected_kind = {"ngram": dpb.DRAFTER_KIND_NGRAM, "draft_model": dpb.DRAFTER_KIND_DRAFT_MODEL,
                     "dflash": dpb.DRAFTER_KIND_DFLASH, "eagle3": dpb.DRAFTER_KIND_EAGLE3}[kind]
    assert answer.kind == expected_kind and answer.num_speculative_tokens == K
    assert set(answer.supported_orders) == {kv_pb.PAGE_ORDER_NHD, kv_pb.PAGE_ORDER_HND}
    assert all(spec.owner == kv_pb.LAYER_OWNER_DRAFT for spec in answer.layers)
    assert len(answer.layers) == {"ngram": 0, "draft_model": 1, "dflash": 2, "eagle3": 1}[kind]
    assert list(answer.target_layer_ids) == {"dflash": [0, 1], "eagle3": [0]}.get(kind, [])
    error = rpc_error(lambda: fake.propose(0, [fake.update(Seq(1), [5, 6, 7], 8)]))
    assert error.code() == FAILED_PRECONDITION
    assert error.details().startswith(LAYOUT_NOT_RESOLVED), error.details()


def test_incompatible_targets_are_failed_precondition_naming_both_values(target_for, checkpoints):
    vocab = checkpoints.vocab_size
    error = rpc_error(lambda: target_for("draft_model").negotiate(vocab_size=600))
    assert error.code() == FAILED_PRECONDITION
    assert f"vocab_size: target 600, drafter {vocab}" in error.details()

    error = rpc_error(lambda: target_for("dflash").negotiate(hidden_size=96, fingerprint="0123456789abcdef"))
    assert error.code() == FAILED_PRECONDITION
    assert "hidden_size: target 96, drafter 64" in error.details()
    assert f"target 0123456789abcdef, drafter {checkpoints.fingerprint}" in error.details()

    error = rpc_error(lambda: target_for("eagle3").negotiate(vocab_size=600, num_layers=1))
    assert error.code() == FAILED_PRECONDITION
    assert f"vocab_size: target 600, drafter {vocab}" in error.details()
    assert "eagle_aux_hidden_state_layer_ids [1]" in error.details()

    error = rpc_error(lambda: target_for("draft_model").negotiate(supported_orders=[kv_pb.PAGE_ORDER_UNSPECIFIED]))
    assert error.code() == FAILED_PRECONDITION and "order" in error.details()


def test_a_cuda_target_on_another_torch_build_is_refused_before_any_handle(target_for):
    """CUDA IPC handles are torch's own format: Negotiate refuses a different build, naming both."""
    fake = target_for("dflash")
    error = rpc_error(lambda: fake.negotiate(device_type="cuda", torch_version="2.11.0+cu130", cuda_version="13.0"))
    assert error.code() == FAILED_PRECONDITION
    here = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"
    assert f"torch build: target torch 2.11.0+cu130 (CUDA 13.0), drafter {here}" in error.details()
    reply = fake.negotiate()  # a CPU target shares a file, whatever its torch
    assert (reply.torch_version, reply.cuda_version) == (torch.__version__, torch.version.cuda or "")
    # an n-gram drafter maps no pool: any build will do
    target_for("ngram").negotiate(device_type="cuda", torch_version="2.11.0+cu130", cuda_version="13.0")


def test_attach_says_which_unconfirmed_exports_it_mapped(target_for):
    fake = target_for("draft_model")
    fake.negotiate()
    error = rpc_error(lambda: fake.attach(epoch=1, bad_canary=True))  # a shm file opens only with the canary
    assert error.code() == PERMISSION_DENIED
    answer = fake.attach(epoch=2, unconfirmed=(1, 7))  # 1: refused before mapping; 7: never reached it
    assert list(answer.mapped_epochs) == []
    error = rpc_error(lambda: fake.attach(epoch=3, unconfirmed=tuple(range(1025))))
    assert error.code() == INVALID_ARGUMENT and "unconfirmed_epochs" in error.details()
    assert len(fake.propose(2, [fake.update(Seq(1), [5, 6, 7, 8], 9)])[1]) == K  # epoch 2 still served
    assert list(fake.attach(epoch=4, unconfirmed=(2, 3)).mapped_epochs) == [2]  # 2 mapped; 3 refused


def test_attach_warms_the_attention_backend_on_scratch_pages_before_answering(checkpoints, tmp_path, shm_dir):
    """The first Propose must not pay for kernel compiles (FlashInfer JITs for minutes): the
    drafter runs its attention once at Attach, outside the target's pages."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    port = free_port()
    proc = start_drafter("dflash", ["--model", str(checkpoints.dflash), "--target-model", str(checkpoints.target),
                                    "--metrics-port", str(port)], tmp_path / "dflash.log", token_file, shm_dir)
    fake = None
    try:
        fake = FakeTarget(proc.wait_serving(timeout=120), shm_dir, checkpoints)
        assert scrape_metrics(port)["splitspec_draft_attention_warmup_seconds_count"] == 0
        fake.negotiate()
        fake.attach(epoch=1)
        assert scrape_metrics(port)["splitspec_draft_attention_warmup_seconds_count"] == 1, proc.log()
        backend = select_backend("auto", torch.device("cpu"), kv_dtype=torch.float32).name  # what the drafter picks
        assert proc.log().index(f"warmed the {backend} attention backend") < proc.log().index("attached to target")
        draft_regions = [fake.pool.region(s) for s in fake.pool.layout.layers if s.owner == "draft"]
        assert draft_regions and all(not r.any() for r in draft_regions), "the warm-up wrote into the pool"
        seq = Seq(1)
        staging = fake.pool.staging()
        staging[:4].copy_(torch.randn(4, staging.shape[1]))
        assert len(fake.propose(1, [fake.update(seq, [5, 6, 7, 8], 9)])[1]) == K
        assert scrape_metrics(port)["splitspec_draft_attention_warmup_seconds_count"] == 1  # once per Attach
    finally:
        if fake is not None:
            fake.close()
        proc.stop(timeout=20)


def test_wrong_canary_is_permission_denied_and_a_stale_epoch_failed_precondition(target_for):
    fake = target_for("draft_model")
    fake.negotiate()
    error = rpc_error(lambda: fake.attach(epoch=1, bad_canary=True))  # the canary says: not the target's pool
    assert error.code() == PERMISSION_DENIED
    answer = fake.attach(epoch=2)
    assert (answer.target_id, answer.epoch) == (fake.target_id, 2)
    assert answer.mapped_bytes == fake.pool.layout.total_bytes
    seq = Seq(1)
    assert len(fake.propose(2, [fake.update(seq, [5, 6, 7, 8], 9)])[1]) == K
    error = rpc_error(lambda: fake.propose(1, [fake.update(seq, [9], 10)]))
    assert error.code() == FAILED_PRECONDITION and error.details().startswith(LAYOUT_NOT_RESOLVED)

    # a new epoch drops every sequence: the continuation is not speculated, a restart is
    fake.negotiate()
    fake.attach(epoch=3)
    assert fake.propose(3, [fake.update(seq, [9], 10)]) == {}
    assert len(fake.propose(3, [fake.update(Seq(2), [5, 6, 7, 8], 9)])[2]) == K


# ---------------------------------------------------------------- ngram


def test_ngram_proposals_follow_the_prompt_lookup(target_for):
    fake = target_for("ngram")
    fake.negotiate()
    assert fake.attach(epoch=1).mapped_bytes == 0  # no pages to map
    a, b, c = Seq(1), Seq(2), Seq(3)
    drafts = fake.propose(1, [
        fake.update(a, [5, 6, 7, 8, 9, 5, 6, 7], 8),  # [6, 7, 8] seen at 1 → 9, 5, 6
        fake.update(b, [1, 2, 9, 1, 2, 7, 1], 2, k=2),  # most recent [7, 1, 2]? no; [1, 2] at 3 → 7, 1
        fake.update(c, [1, 2, 3], 4),  # nothing repeats
    ])
    assert drafts == {1: [9, 5, 6], 2: [7, 1]}
    # accept 9 and 5, bonus 4: tokens ... 8 9 5 4 → [4] never seen before; then 7 → [5, 6, 7, 8, 9, 5, 4, 7]
    drafts = fake.propose(1, [fake.update(a, [8, 9, 5], 4), fake.update(b, [2, 7], 3, k=0)], released=(3,))
    assert drafts == {}
    assert fake.propose(1, [fake.update(a, [4], 7)]) == {1: [8, 9, 5]}
    fake.release(1, (1,))
    assert fake.propose(1, [fake.update(a, [7], 8)]) == {}  # released: a continuation is out of sync


# ---------------------------------------------------------------- draft_model


@pytest.fixture(scope="module")
def draft_lm(checkpoints):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoints.draft, dtype=torch.float32).eval()


def greedy(model, tokens: list[int], k: int) -> list[int]:
    """The draft LM's greedy continuation, recomputed from scratch each step."""
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(tokens):]


def other_token(token: int) -> int:
    return 4 if token != 4 else 5


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_draft_model_proposals_equal_a_greedy_transformers_continuation(order, target_for, draft_lm, tokenizer):
    fake = target_for("draft_model")
    fake.negotiate()
    fake.attach(epoch=1, order=order)
    seqs = [Seq(i) for i in range(3)]
    prompts = [tokenizer.encode(PROMPTS[i]) for i in range(3)]
    updates = [fake.update(s, p[:-1], p[-1], k=(K + 2 if s.seq_id == 1 else K)) for s, p in zip(seqs, prompts)]
    updates[2].num_speculative_tokens = 0  # record only
    drafts = fake.propose(1, updates)
    assert set(drafts) == {0, 1}
    for s in seqs[:2]:
        assert drafts[s.seq_id] == greedy(draft_lm, s.tokens, K), s.seq_id  # K+2 asked: capped at K

    # seq 0 accepts one draft (then a different bonus), seq 1 all K, seq 2 asks for drafts now
    d0, d1 = drafts[0], drafts[1]
    updates = [
        fake.update(seqs[0], [seqs[0].tokens[-1], d0[0]], other_token(d0[1])),
        fake.update(seqs[1], [seqs[1].tokens[-1], *d1], 17),
        fake.update(seqs[2], [seqs[2].tokens[-1]], 42),
    ]
    drafts = fake.propose(1, updates)
    for s in seqs:
        assert drafts[s.seq_id] == greedy(draft_lm, s.tokens, K), s.seq_id


def test_invalid_requests_are_invalid_argument_and_change_nothing(target_for, draft_lm, checkpoints):
    fake = target_for("draft_model")
    fake.negotiate()
    fake.attach(epoch=1)
    seq = Seq(1)
    fake.propose(1, [fake.update(seq, [5, 6, 7, 8], 9)])
    snapshot = (list(seq.tokens), list(seq.pages))

    bad = fake.update(seq, [9], 10)
    bad.new_pages.append(NUM_PAGES)
    error = rpc_error(lambda: fake.propose(1, [bad]))
    assert error.code() == INVALID_ARGUMENT and "sequences[0].new_pages" in error.details(), error.details()

    seq.tokens, seq.pages = list(snapshot[0]), list(snapshot[1])
    bad = fake.update(seq, [9], checkpoints.vocab_size)
    error = rpc_error(lambda: fake.propose(1, [bad]))
    assert error.code() == INVALID_ARGUMENT and "sequences[0].last_token_id" in error.details()

    twice = fake.update(Seq(5), [1, 2], 3)
    error = rpc_error(lambda: fake.propose(1, [twice, twice]))
    assert error.code() == INVALID_ARGUMENT and "sequences[1].seq_id" in error.details()

    short = fake.update(Seq(6), list(range(5, 30)), 3)
    del short.new_pages[2:]
    error = rpc_error(lambda: fake.propose(1, [short]))
    assert error.code() == INVALID_ARGUMENT and "sequences[0].new_pages" in error.details()

    past = fake.update(Seq(7), [1, 2, 3], 4)
    past.cached_context_tokens = 4  # more cached tokens than the update's context
    error = rpc_error(lambda: fake.propose(1, [past]))
    assert error.code() == INVALID_ARGUMENT and "sequences[0].cached_context_tokens" in error.details()

    seq.tokens, seq.pages = list(snapshot[0]), list(snapshot[1])
    continuing = fake.update(seq, [9], 10)
    continuing.cached_context_tokens = 1  # only a sequence's first update may say so
    error = rpc_error(lambda: fake.propose(1, [continuing]))
    assert error.code() == INVALID_ARGUMENT and "sequences[0].cached_context_tokens" in error.details()

    # nothing was applied: the sequence continues from where the valid call left it
    seq.tokens, seq.pages = list(snapshot[0]), list(snapshot[1])
    assert fake.propose(1, [fake.update(seq, [9], 10)]) == {1: greedy(draft_lm, seq.tokens, K)}


# ---------------------------------------------------------------- dflash


@pytest.fixture(scope="module")
def dflash_reference(checkpoints):
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(checkpoints.target, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(checkpoints.dflash, dtype=torch.float32).eval()
    return target, draft


def target_features(target, tokens: list[int]) -> torch.Tensor:
    """[T, 2 * 64]: the hidden states after target layers 0 and 1 (HF hidden_states[i + 1])."""
    with torch.no_grad():
        out = target(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[1][0], out.hidden_states[2][0]], dim=-1)


def reference_drafts(reference, context: list[int], last: int, mask_token_id: int) -> list[int]:
    target, draft = reference
    block = torch.tensor([[last] + [mask_token_id] * K])
    with torch.no_grad():
        hidden = draft(
            target_hidden=target_features(target, context)[None],
            noise_embedding=target.get_input_embeddings()(block),
            position_ids=torch.arange(len(context) + K + 1)[None],
        )
        return draft.compute_logits(hidden[:, 1:], target.lm_head).argmax(-1)[0].tolist()


def test_dflash_proposals_equal_the_reference(target_for, dflash_reference, tokenizer, checkpoints):
    target, _ = dflash_reference
    fake = target_for("dflash")
    fake.negotiate()
    fake.attach(epoch=1)
    staging = fake.pool.staging()
    seqs = [Seq(0), Seq(1)]
    prompts = [tokenizer.encode(PROMPTS[i]) for i in (0, 3)]
    updates, row = [], 0
    for s, p in zip(seqs, prompts):
        staging[row : row + len(p) - 1] = target_features(target, p[:-1])
        updates.append(fake.update(s, p[:-1], p[-1], staging_row=row))
        row += len(p) - 1
    drafts = fake.propose(1, updates)
    for s in seqs:
        expected = reference_drafts(dflash_reference, s.tokens[:-1], s.tokens[-1], checkpoints.mask_token_id)
        assert drafts[s.seq_id] == expected, s.seq_id

    staging.fill_(float("nan"))  # the target reuses staging: the drafter must have copied its rows
    # seq 0 accepts two drafts, seq 1 none; the new context's features land in rows 40.. and 2..
    updates = []
    for s, accepted, row in ((seqs[0], drafts[0][:2], 40), (seqs[1], [], 2)):
        new_context = [s.tokens[-1], *accepted]
        full = s.tokens[:-1] + new_context
        staging[row : row + len(new_context)] = target_features(target, full)[-len(new_context):]
        updates.append(fake.update(s, new_context, 11, staging_row=row))
    drafts = fake.propose(1, updates)
    for s in seqs:
        expected = reference_drafts(dflash_reference, s.tokens[:-1], s.tokens[-1], checkpoints.mask_token_id)
        assert drafts[s.seq_id] == expected, s.seq_id

    bad = fake.update(Seq(9), [1, 2, 3], 4, staging_row=STAGING_ROWS - 2)
    error = rpc_error(lambda: fake.propose(1, [bad]))
    assert error.code() == INVALID_ARGUMENT and "sequences[0].staging_row" in error.details()


# ---------------------------------------------------------------- eagle3


def test_eagle3_proposals_equal_the_reference(target_for, dflash_reference, tokenizer, checkpoints):
    """Over gRPC, with the features in the pool's staging rows: speculators' drafts, before and
    after the context grows (the staging rows reused in between)."""
    from tests.eagle3_reference import build_reference

    target, _ = dflash_reference
    reference = build_reference(HeadShape(aux_layer_ids=(1,)), checkpoints.target)  # the saved head's weights
    embed = target.get_input_embeddings()

    def features(tokens: list[int]) -> torch.Tensor:  # [T, 64]: the state entering layer 1
        with torch.no_grad():
            return target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[1][0]

    def expected(s: Seq) -> list[int]:
        return reference.drafts(features(s.tokens[:-1]), s.tokens[1:], K, embed=embed)

    fake = target_for("eagle3")
    fake.negotiate()
    fake.attach(epoch=1)
    staging = fake.pool.staging()
    seqs = [Seq(0), Seq(1)]
    updates, row = [], 0
    for s, i in zip(seqs, (0, 3)):
        p = tokenizer.encode(PROMPTS[i])
        staging[row : row + len(p) - 1] = features(p[:-1])
        updates.append(fake.update(s, p[:-1], p[-1], staging_row=row))
        row += len(p) - 1
    drafts = fake.propose(1, updates)
    assert {s.seq_id: expected(s) for s in seqs} == drafts

    staging.fill_(float("nan"))
    updates = []
    for s, accepted, row in ((seqs[0], drafts[0][:2], 40), (seqs[1], [], 2)):
        new_context = [s.tokens[-1], *accepted]
        staging[row : row + len(new_context)] = features(s.tokens[:-1] + new_context)[-len(new_context):]
        updates.append(fake.update(s, new_context, 11, staging_row=row))
    drafts = fake.propose(1, updates)
    assert {s.seq_id: expected(s) for s in seqs} == drafts

    bad = fake.update(Seq(9), [1, 2, 3], 4, staging_row=STAGING_ROWS - 2)
    error = rpc_error(lambda: fake.propose(1, [bad]))
    assert error.code() == INVALID_ARGUMENT and "sequences[0].staging_row" in error.details()
    assert fake.propose(1, [fake.update(seqs[0], [11], 12, staging_row=0)]) is not None  # still serving


def test_propose_reports_how_far_draft_layers_are_written(target_for):
    """The target caches a page's draft layers only where the drafter says it wrote them."""
    fake = target_for("draft_model")
    fake.negotiate()
    fake.attach(epoch=1)

    def written(updates: list[dpb.SequenceUpdate]) -> dict[int, int]:
        request = dpb.ProposeRequest(target_id=fake.target_id, epoch=1, sequences=updates)
        response = fake.stub.Propose(request, metadata=fake.metadata, timeout=RPC_TIMEOUT)
        return {w.seq_id: w.num_tokens for w in response.written}

    seq = Seq(1)
    assert written([fake.update(seq, [5, 6, 7, 8], 9, k=0)]) == {1: 0}  # recorded, not computed yet
    assert written([fake.update(seq, [9], 10)]) == {1: 5}  # drafting caught the LM up on its context
    cached = fake.update(Seq(2), [5, 6, 7, 8], 9, k=0)
    cached.cached_context_tokens = 3  # a prefix cache hit: the first 3 tokens' draft KV is in the pages
    assert written([cached]) == {2: 3}
