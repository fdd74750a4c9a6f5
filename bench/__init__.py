"""Benchmarks, each run as a script from the repository root (`.venv/bin/python bench/<name>.py`).
What the ones that drive the demo pair's engine in this process share: their arguments
(`demo_pair_args`, `held_out_prompts`) and a run of one request at a time (`one_at_a_time`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def demo_pair_args(description: str, *, prompts: int, new_tokens: int,
                   threads: int | None = 1) -> argparse.ArgumentParser:
    """--models (the demo pair's folder), --prompts (held-out ones), --new-tokens, --k, --repeat
    (the rows take turns; medians) and --threads (torch's; None: torch's default)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=REPO / "demo")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--k", type=int, default=8, help="draft tokens per step")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row, taking turns; medians")
    parser.add_argument("--threads", type=int, default=threads, help="torch threads (default: %(default)s)")
    return parser


def held_out_prompts(args: argparse.Namespace) -> list[list[int]]:
    """Sets torch's threads to --threads (when given); the --prompts held-out prompts as token ids."""
    import torch

    from bench.compare import load_held_out

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return load_held_out(args.models, args.prompts)[1]


def one_at_a_time(core, prompts: list[list[int]], new_tokens: int, **request) -> tuple[int, float, list]:
    """Each prompt alone (concurrency 1) for up to `new_tokens` tokens (EOS ignored), `request`
    adding EngineRequest fields; (tokens, seconds, each request's final usage)."""
    from target_service.api_types import EngineRequest, StopParams

    tokens, usages = 0, []
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        rid = f"r{i}-{time.monotonic_ns()}"
        core.add(EngineRequest(rid, tuple(ids), stop=StopParams(max_tokens=new_tokens, ignore_eos=True), **request))
        while core.in_flight(rid):
            for out in core.step():
                tokens += len(out.token_ids)
                if out.finish_reason is not None:
                    usages.append(out.usage)
    return tokens, time.perf_counter() - started, usages
