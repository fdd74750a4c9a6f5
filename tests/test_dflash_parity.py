"""Our DFlash drafter over paged KV against the reference `dflash` package (z-lab).

The reference is run exactly as `dflash.model.dflash_generate` runs one draft block:
context features from the target's `output_hidden_states`, the noise embedding of
`[last token, mask x K]`, position ids from the first new context token to the end of
the block, and a `DynamicCache` that keeps the context K/V (cropped back after the block).

Tolerances (float32 models on CPU, draft logit std ~5, top-2 margins >= 0.9):
- float32 KV pages: logits within 1e-4 abs of the reference; measured bitwise equal for
  one sequence, ~1.2e-5 when sequences share a padded batch.
- fp8_e4m3 KV pages (NHD and HND alike): measured max |logits - reference| 0.56, i.e.
  0.11 x std(reference logits), and 20/20 greedy tokens equal; bounds: 0.25 x std, and
  at least 80% of the tokens.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.attention import TorchAttentionBackend
from common.attention_metadata import AttentionMetadata
from common.compiled_forward import CompileConfig
from common.kv_layout import build_layout
from common.kv_pool import PagePool
from common.qwen3 import WeightLoadError
from draft_service.dflash_model import (
    DFlashConfig,
    DFlashConfigError,
    DFlashDraftModel,
    DraftProposal,
    NewContext,
    TargetHeads,
    build_target_layer_ids,
)
from tests.tiny_models import (
    PROMPTS,
    REFERENCE_DFLASH_K,
    TARGET_LAYER_IDS,
    TARGET_LAYERS,
    make_qwen3,
    make_reference_dflash,
)

CPU = torch.device("cpu")
K = REFERENCE_DFLASH_K  # draft tokens per block
PAGE_SIZE = 4
NUM_PAGES = 96
LOGIT_ATOL = 1e-4
MIN_MARGIN = 0.1  # the reference's top-2 logit gap on every case: greedy parity is meaningful
FP8_RELATIVE_BOUND = 0.25  # max |logits - reference| / std(reference logits)
FP8_MIN_AGREEMENT = 0.8  # fraction of greedy draft tokens equal to the reference's


# ---------------------------------------------------------------------------------------
# Checkpoints and the reference (tests/tiny_models.py builds the reference's checkpoint)


@dataclass
class Case:
    prompt_ids: torch.Tensor  # [L]
    features: torch.Tensor  # [L, n * hidden]: the target's hidden states after TARGET_LAYER_IDS
    next_token: int  # the target's greedy token at position L (the first block's anchor)

    @property
    def length(self) -> int:
        return self.prompt_ids.shape[0]


@dataclass
class Models:
    target: torch.nn.Module  # transformers Qwen3ForCausalLM
    reference: torch.nn.Module  # dflash.model.DFlashDraftModel
    ours: DFlashDraftModel
    draft_dir: Path
    cases: list[Case]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    from dflash.model import DFlashDraftModel as ReferenceDraft
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("dflash")
    target_dir = make_qwen3(root / "target", num_hidden_layers=TARGET_LAYERS)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    draft_dir = make_reference_dflash(
        root / "draft", vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id
    )
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    reference = ReferenceDraft.from_pretrained(draft_dir, dtype=torch.float32).eval()
    heads = TargetHeads(embed=target.get_input_embeddings(), lm_head=target.lm_head)
    ours = DFlashDraftModel.from_pretrained(draft_dir, heads, torch.float32, CPU)
    texts = PROMPTS[:4] + ["\n".join(PROMPTS[11:14])]  # the last spans 15 pages
    cases = [target_case(target, tokenizer(text, return_tensors="pt").input_ids[0]) for text in texts]
    return Models(target, reference, ours, draft_dir, cases)


@torch.no_grad()
def target_case(target, prompt_ids: torch.Tensor) -> Case:
    from dflash.model import extract_context_feature

    out = target(prompt_ids[None], output_hidden_states=True)
    features = extract_context_feature(out.hidden_states, TARGET_LAYER_IDS)[0]  # [L, n * hidden]
    return Case(prompt_ids, features, int(out.logits[0, -1].argmax()))


@torch.no_grad()
def reference_block(
    models: Models, new_features: torch.Tensor, anchor: int, start: int, k: int = K, cache=None
) -> torch.Tensor:  # [k, V]
    """One draft block as `dflash_generate` runs it. `new_features` [n, F] are the context
    rows at positions start - n .. start - 1 not yet in `cache`; the anchor sits at `start`."""
    from dflash.model import _crop_to, _draft_value, _make_cache, _raw_input_embeddings

    reference = models.reference
    cache = _make_cache(reference.config) if cache is None else cache
    block = torch.tensor([[anchor] + [reference.mask_token_id] * k])  # [1, k + 1]
    scale = float(_draft_value(reference.config, "input_embedding_scale", 1.0))
    noise = _raw_input_embeddings(models.target, block, scale)  # [1, k + 1, hidden]
    positions = torch.arange(start - new_features.shape[0], start + k + 1)[None]
    hidden = reference(
        target_hidden=new_features[None],
        noise_embedding=noise,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    )[:, -k:]
    _crop_to(cache, start)
    return reference.compute_logits(hidden, models.target.lm_head)[0]


# ---------------------------------------------------------------------------------------
# The paged pool on our side


@dataclass
class Paged:
    pool: PagePool
    backend: TorchAttentionBackend
    kv_caches: dict[int, torch.Tensor]
    free_pages: list[int]

    def allocate(self, num_tokens: int) -> list[int]:
        """Scattered page ids for one sequence of num_tokens slots."""
        count = -(-num_tokens // PAGE_SIZE)
        pages, self.free_pages = self.free_pages[:count], self.free_pages[count:]
        return pages


@pytest.fixture
def make_paged(tmp_path, models):
    pools: list[PagePool] = []

    def make(order: str = "NHD", kv_dtype: str = "float32") -> Paged:
        layout = build_layout(
            order=order,
            page_size=PAGE_SIZE,
            kv_dtype=kv_dtype,
            num_pages=NUM_PAGES,
            layers=models.ours.kv_layer_specs(),
        )
        shm_dir = tmp_path / f"pool{len(pools)}"  # one pool file per folder
        shm_dir.mkdir()
        pool = PagePool.create(layout, CPU, shm_dir=shm_dir)
        pools.append(pool)
        free = list(range(NUM_PAGES))
        random.Random(len(pools)).shuffle(free)
        return Paged(pool, TorchAttentionBackend(layout), pool.kv_caches("draft"), free)

    yield make
    for pool in pools:
        pool.close()


def write_chunks(
    ours: DFlashDraftModel, paged: Paged, chunks: list[tuple[Case, int, int]], tables: list[list[int]]
) -> None:
    """One batched write_context: sequence b gets its case's context rows start..end."""
    meta = AttentionMetadata.build(
        query_lens=[end - start for _, start, end in chunks],
        seq_lens=[end for _, _, end in chunks],
        page_tables=tables,
        page_size=PAGE_SIZE,
        device=CPU,
    )
    features = torch.cat([case.features[start:end] for case, start, end in chunks])  # [T, F]
    positions = torch.cat([torch.arange(start, end) for _, start, end in chunks])  # [T]
    ours.write_context(features, positions, meta, paged.kv_caches, paged.backend)


