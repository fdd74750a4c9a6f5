"""Tiny checkpoints for tests: the shared recipes (splitspec/tiny_models.py, which the
benchmarks use too) and a reference DFlash drafter saved by z-lab's own package."""

from __future__ import annotations

from pathlib import Path

import torch

from splitspec.tiny_models import PROMPTS, make_qwen3, make_tokenizer, qwen3_config  # noqa: F401 (re-exported)

# The reference DFlash drafter's shape: it drafts K tokens per block from the hidden states of
# target layers TARGET_LAYER_IDS of a TARGET_LAYERS-layer target.
REFERENCE_DFLASH_K = 4
TARGET_LAYERS = 4
TARGET_LAYER_IDS = [0, 2]


def make_reference_dflash(
    out_dir: Path, *, vocab_size: int, mask_token_id: int, seed: int = 0, hidden_size: int = 64
) -> Path:
    """A tiny random z-lab DFlash checkpoint saved by the reference package itself.

    Its head layout (4 query heads, 1 KV head of dim 32) differs from the target's on
    purpose. Projections are scaled up so that the context and the block matter, and the
    final norm so that greedy choices are not near-ties."""
    from dflash.model import DFlashDraftModel as ReferenceDraft
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_target_layers=TARGET_LAYERS,
        dflash_config={
            "mask_token_id": mask_token_id, "target_layer_ids": TARGET_LAYER_IDS, "block_size": REFERENCE_DFLASH_K + 1
        },
    )
    torch.manual_seed(seed)
    model = ReferenceDraft(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                param.mul_(8.0)
        model.norm.weight.mul_(4.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
