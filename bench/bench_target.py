"""Target engine benchmark: transformers `generate` vs our engine, side by side in one run.

Builds one random Qwen3 checkpoint, then measures on the same prompts:
  1. transformers `generate` (greedy, batch 1)
  2. our engine at batch 1
  3. our engine's aggregate output tokens/s at concurrency 1, 4 and 16
and prints a markdown table with ratios. Usage:
  .venv/bin/python bench/bench_target.py [--hidden-size 256] [--layers 4] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import run_engine  # noqa: E402
from bench.pools import pool_folder  # noqa: E402
from common.kv_layout import CacheConfig  # noqa: E402
from splitspec.tiny_models import PROMPTS, make_qwen3  # noqa: E402
from target_service.config import EngineConfig  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402


def bench_transformers(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generated, start = 0, time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False)
            generated += out.shape[1] - len(ids)
    return generated / (time.perf_counter() - start)


def bench_engine(core, prompts: list[list[int]], new_tokens: int, concurrency: int) -> float:
    """Aggregate output tokens/s with `concurrency` requests in flight at all times."""
    tokens, seconds, *_ = run_engine(core, prompts, new_tokens, concurrency)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=pool_folder()) as tmp:
        model_dir = make_qwen3(Path(tmp) / "model", hidden_size=args.hidden_size,
                               intermediate_size=3 * args.hidden_size, num_hidden_layers=args.layers,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden_size // 8)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok.encode(p) for p in (PROMPTS * 4)[: args.prompts]]
        hf = bench_transformers(model_dir, prompts[:4], args.new_tokens)
        cache = CacheConfig(cache_dtype="float32", shm_dir=tmp)
        core = build_engine_core(EngineConfig(model=str(model_dir), cache=cache, max_num_seqs=16))
        core.warmup()
        rates = {c: bench_engine(core, prompts if c > 1 else prompts[:4], args.new_tokens, c) for c in (1, 4, 16)}
        core.close()

    print(f"\nTarget engine, random Qwen3 (hidden {args.hidden_size}, {args.layers} layers), float32, "
          f"{args.new_tokens} new tokens/request — {date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}\n")
    print("| run | output tok/s | vs transformers | vs engine c=1 |")
    print("|---|---:|---:|---:|")
    print(f"| transformers generate, batch 1 | {hf:.1f} | 1.00 | {hf / rates[1]:.2f} |")
    for c, r in rates.items():
        print(f"| splitspec engine, concurrency {c} | {r:.1f} | {r / hf:.2f} | {r / rates[1]:.2f} |")


if __name__ == "__main__":
    main()