def propose_one(
    ours: DFlashDraftModel, paged: Paged, anchor: int, context_len: int, table: list[int], k: int = K
) -> DraftProposal:
    anchors = torch.tensor([anchor])
    return ours.propose(anchors, [context_len], [table], paged.kv_caches, paged.backend, num_tokens=k)


# ---------------------------------------------------------------------------------------
# (a) one block over the whole prompt, NHD and HND


def test_reference_choices_are_not_near_ties(models):
    for case in models.cases:
        top2 = reference_block(models, case.features, case.next_token, case.length).topk(2).values  # [K, 2]
        assert float((top2[:, 0] - top2[:, 1]).min()) >= MIN_MARGIN


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_block_matches_reference(models, make_paged, order):
    paged = make_paged(order)
    for case in models.cases:
        expected = reference_block(models, case.features, case.next_token, case.length)  # [K, V]
        table = paged.allocate(case.length + K + 1)
        write_chunks(models.ours, paged, [(case, 0, case.length)], [table])
        proposal = propose_one(models.ours, paged, case.next_token, case.length, table)
        assert proposal.token_ids.shape == (1, K) and proposal.logits.shape == (1, K, expected.shape[-1])
        assert proposal.token_ids[0].tolist() == expected.argmax(-1).tolist()
        torch.testing.assert_close(proposal.logits[0], expected, atol=LOGIT_ATOL, rtol=0)


