"""What output options cost: tokens/s of the demo pair with logprobs (top 5) and with logit
shaping (repetition and frequency penalties) against plain decoding, speculation on (DFlash, in
this process) and off, on the same held-out prompts, rows interleaved and each the median of
`--repeat` runs. Usage:
  .venv/bin/python bench/options_cost.py [--models demo] [--prompts 4] [--new-tokens 64] [--repeat 3]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import demo_pair_args, held_out_prompts, one_at_a_time  # noqa: E402
from bench.compare import in_process_engine  # noqa: E402
from bench.pools import pool_folder  # noqa: E402
from target_service.api_types import LogprobParams, SamplingParams, SpeculationParams  # noqa: E402
from target_service.engine_core import EngineCore  # noqa: E402

OPTIONS: dict[str, Callable[[], dict]] = {
    "plain": lambda: {},
    "logprobs (top 5)": lambda: {"logprobs": LogprobParams(completion=True, top=5)},
    "penalties": lambda: {"sampling": SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3)},
}


def run(core: EngineCore, prompts: list[list[int]], new_tokens: int, speculate: bool, options: dict) -> float:
    """Tokens/s over the prompts one at a time (concurrency 1)."""
    tokens, seconds, _ = one_at_a_time(core, prompts, new_tokens, speculation=SpeculationParams(disable=not speculate),
                                       **options)
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    args = demo_pair_args(__doc__, prompts=4, new_tokens=64, threads=None).parse_args(argv)
    prompts = held_out_prompts(args)
    with tempfile.TemporaryDirectory(dir=pool_folder(), prefix="splitspec-options-") as shm:
        core = in_process_engine(args.models, shm, args.k, kind="dflash")
        try:
            rows = [(name, speculate) for speculate in (True, False) for name in OPTIONS]
            run(core, prompts[:1], 8, True, {})  # warm
            rates: dict[tuple[str, bool], list[float]] = {row: [] for row in rows}
            for _ in range(args.repeat):
                for name, speculate in rows:
                    rates[(name, speculate)].append(run(core, prompts, args.new_tokens, speculate, OPTIONS[name]()))
        finally:
            core.close()
    print("| speculation | options | tokens/s | vs plain |")
    print("|---|---|---|---|")
    for name, speculate in rows:
        rate, base = statistics.median(rates[(name, speculate)]), statistics.median(rates[("plain", speculate)])
        print(f"| {'on (dflash)' if speculate else 'off'} | {name} | {rate:.1f} | {rate / base:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
