"""Measure the demo pair on the held-out standard-library modules; print a markdown table.

    .venv/bin/python scripts/eval_demo.py                  # demo/ (scripts/train_demo.py writes it)
    .venv/bin/python scripts/eval_demo.py --models DIR --max-tokens 64 --prompts-per-module 2

- **Perplexity** of the target on the held-out modules (`demo_training.HELD_OUT`, never
  trained on), with transformers, over non-overlapping windows of the model's context.
- **Mean acceptance length** per drafter at K (default 8), measured through the real
  stack: `splitspec up`'s own code path starts the target and the drafter as two
  processes (handshake, shared KV pages), and greedy requests report `Usage`. The
  figure is tokens per target forward during decoding, bonus included:
  Σ (completion_tokens − 1) / Σ (completion_tokens − 1 − accepted_tokens); every decode
  forward yields one target token plus the accepted drafts, and the first token comes
  from the prefill. "per drafted step" is (accepted + num_drafts) / num_drafts.

Prompts: in each held-out module, `--prompts-per-module` function definitions spread
over the file; a prompt is the source before and including the `def` line (at most
`--prompt-tokens` tokens), completed greedily for `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import demo_training  # noqa: E402  (the held-out list and the corpus rules)

DRAFTERS = ("dflash", "draft_model", "ngram")


CODE_PROMPTS = ("def fibonacci(n):", "def factorial(n):", "def is_prime(n):")


def load_target(target_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(target_dir),
            AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval())


@torch.no_grad()
def perplexities(tokenizer, model, files: list[Path], windows: list[int]) -> dict[int, tuple[float, int]]:
    """{window: (perplexity, tokens scored)} over non-overlapping windows of each length (≤ the model's context)."""
    documents = [tokenizer(demo_training.read_text(path)).input_ids + [tokenizer.eos_token_id] for path in files]
    context = model.config.max_position_embeddings
    return {w: demo_training.perplexity(model, documents, w) for w in windows if w <= context}


def first_function(text: str) -> str:
    """The first top-level `def` of `text` and its indented body, up to the next top-level line."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i][0].isspace()),
               len(lines))
    return "\n".join(lines[start:end]) + "\n"


def returns_a_value(source: str) -> bool:
    """Whether `source` parses as one function whose body has a `return <value>`."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    return len(functions) == 1 and any(isinstance(node, ast.Return) and node.value is not None
                                       for node in ast.walk(functions[0]))


@torch.no_grad()
def code_completions(tokenizer, model, prompts: tuple[str, ...], max_tokens: int) -> list[tuple[str, str, bool]]:
    """(prompt, greedy completion, whether prompt + completion holds a function returning a value)."""
    results = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        results.append((prompt, completion, returns_a_value(first_function(prompt + completion))))
    return results


