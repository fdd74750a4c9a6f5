"""A small scaling probe for the demo target: held-out loss against training compute.

Trains target shapes for the same compute each (steps ∝ 1 / FLOPs per token) with the full
recipe's optimizer, schedule, batch and corpus, and reports each one's held-out perplexity
(scripts/eval_demo.py's figure) at the end of its (short) cosine schedule. At a fixed compute
the best shape is the compute-optimal size for that budget; the full recipe's size comes from
it and from how the optimum grows with compute (N_opt ∝ C^0.5, Hoffmann et al. 2022).

    .venv/bin/python scripts/scaling_probe.py                      # the three default shapes
    .venv/bin/python scripts/scaling_probe.py --shape 256x6:704 --shape 384x6:896 --report docs/scaling_probe.json
    .venv/bin/python scripts/scaling_probe.py --shape 320x8:960 --tokens 2e6

Every run is resumable like train_demo.py's (rerun the same command); the report is written
to `--report` (JSON) and printed as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from demo_resume import CheckpointPolicy, WorkDir
from demo_training import FULL, REPO_ROOT, SEED, Sizes, StepOptions, keep_temp_files_in, load_corpus, log
from train_demo import Context, run_identity, target_stage, tokenizer_stage

from common.cpu_info import read_cpu_info

HEAD_DIM = 64
# What every probe run shares with the full recipe (corpus, optimizer, schedule) and the window and
# batch it trains with; fixed here, so that the full recipe can change without changing the probe.
PROBE_BASE = dataclasses.replace(FULL, context=512, target_batch=8, target_steps=3000, heldout_evals=8,
                                 draft_distill_steps=3000, draft_batch=8)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A target shape `HIDDENxLAYERS:INTERMEDIATE` (heads of 64; two query heads per key/value head
    where the head count is even)."""

    hidden: int
    layers: int
    intermediate: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        try:
            width, _, intermediate = text.partition(":")
            hidden, _, layers = width.partition("x")
            shape = cls(int(hidden), int(layers), int(intermediate))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected HIDDENxLAYERS:INTERMEDIATE, not {text!r}") from None
        if shape.hidden % HEAD_DIM or min(shape.layers, shape.intermediate) < 1:
            raise argparse.ArgumentTypeError(f"{text}: hidden must be a multiple of {HEAD_DIM}, the rest ≥ 1")
        return shape

    @property
    def name(self) -> str:
        return f"{self.hidden}x{self.layers}:{self.intermediate}"

    def sizes(self, base: Sizes, steps: int) -> Sizes:
        heads = self.hidden // HEAD_DIM
        kv_heads = heads // 2 if heads % 2 == 0 else heads
        return dataclasses.replace(base, hidden=self.hidden, layers=self.layers, intermediate=self.intermediate,
                                   heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM, target_steps=steps,
                                   target_layer_ids=(0,), heldout_evals=1)


def matmul_params(sizes: Sizes) -> int:
    """Weights multiplied per token: every layer's projections and the (tied) output head."""
    q, kv = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    per_layer = sizes.hidden * (2 * q + 2 * kv) + 3 * sizes.hidden * sizes.intermediate
    return sizes.layers * per_layer + sizes.vocab_size * sizes.hidden


def train_flops_per_token(sizes: Sizes) -> float:
    """6 N (forward and backward of the products) + the attention scores and values at the mean
    causal length, forward and backward."""
    attention = 6 * 2 * sizes.layers * sizes.heads * sizes.head_dim * (sizes.context / 2)
    return 6 * matmul_params(sizes) + attention


def stored_megabytes(sizes: Sizes) -> float:
    """bfloat16 safetensors of the target (tied embeddings, norms included)."""
    q, kv = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    norms = sizes.layers * (2 * sizes.hidden + 2 * sizes.head_dim) + sizes.hidden
    params = sizes.layers * (sizes.hidden * (2 * q + 2 * kv) + 3 * sizes.hidden * sizes.intermediate)
    return 2 * (params + sizes.vocab_size * sizes.hidden + norms) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=Shape.parse, action="append", default=None,
                        help="a shape HIDDENxLAYERS:INTERMEDIATE (repeatable; default: 256x6:704, 384x6:896, "
                             "512x6:1024)")
    parser.add_argument("--tokens", type=float, default=2.5e6,
                        help="training tokens of the reference shape (384x6:896); the others get the same compute "
                             "(default: %(default)s)")
    parser.add_argument("--work", type=Path, default=REPO_ROOT / ".demo" / "probe",
                        help="work folder (default: %(default)s)")
    parser.add_argument("--report", type=Path, default=None, help="JSON report (default: WORK/report.json)")
    parser.add_argument("--tokenizer", type=Path, default=REPO_ROOT / "demo" / "tokenizer",
                        help="the demo tokenizer to train with (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    shapes = args.shape or [Shape(256, 6, 704), Shape(384, 6, 896), Shape(512, 6, 1024)]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    keep_temp_files_in(args.work / "tmp")

    sources, _ = load_corpus(PROBE_BASE.corpus)
    shared = WorkDir(args.work / "streams", run_identity(PROBE_BASE, sources))
    if not shared.file("tokenizer").is_dir():
        shutil.copytree(args.tokenizer, shared.file("tokenizer"))
    policy = CheckpointPolicy()
    tokenizer, streams = tokenizer_stage(Context(PROBE_BASE, shared, policy, StepOptions()), sources)
    tokens_per_step = PROBE_BASE.target_batch * PROBE_BASE.context
    budget = train_flops_per_token(Shape(384, 6, 896).sizes(PROBE_BASE, 1)) * args.tokens

    rows = []
    for shape in shapes:
        per_token = train_flops_per_token(shape.sizes(PROBE_BASE, 1))
        steps = max(1, round(budget / per_token / tokens_per_step))
        sizes = shape.sizes(PROBE_BASE, steps)
        work = WorkDir(args.work / shape.name.replace(":", "-"), run_identity(sizes, sources))
        ctx = Context(sizes, work, policy, StepOptions(precision=sizes.precision, compile=True))
        log(f"probe {shape.name}: {steps} steps of {tokens_per_step} tokens")
        started = time.monotonic()
        _, result = target_stage(ctx, streams, tokenizer)
        rows.append({"shape": shape.name, "matmul_params": matmul_params(sizes),
                     "stored_mb": round(stored_megabytes(sizes), 2), "steps": steps,
                     "tokens": steps * tokens_per_step, "flops": per_token * steps * tokens_per_step,
                     "train_seconds": round(result.seconds, 1), "final_loss": round(result.tail_mean("loss"), 4),
                     "heldout_perplexity": round(result.evaluations[-1]["heldout_perplexity"], 3),
                     "wall_seconds_this_session": round(time.monotonic() - started, 1)})
        log(f"probe {shape.name}: held-out perplexity {rows[-1]['heldout_perplexity']}")

    report = {"cpu": read_cpu_info().describe(), "torch": torch.__version__, "seed": SEED, "budget_flops": budget,
              "tokens_per_step": tokens_per_step, "context": PROBE_BASE.context, "runs": rows}
    path = args.report or args.work / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'shape':<14}{'params':>10}{'MB bf16':>9}{'tokens':>11}{'seconds':>9}{'held-out ppl':>14}")
    for r in rows:
        print(f"{r['shape']:<14}{r['matmul_params'] / 1e6:>9.2f}M{r['stored_mb']:>9.1f}{r['tokens']:>11,}"
              f"{r['train_seconds']:>9.0f}{r['heldout_perplexity']:>14.2f}")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
