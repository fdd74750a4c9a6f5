"""Tiny checkpoints for tests: the shared recipes (splitspec/tiny_models.py, which the
benchmarks use too) and a reference DFlash drafter saved by z-lab's own package."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from splitspec.tiny_models import PROMPTS, TINY_SHAPE, make_qwen3, make_tokenizer, qwen3_config  # noqa: F401 (re-exported)

# The reference DFlash drafter's shape: it drafts K tokens per block from the hidden states of
# target layers TARGET_LAYER_IDS of a TARGET_LAYERS-layer target.
REFERENCE_DFLASH_K = 4
TARGET_LAYERS = 4
TARGET_LAYER_IDS = [0, 2]


def make_pair(root: Path, draft_name: str = "draft", **target_config) -> tuple[Path, Path]:
    """A tiny Qwen3 target under `root`/target and a copy of it as its draft LM under `root`/`draft_name`:
    the copy drafts the target's argmax, so every draft is accepted."""
    target = make_qwen3(root / "target", **target_config)
    draft = root / draft_name
    shutil.copytree(target, draft)
    return target, draft


@dataclass(frozen=True)
class SpecModels:
    """A tiny target, a copy of it as its draft LM (every draft accepted) and a reference DFlash
    drafter reading the target's layers: one checkpoint of each kind the drafters load."""

    target: Path
    draft_lm: Path
    dflash: Path


def make_spec_models(root: Path, draft_name: str = "draft-lm") -> SpecModels:
    from transformers import AutoTokenizer

    target, draft_lm = make_pair(root, draft_name=draft_name, num_hidden_layers=TARGET_LAYERS)
    tok = AutoTokenizer.from_pretrained(target)
    dflash = make_reference_dflash(root / "dflash", vocab_size=len(tok), mask_token_id=tok.mask_token_id)
    return SpecModels(target, draft_lm, dflash)


def make_bench_models(root: Path) -> Path:
    """The benchmarks' models folder (target/, draft_model/, dflash/) in tiny."""
    make_spec_models(root, draft_name="draft_model")
    return root


def make_reference_dflash(
    out_dir: Path, *, vocab_size: int, mask_token_id: int, seed: int = 0, hidden_size: int = 64
) -> Path:
    """A tiny random z-lab DFlash checkpoint saved by the reference package itself.

    Its head layout (4 query heads, 1 KV head of dim 32) differs from the target's on
    purpose. Projections are scaled up so that the context and the block matter, and the
    final norm so that greedy choices are not near-ties."""
    from dflash.model import DFlashDraftModel as ReferenceDraft

    dflash = {"mask_token_id": mask_token_id, "target_layer_ids": TARGET_LAYER_IDS, "block_size": REFERENCE_DFLASH_K + 1}
    config = qwen3_config(vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_key_value_heads=1,
                          head_dim=32, num_target_layers=TARGET_LAYERS, dflash_config=dflash)
    torch.manual_seed(seed)
    model = ReferenceDraft(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                param.mul_(8.0)
        model.norm.weight.mul_(4.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_llama_family(out_dir: Path, model_type: str, **overrides) -> Path:
    """A tiny random LlamaForCausalLM (llama3 rope, biased attention, tied embeddings) or
    Qwen2ForCausalLM (q/k/v bias), saved like make_qwen3; `overrides` replace config fields."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = make_tokenizer(out_dir)
    fields = dict(vocab_size=len(tokenizer), **TINY_SHAPE, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    fields.update(overrides)
    if model_type == "llama":
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        config = LlamaConfig(
            **fields, head_dim=16, attention_bias=True, tie_word_embeddings=True, rope_parameters=rope
        )
        cls = LlamaForCausalLM
    else:
        config = Qwen2Config(**fields, tie_word_embeddings=False)
        cls = Qwen2ForCausalLM
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