def test_shorter_block_matches_reference(models, make_paged):
    """num_tokens < block_size - 1, as dflash_generate does near max_new_tokens."""
    paged = make_paged()
    case = models.cases[0]
    expected = reference_block(models, case.features, case.next_token, case.length, k=2)  # [2, V]
    table = paged.allocate(case.length + 3)
    write_chunks(models.ours, paged, [(case, 0, case.length)], [table])
    proposal = propose_one(models.ours, paged, case.next_token, case.length, table, k=2)
    torch.testing.assert_close(proposal.logits[0], expected, atol=LOGIT_ATOL, rtol=0)


def test_fewer_drafts_asked_are_the_first_of_the_whole_block(models, make_paged):
    """num_drafts n < K: the head runs over the block's first n masks only, and gives what the
    whole block's first n drafts are (a block of K masks, not a shorter one); n outside 1..K refused."""
    paged = make_paged()
    case = models.cases[0]
    table = paged.allocate(case.length + K + 1)
    write_chunks(models.ours, paged, [(case, 0, case.length)], [table])
    anchors = torch.tensor([case.next_token])
    whole = propose_one(models.ours, paged, case.next_token, case.length, table)
    for n in (1, 3):
        few = models.ours.propose(anchors, [case.length], [table], paged.kv_caches, paged.backend, num_tokens=K,
                                  num_drafts=n)
        assert few.token_ids.shape == (1, n) and few.logits.shape == (1, n, whole.logits.shape[-1])
        assert few.token_ids[0].tolist() == whole.token_ids[0, :n].tolist()
        # a head over fewer rows may round otherwise (BLAS blocks by row count)
        torch.testing.assert_close(few.logits, whole.logits[:, :n], atol=LOGIT_ATOL, rtol=0)
    for n in (0, K + 1):
        with pytest.raises(ValueError, match=f"{n} drafts from a block of {K} masks"):
            models.ours.propose(anchors, [case.length], [table], paged.kv_caches, paged.backend, num_tokens=K,
                                num_drafts=n)


