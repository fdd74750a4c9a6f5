"""`splitspec bench`: a gRPC load generator for any running splitspec stack.

Prompts come from the demo's held-out modules or a JSONL file (`{"prompt": ...}` per
line). Load is a fixed concurrency (one or several levels) or an open-loop Poisson
request rate. The report has requests/s, output tokens/s, TTFT / inter-token / end-to-end
latency percentiles, the mean acceptance length and per-position acceptance, as JSON,
a markdown table, and optionally a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from splitspec.channel import open_aio_channel
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # n observations of interval/n per chunk
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class LevelReport:
    """One load level (a concurrency or a request rate)."""

    label: str
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None  # tokens per verify step, bonus included
    acceptance_per_position: list[float]  # P(draft token i accepted | a draft was verified)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    ordered = sorted(values)
    return {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in PERCENTILES}


def summarize(label: str, results: list[RequestResult], duration_s: float, concurrency: int | None,
              request_rate: float | None) -> LevelReport:
    done = [r for r in results if r.ok]
    drafts = sum(r.num_drafts for r in done)
    drafted = sum(r.draft_tokens for r in done)
    accepted = sum(r.accepted_tokens for r in done)
    depth = max((len(r.accepted_per_position) for r in done), default=0)
    per_pos = [sum(r.accepted_per_position[i] for r in done if i < len(r.accepted_per_position))
               for i in range(depth)]
    output = sum(r.output_tokens for r in done)
    return LevelReport(
        label=label, concurrency=concurrency, request_rate=request_rate, num_requests=len(results),
        failed=len(results) - len(done), duration_s=duration_s,
        requests_per_s=len(done) / duration_s if duration_s else 0.0,
        output_tokens_per_s=output / duration_s if duration_s else 0.0,
        prompt_tokens=sum(r.prompt_tokens for r in done), output_tokens=output,
        ttft_s=percentiles([r.ttft_s for r in done]),
        itl_s=percentiles([x for r in done for x in r.itl_s]),
        e2e_s=percentiles([r.e2e_s for r in done]),
        num_drafts=drafts, draft_tokens=drafted, accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        acceptance_per_position=[n / drafts for n in per_pos] if drafts else [],
    )


async def run_request(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    previous = None
    try:
        async for response in stub.Generate(request, timeout=timeout):
            now = time.perf_counter()
            if response.HasField("chunk") and response.chunk.token_ids:
                n = len(response.chunk.token_ids)
                if previous is None:
                    result.ttft_s = now - start
                else:  # as the server's metric: n tokens in one step are n intervals of interval/n
                    result.itl_s.extend([(now - previous) / n] * n)
                previous = now
                result.output_tokens += n
            elif response.HasField("complete"):
                usage = response.complete.usage
                result.ok = True
                result.e2e_s = now - start
                result.prompt_tokens = usage.prompt_tokens
                result.num_drafts, result.draft_tokens = usage.num_drafts, usage.draft_tokens
                result.accepted_tokens = usage.accepted_tokens
                result.accepted_per_position = list(usage.accepted_per_position)
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    return result


def build_request(prompt: str, args: argparse.Namespace, index: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text=prompt)
    request.stop.max_tokens = args.max_tokens
    request.stop.ignore_eos = args.ignore_eos
    request.sampling.temperature = args.temperature
    if args.temperature > 0:
        request.sampling.seed = args.seed + index
    request.speculation.disable = args.no_speculation
    if args.top_logprobs is not None:
        request.logprobs.completion, request.logprobs.top = True, args.top_logprobs
    return request


async def run_level(address: str, prompts: list[str], args: argparse.Namespace, concurrency: int | None,
                    rate: float | None, progress) -> tuple[list[RequestResult], float]:
    requests = [build_request(prompts[i % len(prompts)], args, i) for i in range(args.num_requests)]
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with open_aio_channel(address, args.tls_ca, options) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()
        if rate is None:
            results = await _closed_loop(stub, requests, concurrency or 1, args.timeout, progress)
        else:
            results = await _open_loop(stub, requests, rate, args.seed, args.timeout, progress)
        return results, time.perf_counter() - start


async def _closed_loop(stub, requests, concurrency: int, timeout: float, progress) -> list[RequestResult]:
    queue = list(enumerate(requests))
    results: list[RequestResult | None] = [None] * len(requests)

    async def worker() -> None:
        while queue:
            i, request = queue.pop(0)
            results[i] = await run_request(stub, request, timeout)
            progress.update(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results  # type: ignore[return-value]


async def _open_loop(stub, requests, rate: float, seed: int, timeout: float, progress) -> list[RequestResult]:
    rng = random.Random(seed)

    async def one(request):
        result = await run_request(stub, request, timeout)
        progress.update(1)
        return result

    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def load_prompts(source: str, num: int) -> list[str]:
    if source == "heldout":
        from splitspec.heldout import held_out_prompts

        prompts = held_out_prompts(num)
    else:
        lines = Path(source).read_text().splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {source}")
    return prompts


def markdown(levels: list[LevelReport]) -> str:
    head = ("| load | req/s | out tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 s "
            "| accept rate | accept len | failed |")
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in levels:
        ms = lambda d: "/".join(f"{d[f'p{p}'] * 1e3:.1f}" for p in PERCENTILES)  # noqa: E731
        s = "/".join(f"{r.e2e_s[f'p{p}']:.2f}" for p in PERCENTILES)
        rate = f"{r.acceptance_rate:.2f}" if r.acceptance_rate is not None else "-"
        length = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
        rows.append(f"| {r.label} | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | {ms(r.ttft_s)} "
                    f"| {ms(r.itl_s)} | {s} | {rate} | {length} | {r.failed} |")
    per_pos = [r for r in levels if r.acceptance_per_position]
    if per_pos:
        depth = max(len(r.acceptance_per_position) for r in per_pos)
        rows += ["", "| load | " + " | ".join(f"pos {i}" for i in range(depth)) + " |",
                 "|---|" + "---:|" * depth]
        for r in per_pos:
            cells = [f"{x:.2f}" for x in r.acceptance_per_position] + ["-"] * (depth - len(r.acceptance_per_position))
            rows.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def plot(levels: list[LevelReport], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, acc) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r.concurrency or r.request_rate for r in levels]
    lat.plot(xs, [r.ttft_s["p50"] * 1e3 for r in levels], "o-", label="TTFT p50 (ms)")
    lat.plot(xs, [r.itl_s["p50"] * 1e3 for r in levels], "s-", label="ITL p50 (ms)")
    lat.set_xlabel("concurrency" if levels[0].concurrency else "request rate (req/s)")
    lat.set_ylabel("latency (ms)")
    twin = lat.twinx()
    twin.plot(xs, [r.output_tokens_per_s for r in levels], "^--", color="tab:green", label="output tok/s")
    twin.set_ylabel("output tokens/s")
    lat.legend(loc="upper left")
    twin.legend(loc="lower right")
    lat.set_title("latency and throughput")
    for r in levels:
        if r.acceptance_per_position:
            acc.plot(range(len(r.acceptance_per_position)), r.acceptance_per_position, "o-", label=r.label)
    acc.set_xlabel("draft position")
    acc.set_ylabel("P(accepted)")
    acc.set_ylim(0, 1.05)
    acc.set_title("acceptance per position")
    if acc.lines:
        acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="load-test a running stack and report latency, throughput, acceptance",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051", help="the target's gRPC address")
    p.add_argument("--tls-ca", default=None, help="CA certificate (PEM) when the target serves TLS")
    p.add_argument("--prompts", default="heldout", help="'heldout' (demo held-out modules) or a JSONL file")
    p.add_argument("--num-requests", type=int, default=32, help="requests per load level")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1", help="comma-separated concurrency levels, e.g. 1,4,16")
    load.add_argument("--request-rate", type=float, default=None, help="open-loop Poisson arrivals (req/s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seeds are seed + request index")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens tokens")
    p.add_argument("--no-speculation", action="store_true", help="ask the target not to speculate")
    p.add_argument("--top-logprobs", type=int, default=None, metavar="N",
                   help="ask for every output token's logprob and its N most likely alternatives (0..20)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--markdown", default=None, help="write the markdown table here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.num_requests <= 0 or args.max_tokens <= 0:
        print("--num-requests and --max-tokens must be positive", file=sys.stderr)
        return 2
    prompts = load_prompts(args.prompts, args.num_requests)
    plan = ([(f"rate {args.request_rate:g}/s", None, args.request_rate)] if args.request_rate is not None else
            [(f"concurrency {c}", int(c), None) for c in args.concurrency.split(",")])
    levels = []
    for label, concurrency, rate in plan:
        with tqdm(total=args.num_requests, desc=label, disable=args.no_progress, file=sys.stderr) as progress:
            results, duration = asyncio.run(run_level(args.target, prompts, args, concurrency, rate, progress))
        levels.append(summarize(label, results, duration, concurrency, rate))
        for r in results:
            if not r.ok:
                print(f"request failed: {r.error}", file=sys.stderr)
    table = markdown(levels)
    print(table)
    report = {"target": args.target, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "levels": [asdict(level) for level in levels]}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.plot:
        plot(levels, args.plot)
    return 1 if any(level.failed for level in levels) else 0
