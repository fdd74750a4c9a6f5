"""Our EAGLE-3 drafter against vLLM `speculators`' EAGLE-3 model, in both checkpoint layouts.

Tiny heads of our own sizes (4 query heads of dim 20 over one KV head, a reduced vocabulary of
203 ids) are saved from the reference's modules as speculators saves them (`Eagle3Speculator`)
and as SpecForge / the original EAGLE does (`LlamaForCausalLMEagle3`, `midlayer.*`). The
drafter, bound to a real page pool, drafts from the target's hidden states (HF
`hidden_states[i]` for aux id i) and must propose the reference's greedy tokens at float32:
token-identical, per variant, batched or not, and after its context grew across proposals.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.kv_layout import LayerSpec, StagingSpec, build_layout
from common.kv_pool import PagePool
from common.qwen3 import WeightLoadError
from draft_service.drafters import (
    DrafterConfig,
    IncompatibleTargetError,
    TargetInfo,
    Update,
    load_drafter,
    resolve_kind,
)
from draft_service.drafters.base import FeatureDrafter
from draft_service.eagle3_model import Eagle3ConfigError, default_aux_layer_ids
from tests.eagle3_reference import HeadShape, build_reference, save_specforge, save_speculators
from tests.tiny_models import PROMPTS, make_llama_family, make_qwen3

K = 5
PAGE_SIZE = 4
NUM_PAGES = 128
TARGET_LAYERS = 6

SHAPES = {
    "llama-1-layer": HeadShape(),
    "norm_before_residual": HeadShape(norm_before_residual=True, aux_layer_ids=(2, 3, 5)),
    "qwen3-2-layers": HeadShape(layer_type="qwen3", num_layers=2, aux_layer_ids=(1, 4)),
    "norm_before_fc": HeadShape(norm_before_fc=True),
    "fc_norm": HeadShape(fc_norm=True, own_embedding=True),
    "default-aux-own-embedding": HeadShape(aux_layer_ids=None, own_embedding=True, draft_vocab_size=97),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eagle3")


@pytest.fixture(scope="module")
def target_dir(root) -> Path:
    return make_qwen3(root / "qwen3-target", num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(target_dir)


def target_info(hf_model, fingerprint: str = "") -> TargetInfo:
    config = hf_model.config
    return TargetInfo(architecture=config.architectures[0], hidden_size=config.hidden_size,
                      vocab_size=config.vocab_size, num_layers=config.num_hidden_layers, fingerprint=fingerprint)


class Session:
    """A drafter loaded as splitspec-draft loads it, bound to a real pool with staging."""

    def __init__(self, model_dir: Path, target_dir: Path, hf_model, shm_dir: Path, epoch: int, *,
                 kind: str = "eagle3") -> None:
        self.drafter = load_drafter(DrafterConfig(kind=kind, model=str(model_dir), target_model=str(target_dir),
                                                  dtype="float32", num_speculative_tokens=K, shm_dir=str(shm_dir)))
        self.drafter.check_target(target_info(hf_model, getattr(self.drafter, "embed_fingerprint", "")))
        staging = StagingSpec(rows=64, width=self.drafter.feature_width,
                              layer_ids=tuple(self.drafter.target_layer_ids()))
        layout = build_layout(order="NHD", page_size=PAGE_SIZE, kv_dtype="float32", num_pages=NUM_PAGES,
                              layers=[LayerSpec("target", 0, 2, 16), *self.drafter.layer_specs()],
                              staging=staging, target_id="e3", epoch=epoch)
        self.pool = PagePool.create(layout, torch.device("cpu"), shm_dir)
        self.drafter.bind(self.pool, layout)
        self.next_page = NUM_PAGES - 1  # pages handed out from the top down: never contiguous with ids
        self.pages: dict[int, list[int]] = {}

    def close(self) -> None:
        self.drafter.unbind()
        self.pool.close()

    def update(self, seq_id: int, start: int, context: list[int], last: int, rows: torch.Tensor, k: int = K):
        table = self.pages.setdefault(seq_id, [])
        new = []
        while len(table) * PAGE_SIZE < start + len(context) + 1 + k:
            new.append(self.next_page)
            table.append(self.next_page)
            self.next_page -= 1
        seq = self.drafter.update(Update(seq_id, start, tuple(context), last, tuple(new), 0, k))
        assert seq is not None
        return seq, rows, k

    def propose(self, items) -> dict[int, list[int]]:
        return self.drafter.propose(items)


@pytest.fixture
def session(shm_dir, target_dir, hf_target):
    made: list[Session] = []

    def make(model_dir: Path, target: Path = target_dir, hf=None) -> Session:
        made.append(Session(model_dir, target, hf or hf_target[0], shm_dir, epoch=len(made) + 1))
        return made[-1]

    yield make
    for s in made:
        s.close()


@torch.no_grad()
def case(hf_model, tokenizer, text: str, aux_ids) -> tuple[list[int], torch.Tensor]:
    """(prompt ids + the target's greedy next token, features [L, n * hidden] for the prompt)."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    out = hf_model(ids[None], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i][0] for i in aux_ids], dim=-1)
    return [*ids.tolist(), int(out.logits[0, -1].argmax())], features


def aux_ids_of(shape: HeadShape) -> tuple[int, ...]:
    return shape.aux_layer_ids or default_aux_layer_ids(TARGET_LAYERS)


@pytest.fixture(scope="module")
def checkpoints(root, target_dir):
    """{shape name: (reference, {layout: folder})}."""
    made = {}
    for name, shape in SHAPES.items():
        reference = build_reference(shape, target_dir, seed=len(made))
        folders = {"speculators": save_speculators(reference, root / name / "speculators", target_dir)}
        if shape.layer_type == "llama" and shape.num_layers == 1 and not (shape.norm_before_fc or shape.fc_norm):
            folders["specforge"] = save_specforge(reference, root / name / "specforge")
        made[name] = (reference, folders)
    return made


@pytest.mark.parametrize("name", SHAPES)
def test_drafts_equal_speculators_reference(name, checkpoints, session, hf_target):
    """Both layouts of the same weights propose the reference's drafts, one sequence at a
    time and three in one batch."""
    hf_model, tokenizer = hf_target
    reference, folders = checkpoints[name]
    embed = None if reference.shape.own_embedding else hf_model.get_input_embeddings()
    cases = [case(hf_model, tokenizer, text, aux_ids_of(reference.shape)) for text in PROMPTS[:3]]
    expected = [reference.drafts(features, tokens[1:], K, embed=embed) for tokens, features in cases]
    for layout, folder in folders.items():
        s = session(folder)
        assert s.drafter.model.config.layout == layout
        for i, (tokens, features) in enumerate(cases):
            got = s.propose([s.update(i, 0, tokens[:-1], tokens[-1], features)])
            assert got[i] == expected[i], f"{name}, {layout}, prompt {i}"
        batch = [s.update(10 + i, 0, tokens[:-1], tokens[-1], features) for i, (tokens, features) in enumerate(cases)]
        got = s.propose(batch)
        assert [got[10 + i] for i in range(len(cases))] == expected, f"{name}, {layout}, batched"


@pytest.mark.parametrize("max_held_rows", [None, 2])
def test_context_grows_across_proposals(max_held_rows, checkpoints, session, hf_target, monkeypatch):
    """A sequence's context arriving over several steps (fewer drafts asked, none asked, a
    scratch draft overwritten) drafts what the reference drafts from the whole prefix; also
    when the rows of steps without drafts are written as they come (past `max_held_rows`)."""
    if max_held_rows is not None:
        monkeypatch.setattr(FeatureDrafter, "max_held_rows", max_held_rows)
    hf_model, tokenizer = hf_target
    reference, folders = checkpoints["qwen3-2-layers"]
    tokens, features = case(hf_model, tokenizer, "\n".join(PROMPTS[11:14]), aux_ids_of(reference.shape))
    s = session(folders["speculators"])
    embed = hf_model.get_input_embeddings()
    cuts = [5, 6, 9, 17, 18, 26, len(tokens) - 1]
    start = 0
    for step, end in enumerate(cuts):
        k = (0, 2, K, 1, 0, 0, K)[step]
        item = s.update(0, start, tokens[start:end], tokens[end], features[start:end], k)
        got = s.propose([item])
        if k:
            assert got[0] == reference.drafts(features[:end], tokens[1 : end + 1], K, embed=embed)[:k], f"cut {end}"
        start = end


def test_aux_layers_are_the_states_entering_them(checkpoints, session, hf_target, target_dir, shm_dir):
    """The staging rows the target fills (captures after layer i - 1) are HF hidden_states[i]."""
    from common.qwen3 import Qwen3ForCausalLM
    from tests.paged_runner import PagedRunner, Seq

    hf_model, tokenizer = hf_target
    reference, folders = checkpoints["llama-1-layer"]
    s = session(folders["specforge"])
    capture = tuple(s.drafter.target_layer_ids())
    assert capture == tuple(i - 1 for i in reference.shape.aux_layer_ids)
    ours = Qwen3ForCausalLM.from_pretrained(target_dir, torch.float32, "cpu")
    runner = PagedRunner(ours, shm_dir)
    try:
        tokens, features = case(hf_model, tokenizer, PROMPTS[0], reference.shape.aux_layer_ids)
        captured = runner.step([Seq(tokens[:-1])], [len(tokens) - 1], capture=capture)[1]
        ours_features = torch.cat([captured[i] for i in capture], dim=-1)
        torch.testing.assert_close(ours_features, features, atol=1e-4, rtol=1e-4)
    finally:
        runner.close()


def test_auto_kind_reads_either_layout(checkpoints):
    _, folders = checkpoints["llama-1-layer"]
    assert resolve_kind("auto", str(folders["speculators"])) == "eagle3"
    assert resolve_kind("auto", str(folders["specforge"])) == "eagle3"


# ---------------------------------------------------------------------------------------
# Malformed heads: refused at load or at the handshake, naming the field


def corrupt(src: Path, dst: Path, *, config: dict | None = None, drop: tuple[str, ...] = (),
            tensors: dict[str, torch.Tensor] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    raw.update(config or {})
    (dst / "config.json").write_text(json.dumps(raw))
    state = {k: v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    state.update(tensors or {})
    save_file(state, str(dst / "model.safetensors"))
    return dst


def load(folder: Path, target_dir: Path, shm_dir: Path):
    return load_drafter(DrafterConfig(kind="eagle3", model=str(folder), target_model=str(target_dir),
                                      dtype="float32", shm_dir=str(shm_dir)))


def test_malformed_heads_fail_at_load_naming_the_field(checkpoints, root, target_dir, shm_dir):
    _, folders = checkpoints["llama-1-layer"]
    spec, forge = folders["speculators"], folders["specforge"]
    bad = root / "bad"
    d2t = load_file(spec / "model.safetensors")["d2t"]
    cases = [
        (corrupt(forge, bad / "no-d2t", drop=("d2t",)), Eagle3ConfigError, "d2t is missing"),
        (corrupt(spec, bad / "d2t-range", tensors={"d2t": d2t + 10_000}), Eagle3ConfigError, "d2t maps"),
        (corrupt(spec, bad / "d2t-shape", tensors={"d2t": d2t[:-1].contiguous()}), Eagle3ConfigError,
         "d2t must be"),
        (corrupt(spec, bad / "fc", tensors={"fc.weight": torch.zeros(64, 96)}), WeightLoadError, "fc.weight"),
        (corrupt(spec, bad / "norm-output", config={"norm_output": True}), Eagle3ConfigError, "norm_output"),
        (corrupt(spec, bad / "both-norms", config={"norm_before_fc": True, "fc_norm": True}), Eagle3ConfigError,
         "mutually exclusive"),
        (corrupt(spec, bad / "aux-zero", config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}),
         Eagle3ConfigError, "eagle_aux_hidden_state_layer_ids"),
        (corrupt(spec, bad / "layer-type", config={"transformer_layer_config": {"model_type": "gemma3"}}),
         Eagle3ConfigError, "model_type 'gemma3'"),
        (corrupt(spec, bad / "draft-vocab", config={"draft_vocab_size": 10**6}), Eagle3ConfigError,
         "draft_vocab_size"),
        (corrupt(forge, bad / "sliding", config={"layer_types": ["sliding_attention"]}), Eagle3ConfigError,
         "layer_types"),
        (corrupt(forge, bad / "forge-fc-norm", config={"fc_norm": True}), Eagle3ConfigError, "fc_norm"),
        (corrupt(spec, bad / "not-eagle", config={"architectures": ["LlamaForCausalLM"],
                                                  "speculators_model_type": "mlp"}), Eagle3ConfigError,
         "not an EAGLE-3 head"),
        (corrupt(forge, bad / "extra", tensors={"midlayer.extra.weight": torch.zeros(2)}), WeightLoadError,
         "layers.0.extra.weight"),
    ]
    for folder, error, words in cases:
        with pytest.raises(error, match=words):
            load(folder, target_dir, shm_dir)


def test_incompatible_targets_fail_at_the_handshake(checkpoints, target_dir, hf_target, shm_dir):
    hf_model, _ = hf_target
    _, folders = checkpoints["llama-1-layer"]
    drafter = load(folders["speculators"], target_dir, shm_dir)
    good = target_info(hf_model, drafter.embed_fingerprint)
    drafter.check_target(good)
    for changes, words in (
        ({"vocab_size": good.vocab_size + 1}, "vocab_size"),
        ({"hidden_size": 48}, "hidden_size"),
        ({"num_layers": 4}, "eagle_aux_hidden_state_layer_ids"),
        ({"fingerprint": "0" * 16}, "fingerprint"),
    ):
        with pytest.raises(IncompatibleTargetError, match=words):
            drafter.check_target(replace(good, **changes))


def test_head_needs_an_embedding_that_fits(checkpoints, shm_dir):
    from torch import nn

    from draft_service.eagle3_model import Eagle3DraftModel

    _, folders = checkpoints["llama-1-layer"]
    with pytest.raises(Eagle3ConfigError, match="target-model"):
        load_drafter(DrafterConfig(kind="eagle3", model=str(folders["specforge"]), dtype="float32",
                                   shm_dir=str(shm_dir)))
    vocab = json.loads((folders["specforge"] / "config.json").read_text())["vocab_size"]
    for embed, words in ((nn.Embedding(vocab + 1, 64), "vocab_size"), (nn.Embedding(vocab, 48), "hidden_size 64")):
        with pytest.raises(Eagle3ConfigError, match=words):
            Eagle3DraftModel.from_pretrained(folders["specforge"], torch.float32, "cpu", embed=embed)


def test_llama_target_head(root, session, shm_dir):
    """A head over a Llama-3 target (llama3 rope scaling, biased attention): the reference's drafts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llama_dir = make_llama_family(root / "llama-target", "llama", num_hidden_layers=TARGET_LAYERS)
    hf_model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    shape = HeadShape(aux_layer_ids=None)
    reference = build_reference(shape, llama_dir, seed=7)
    folder = save_specforge(reference, root / "llama-head")
    s = session(folder, llama_dir, hf_model)
    for i, text in enumerate(PROMPTS[:3]):
        tokens, features = case(hf_model, tokenizer, text, default_aux_layer_ids(TARGET_LAYERS))
        expected = reference.drafts(features, tokens[1:], K, embed=hf_model.get_input_embeddings())
        assert s.propose([s.update(i, 0, tokens[:-1], tokens[-1], features)])[i] == expected


def test_up_takes_your_own_folders_and_names_what_is_missing(checkpoints, target_dir, tmp_path):
    from splitspec.up import UpError, model_dirs

    _, folders = checkpoints["llama-1-layer"]
    demo = tmp_path / "demo"
    assert model_dirs(demo, "auto", target_dir, folders["speculators"]) == (target_dir, folders["speculators"])
    assert model_dirs(demo, "eagle3", target_dir, folders["specforge"]) == (target_dir, folders["specforge"])
    assert model_dirs(demo, "ngram", target_dir) == (target_dir, None)
    for drafter, target, draft, words in (
        ("auto", target_dir, None, "--draft-model"),
        ("eagle3", target_dir, None, "demo recipe trains none"),
        ("eagle3", tmp_path / "nowhere", folders["specforge"], "no checkpoint in"),
        ("dflash", None, None, "train the demo pair"),
    ):
        with pytest.raises(UpError, match=words):
            model_dirs(demo, drafter, target, draft)
