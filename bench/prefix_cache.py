"""Prefix caching on a chat-shaped workload: the cache on against off, side by side in one run.

Conversations (--conversations, 8, all at once: concurrency 8) share one system prompt
(--system-tokens, 1024); each runs --turns turns one after another, a turn's prompt being the
system prompt, every earlier user message with the answer the engine gave it, and a new
user message (--user-tokens); answers are 0.5-1.5x --new-tokens long, drawn per turn, so the
conversations drift apart as chats do rather than prefilling in lockstep. Both engines are built and warmed up first, in this process,
on one random Qwen3 checkpoint; the runs then take turns (--repeats each, the cache emptied
before each run), and each figure is the median over the repeats.

Reported per engine: time to first token of the turns after the first (their history is
cached when the cache is on) and of first turns, output tokens/s and prompt+output tokens/s
over the whole run, and the prefix cache's hit rate; the outputs of the two engines must be
identical. Usage:
  .venv/bin/python bench/prefix_cache.py [--system-tokens 1024] [--turns 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.pools import pool_folder  # noqa: E402
from common.kv_layout import CacheConfig  # noqa: E402
from splitspec.tiny_models import make_qwen3  # noqa: E402
from target_service.api_types import EngineRequest, StopParams  # noqa: E402
from target_service.config import EngineConfig  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402
from target_service.engine_core import EngineCore  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 5, 500  # token ids the random prompts draw from (the tiny tokenizer's 512)


@dataclass
class Conversation:
    index: int
    user_messages: list[list[int]]
    answer_lengths: list[int]
    history: list[int] = field(default_factory=list)
    turn: int = 0
    request_id: str = ""
    added_at: float = 0.0
    answer: list[int] = field(default_factory=list)


@dataclass
class RunResult:
    seconds: float
    ttft_later: list[float]  # seconds, turns after the first
    ttft_first: list[float]
    output_tokens: int
    prompt_tokens: int
    hit_tokens: int
    answers: dict[tuple[int, int], list[int]]  # (conversation, turn) → generated tokens


@dataclass(frozen=True)
class Workload:
    system: list[int]
    users: list[list[list[int]]]  # per conversation, per turn: the user message
    answer_lengths: list[list[int]]  # per conversation, per turn: max_tokens


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    system = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.system_tokens)]
    users = [[[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.user_tokens)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    lengths = [[rng.randrange(max(1, args.new_tokens // 2), args.new_tokens * 3 // 2 + 1) for _ in range(args.turns)]
               for _ in range(args.conversations)]
    return Workload(system, users, lengths)


def run(core: EngineCore, workload: Workload, tag: str) -> RunResult:
    """Every conversation at once, each turn added the moment the previous one finishes."""
    core.page_manager.reset_prefix_cache()
    convs = [Conversation(i, messages, lengths, list(workload.system))
             for i, (messages, lengths) in enumerate(zip(workload.users, workload.answer_lengths))]
    by_request: dict[str, Conversation] = {}
    result = RunResult(0.0, [], [], 0, 0, 0, {})

    def start_turn(conv: Conversation) -> None:
        conv.history += conv.user_messages[conv.turn]
        conv.request_id = f"{tag}-c{conv.index}-t{conv.turn}"
        conv.answer = []
        by_request[conv.request_id] = conv
        conv.added_at = time.perf_counter()
        core.add(EngineRequest(conv.request_id, tuple(conv.history),
                               stop=StopParams(max_tokens=conv.answer_lengths[conv.turn], ignore_eos=True)))
        result.prompt_tokens += len(conv.history)

    started = time.perf_counter()
    for conv in convs:
        start_turn(conv)
    while core.has_work():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            conv = by_request[out.request_id]
            if not conv.answer and out.token_ids:
                (result.ttft_later if conv.turn else result.ttft_first).append(now - conv.added_at)
            conv.answer += out.token_ids
            result.output_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                result.hit_tokens += out.usage.cached_tokens
                result.answers[(conv.index, conv.turn)] = conv.answer
                conv.history += conv.answer
                conv.turn += 1
                if conv.turn < len(conv.user_messages):
                    start_turn(conv)
    result.seconds = time.perf_counter() - started
    return result


def build(model_dir: Path, shm_dir: str, prefix_caching: bool, args: argparse.Namespace) -> EngineCore:
    cache = CacheConfig(cache_dtype="float32", shm_dir=shm_dir, num_pages=args.num_pages)
    core = build_engine_core(EngineConfig(model=str(model_dir), cache=cache, max_num_seqs=args.conversations,
                                          max_num_batched_tokens=args.max_num_batched_tokens,
                                          enable_prefix_caching=prefix_caching))
    core.warmup()
    return core


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=32, help="an answer's mean length")
    parser.add_argument("--conversations", type=int, default=8, help="conversations at once (the concurrency)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workload = make_workload(args)
    max_len = args.system_tokens + args.turns * (args.user_tokens + 2 * args.new_tokens) + 64
    with tempfile.TemporaryDirectory(dir=pool_folder()) as tmp:
        model_dir = make_qwen3(Path(tmp) / "model", hidden_size=args.hidden_size,
                               intermediate_size=3 * args.hidden_size, num_hidden_layers=args.layers,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden_size // 8,
                               max_position_embeddings=max(4096, max_len))
        engines = {"cache off": build(model_dir, tmp, False, args), "cache on": build(model_dir, tmp, True, args)}
        results: dict[str, list[RunResult]] = {name: [] for name in engines}
        for repeat in range(args.repeats):
            for name, core in engines.items():  # the rows take turns: a drift of the machine hits both
                results[name].append(run(core, workload, f"{name[-3:].strip()}{repeat}"))
        for core in engines.values():
            core.close()

    identical = all(r.answers == results["cache off"][0].answers for runs in results.values() for r in runs)
    print(f"\nPrefix caching, chat-shaped: {args.conversations} conversations at once, a shared system prompt of "
          f"{args.system_tokens} tokens, {args.turns} turns of {args.user_tokens} user tokens and "
          f"{args.new_tokens // 2}-{args.new_tokens * 3 // 2} generated tokens; "
          f"random Qwen3 (hidden {args.hidden_size}, {args.layers} layers), "
          f"float32 — {date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; median of {args.repeats} runs each, taking turns\n")
    print("| run | TTFT, later turns p50 ms | mean ms | TTFT, first turns p50 ms | output tok/s | "
          "prompt+output tok/s | prefix hit rate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for name, runs in results.items():
        later = median([median(r.ttft_later) for r in runs])
        later_mean = median([statistics.fmean(r.ttft_later) for r in runs])
        first = median([median(r.ttft_first) for r in runs])
        out_rate = median([r.output_tokens / r.seconds for r in runs])
        total_rate = median([(r.prompt_tokens + r.output_tokens) / r.seconds for r in runs])
        hit_rate = median([r.hit_tokens / r.prompt_tokens for r in runs])
        summary[name] = (later, out_rate)
        print(f"| {name} | {1000 * later:.1f} | {1000 * later_mean:.1f} | {1000 * first:.1f} | {out_rate:.1f} | "
              f"{total_rate:.1f} | {hit_rate:.1%} |")
    speedup = summary["cache off"][0] / summary["cache on"][0]
    throughput = summary["cache on"][1] / summary["cache off"][1]
    print(f"\n- TTFT of a turn whose prefix is cached, off / on: {speedup:.1f}x "
          f"({'met' if speedup >= 5 else 'MISSED'}; goal >= 5x)")
    print(f"- output tokens/s, on / off: {throughput:.2f} ({'met' if throughput > 1 else 'MISSED'}; goal > 1)")
    print(f"- outputs identical with the cache on and off: {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
