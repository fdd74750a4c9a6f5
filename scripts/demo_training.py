"""What the stages of the demo training share: the corpus (with the held-out modules kept
out), the run sizes and seed, and the training-loop helpers.

scripts/train_demo.py runs the stages; scripts/eval_demo.py and tests/test_demo.py read the
corpus rules from here.
"""

from __future__ import annotations

import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Top-level stdlib modules never trained on: the held-out set of scripts/eval_demo.py.
from splitspec.heldout import HELD_OUT  # (one list for training, eval and bench)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "demo"

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
                 "__pycache__"}
MAX_FILE_BYTES = 300_000  # generated tables and data blobs are not code worth learning


@dataclass
class Sizes:
    """Every size and step count of one run (the full run or the smoke run)."""

    vocab_size: int
    # target
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    target_steps: int
    target_batch: int
    target_lr: float
    # greedy continuations of the target (training data of both drafters)
    gen_prompt_lens: tuple[int, ...]
    gen_prompts_per_len: int
    gen_total_len: int
    gen_batch: int
    # dflash
    dflash_layers: int
    dflash_intermediate: int
    dflash_heads: int
    dflash_kv_heads: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    dflash_steps: int
    dflash_batch: int
    dflash_anchors: int
    dflash_lr: float
    # draft_model
    draft_hidden: int
    draft_layers: int
    draft_intermediate: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_dim: int
    draft_pretrain_steps: int
    draft_distill_steps: int
    draft_batch: int
    draft_distill_batch: int
    draft_lr: float
    max_files: int | None = None  # smoke: train on the first files only
    threads: int = 2


FULL = Sizes(
    vocab_size=4096, hidden=256, layers=6, intermediate=768, heads=4, kv_heads=2, head_dim=64, context=512,
    target_steps=1200, target_batch=8, target_lr=2e-3,
    gen_prompt_lens=(8, 16, 24, 32, 48, 64, 80, 96), gen_prompts_per_len=192, gen_total_len=288, gen_batch=96,
    dflash_layers=2, dflash_intermediate=768, dflash_heads=4, dflash_kv_heads=2, target_layer_ids=(1, 3, 5),
    block_size=9, dflash_steps=1500, dflash_batch=8, dflash_anchors=16, dflash_lr=1.5e-3,
    draft_hidden=192, draft_layers=2, draft_intermediate=576, draft_heads=3, draft_kv_heads=1, draft_head_dim=64,
    draft_pretrain_steps=500, draft_distill_steps=700, draft_batch=8, draft_distill_batch=16, draft_lr=2e-3,
)
SMOKE = Sizes(
    vocab_size=320, hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=16, context=128,
    target_steps=30, target_batch=4, target_lr=3e-3,
    gen_prompt_lens=(8, 16), gen_prompts_per_len=4, gen_total_len=48, gen_batch=4,
    dflash_layers=1, dflash_intermediate=128, dflash_heads=4, dflash_kv_heads=2, target_layer_ids=(0, 1),
    block_size=9, dflash_steps=20, dflash_batch=4, dflash_anchors=4, dflash_lr=3e-3,
    draft_hidden=32, draft_layers=1, draft_intermediate=64, draft_heads=2, draft_kv_heads=1, draft_head_dim=16,
    draft_pretrain_steps=10, draft_distill_steps=10, draft_batch=4, draft_distill_batch=4, draft_lr=3e-3,
    max_files=40,
)
SEED = 1234


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------
# Corpus


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(relative: Path) -> bool:
    return any(part in EXCLUDED_DIRS for part in relative.parts[:-1])


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the running interpreter's standard library."""
    root = stdlib_dir()
    held_names = {f"{name}.py" for name in HELD_OUT}
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _is_excluded(relative) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        (held if len(relative.parts) == 1 and relative.name in held_names else train).append(path)
    return train, held


def held_out_files() -> list[Path]:
    """The held-out modules in HELD_OUT order (scripts/eval_demo.py reads these)."""
    by_name = {p.stem: p for p in corpus_files()[1]}
    return [by_name[name] for name in HELD_OUT if name in by_name]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# ---------------------------------------------------------------------------------------
# Tokenizer


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All files as one stream of ids, each file followed by EOS."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])  # [B, length]


# ---------------------------------------------------------------------------------------
# Training helpers


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def optimizer_step(opt: torch.optim.Optimizer, params, loss: torch.Tensor, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in params if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def qwen3_config(sizes_vocab: int, tokenizer, *, hidden, layers, intermediate, heads, kv_heads, head_dim,
                 max_positions):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=sizes_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )


def save_lm(model, tokenizer, out_dir: Path) -> None:
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def train_lm(model, batches, steps: int, lr: float, name: str, history: dict) -> None:
    """Next-token training; `batches(step)` → (input ids [B, T], labels [B, T] with -100 where ignored)."""
    model.train()
    params = list(model.parameters())
    opt = make_optimizer(params, lr)
    warmup = max(1, min(50, steps // 10))
    start, losses = time.monotonic(), []
    for step in range(steps):
        ids, labels = batches(step)
        with autocast():
            loss = model(input_ids=ids, labels=labels).loss
        optimizer_step(opt, params, loss, lr_at(step, steps, lr, warmup))
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            rate = (step + 1) / (time.monotonic() - start)
            log(f"{name} step {step + 1}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                f"({rate:.2f} steps/s)")
    model.eval()
    history[f"{name}_final_loss"] = sum(losses[-50:]) / len(losses[-50:])
