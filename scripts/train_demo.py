"""Train the bundled demo models: a tokenizer, a Qwen3 target and two drafters for it.

    python scripts/train_demo.py              # full run → demo/ (~40 min on 2 CPU cores)
    python scripts/train_demo.py --smoke --out /tmp/demo-smoke   # tiny sizes, < 1 min (CI)

Everything is trained from the Python standard library source of the running
interpreter (test packages, codec tables and data blobs left out), with a FIXED list of
held-out modules (`HELD_OUT`) kept out of training for scripts/eval_demo.py. Seeds are
fixed and step counts are fixed (not time-based), so a rerun with the same interpreter
and torch reproduces the same models up to floating-point nondeterminism.

Output, in the real Hugging Face formats (safetensors stored in bfloat16, scripts/demo_bf16.py; ≤ 40 MB):
- `tokenizer/`   byte-level BPE (`tokenizers`), EOS `<|endoftext|>`, mask `<|mask|>`
                 (reserved for DFlash), chat tokens; `AutoTokenizer` loads it.
- `target/`      `Qwen3ForCausalLM` + tokenizer files (`AutoModelForCausalLM` loads it).
- `dflash/`      a DFlash block drafter in z-lab's format, trained with the `dflash`
                 package's own `DFlashDraftModel` class: the block `[anchor, mask × 8]`
                 attends to the target's hidden states after `target_layer_ids` and
                 learns the target's own greedy continuation (loss on the 8 predictions).
- `draft_model/` a 2-layer Qwen3 LM on the same tokenizer: pretrained on the corpus,
                 then distilled on the target's greedy continuations.
- `training.json` sizes, steps, losses and stage times of the run.

Stages: tokenizer → target (bf16 autocast, fp32 weights) → greedy continuations of the
target (fp32, exactly as served) from prompts cut out of the training files, with the
target's hidden states cached → DFlash → draft_model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "demo"

# Top-level stdlib modules never trained on: the held-out set of scripts/eval_demo.py.
from splitspec.heldout import HELD_OUT  # noqa: E402  (one list for training, eval and bench)
from splitspec.tokenizer import train_bpe_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_bf16 import store_bf16  # noqa: E402  (scripts/demo_bf16.py)

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


# ---------------------------------------------------------------------------------------
# Greedy continuations of the target, with its hidden states


@dataclass
class Continuations:
    ids: torch.Tensor  # [N, T] prompt + greedy continuation
    prompt_lens: torch.Tensor  # [N]
    valid_lens: torch.Tensor  # [N]: tokens up to and including the first EOS of the continuation
    features: torch.Tensor  # [N, T, len(target_layer_ids) * hidden], float16


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, total_len: int) -> torch.Tensor:
    """[B, P] → [B, total_len]: the target's greedy continuation, decoded with a KV cache."""
    out = target(input_ids=prompts, use_cache=True)
    cache, tokens = out.past_key_values, [out.logits[:, -1].argmax(-1)]
    for _ in range(total_len - prompts.shape[1] - 1):
        out = target(input_ids=tokens[-1][:, None], past_key_values=cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompts, torch.stack(tokens, dim=1)], dim=1)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    from dflash.model import extract_context_feature

    out = target(input_ids=ids, output_hidden_states=True)
    return extract_context_feature(out.hidden_states, list(layer_ids))  # [B, T, n * hidden]


def make_continuations(target, stream: torch.Tensor, sizes: Sizes, eos_id: int) -> Continuations:
    generator = torch.Generator().manual_seed(SEED + 2)
    all_ids, prompt_lens = [], []
    for prompt_len in sizes.gen_prompt_lens:
        remaining = sizes.gen_prompts_per_len
        while remaining:
            batch = min(sizes.gen_batch, remaining)
            prompts = random_windows(stream, batch, prompt_len, generator)
            all_ids.append(greedy_continue(target, prompts, sizes.gen_total_len))
            prompt_lens += [prompt_len] * batch
            remaining -= batch
        log(f"greedy continuations: prompt length {prompt_len} done")
    ids = torch.cat(all_ids)
    prompt_lens_t = torch.tensor(prompt_lens)
    valid = []
    for row, p in zip(ids, prompt_lens):
        eos = (row[p:] == eos_id).nonzero()
        valid.append(p + int(eos[0]) + 1 if len(eos) else row.numel())
    features = torch.cat([
        target_features(target, ids[i:i + sizes.gen_batch], sizes.target_layer_ids).to(torch.float16)
        for i in range(0, ids.shape[0], sizes.gen_batch)
    ])
    if not torch.isfinite(features).all():
        raise RuntimeError("target hidden states overflow float16")
    return Continuations(ids, prompt_lens_t, torch.tensor(valid), features)


# ---------------------------------------------------------------------------------------
# DFlash


