"""Chaos under `splitspec up`: retrying clients while the drafter, the gateway and the target
are SIGKILLed at random.

Starts `splitspec up` on the demo pair (any free ports, a private shm folder), takes each
prompt's greedy output with speculation disabled as the reference, then runs `--clients`
closed-loop clients (OpenAI completions through the gateway, streaming and not, greedy)
that retry a failed request (connection refused or cut, 5xx, a stream ending in an error
event) until it succeeds or `--give-up-s` passes (then it is lost). Meanwhile it SIGKILLs
a service every `--kill-every-s` seconds (after the last one is serving again; each service
once per round, in random order) and
times its recovery: the drafter until the target reports it READY again, the target until
it is SERVING, the gateway until /health answers 200. Every 2 s it reads each service's
anonymous resident memory (RssAnon: the KV pool's shared pages, mapped in as they are
touched, are not the process's own). At the end it stops `up` with SIGINT and checks that it exited 0 and left
nothing in the shm folder.

Reports requests, kills per service, lost, outputs different from the reference, recovery
times, and RssAnon per service (each process's first sample 15 s after it appeared, and
its largest later one); `--json` writes it all. Exit status 1 when anything was lost or differed, an
RSS grew past `--rss-slack`, or files were left. Usage:
  .venv/bin/python bench/chaos.py [--duration-s 600] [--clients 4] [--kill-every-s 20 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import httpx2  # noqa: E402

from bench.pools import pool_folder  # noqa: E402
from splitspec.up import stop_process  # noqa: E402
from splitspec.v1 import generation_pb2 as pb  # noqa: E402
from splitspec.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

READY = re.compile(r"splitspec up: ready at (\S+) .*OpenAI API at (http://\S+)/v1")
SERVICES = {"draft": "draft_service.cli", "target": "target_service.cli", "gateway": "splitspec.gateway.cli"}
PROMPTS = ["def fibonacci(n):", "def factorial(n):", "def is_prime(n):", "class Stack:", "import os\n\ndef",
           "def quicksort(items):", "def read_lines(path):", "def gcd(a, b):"]


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 600.0
    clients: int = 4
    kill_every_s: tuple[float, float] = (20.0, 40.0)
    max_tokens: int = 48
    give_up_s: float = 300.0  # a request not answered within this (retries included) is lost
    rss_every_s: float = 2.0
    warm_after_s: float = 15.0  # a process's warm memory: its first sample this long after it appeared
    rss_slack: float = 0.5  # a process's RssAnon may grow by this share of its warm one (plus rss_slack_mib)
    rss_slack_mib: float = 64.0
    drafter: str = "dflash"
    models: Path = REPO / "demo"
    seed: int = 0
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.clients < 1 or self.max_tokens < 1 or self.give_up_s <= 0:
            raise ValueError("duration, clients, max_tokens and give_up_s must be positive")
        low, high = self.kill_every_s
        if not 0 < low <= high:
            raise ValueError(f"--kill-every-s must be 0 < low <= high, got {low} {high}")
        if self.rss_every_s <= 0 or self.warm_after_s < 0 or self.rss_slack < 0 or self.rss_slack_mib < 0:
            raise ValueError("rss_every_s must be > 0, warm_after_s and the RSS slacks >= 0")


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    requests: int = 0
    retries: int = 0
    lost: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        with self.lock:
            self.retries += 1
            self.errors[kind] = self.errors.get(kind, 0) + 1


# ---------------------------------------------------------------- the stack


class Up:
    """`splitspec up` in a subprocess, its output in a file."""

    def __init__(self, config: ChaosConfig, shm: Path, log_path: Path, extra: tuple[str, ...] = ()) -> None:
        self.log_path = log_path
        args = ["--drafter", config.drafter, "--models", str(config.models), "--port", "0", "--draft-port", "0",
                "--gateway-port", "0", "--metrics-port", "0", "--draft-metrics-port", "0", "--shm-dir", str(shm), "--speculative-policy", "fixed",
                "--max-restarts", "1000", "--startup-timeout", str(config.startup_timeout_s), *extra]
        env = {k: v for k, v in os.environ.items() if k != "SPLITSPEC_INTERNAL_TOKEN"} | {"PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "splitspec.cli", "up", *args], cwd=REPO, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
        self.target, self.base = "", ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (match := READY.search(self.log())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"splitspec up did not come up:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        self.target, self.base = match[1], match[2]

    def pids(self) -> dict[str, int]:
        """The current pid of each service (children of `up`, by their module)."""
        found = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the thread ended after the listing (as a child may before its cmdline is read)
                continue
            for pid in children:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                for name, module in SERVICES.items():
                    if module.encode() in cmdline:
                        found[name] = int(pid)
        return found

    def interrupt(self, timeout: float = 120.0) -> int:
        return stop_process(self.proc, signal.SIGINT, timeout)


def rss_anon_mib(pid: int) -> float | None:
    """A process's anonymous resident memory (VmRSS less the shared KV pool's pages a
    drafter or target touches, which count in VmRSS as they are mapped in), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def drafter_ready(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as channel:
            info = pb_grpc.GenerationStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=2)
        return info.drafter.status == pb.DrafterState.STATUS_READY
    except grpc.RpcError:
        return False


