"""Train the bundled demo models: a tokenizer, a Qwen3 target and two drafters for it.

    .venv/bin/python scripts/train_demo.py              # full run → demo/ (~40 min on 2 CPU cores)
    .venv/bin/python scripts/train_demo.py --smoke --out /tmp/demo-smoke   # tiny sizes, < 1 min (CI)

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
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from demo_bf16 import store_bf16  # the sibling modules: scripts/ is on the path when this runs
from demo_training import (
    DEFAULT_OUT,
    FULL,
    HELD_OUT,
    SEED,
    SMOKE,
    Sizes,
    autocast,
    corpus_files,
    log,
    lr_at,
    make_optimizer,
    optimizer_step,
    qwen3_config,
    random_windows,
    read_text,
    save_lm,
    stdlib_dir,
    token_stream,
    train_lm,
)

from splitspec.tokenizer import train_bpe_tokenizer

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
    sizes = dataclasses.replace(SMOKE if args.smoke else FULL, threads=args.threads)
    run(sizes, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
