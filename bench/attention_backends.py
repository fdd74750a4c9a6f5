"""What the CPU attention backend costs the demo target: target-only tokens/s and step time with the
torch backend (SDPA over gathered pages) and the native C kernels, eager and compiled, at several
concurrencies, the engines taking turns in one process (each row the median of `--repeat` runs),
and whether their greedy outputs agree. Usage:
  .venv/bin/python bench/attention_backends.py [--concurrency 1,8,16] [--compile] [--repeat 3]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import demo_pair_args, held_out_prompts  # noqa: E402
from bench.compare import engine_config, requests_for, run_engine  # noqa: E402
from bench.pools import pool_folder  # noqa: E402
from common.cpu_info import read_cpu_info  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402

BACKENDS = ("torch", "native")


def main(argv: list[str] | None = None) -> int:
    parser = demo_pair_args(__doc__, prompts=8, new_tokens=64, threads=None)
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--compile", action="store_true", help="both engines with the compiled forward")
    args = parser.parse_args(argv)
    prompts = held_out_prompts(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"{read_cpu_info().describe()}; the demo target alone, {'compiled' if args.compile else 'eager'} forward, "
          f"{len(prompts)} held-out prompts, {args.new_tokens} new tokens, median of {args.repeat}\n")
    print("| concurrency | torch tok/s | torch step ms | native tok/s | native step ms | native / torch | same greedy |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(dir=pool_folder(), prefix="splitspec-attention-") as shm:
        cores = {}
        for name in BACKENDS:
            config = dataclasses.replace(engine_config(args.models, shm, args.k, compile_steps=args.compile),
                                         attention_backend=name)
            cores[name] = build_engine_core(config)
            cores[name].warmup()
        for concurrency in levels:
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in BACKENDS}
            outputs: dict[str, dict[int, list[int]]] = {}
            for _ in range(args.repeat):
                for name, core in cores.items():
                    outputs[name] = {}
                    tokens, seconds, steps, *_ = run_engine(core, requests_for(prompts, concurrency), args.new_tokens,
                                                            concurrency, speculate=False, outputs=outputs[name])
                    runs[name].append((tokens / seconds, seconds / steps * 1e3))
            rate = {name: statistics.median(r[0] for r in runs[name]) for name in BACKENDS}
            step = {name: statistics.median(r[1] for r in runs[name]) for name in BACKENDS}
            same = outputs["torch"] == outputs["native"]
            print(f"| {concurrency} | {rate['torch']:.1f} | {step['torch']:.2f} | {rate['native']:.1f} | "
                  f"{step['native']:.2f} | {rate['native'] / rate['torch']:.2f} | {'yes' if same else 'NO'} |",
                  flush=True)
        for core in cores.values():
            core.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
