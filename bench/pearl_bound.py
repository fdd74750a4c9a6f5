"""How much PEARL-style drafting during the verify could save, measured before building it.

PEARL (Liu et al. 2024) lets the drafter draft block n+1 while the target verifies block
n, assuming block n is accepted in full. The work pays only on steps where every one of
the K drafts is accepted *and* the drafter's guess for the next position equals the
token the target emits there (the bonus token); then the next step needs no `Propose`
wait. So the saving is at most

    P(all K accepted and the bonus guessed) x (time in Propose / decode time)

of the decode time, and it is zero for DFlash, whose drafts for block n+1 are computed
from the target's hidden states of block n, which exist only after that verify.

This drives the engine in-process at a fixed K (every step drafts), with the drafter
called directly, on the demo pair and the held-out prompts, and prints per drafter the
fraction of drafted steps whose K drafts were all accepted (from
`splitspec_spec_decode_num_accepted_tokens_per_pos`), the mean Propose and step times,
and the bound above (taking the bonus guess as always right, so an overestimate; a
request's last step may ask fewer than K drafts and then counts as not all accepted: at
most one drafted step per request).

  .venv/bin/python bench/pearl_bound.py [--models demo] [--prompts 8] [--new-tokens 64] [-k 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.compare import in_process_engine, load_held_out, run_engine  # noqa: E402
from bench.pools import pool_folder  # noqa: E402


def counter(registry, name: str, labels: dict[str, str] | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


def counters(registry, k: int) -> tuple[float, float, float, float]:
    """Drafted steps, steps with all k accepted, Propose seconds and Proposes, so far."""
    return (counter(registry, "splitspec_spec_decode_num_drafts_total"),
            counter(registry, "splitspec_spec_decode_num_accepted_tokens_per_pos_total", {"position": str(k - 1)}),
            counter(registry, "splitspec_drafter_propose_latency_seconds_sum"),
            counter(registry, "splitspec_drafter_propose_latency_seconds_count"))


def measure(models: Path, kind: str, prompts: list[list[int]], new_tokens: int, k: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=pool_folder()) as shm_dir:
        core = in_process_engine(models, shm_dir, k, kind, "fixed")
        try:
            core.warmup()
            run_engine(core, prompts, new_tokens, 1)  # every step shape once: their compiles are not measured
            core.runner.forward.wait_ready()
            before = counters(core.metrics.registry, k)
            tokens, seconds, steps, drafts, accepted = run_engine(core, prompts, new_tokens, 1)
            num_drafts, all_accepted, propose_s, proposes = (
                now - then for now, then in zip(counters(core.metrics.registry, k), before, strict=True))
        finally:
            core.close()
    all_fraction = all_accepted / num_drafts if num_drafts else 0.0
    propose_ms = 1e3 * propose_s / proposes if proposes else 0.0
    step_ms = 1e3 * seconds / steps
    return {"tokens": tokens, "drafted steps": num_drafts, "accepted per drafted step": accepted / max(1, drafts),
            "all K accepted": all_fraction, "propose ms": propose_ms, "step ms": step_ms,
            "bound": all_fraction * propose_s / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=REPO / "demo")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, prompts = load_held_out(args.models, args.prompts)
    print(f"fixed K={args.k}, {len(prompts)} held-out prompts x {args.new_tokens} tokens, concurrency 1, "
          f"drafter in-process\n")
    print("| drafter | accepted drafts per drafted step | steps with all K accepted | Propose ms | step ms "
          "| PEARL post-verify saving, at most |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in ("draft_model", "dflash"):
        m = measure(args.models, kind, prompts, args.new_tokens, args.k)
        bound = "0 (needs the verify's hidden states)" if kind == "dflash" else f"{m['bound']:.1%}"
        print(f"| {kind} | {m['accepted per drafted step']:.2f} | {m['all K accepted']:.1%} | {m['propose ms']:.2f} "
              f"| {m['step ms']:.2f} | {bound} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