def target_serving(target: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def gateway_healthy(base: str) -> bool:
    try:
        return httpx2.get(f"{base}/health", timeout=2).status_code == 200
    except httpx2.HTTPError:
        return False


# ---------------------------------------------------------------- clients


def complete(base: str, prompt: str, max_tokens: int, stream: bool, disable_speculation: bool = False) -> str:
    """One greedy completion's text; raises on any failure (the caller retries)."""
    body = {"model": "splitspec-demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if disable_speculation:
        body["speculation"] = {"disable": True}
    url = f"{base}/v1/completions"
    if not stream:
        reply = httpx2.post(url, json=body, timeout=120)
        if reply.status_code != 200:
            raise RuntimeError(f"http {reply.status_code}")
        return reply.json()["choices"][0]["text"]
    parts, done = [], False
    with httpx2.stream("POST", url, json=body, timeout=120) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"http {reply.status_code}")
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error {event['error'].get('code')}")
            parts.extend(choice["text"] for choice in event["choices"])
    if not done:
        raise RuntimeError("stream cut")
    return "".join(parts)


def error_kind(exc: Exception) -> str:
    text = str(exc)
    return text if text.startswith(("http ", "stream ")) else type(exc).__name__


def client(base: str, reference: dict[str, str], config: ChaosConfig, tally: Tally, stop: threading.Event,
           rng: random.Random) -> None:
    while not stop.is_set():
        prompt, stream = rng.choice(PROMPTS), rng.random() < 0.5
        deadline = time.monotonic() + config.give_up_s
        while True:
            try:
                text = complete(base, prompt, config.max_tokens, stream)
                break
            except Exception as exc:  # noqa: BLE001 (any failure is retried, and counted by kind)
                tally.error(error_kind(exc))
                if time.monotonic() > deadline:
                    text = None
                    break
                time.sleep(0.2)
        with tally.lock:
            tally.requests += 1
            if text is None:
                tally.lost += 1
            elif text != reference[prompt]:
                tally.mismatches.append(prompt)


# ---------------------------------------------------------------- kills and memory


@dataclass
class Kill:
    service: str
    at_s: float
    recovery_s: float | None = None


def recovered(up: Up, service: str) -> Callable[[], bool]:
    return {"draft": lambda: drafter_ready(up.target), "target": lambda: target_serving(up.target),
            "gateway": lambda: gateway_healthy(up.base)}[service]


def chaos(up: Up, config: ChaosConfig, kills: list[Kill], stop: threading.Event, rng: random.Random,
          start: float) -> None:
    services = list(SERVICES) if config.drafter != "none" else ["target", "gateway"]
    order: list[str] = []
    while not stop.wait(rng.uniform(*config.kill_every_s)):
        order = order or rng.sample(services, len(services))  # each service once per round, in random order
        service = order.pop()
        pid = up.pids().get(service)
        if pid is None:
            continue
        os.kill(pid, signal.SIGKILL)
        kill = Kill(service, round(time.monotonic() - start, 1))
        kills.append(kill)
        check = recovered(up, service)
        time.sleep(0.5)  # let `up` see the exit
        while not stop.is_set():
            new_pid = up.pids().get(service)
            if new_pid not in (None, pid) and check():
                kill.recovery_s = round(time.monotonic() - start - kill.at_s, 2)
                break
            time.sleep(0.1)


Samples = dict[str, dict[int, list[tuple[float, float]]]]  # service → pid → (seconds, RssAnon MiB)


def sample_rss(up: Up, samples: Samples, stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        now = time.monotonic()
        for service, pid in up.pids().items():
            if (rss := rss_anon_mib(pid)) is not None:
                samples.setdefault(service, {}).setdefault(pid, []).append((now, rss))


def rss_report(samples: Samples, config: ChaosConfig) -> dict[str, dict]:
    """Per service, of the processes that lived past `warm_after_s`: the warm RssAnon and the
    largest later one of the process that grew most (against the slack)."""
    report = {}
    for service, per_pid in samples.items():
        rows = []
        for series in per_pid.values():
            later = [rss for at, rss in series if at >= series[0][0] + config.warm_after_s]
            if len(later) >= 2:
                rows.append((later[0], max(later)))
        if not rows:
            continue
        grown = [peak - warm for warm, peak in rows]
        worst = max(range(len(rows)), key=lambda i: grown[i] - rows[i][0] * config.rss_slack)
        warm, peak = rows[worst]
        report[service] = {"processes": len(per_pid), "warm_mib": round(warm, 1), "peak_mib": round(peak, 1),
                           "grown_mib": round(peak - warm, 1),
                           "flat": peak <= warm * (1 + config.rss_slack) + config.rss_slack_mib}
    return report


# ---------------------------------------------------------------- the run


def reference_outputs(base: str, max_tokens: int) -> dict[str, str]:
    return {prompt: complete(base, prompt, max_tokens, False, disable_speculation=True) for prompt in PROMPTS}


def run(config: ChaosConfig, work: Path) -> dict:
    shm = Path(tempfile.mkdtemp(prefix="splitspec-chaos-", dir=pool_folder()))
    up = Up(config, shm, work / "up.log")
    rng = random.Random(config.seed)
    tally, kills, samples = Tally(), [], {}
    try:
        up.wait_ready(config.startup_timeout_s)
        reference = reference_outputs(up.base, config.max_tokens)
        stop, rss_stop = threading.Event(), threading.Event()
        rss = threading.Thread(target=sample_rss, args=(up, samples, rss_stop, config.rss_every_s), daemon=True)
        rss.start()
        start = time.monotonic()
        clients = [threading.Thread(target=client, args=(up.base, reference, config, tally, stop,
                                                         random.Random(config.seed + 1 + i)), daemon=True)
                   for i in range(config.clients)]
        killer = threading.Thread(target=chaos, args=(up, config, kills, stop, rng, start), daemon=True)
        for thread in (*clients, killer):
            thread.start()
        stop.wait(config.duration_s)
        stop.set()
        killer.join()
        for thread in clients:
            thread.join(config.give_up_s + 130)
        elapsed = time.monotonic() - start
        rss_stop.set()
        rss.join()
    finally:
        code = up.interrupt()
        leftovers = sorted(p.name for p in shm.iterdir())
        shutil.rmtree(shm, ignore_errors=True)
    recoveries = {s: [k.recovery_s for k in kills if k.service == s and k.recovery_s is not None] for s in SERVICES}
    return {
        "duration_s": round(elapsed, 1), "clients": config.clients, "requests": tally.requests,
        "retries": tally.retries, "errors_retried": tally.errors, "lost": tally.lost,
        "mismatches": len(tally.mismatches), "kills": {s: sum(k.service == s for k in kills) for s in SERVICES},
        "recovery_s": {s: {"median": statistics.median(v), "max": max(v)} for s, v in recoveries.items() if v},
        "rss": rss_report(samples, config), "up_exit": code, "shm_leftovers": leftovers,
        "kill_log": [asdict(k) for k in kills], "log": str(work / "up.log"),
    }


def passed(result: dict) -> bool:
    return (result["lost"] == 0 and result["mismatches"] == 0 and result["up_exit"] == 0
            and not result["shm_leftovers"] and all(r["flat"] for r in result["rss"].values()))


def print_report(result: dict) -> None:
    print(f"{result['requests']} requests by {result['clients']} clients in {result['duration_s']} s: "
          f"{result['lost']} lost, {result['mismatches']} different from non-speculative greedy, "
          f"{result['retries']} retries {result['errors_retried']}")
    print(f"`splitspec up` exit {result['up_exit']}; left in the shm folder: {result['shm_leftovers'] or 'nothing'}")
    print("| service | kills | recovery median / max (s) | RssAnon warm → peak (MiB), processes |")
    print("|---|---:|---:|---|")
    for service in SERVICES:
        rec = result["recovery_s"].get(service)
        recovery = f"{rec['median']:.1f} / {rec['max']:.1f}" if rec else "-"
        rss = result["rss"].get(service, {})
        print(f"| {service} | {result['kills'][service]} | {recovery} | "
              f"{rss.get('warm_mib', '-')} → {rss.get('peak_mib', '-')}, {rss.get('processes', 0)} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--kill-every-s", type=float, nargs=2, default=(20.0, 40.0), metavar=("LOW", "HIGH"))
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--give-up-s", type=float, default=300.0)
    p.add_argument("--drafter", default="dflash", choices=("dflash", "draft_model", "ngram", "none"))
    p.add_argument("--models", type=Path, default=REPO / "demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=None, help="where up.log goes (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    config = ChaosConfig(duration_s=args.duration_s, clients=args.clients, kill_every_s=tuple(args.kill_every_s),
                         max_tokens=args.max_tokens, give_up_s=args.give_up_s, drafter=args.drafter,
                         models=args.models, seed=args.seed)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="splitspec-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    result = run(config, work)
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
