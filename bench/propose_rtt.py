"""The internal channel's floor: the round trip of an empty `Propose` to a drafter process.

Starts an ngram drafter (no model, so nothing but transport is timed), handshakes a
target engine core with it, and times empty `Propose` calls back to back and after idle
gaps like the target's forward between two steps: the gap shows what waking idle threads
costs on this machine. Usage:
  python bench/propose_rtt.py [--calls 300] [--gaps-ms 0,1,5]
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.compare import DrafterProcess, engine_config  # noqa: E402
from bench.pools import pool_folder  # noqa: E402
from splitspec.v1 import drafter_pb2 as dpb  # noqa: E402
from target_service.engine import build_engine_core  # noqa: E402


def time_calls(call, calls: int, gap_s: float) -> list[float]:
    """Seconds of each call, each after `gap_s` of sleep."""
    seconds = []
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=REPO / "demo", help="folder with target/")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--gaps-ms", default="0,1,5", help="idle time before each call")
    args = parser.parse_args(argv)
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(dir=pool_folder()) as tmp:
        drafter = DrafterProcess("ngram", args.models, token, Path(tmp) / "ngram.log", tmp)
        try:
            core = build_engine_core(engine_config(args.models, tmp, k=8, drafter=drafter.address, token=token))
            if not core.link.ready:
                raise RuntimeError(f"the drafter did not handshake: {core.link.detail}")
            link, layout = core.link, core.layout

            def empty_propose():
                return link.propose(dpb.ProposeRequest(target_id=layout.target_id, epoch=layout.epoch))

            time_calls(empty_propose, 50, 0.0)  # connection and caches warm
            print("| idle before each call | median µs | p90 µs |\n|---:|---:|---:|")
            for gap in gaps:
                seconds = sorted(time_calls(empty_propose, args.calls, gap))
                median, p90 = seconds[len(seconds) // 2], seconds[int(len(seconds) * 0.9)]
                print(f"| {gap * 1e3:g} ms | {median * 1e6:.0f} | {p90 * 1e6:.0f} |")
            core.close()
        finally:
            drafter.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