def test_embedding_scale_multiplier_and_softcap_match_reference(models, make_paged, tmp_path):
    from dflash.model import DFlashDraftModel as ReferenceDraft

    folder = copy_checkpoint(models, tmp_path / "scaled")
    section = {
        **dflash_section(models),
        "input_embedding_scale": 0.5,
        "output_multiplier": 2.0,
        "final_logit_softcapping": 8.0,
    }
    edit_config(folder, dflash_config=section)
    scaled = Models(
        models.target,
        ReferenceDraft.from_pretrained(folder, dtype=torch.float32).eval(),
        DFlashDraftModel.from_pretrained(folder, heads(models), torch.float32, CPU),
        folder,
        models.cases,
    )
    paged = make_paged()
    case = models.cases[1]
    expected = reference_block(scaled, case.features, case.next_token, case.length)  # [K, V]
    assert float(expected.abs().max()) <= 8.0
    table = paged.allocate(case.length + K + 1)
    write_chunks(scaled.ours, paged, [(case, 0, case.length)], [table])
    proposal = propose_one(scaled.ours, paged, case.next_token, case.length, table)
    torch.testing.assert_close(proposal.logits[0], expected, atol=LOGIT_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------
# (b) incremental context, as the engine writes it after acceptances


def test_incremental_context_matches_reference(models, make_paged):
    from dflash.model import _make_cache

    paged = make_paged("HND")
    for case in models.cases:
        split = case.length // 2
        anchor = int(case.prompt_ids[split])  # the token at position `split`
        cache = _make_cache(models.reference.config)
        first = reference_block(models, case.features[:split], anchor, split, cache=cache)
        second = reference_block(models, case.features[split:], case.next_token, case.length, cache=cache)
        full = reference_block(models, case.features, case.next_token, case.length)
        torch.testing.assert_close(second, full, atol=LOGIT_ATOL, rtol=0)

        table = paged.allocate(case.length + K + 1)
        write_chunks(models.ours, paged, [(case, 0, split)], [table])
        ours_first = propose_one(models.ours, paged, anchor, split, table)
        # The block above left its K/V at slots split..split+K: the next chunk and block overwrite them.
        write_chunks(models.ours, paged, [(case, split, case.length)], [table])
        ours_second = propose_one(models.ours, paged, case.next_token, case.length, table)
        torch.testing.assert_close(ours_first.logits[0], first, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(ours_second.logits[0], full, atol=LOGIT_ATOL, rtol=0)
        assert ours_second.token_ids[0].tolist() == full.argmax(-1).tolist()


# ---------------------------------------------------------------------------------------
# (c) a batch of sequences with different context lengths


def test_batched_propose_equals_single_sequences(models, make_paged):
    paged = make_paged("NHD")
    cases = [models.cases[4], models.cases[0], models.cases[2]]
    tables = [paged.allocate(c.length + K + 1) for c in cases]
    splits = [c.length - 1 - i for i, c in enumerate(cases)]  # uneven chunks per sequence
    write_chunks(models.ours, paged, [(c, 0, s) for c, s in zip(cases, splits)], tables)
    write_chunks(models.ours, paged, [(c, s, c.length) for c, s in zip(cases, splits)], tables)
    anchors = torch.tensor([c.next_token for c in cases])
    batched = models.ours.propose(anchors, [c.length for c in cases], tables, paged.kv_caches, paged.backend)
    assert batched.token_ids.shape == (3, K)

    for b, case in enumerate(cases):
        single_pool = make_paged("NHD")
        table = single_pool.allocate(case.length + K + 1)
        write_chunks(models.ours, single_pool, [(case, 0, case.length)], [table])
        single = propose_one(models.ours, single_pool, case.next_token, case.length, table)
        torch.testing.assert_close(batched.logits[b], single.logits[0], atol=LOGIT_ATOL, rtol=0)
        assert batched.token_ids[b].tolist() == single.token_ids[0].tolist()
        expected = reference_block(models, case.features, case.next_token, case.length)
        torch.testing.assert_close(batched.logits[b], expected, atol=LOGIT_ATOL, rtol=0)


def new_context(cases_chunks: list[tuple[Case, int, int]], tables: list[list[int]]) -> NewContext:
    """The rows start..end of each case, handed to `propose` instead of written first."""
    positions = [pos for _, start, end in cases_chunks for pos in range(start, end)]
    slots = [table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
             for (_, start, end), table in zip(cases_chunks, tables) for pos in range(start, end)]
    return NewContext(
        features=torch.cat([case.features[start:end] for case, start, end in cases_chunks]),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
    )


@dataclass
class HeldBatch:
    """Three cases of other lengths, each with its last 1, 4 and 7 context rows held (handed to
    `propose`) and the rest written first; page tables for K + 1 slots past each."""

    cases: list[Case]
    splits: list[int]  # per case: rows 0 .. split are written first, split .. length held
    tables: list[list[int]]

    @classmethod
    def of(cls, models, paged) -> HeldBatch:
        cases = [models.cases[4], models.cases[0], models.cases[2]]
        splits = [c.length - 1 - 3 * i for i, c in enumerate(cases)]
        return cls(cases, splits, [paged.allocate(c.length + K + 1) for c in cases])

    @property
    def anchors(self) -> torch.Tensor:
        return torch.tensor([c.next_token for c in self.cases])

    @property
    def lengths(self) -> list[int]:
        return [c.length for c in self.cases]

    @property
    def written(self) -> list[tuple[Case, int, int]]:
        return [(c, 0, s) for c, s in zip(self.cases, self.splits)]

    @property
    def held(self) -> list[tuple[Case, int, int]]:
        return [(c, s, c.length) for c, s in zip(self.cases, self.splits)]


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_context_drafted_over_in_the_same_forward_equals_written_first(models, make_paged, order):
    """`propose(new_context=...)` writes the held rows' K/V inside the block's forward: the
    drafts, the logits and every page equal a write_context followed by propose."""
    fused_pool, written_pool = make_paged(order), make_paged(order)
    batch = HeldBatch.of(models, fused_pool)
    cases, tables = batch.cases, batch.tables
    for paged in (fused_pool, written_pool):
        write_chunks(models.ours, paged, batch.written, tables)
    fused = models.ours.propose(batch.anchors, batch.lengths, tables, fused_pool.kv_caches, fused_pool.backend,
                                new_context=new_context(batch.held, tables))
    write_chunks(models.ours, written_pool, batch.held, tables)
    written = models.ours.propose(batch.anchors, batch.lengths, tables, written_pool.kv_caches, written_pool.backend)
    assert fused.token_ids.tolist() == written.token_ids.tolist()
    torch.testing.assert_close(fused.logits, written.logits, atol=LOGIT_ATOL, rtol=0)
    for i in fused_pool.kv_caches:
        torch.testing.assert_close(fused_pool.kv_caches[i], written_pool.kv_caches[i], atol=1e-5, rtol=0)
    for b, case in enumerate(cases):
        expected = reference_block(models, case.features, case.next_token, case.length)
        torch.testing.assert_close(fused.logits[b], expected, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.slow  # Inductor compiles the block and context buckets
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_compiled_proposals_match_the_reference(models, make_paged, order):
    """Through the compiled block and context buckets (a block of one sequence at its exact
    bucket, three sequences' blocks and their held rows padded; the prompts' context
    eagerly, past the largest bucket): the reference's drafts and logits, every page
    written as the eager path writes it."""
    compiled = DFlashDraftModel.from_pretrained(models.draft_dir, heads(models), torch.float32, CPU)
    config = CompileConfig(enabled=True, sizes=(K + 1, 2 * (K + 1), 4 * (K + 1)), background=False)
    compiled.use_compiled(config, models.target.get_input_embeddings().weight)
    compiled_pool, eager_pool = make_paged(order), make_paged(order)
    batch = HeldBatch.of(models, compiled_pool)
    cases, tables = batch.cases, batch.tables
    outputs = []
    for model, paged in ((compiled, compiled_pool), (models.ours, eager_pool)):
        write_chunks(model, paged, batch.written, tables)
        outputs.append(model.propose(batch.anchors, batch.lengths, tables, paged.kv_caches, paged.backend,
                                     new_context=new_context(batch.held, tables)))
    for i in compiled_pool.kv_caches:
        torch.testing.assert_close(compiled_pool.kv_caches[i], eager_pool.kv_caches[i], atol=1e-5, rtol=0)
    got = outputs[0]
    for b, case in enumerate(cases):
        expected = reference_block(models, case.features, case.next_token, case.length)
        torch.testing.assert_close(got.logits[b], expected, atol=LOGIT_ATOL, rtol=0)
        assert got.token_ids[b].tolist() == expected.argmax(-1).tolist()
    single = propose_one(compiled, compiled_pool, cases[1].next_token, cases[1].length, tables[1])
    torch.testing.assert_close(single.logits[0], got.logits[1], atol=LOGIT_ATOL, rtol=0)
    block, context = compiled.compiled_block.stats, compiled.compiled_context.stats
    padded = config.bucket(3 * (K + 1))
    assert padded > 3 * (K + 1) and block.steps == {padded: 1, K + 1: 1} and block.eager_steps == 0
    held_rows = sum(end - start for _, start, end in batch.held)
    assert config.bucket(held_rows) > held_rows and context.steps == {config.bucket(held_rows): 1}
    assert context.eager_steps == 1  # the prompts' rows, past the largest bucket


# ---------------------------------------------------------------------------------------
# (d) fp8 pages


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_fp8_pages_mostly_agree(models, make_paged, order):
    paged = make_paged(order, "fp8_e4m3")
    agree, total, worst = 0, 0, 0.0
    for case in models.cases:
        expected = reference_block(models, case.features, case.next_token, case.length)  # [K, V]
        table = paged.allocate(case.length + K + 1)
        write_chunks(models.ours, paged, [(case, 0, case.length)], [table])
        proposal = propose_one(models.ours, paged, case.next_token, case.length, table)
        worst = max(worst, float((proposal.logits[0] - expected).abs().max() / expected.std()))
        agree += int((proposal.token_ids[0] == expected.argmax(-1)).sum())
        total += K
    assert worst <= FP8_RELATIVE_BOUND, f"fp8 logits off by {worst:.3f} logit std"
    assert agree >= FP8_MIN_AGREEMENT * total, f"only {agree}/{total} fp8 draft tokens agree"


# ---------------------------------------------------------------------------------------
# (e) checkpoints and config


def copy_checkpoint(models: Models, out_dir: Path) -> Path:
    shutil.copytree(models.draft_dir, out_dir)
    return out_dir


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def dflash_section(models: Models) -> dict:
    return dict(json.loads((models.draft_dir / "config.json").read_text())["dflash_config"])


def heads(models: Models) -> TargetHeads:
    return models.ours.target


def test_missing_tensor_is_a_clear_error(models, tmp_path):
    folder = copy_checkpoint(models, tmp_path / "no_fc")
    weights = load_file(folder / "model.safetensors")
    del weights["fc.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"1 missing tensor\(s\): fc\.weight"):
        DFlashDraftModel.from_pretrained(folder, heads(models), torch.float32, CPU)


def test_wrong_shape_is_a_clear_error(models, tmp_path):
    folder = copy_checkpoint(models, tmp_path / "three_layers")
    edit_config(folder, dflash_config={**dflash_section(models), "target_layer_ids": [0, 1, 2]})
    shapes = r"fc\.weight has shape \(64, 128\), the config implies \(64, 192\)"
    with pytest.raises(WeightLoadError, match=shapes):
        DFlashDraftModel.from_pretrained(folder, heads(models), torch.float32, CPU)


def test_dflash2_checkpoint_is_rejected(models, tmp_path):
    folder = copy_checkpoint(models, tmp_path / "dflash2")
    edit_config(
        folder,
        architectures=["DFlash2DraftModel"],
        dflash_config={**dflash_section(models), "conv_kernel_size": 4},
    )
    with pytest.raises(DFlashConfigError, match="DFlash2 checkpoints .* are not supported"):
        DFlashDraftModel.from_pretrained(folder, heads(models), torch.float32, CPU)


def test_dflash2_tensors_are_rejected(models, tmp_path):
    folder = copy_checkpoint(models, tmp_path / "dflash2_tensors")
    weights = load_file(folder / "model.safetensors")
    weights["candidate_selector.hidden_projection.weight"] = torch.zeros(8, 64)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(DFlashConfigError, match="DFlash2 tensors"):
        DFlashDraftModel.from_pretrained(folder, heads(models), torch.float32, CPU)


def test_not_a_dflash_checkpoint(models, tmp_path):
    folder = copy_checkpoint(models, tmp_path / "plain_qwen3")
    edit_config(folder, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(DFlashConfigError, match="not a DFlash checkpoint"):
        DFlashDraftModel.from_pretrained(folder, heads(models), torch.float32, CPU)


def test_missing_mask_token_is_a_clear_error(models, tmp_path):
    folder = copy_checkpoint(models, tmp_path / "no_mask")
    section = dflash_section(models)
    del section["mask_token_id"]
    edit_config(folder, dflash_config=section)
    with pytest.raises(DFlashConfigError, match="mask_token_id"):
        DFlashDraftModel.from_pretrained(folder, heads(models), torch.float32, CPU)


def test_config_facts_and_target_layer_fallback(models):
    from transformers import Qwen3Config

    ours = models.ours
    assert ours.target_layer_ids == TARGET_LAYER_IDS
    assert ours.feature_width == len(TARGET_LAYER_IDS) * 64
    assert ours.num_speculative_tokens == K
    assert [(s.owner, s.index, s.num_kv_heads, s.head_dim) for s in ours.kv_layer_specs()] == [
        ("draft", 0, 1, 32),
        ("draft", 1, 1, 32),
    ]
    ours.check_target(num_layers=TARGET_LAYERS, hidden_size=64)
    with pytest.raises(DFlashConfigError, match="exceed the target's 2 layers"):
        ours.check_target(num_layers=2, hidden_size=64)

    fallback = Qwen3Config(
        num_hidden_layers=3,
        num_target_layers=36,
        architectures=["DFlashDraftModel"],
        dflash_config={"mask_token_id": 7},
    )
    config = DFlashConfig.from_hf_config(fallback)
    assert list(config.target_layer_ids) == build_target_layer_ids(36, 3) == [1, 17, 33]
    assert config.block_size == 16 and config.mask_token_id == 7 and not config.causal
    assert build_target_layer_ids(4, 1) == [2]


def test_propose_rejects_bad_arguments(models, make_paged):
    paged = make_paged()
    table = paged.allocate(16)
    with pytest.raises(ValueError, match="num_tokens must be in 1..4"):
        propose_one(models.ours, paged, 5, 8, table, k=K + 1)
    with pytest.raises(ValueError, match="must agree"):
        models.ours.propose(torch.tensor([1, 2]), [8], [table], paged.kv_caches, paged.backend)
