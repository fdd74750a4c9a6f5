"""The gateway's memory under a hostile flood.

Starts a target (the demo target by default, `--max-waiting` small so a burst is partly
refused) and a gateway in front of it, and sends `--rounds` rounds of hostile HTTP: bodies
past the size limit (declared and chunked), 500,000-deep JSON, 300,000-id prompts, chats of
10,000 messages, wrong types in every field, 1,100 concurrent requests, streams cut at
random, and connections that send half a request and hang up. Reads the gateway's RSS
(VmRSS and RssAnon) before, after each phase of each round and after the flood has been
idle `--settle-s` seconds (the gateway gives freed heap back while busy: --trim-interval-s).
tests/test_gateway_memory.py runs it. Usage:
  .venv/bin/python bench/gateway_flood.py [--rounds 3] [--model demo/target] [--phases burst]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx2  # noqa: E402

from bench.pools import pool_folder  # noqa: E402
from splitspec.net import free_port  # noqa: E402
from splitspec.up import Stack, child_env, wait_http_ok, wait_serving  # noqa: E402

MODEL = "flood"


def rss_mib(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


def hostile_bodies(rng: random.Random) -> list[bytes | dict]:
    """One of each kind of hostile body."""
    base = {"model": MODEL, "prompt": "def f():", "max_tokens": 4}
    wrong = [{**base, key: value} for key in ("temperature", "top_p", "max_tokens", "stream", "stop", "seed", "n")
             for value in ("0", True, None, [], {}, 1e308, -1, "x" * 1000)]
    return [
        b'{"model": "m", "prompt": ' + b"[" * 500_000 + b"]" * 500_000 + b"}",
        json.dumps({**base, "prompt": [rng.randrange(1000, 4000) for _ in range(300_000)]}).encode(),
        json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}] * 10_000}).encode(),
        json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 100}] * 4000}).encode(),
        json.dumps({**base, "prompt": "x" * 1_900_000}).encode(),
        b"\xff\xfe not json at all" * 1000,
        *(json.dumps(body).encode() for body in wrong),
    ]


async def send_all(base: str, bodies: list[bytes], concurrency: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    limit = asyncio.Semaphore(concurrency)
    async with httpx2.AsyncClient(timeout=120, limits=httpx2.Limits(max_connections=concurrency)) as http:
        async def one(body: bytes) -> None:
            async with limit:
                try:
                    reply = await http.post(f"{base}/v1/completions", content=body,
                                            headers={"content-type": "application/json"})
                    statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
                except httpx2.HTTPError as exc:
                    statuses[-1] = statuses.get(-1, 0) + 1
                    del exc

        await asyncio.gather(*(one(b) for b in bodies))
    return statuses


async def oversized(base: str, count: int) -> None:
    async with httpx2.AsyncClient(timeout=60) as http:
        async def chunks():
            for _ in range(3 * 1024):
                yield b" " * 1024

        for _ in range(count):
            await http.post(f"{base}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            await http.post(f"{base}/v1/completions", content=b"x" * (3 << 20),
                            headers={"content-type": "application/json"})


async def burst(base: str, count: int) -> dict[int, int]:
    body = json.dumps({"model": MODEL, "prompt": "def f():", "max_tokens": 4, "temperature": 0}).encode()
    return await send_all(base, [body] * count, count)


async def cut_streams(base: str, count: int, rng: random.Random) -> None:
    body = {"model": MODEL, "prompt": "def f():", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def one(http: httpx2.AsyncClient) -> None:
        try:
            async with http.stream("POST", f"{base}/v1/completions", json=body) as reply:
                async for _ in reply.aiter_lines():
                    if rng.random() < 0.05:
                        return
        except httpx2.HTTPError:
            pass

    async with httpx2.AsyncClient(timeout=120, limits=httpx2.Limits(max_connections=count)) as http:
        await asyncio.gather(*(one(http) for _ in range(count)))


def half_requests(address: tuple[str, int], count: int) -> None:
    for i in range(count):
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"a\": " * (i % 3))


PHASES = ("hostile", "oversized", "burst", "cut", "half")


def flood(model: Path, rounds: int, phases: tuple[str, ...] = PHASES, settle_s: float = 5.0,
          gateway_args: tuple[str, ...] = (), gateway_env: dict[str, str] | None = None) -> dict[str, dict]:
    """The gateway's memory ({"VmRSS", "RssAnon"} in MiB) at "start", after each "round N phase"
    and "settled"; printed as it goes."""
    rng = random.Random(0)
    stack = Stack(echo=False)
    env = child_env()
    shm = tempfile.mkdtemp(prefix="splitspec-flood-", dir=pool_folder())
    memory = {}
    try:
        port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        target = stack.start("target", "target_service.cli", [
            "--model", str(model), "--port", str(port), "--shm-dir", shm, "--max-num-seqs", "8",
            "--max-waiting", "64", "--metrics-port", "0"], env)
        wait_serving(target, f"127.0.0.1:{port}", time.monotonic() + 300)
        gateway = stack.start("gateway", "splitspec.gateway.cli", [
            "--target", f"127.0.0.1:{port}", "--port", str(http_port), "--served-model-name", MODEL,
            *gateway_args], env | (gateway_env or {}))
        base = f"http://127.0.0.1:{http_port}"
        wait_http_ok(gateway, f"{base}/health", time.monotonic() + 60)
        pid = gateway.proc.pid
        asyncio.run(send_all(base, [json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()] * 8, 4))
        memory["start"] = rss_mib(pid)
        print("start", memory["start"], flush=True)
        run_phase = {
            "hostile": lambda: asyncio.run(send_all(base, hostile_bodies(rng) * 3, 16)),
            "oversized": lambda: asyncio.run(oversized(base, 10)),
            "burst": lambda: asyncio.run(burst(base, 1100)),
            "cut": lambda: asyncio.run(cut_streams(base, 200, rng)),
            "half": lambda: half_requests(("127.0.0.1", http_port), 300),
        }
        for round_ in range(rounds):
            for name in phases:
                outcome = run_phase[name]()
                memory[f"round {round_ + 1} {name}"] = rss_mib(pid)
                print(f"round {round_ + 1} {name}", memory[f"round {round_ + 1} {name}"], outcome or "", flush=True)
        time.sleep(settle_s)
        memory["settled"] = rss_mib(pid)
        print("settled", memory["settled"], flush=True)
    finally:
        stack.stop(20)
        shutil.rmtree(shm, ignore_errors=True)
    return memory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "demo" / "target")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=12.0, help="idle seconds before the last reading")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment for the gateway (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    args = p.parse_args(argv)
    flood(args.model, args.rounds, tuple(args.phases), args.settle_s, tuple(args.gateway_arg),
          dict(item.split("=", 1) for item in args.gateway_env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
