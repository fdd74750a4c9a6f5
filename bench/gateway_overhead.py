"""What splitspec-gateway costs: output tokens/s through the gateway (OpenAI streaming
completions over HTTP) against straight gRPC to the same target, in one run.

Starts a target (target only: no drafter, so nothing but the gateway differs) and a
gateway in front of it, then alternates rounds of the same closed-loop load (the same
held-out prompts, greedy, `max_tokens` each with ignore_eos) over gRPC (the load
generator of `splitspec bench`) and over the gateway (httpx, SSE parsed line by line),
and reports the median of each. `--profile` records the gateway with py-spy during one
extra gateway round and prints its hottest frames. Usage:
  .venv/bin/python bench/gateway_overhead.py [--model demo/target] [--concurrency 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx2  # noqa: E402

from splitspec import bench  # noqa: E402
from splitspec.up import Stack, child_env, free_port, wait_http_ok, wait_serving  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_ids(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def client_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class NoProgress:
    def update(self, n: int) -> None:
        pass


def grpc_round(address: str, prompts: list[str], args) -> tuple[int, float]:
    """(output tokens, seconds) of one closed-loop round over gRPC."""
    load = SimpleNamespace(num_requests=args.num_requests, max_tokens=args.max_tokens, ignore_eos=True,
                           temperature=0.0, seed=0, no_speculation=False, tls_ca=None, timeout=600.0)
    results, seconds = asyncio.run(bench.run_level(address, prompts, load, args.concurrency, None, NoProgress()))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"gRPC requests failed: {failed[:3]}")
    return sum(r.output_tokens for r in results), seconds


async def _stream_completion(http: httpx2.AsyncClient, url: str, body: dict) -> int:
    """One streaming completion; its completion tokens (from the usage chunk)."""
    tokens = None
    async with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {await reply.aread()!r}")
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    if tokens is None:
        raise RuntimeError("the stream had no usage chunk")
    return tokens


def gateway_round(base: str, model: str, prompts: list[str], args) -> tuple[int, float]:
    """(output tokens, seconds) of one closed-loop round through the gateway."""
    async def run() -> tuple[int, float]:
        queue = list(range(args.num_requests))
        tokens: list[int] = []
        limits = httpx2.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
        async with httpx2.AsyncClient(timeout=600, limits=limits) as http:
            async def worker() -> None:
                while queue:
                    i = queue.pop(0)
                    body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": args.max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
                    tokens.append(await _stream_completion(http, f"{base}/v1/completions", body))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return sum(tokens), time.perf_counter() - start

    return asyncio.run(run())


def profile_gateway(pid: int, seconds: float, out: Path) -> list[tuple[str, int]]:
    """py-spy samples of the gateway for `seconds` (run while it is loaded); the top frames."""
    py_spy = Path(sys.executable).parent / "py-spy"
    subprocess.run([str(py_spy), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--format", "raw",
                    "--rate", "250", "--output", str(out)], check=True, capture_output=True)
    own = Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        if "select (selectors.py" not in leaf:  # the event loop waiting: idle
            own[leaf] += int(count)  # self time of the innermost frame
    return own.most_common(15)


def report(rates: dict[str, list[float]], args) -> str:
    """Median and best of each path, and the median of the per-round ratios: on a shared
    machine a burst of other work slows single rounds; pairs and the best runs resist it."""
    ratios = [g / c for g, c in zip(rates["gateway"], rates["grpc"])]
    ratio = statistics.median(ratios)
    best = max(rates["gateway"]) / max(rates["grpc"])
    lines = [f"\nconcurrency {args.concurrency}, {args.num_requests} requests x {args.max_tokens} tokens, "
             f"{args.rounds} rounds of each path:",
             "| path | median tok/s | best tok/s |", "|---|---:|---:|"]
    for kind, label in (("grpc", "gRPC (splitspec bench's load generator)"),
                        ("gateway", "OpenAI streaming completions through splitspec-gateway")):
        lines.append(f"| {label} | {statistics.median(rates[kind]):.1f} | {max(rates[kind]):.1f} |")
    overhead = 1 - ratio
    lines += [f"gateway / gRPC: median of the round ratios {ratio:.3f}, best / best {best:.3f}",
              f"gateway overhead: {overhead * 100:.1f}% ({'met' if overhead <= 0.05 else 'MISSED'}; aim <= 5%)"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "demo/target", help="target checkpoint folder")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64, help="requests per round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind (alternating)")
    p.add_argument("--target-threads", type=int, default=None,
                   help="the target's torch CPU threads (default: torch's, one per core)")
    p.add_argument("--pin", action="store_true",
                   help="pin the target to CPU 0 and the gateway and this client to CPU 1 (the gateway on CPUs of its own, "
                        "as in a deployment; use with --target-threads 1)")
    p.add_argument("--profile", type=Path, default=None, help="folder for a py-spy profile of the gateway")
    args = p.parse_args()

    prompts = bench.load_prompts("heldout", args.num_requests)
    stack = Stack(echo=False)
    env = child_env()
    deadline = time.monotonic() + 600
    port, gateway_port = free_port(), free_port()
    address, base = f"127.0.0.1:{port}", f"http://127.0.0.1:{gateway_port}"
    target = stack.start("target", "target_service.cli",
                         ["--model", str(args.model), "--port", str(port), "--max-num-seqs", str(args.concurrency),
                          "--metrics-port", "0", "--log-level", "warning",
                          *(["--threads", str(args.target_threads)] if args.target_threads else [])], env)
    try:
        wait_serving(target, address, deadline)
        gateway = stack.start("gateway", "splitspec.gateway.cli",
                              ["--target", address, "--port", str(gateway_port), "--served-model-name", "m",
                               "--log-level", "warning"], env)
        wait_http_ok(gateway, f"{base}/health", deadline)
        if args.pin:
            for pid in [target.proc.pid, *thread_ids(target.proc.pid)]:
                os.sched_setaffinity(pid, {0})
            for pid in [gateway.proc.pid, *thread_ids(gateway.proc.pid), 0, *thread_ids(os.getpid())]:
                os.sched_setaffinity(pid, {1})
        grpc_round(address, prompts[:args.concurrency], argparse.Namespace(**{**vars(args), "num_requests":
                                                                             args.concurrency}))  # warm-up
        gateway_round(base, "m", prompts[:args.concurrency], argparse.Namespace(**{**vars(args), "num_requests":
                                                                                  args.concurrency}))
        rates = {"grpc": [], "gateway": []}
        cpu = {(kind, who): 0.0 for kind in rates for who in ("target", "gateway", "client")}
        tokens_of = dict.fromkeys(rates, 0)
        for r in range(args.rounds):  # a pair per round, its order alternating
            for kind in ("grpc", "gateway") if r % 2 == 0 else ("gateway", "grpc"):
                before = (cpu_seconds(target.proc.pid), cpu_seconds(gateway.proc.pid), client_cpu_seconds())
                tokens, seconds = (grpc_round(address, prompts, args) if kind == "grpc" else
                                   gateway_round(base, "m", prompts, args))
                after = (cpu_seconds(target.proc.pid), cpu_seconds(gateway.proc.pid), client_cpu_seconds())
                for who, b, a in zip(("target", "gateway", "client"), before, after):
                    cpu[kind, who] += a - b
                tokens_of[kind] += tokens
                rates[kind].append(tokens / seconds)
                print(f"round {r + 1} {kind:8s} {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tok/s",
                      flush=True)
        print(report(rates, args))
        print("\nCPU seconds per 1000 output tokens (from /proc; load on other processes does not change them):")
        print("| path | target | gateway | client |\n|---|---:|---:|---:|")
        for kind in rates:
            per_k = [1000 * cpu[kind, who] / tokens_of[kind] for who in ("target", "gateway", "client")]
            print(f"| {kind} | " + " | ".join(f"{v:.3f}" for v in per_k) + " |")
        share = cpu["gateway", "gateway"] / (cpu["gateway", "gateway"] + cpu["gateway", "target"])
        print(f"the gateway's share of the server-side CPU through the gateway: {share * 100:.1f}%")
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            out = args.profile / "gateway.pyspy.txt"
            import threading

            result = {}
            thread = threading.Thread(target=lambda: result.update(top=profile_gateway(gateway.proc.pid, 8, out)))
            thread.start()
            while thread.is_alive():
                gateway_round(base, "m", prompts, args)
            thread.join()
            print(f"\npy-spy, the gateway's hottest frames (self samples, the event loop's idle wait left out; "
                  f"raw profile in {out}):")
            for frame, count in result["top"]:
                print(f"  {count:6d}  {frame}")
        return 0
    finally:
        stack.stop(30)


if __name__ == "__main__":
    sys.exit(main())