def held_out_prompts(tokenizer, files: list[Path], per_module: int, prompt_tokens: int) -> list[str]:
    """`per_module` def lines spread over each file; the text before and through each."""
    prompts = []
    for path in files:
        lines = demo_training.read_text(path).splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i >= 5]
        if not defs:
            continue
        picks = sorted({defs[(j * len(defs)) // per_module] for j in range(per_module)})
        for i in picks:
            start = i
            while start > 0 and len(tokenizer("".join(lines[start - 1:i + 1])).input_ids) <= prompt_tokens:
                start -= 1
            prompts.append("".join(lines[start:i + 1]))
    return prompts


@dataclass
class Row:
    drafter: str
    requests: int
    completion_tokens: int
    accepted: int
    drafted: int
    num_drafts: int
    wall_s: float

    @property
    def acceptance_length(self) -> float:
        decoded = self.completion_tokens - self.requests
        return decoded / max(1, decoded - self.accepted)

    @property
    def per_drafted_step(self) -> float:
        return (self.accepted + self.num_drafts) / self.num_drafts if self.num_drafts else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


def up_args(models: Path, drafter: str, k: int) -> argparse.Namespace:
    """`splitspec up`'s own arguments (its parser, so they cannot drift from it): loopback,
    any free ports, no gateway, and the fixed policy (acceptance at K, every step)."""
    from splitspec.cli import build_parser

    return build_parser().parse_args([
        "up", "--drafter", drafter, "--models", str(models), "--port", "0", "--draft-port", "0", "--no-gateway",
        "--num-speculative-tokens", str(k), "--speculative-policy", "fixed", "--drafter-timeout-s", "30",
        "--startup-timeout", "600", "--log-level", "warning"])


def generate(address: str, prompt: str, max_tokens: int, k: int):
    import grpc

    from splitspec.v1 import generation_pb2 as pb
    from splitspec.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=max_tokens),
                                 speculation=pb.SpeculationParams(num_speculative_tokens=k))
    tokens, complete = [], None
    with grpc.insecure_channel(address) as channel:
        for response in pb_grpc.GenerationStub(channel).Generate(request, timeout=600):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
            else:
                complete = response.complete
    return tokens, complete


def measure(models: Path, drafter: str, prompts: list[str], max_tokens: int, k: int, concurrency: int) -> Row:
    from splitspec.up import Stack, bring_up

    stack = Stack(echo=False)
    try:
        address = bring_up(up_args(models, drafter, k), stack)
        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: generate(address, p, max_tokens, k), prompts))
        wall = time.monotonic() - started
    finally:
        stack.stop(20.0)
    usages = [complete.usage for _, complete in results]
    return Row(drafter, len(prompts), sum(u.completion_tokens for u in usages),
               sum(u.accepted_tokens for u in usages), sum(u.draft_tokens for u in usages),
               sum(u.num_drafts for u in usages), wall)


def table(rows: list[Row], k: int) -> str:
    lines = [f"| drafter | mean acceptance length (K={k}) | per drafted step | draft acceptance rate "
             "| completion tokens | tokens/s (2 CPU cores) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r.drafter == "none":
            lines.append(f"| none | 1.00 | – | – | {r.completion_tokens} | {r.completion_tokens / r.wall_s:.1f} |")
            continue
        lines.append(f"| {r.drafter} | **{r.acceptance_length:.2f}** | {r.per_drafted_step:.2f} | "
                     f"{r.acceptance_rate:.2f} | {r.completion_tokens} | {r.completion_tokens / r.wall_s:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=demo_training.DEFAULT_OUT)
    parser.add_argument("--drafters", default=",".join(DRAFTERS) + ",none",
                        help="comma-separated kinds to measure (none: the target alone, for tokens/s)")
    parser.add_argument("--k", type=int, default=8, help="draft tokens per step")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-module", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", default="512,2048",
                        help="perplexity windows, in tokens (those past the model's context are skipped)")
    parser.add_argument("--code-tokens", type=int, default=64, help="new tokens of each code prompt")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    files = demo_training.held_out_files()
    tokenizer, model = load_target(args.models / "target")
    ppl = perplexities(tokenizer, model, files, [int(w) for w in args.windows.split(",")])
    code = code_completions(tokenizer, model, CODE_PROMPTS, args.code_tokens)
    del model
    prompts = held_out_prompts(tokenizer, files, args.prompts_per_module, args.prompt_tokens)
    rows = [measure(args.models, kind, prompts, args.max_tokens, args.k, args.concurrency)
            for kind in args.drafters.split(",") if kind]
    print(f"Held-out modules: {', '.join(p.name for p in files)}\n")
    for window, (value, n_tokens) in ppl.items():
        print(f"Target perplexity on the held-out modules, {window}-token windows: **{value:.2f}** ({n_tokens} tokens)")
    print(f"\nGreedy completions ({args.code_tokens} new tokens), a function returning a value:\n")
    for prompt, completion, ok in code:
        print(f"- `{prompt}` {'yes' if ok else 'NO'}: {completion[:120]!r}")
    print()
    print(f"{len(prompts)} greedy prompts, {args.max_tokens} new tokens each, concurrency {args.concurrency}:\n")
    print(table(rows, args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
