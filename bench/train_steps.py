"""Training-step throughput of the demo stages at the FULL sizes, one variant per run.

Times the steps of scripts/train_demo.py's stages on random token ids (throughput does not
depend on the text): the target's LM step (tokens/s), the greedy continuations (generated
tokens/s, with and without the hidden-state pass) and the DFlash step (steps/s). Run each
variant in its own process (torch.compile and thread pools keep state), e.g.:

    .venv/bin/python bench/train_steps.py target --precision bf16
    .venv/bin/python bench/train_steps.py target --precision fp32 --optimizer fused
    .venv/bin/python bench/train_steps.py target --precision bf16 --compile
    .venv/bin/python bench/train_steps.py target --batch 16 --context 256
    .venv/bin/python bench/train_steps.py continuations --gen-batch 96
    .venv/bin/python bench/train_steps.py dflash

`--sizes smoke` for a quick check that it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import demo_drafters  # noqa: E402
import demo_training  # noqa: E402
import train_demo  # noqa: E402

FAKE_TOKENIZER = SimpleNamespace(eos_token_id=0, pad_token_id=0, mask_token_id=3)


def target_model(sizes: demo_training.Sizes):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(train_demo.target_config(sizes, FAKE_TOKENIZER))


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class Timing:
    wall_s: float  # per call
    cpu_s: float  # per call, all threads of this process
    others: float  # share of the machine's CPUs that other processes used meanwhile (the figure is noise if high)

    def rate(self, units: float) -> str:
        return f"{units / self.wall_s:.4g}/s wall, {units / self.cpu_s:.4g}/CPU-s, others busy {self.others:.0%}"


def timed(step, warmup: int, steps: int) -> Timing:
    """Wall and CPU seconds per call of `step` after `warmup` calls."""
    for _ in range(warmup):
        step()
    wall, cpu, busy = time.perf_counter(), time.process_time(), busy_cpu_seconds()
    for _ in range(steps):
        step()
    wall, cpu, busy = time.perf_counter() - wall, time.process_time() - cpu, busy_cpu_seconds() - busy
    others = max(0.0, busy - cpu) / (wall * os.cpu_count())
    return Timing(wall / steps, cpu / steps, others)


def bench_target(sizes, args) -> str:
    model = target_model(sizes).train()
    model.set_attn_implementation(args.attention)
    params = list(model.parameters())
    opt = demo_training.make_optimizer(params, sizes.target_lr, args.optimizer)
    options = demo_training.StepOptions(precision=args.precision, compile=args.compile)
    forward = demo_training.lm_forward(model, options)
    batch, context = args.batch or sizes.target_batch, args.context or sizes.context
    generator = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(0, sizes.vocab_size, (batch, context), generator=generator)
        loss = forward(ids, ids)
        demo_training.optimizer_step(opt, params, loss, sizes.target_lr)
        loss.item()

    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    timing = timed(step, args.warmup, args.steps)
    shape = f"{sizes.layers} layers x {sizes.hidden} ({sum(p.numel() for p in params) / 1e6:.2f}M params)"
    return (f"target {shape} {args.precision} compile={args.compile} optimizer={args.optimizer} "
            f"attention={args.attention} batch {batch} x {context}: "
            f"tokens {timing.rate(batch * context)} ({timing.wall_s * 1e3:.0f} ms/step; first step {first:.1f} s)")


def bench_continuations(sizes, args) -> str:
    model = target_model(sizes).eval()
    batch = args.gen_batch or sizes.gen_batch
    prompt_len = min(48, sizes.gen_total_len // 2)
    total = sizes.gen_total_len
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, sizes.vocab_size, (batch, prompt_len), generator=generator)
    ids = None

    def decode():
        nonlocal ids
        ids = demo_drafters.greedy_continue(model, prompts, total)

    decoding = timed(decode, 0, 1)
    features = timed(lambda: demo_drafters.target_features(model, ids, sizes.target_layer_ids), 0, 1)
    together = timed(lambda: demo_drafters.greedy_continue_with_features(model, prompts, total, sizes.target_layer_ids),
                     0, 1)
    generated = batch * (total - prompt_len)
    return (f"continuations batch {batch}, {prompt_len} + {total - prompt_len} tokens: decode {decoding.wall_s:.1f} s "
            f"(generated tokens {decoding.rate(generated)}) + hidden-state pass {features.wall_s:.1f} s; "
            f"features taken while decoding {together.wall_s:.1f} s (generated tokens {together.rate(generated)})")


def bench_dflash(sizes, args) -> str:
    from dflash.model import DFlashDraftModel

    target = target_model(sizes).eval()
    n_rows = 64
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sizes.vocab_size, (n_rows, sizes.gen_total_len), generator=generator)
    features = torch.randn(n_rows, sizes.gen_total_len, len(sizes.target_layer_ids) * sizes.hidden,
                           generator=generator).to(torch.float16)
    prompt_len = min(48, sizes.gen_total_len // 2)
    data = demo_drafters.Continuations(ids, torch.full((n_rows,), prompt_len), torch.full((n_rows,), sizes.gen_total_len),
                                    [features])
    model = DFlashDraftModel(demo_drafters.dflash_config(sizes, FAKE_TOKENIZER)).train()
    params = list(model.parameters())
    opt = demo_training.make_optimizer(params, sizes.dflash_lr, args.optimizer)
    options = demo_training.StepOptions(precision=args.precision, compile=args.compile)
    step_fn = demo_drafters.dflash_step_fn(model, target, data, sizes, FAKE_TOKENIZER.mask_token_id, opt, params,
                                        generator, options)
    timing = timed(lambda: step_fn(0), args.warmup, args.steps)
    blocks = sizes.dflash_batch * sizes.dflash_anchors
    return (f"dflash {args.precision} compile={args.compile} optimizer={args.optimizer}: steps {timing.rate(1)} "
            f"({timing.wall_s * 1e3:.0f} ms/step, {blocks} blocks of {sizes.block_size} per step)")


def parse_setting(sizes: demo_training.Sizes, text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    current = getattr(sizes, name)  # AttributeError names a size that does not exist
    if isinstance(current, tuple):
        return name, tuple(int(v) for v in value.split(","))
    return name, type(current)(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("target", "continuations", "dflash"))
    parser.add_argument("--sizes", choices=("full", "smoke"), default="full")
    parser.add_argument("--precision", choices=demo_training.PRECISIONS, default="bf16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model's forward (inductor)")
    parser.add_argument("--optimizer", choices=demo_training.ADAMW_IMPLS, default="foreach")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa", help="target: attention kernel")
    parser.add_argument("--batch", type=int, default=0, help="target: sequences per step (default: the sizes')")
    parser.add_argument("--context", type=int, default=0, help="target: tokens per sequence (default: the sizes')")
    parser.add_argument("--gen-batch", type=int, default=0, help="continuations: prompts decoded together")
    parser.add_argument("--anchors", type=int, default=0, help="dflash: blocks per sequence (default: the sizes')")
    parser.add_argument("--dflash-batch", type=int, default=0, help="dflash: sequences per step")
    parser.add_argument("--set", action="append", default=[], metavar="SIZE=VALUE",
                        help="another size, e.g. --set hidden=384 --set target_layer_ids=1,4,7 (repeatable)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = dataclasses.replace(demo_training.FULL if args.sizes == "full" else demo_training.SMOKE,
                                threads=args.threads)
    if args.anchors:
        sizes = dataclasses.replace(sizes, dflash_anchors=args.anchors)
    if args.dflash_batch:
        sizes = dataclasses.replace(sizes, dflash_batch=args.dflash_batch)
    sizes = dataclasses.replace(sizes, **dict(parse_setting(sizes, text) for text in args.set))
    bench = {"target": bench_target, "continuations": bench_continuations, "dflash": bench_dflash}[args.stage]
    with tempfile.TemporaryDirectory(prefix="train-steps-") as tmp:
        demo_training.keep_temp_files_in(Path(tmp))  # compiled kernels leave nothing behind
        try:
            print(f"{bench(sizes, args)}  [{args.threads} threads, torch {torch.__version__}]", flush=True)
        finally:
            tempfile.tempdir = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
