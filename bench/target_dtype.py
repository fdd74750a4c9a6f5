"""Why the target runs in float32 on a CPU (`--dtype auto`), measured: what bfloat16 would gain
in speed and what it would cost in losslessness.

For each dtype, one process builds the demo target alone and the target with the DFlash
drafter called in-process (the adaptive policy, as served), then:

- speed: target-only and speculative tokens/s at concurrency 1, the four engines taking
  turns `--repeat` times (medians), as ratios against float32 target-only;
- greedy identity: each held-out prompt decoded target-only one at a time, target-only in
  batches of 8, and speculatively one at a time. Speculative decoding is lossless only if
  a token's logits do not depend on how many rows the forward that computed them had (a
  decode has 1 per sequence, a verify K+1, a batch more): the script counts the prompts
  whose output differs from target-only at concurrency 1, and where it first does.

  .venv/bin/python bench/target_dtype.py [--models demo] [--prompts 16] [--new-tokens 128]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import demo_pair_args, held_out_prompts  # noqa: E402
from bench.compare import engine_config, in_process_engine, run_engine  # noqa: E402
from bench.pools import pool_folder  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402
from target_service.engine_core import EngineCore  # noqa: E402

DTYPES = ("float32", "bfloat16")


def build_pair(models: Path, shm_dir: str, dtype: str, k: int) -> tuple[EngineCore, EngineCore]:
    """(target only, target + in-process DFlash) computing in `dtype`."""
    plain = build_engine_core(dataclasses.replace(engine_config(models, shm_dir, k), dtype=dtype))
    speculative = in_process_engine(models, shm_dir, k, "dflash", dtype=dtype)
    for core in (plain, speculative):
        core.warmup()
    return plain, speculative


def greedy(core: EngineCore, prompts: list[list[int]], new_tokens: int, concurrency: int) -> list[list[int]]:
    outputs: dict[int, list[int]] = {}
    run_engine(core, prompts, new_tokens, concurrency, outputs=outputs)
    return [outputs[i] for i in range(len(prompts))]


def divergence(reference: list[list[int]], other: list[list[int]]) -> str:
    """How many outputs differ from the reference, and the first differing token of each."""
    firsts = [next(j for j, (a, b) in enumerate(zip(ref, out)) if a != b)
              for ref, out in zip(reference, other) if ref != out]
    where = f" (first differing token: {', '.join(map(str, firsts))})" if firsts else ""
    return f"{len(firsts)}/{len(reference)} differ{where}"


def main(argv: list[str] | None = None) -> int:
    args = demo_pair_args(__doc__, prompts=16, new_tokens=128).parse_args(argv)
    prompts = held_out_prompts(args)
    with tempfile.TemporaryDirectory(dir=pool_folder()) as shm_dir:
        cores = {dtype: build_pair(args.models, shm_dir, dtype, args.k) for dtype in DTYPES}
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeat):
            for dtype, (plain, speculative) in cores.items():
                for name, core in (("target only", plain), ("+ dflash", speculative)):
                    tokens, seconds, *_ = run_engine(core, prompts, args.new_tokens, 1)
                    rates.setdefault((dtype, name), []).append(tokens / seconds)
        base = statistics.median(rates[("float32", "target only")])
        print(f"concurrency 1, {args.prompts} prompts x {args.new_tokens} tokens, median of {args.repeat}, "
              f"{args.threads} thread(s); tokens/s (x float32 target only)")
        for (dtype, name), values in rates.items():
            rate = statistics.median(values)
            print(f"  {dtype:9s} {name:12s} {rate:7.1f}  ({rate / base:.2f}x)")
        print("greedy outputs against target only at concurrency 1")
        for dtype, (plain, speculative) in cores.items():
            reference = greedy(plain, prompts, args.new_tokens, 1)
            print(f"  {dtype:9s} target only, concurrency 8: "
                  f"{divergence(reference, greedy(plain, prompts, args.new_tokens, 8))}")
            print(f"  {dtype:9s} + dflash, concurrency 1:    "
                  f"{divergence(reference, greedy(speculative, prompts, args.new_tokens, 1))}")
        for plain, speculative in cores.values():
            plain.close()
            speculative.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
