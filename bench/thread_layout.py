"""Which thread layout serves fastest on this CPU: measured, for target-only and for the split.

On a CPU the target and the drafter take turns on the same cores, and torch's OpenMP
workers (libgomp) spin after every parallel region before they sleep (`GOMP_SPINCOUNT`,
300,000 spins by default). Spinning keeps a forward's ~100 ops from paying a wake-up each,
but a process's spinning workers take cores from the other process's turn. Each layout
runs in a fresh process (libgomp reads its environment once, when torch loads it): the
target on torch's default threads and the DFlash drafter on `--threads 1` or on every
core, under each spin count; row 4 (target only) and row 7 (the split) at concurrency 1,
as `bench/compare.py` measures them, medians of `--repeat` runs taking turns.

  .venv/bin/python bench/thread_layout.py [--spincounts default,10000] [--drafter-threads 1,2]

The default layout is the one that is fastest for target-only and not slower for the split
(a layout that slows target-only costs every step the policy leaves undrafted).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(models: Path, drafter_threads: int, repeat: int, prompts: int) -> dict:
    """Rows 4 and 7 in this process (its environment is the layout under test)."""
    sys.path.insert(0, str(REPO))
    import bench.compare as compare
    from bench.pools import pool_folder
    from target_service.engine import build_engine_core

    _, held_out = compare.load_held_out(models, prompts)
    requests = compare.requests_for(held_out, 1)
    with tempfile.TemporaryDirectory(dir=pool_folder()) as tmp:
        token = secrets.token_hex(16)
        target_only = build_engine_core(compare.engine_config(models, tmp, 8))
        target_only.warmup()
        drafter = compare.DrafterProcess("dflash", models, token, Path(tmp) / "dflash.log", tmp,
                                         extra_args=["--threads", str(drafter_threads)])
        split = build_engine_core(compare.engine_config(models, tmp, 8, drafter.address, token, "fixed"))
        try:
            if not split.link.ready:
                raise RuntimeError(f"the drafter did not handshake: {split.link.detail}")
            split.warmup()
            runs: dict[int, list] = {4: [], 7: []}
            for _ in range(repeat):
                runs[4].append(compare.measure_once(target_only, 4, "target only", requests, 64, 1))
                runs[7].append(compare.measure_once(split, 7, "split", requests, 64, 1, drafter.metrics_url))
        finally:
            target_only.close()
            split.close()
            drafter.stop()
    row4, row7 = (compare.median_of(runs[r], key=lambda res: res.seconds) for r in (4, 7))
    return {"row4_tok_s": row4.tokens_per_s, "decode_ms": row4.decode_ms, "row7_tok_s": row7.tokens_per_s,
            "verify_ms": row7.verify_ms, "drafter_ms": row7.drafter_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=REPO / "demo")
    parser.add_argument("--spincounts", default="default,10000", help="GOMP_SPINCOUNT values ('default': unset)")
    parser.add_argument("--drafter-threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # drafter threads, in a child
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.models, args.child, args.repeat, args.prompts)))
        return 0
    from common.cpu_info import read_cpu_info

    print(f"{read_cpu_info().describe()}; target on torch's default threads; rows 4 and 7 at concurrency 1, "
          f"{args.prompts} prompts x 64 tokens, K=8 fixed, medians of {args.repeat}")
    print("| GOMP_SPINCOUNT | drafter threads | row 4 tok/s | decode ms | row 7 tok/s | verify ms | in drafter ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spincount in args.spincounts.split(","):
        for threads in (int(t) for t in args.drafter_threads.split(",")):
            env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
            if spincount != "default":
                env["GOMP_SPINCOUNT"] = spincount
            child = [sys.executable, __file__, "--child", str(threads), "--models", str(args.models),
                     "--repeat", str(args.repeat), "--prompts", str(args.prompts)]
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True, cwd=REPO).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {spincount} | {threads} | {r['row4_tok_s']:.1f} | {r['decode_ms']:.2f} | {r['row7_tok_s']:.1f} "
                  f"| {r['verify_ms']:.2f} | {r['drafter_ms']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