def dflash_config(sizes: Sizes, tokenizer):
    from transformers import Qwen3Config

    mask_id = tokenizer.mask_token_id
    return Qwen3Config(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.dflash_intermediate,
        num_hidden_layers=sizes.dflash_layers,
        num_attention_heads=sizes.dflash_heads,
        num_key_value_heads=sizes.dflash_kv_heads,
        head_dim=sizes.head_dim,
        max_position_embeddings=sizes.context,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_target_layers=sizes.layers,
        block_size=sizes.block_size,
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": list(sizes.target_layer_ids),
                       "block_size": sizes.block_size},
        attn_implementation="sdpa",
    )


def dflash_batch(data: Continuations, rows: torch.Tensor, sizes: Sizes, mask_id: int, generator):
    """One training batch of `dflash_anchors` blocks per sequence.

    Block j of a row sits at positions a_j .. a_j + K (anchor a_j ≥ the prompt length, so
    all K labels are the target's greedy tokens); its queries see the context features of
    positions < a_j and the whole block (non-causal), exactly as in `dflash_generate`.
    """
    k = sizes.block_size - 1
    n = sizes.dflash_anchors
    ids = data.ids[rows]  # [B, T]
    T = ids.shape[1]
    batch = rows.numel()
    anchors = torch.empty(batch, n, dtype=torch.long)
    for b, row in enumerate(rows.tolist()):
        low, high = int(data.prompt_lens[row]), int(data.valid_lens[row]) - 1  # anchors in [low, high)
        span = torch.arange(low, max(high, low + 1))
        pick = torch.randint(0, span.numel(), (n,), generator=generator) if span.numel() < n else \
            torch.randperm(span.numel(), generator=generator)[:n]
        anchors[b] = span[pick]
    offsets = torch.arange(sizes.block_size)  # [K + 1]
    positions = anchors[:, :, None] + offsets  # [B, n, K + 1]
    block_ids = torch.full((batch, n, sizes.block_size), mask_id, dtype=torch.long)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    label_pos = positions[:, :, 1:]  # [B, n, K]
    labels = ids.gather(1, label_pos.clamp(max=T - 1).view(batch, -1)).view(batch, n, k)
    valid_lens = data.valid_lens[rows][:, None, None]
    labels = labels.masked_fill(label_pos >= valid_lens, -100)
    q = n * sizes.block_size
    ctx_visible = torch.arange(T)[None, None, :] < anchors.repeat_interleave(sizes.block_size, 1)[:, :, None]
    block_of_query = torch.arange(q) // sizes.block_size
    own_block = block_of_query[:, None] == block_of_query[None, :]  # [q, q]
    mask = torch.cat([ctx_visible, own_block[None].expand(batch, q, q)], dim=2)[:, None]  # [B, 1, q, T + q]
    position_ids = torch.cat([torch.arange(T)[None].expand(batch, T), positions.view(batch, q)], dim=1)
    return block_ids.view(batch, q), labels, mask, position_ids


def train_dflash(target, data: Continuations, sizes: Sizes, tokenizer, out_dir: Path, history: dict):
    from dflash.model import DFlashDraftModel

    torch.manual_seed(SEED + 3)
    config = dflash_config(sizes, tokenizer)
    model = DFlashDraftModel(config).train()
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.lm_head
    k = sizes.block_size - 1
    decay = torch.exp(-torch.arange(k, dtype=torch.float32) / 4.0)  # early positions matter most
    params = list(model.parameters())
    opt = make_optimizer(params, sizes.dflash_lr)
    generator = torch.Generator().manual_seed(SEED + 4)
    steps, start, losses, accs = sizes.dflash_steps, time.monotonic(), [], []
    warmup = max(1, min(50, steps // 10))
    for step in range(steps):
        rows = torch.randint(0, data.ids.shape[0], (sizes.dflash_batch,), generator=generator)
        block_ids, labels, mask, position_ids = dflash_batch(data, rows, sizes, tokenizer.mask_token_id, generator)
        with autocast():
            hidden = model(
                position_ids=position_ids,
                attention_mask=mask,
                noise_embedding=F.embedding(block_ids, embed),
                target_hidden=data.features[rows].float(),
            )  # [B, n * (K + 1), hidden]
            hidden = hidden.view(sizes.dflash_batch, sizes.dflash_anchors, sizes.block_size, -1)[:, :, 1:]
            logits = model.compute_logits(hidden, lm_head).float()  # [B, n, K, V]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view_as(labels)
        valid = (labels != -100).float()
        loss = (ce * valid * decay).sum() / (valid * decay).sum().clamp_min(1.0)
        optimizer_step(opt, params, loss, lr_at(step, steps, sizes.dflash_lr, warmup))
        losses.append(loss.item())
        with torch.no_grad():  # expected accepted length of greedy blocks (prefix of matches)
            hit = ((logits.argmax(-1) == labels) | (labels == -100)).long().cumprod(-1) * valid.long()
            accs.append(hit.sum(-1).float().mean().item())
        if step % 50 == 0 or step == steps - 1:
            rate = (step + 1) / (time.monotonic() - start)
            log(f"dflash step {step + 1}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                f"accepted/block {sum(accs[-50:]) / len(accs[-50:]):.2f} ({rate:.2f} steps/s)")
    model.eval()
    history["dflash_final_loss"] = sum(losses[-50:]) / len(losses[-50:])
    history["dflash_train_accepted_per_block"] = sum(accs[-50:]) / len(accs[-50:])
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


# ---------------------------------------------------------------------------------------
# The stages


def train_target(stream: torch.Tensor, tokenizer, sizes: Sizes, out_dir: Path, history: dict):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(SEED)
    config = qwen3_config(sizes.vocab_size, tokenizer, hidden=sizes.hidden, layers=sizes.layers,
                          intermediate=sizes.intermediate, heads=sizes.heads, kv_heads=sizes.kv_heads,
                          head_dim=sizes.head_dim, max_positions=sizes.context)
    model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED + 1)

    def batches(step):
        ids = random_windows(stream, sizes.target_batch, sizes.context, generator)
        return ids, ids

    train_lm(model, batches, sizes.target_steps, sizes.target_lr, "target", history)
    save_lm(model, tokenizer, out_dir)
    return model


def train_draft_model(stream: torch.Tensor, data: Continuations, tokenizer, sizes: Sizes, out_dir: Path,
                      history: dict):
    """Pretrain on the corpus, then distill on the target's greedy continuations (labels: the
    target's greedy tokens through the first EOS, and the last prompt token)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(SEED + 5)
    config = qwen3_config(sizes.vocab_size, tokenizer, hidden=sizes.draft_hidden, layers=sizes.draft_layers,
                          intermediate=sizes.draft_intermediate, heads=sizes.draft_heads,
                          kv_heads=sizes.draft_kv_heads, head_dim=sizes.draft_head_dim, max_positions=sizes.context)
    model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED + 6)

    def corpus_batches(step):
        ids = random_windows(stream, sizes.draft_batch, sizes.context, generator)
        return ids, ids

    positions = torch.arange(data.ids.shape[1])[None]
    ignore = (positions < data.prompt_lens[:, None] - 1) | (positions >= data.valid_lens[:, None])
    distill_labels = data.ids.masked_fill(ignore, -100)

    def distill_batches(step):
        rows = torch.randint(0, data.ids.shape[0], (sizes.draft_distill_batch,), generator=generator)
        return data.ids[rows], distill_labels[rows]

    train_lm(model, corpus_batches, sizes.draft_pretrain_steps, sizes.draft_lr, "draft_pretrain", history)
    train_lm(model, distill_batches, sizes.draft_distill_steps, sizes.draft_lr / 2, "draft_distill", history)
    save_lm(model, tokenizer, out_dir)
    return model


def dir_megabytes(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def run(sizes: Sizes, out: Path) -> dict:
    torch.set_num_threads(sizes.threads)
    torch.manual_seed(SEED)
    started = time.monotonic()
    history: dict = {"sizes": asdict(sizes), "held_out": list(HELD_OUT), "python": sys.version.split()[0],
                     "torch": torch.__version__, "seed": SEED, "stage_seconds": {}}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    def stage_done(name: str, since: float) -> float:
        now = time.monotonic()
        history["stage_seconds"][name] = round(now - since, 1)
        log(f"stage {name} done in {now - since:.0f} s")
        return now

    t = time.monotonic()
    train_files, held = corpus_files()
    if sizes.max_files is not None:
        train_files = train_files[:sizes.max_files]
    texts = [read_text(p) for p in train_files]
    history["train_files"] = len(train_files)
    history["train_megabytes"] = round(sum(len(s) for s in texts) / 1e6, 2)
    history["held_out_files"] = [str(p.relative_to(stdlib_dir())) for p in held]
    tokenizer = train_bpe_tokenizer(texts, sizes.vocab_size, tmp / "tokenizer")
    stream = token_stream(tokenizer, texts)
    history["train_tokens"] = stream.numel()
    log(f"corpus: {len(texts)} files, {history['train_megabytes']} MB, {stream.numel()} tokens")
    t = stage_done("tokenizer", t)

    target = train_target(stream, tokenizer, sizes, tmp / "target", history)
    t = stage_done("target", t)

    data = make_continuations(target, stream, sizes, tokenizer.eos_token_id)
    history["continuations"] = int(data.ids.shape[0])
    history["continuation_tokens"] = int((data.valid_lens - data.prompt_lens).sum())
    t = stage_done("continuations", t)

    train_dflash(target, data, sizes, tokenizer, tmp / "dflash", history)
    t = stage_done("dflash", t)

    train_draft_model(stream, data, tokenizer, sizes, tmp / "draft_model", history)
    t = stage_done("draft_model", t)

    store_bf16(tmp)  # trained in float32; stored in half the bytes (every checkout carries them)
    history["total_seconds"] = round(time.monotonic() - started, 1)
    history["megabytes"] = round(dir_megabytes(tmp), 2)
    (tmp / "training.json").write_text(json.dumps(history, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"wrote {out} ({history['megabytes']} MB) in {history['total_seconds']:.0f} s")
    return history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps (CI, < 1 minute)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = SMOKE if args.smoke else FULL
    sizes.threads = args.threads
    run(sizes, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
