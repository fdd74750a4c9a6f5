"""What a hostile prompt costs a running target: a large `text` against a live stream.

Starts a target process (the demo target by default), keeps one client streaming
tokens back to back, and sends `--repeat` requests whose `text` is `--text-mb` MB
(past any model length). Reports how long each took to be rejected, the longest gap
between two chunks of the concurrent stream while they were in flight (against the
longest gap before them), and the target's anonymous memory (RssAnon) before, after
the first and after the last big request. `--no-text-bound` serves a copy of the model
whose tokenizer normalizes with NFKC, for which no byte bound is provable: its texts are
tokenized in full (off the event loop). `--source-dir` runs the target from another
checkout (an older commit) with this script, for a before/after comparison. Usage:
  python bench/hostile_inputs.py [--text-mb 12] [--repeat 5] [--no-text-bound] [--source-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.pools import pool_folder  # noqa: E402
from splitspec.up import stop_process  # noqa: E402
from splitspec.v1 import generation_pb2 as pb  # noqa: E402
from splitspec.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

LISTENING = re.compile(r"listening on (\S+):(\d+)")
STREAM_PROMPT = "def fibonacci(n):"


def rss_anon_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


class Target:
    """A target process started from `source_dir`, on a private shm folder."""

    def __init__(self, source_dir: Path, model: Path, log_path: Path) -> None:
        self.shm = Path(tempfile.mkdtemp(prefix="splitspec-bench-", dir=pool_folder()))
        self.log_path = log_path
        cmd = [sys.executable, "-m", "target_service.cli", "--model", str(model), "--port", "0",
               "--metrics-port", "0", "--shm-dir", str(self.shm), "--num-pages", "512"]
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=source_dir, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.address = self._wait_serving()

    def _wait_serving(self, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        address = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the target exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            if not address and (match := LISTENING.search(self.log_path.read_text())):
                address = f"{match[1]}:{match[2]}"
            if address:
                with grpc.insecure_channel(address) as channel:
                    try:
                        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return address
                    except grpc.RpcError:
                        pass
            time.sleep(0.1)
        raise RuntimeError(f"the target did not serve within {timeout} s")

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 60)
        shutil.rmtree(self.shm, ignore_errors=True)


@dataclass
class Streamer:
    """Generate calls back to back on one channel; the arrival time of every chunk."""

    address: str
    max_tokens: int = 400
    arrivals: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        request = pb.GenerateRequest(text=STREAM_PROMPT,
                                     stop=pb.StopParams(max_tokens=self.max_tokens, ignore_eos=True))
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while not self._stop.is_set():
                for response in stub.Generate(request, timeout=600):
                    if response.HasField("chunk"):
                        self.arrivals.append(time.monotonic())
                    if self._stop.is_set():
                        break

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time between two chunks (or a window edge and a chunk) in [start, end]."""
        inside = [t for t in self.arrivals if start <= t <= end]
        edges = [start, *inside, end]
        return max(b - a for a, b in zip(edges, edges[1:]))


def without_text_bound(model: Path, out_dir: Path) -> Path:
    """A copy of `model` whose tokenizer normalizes with NFKC (which may shrink text
    without limit, so no byte bound on what can fit is provable)."""
    copy = out_dir / model.name
    shutil.copytree(model, copy)
    pipeline = json.loads((copy / "tokenizer.json").read_text())
    pipeline["normalizer"] = {"type": "NFKC"}
    (copy / "tokenizer.json").write_text(json.dumps(pipeline))
    return copy


def send_big(address: str, text: str) -> tuple[float, str]:
    """Seconds until the answer, and the answer (status and details, or OK)."""
    request = pb.GenerateRequest(text=text, stop=pb.StopParams(max_tokens=4))
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 << 20)]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        started = time.monotonic()
        try:
            list(stub.Generate(request, timeout=600))
            answer = "OK"
        except grpc.RpcError as err:
            answer = f"{err.code().name}: {err.details()[:80]}"
        return time.monotonic() - started, answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "demo" / "target")
    parser.add_argument("--text-mb", type=float, default=12.0, help="size of each big text, MB")
    parser.add_argument("--repeat", type=int, default=5, help="big requests, one after the other")
    parser.add_argument("--baseline-s", type=float, default=3.0, help="streaming before the first big request")
    parser.add_argument("--source-dir", type=Path, default=REPO, help="run the target from this checkout")
    parser.add_argument("--no-text-bound", action="store_true",
                        help="serve the model with an NFKC tokenizer: texts are tokenized in full")
    parser.add_argument("--settle-s", type=float, default=0.3, help="pause before reading the memory")
    args = parser.parse_args(argv)

    text = ("def fibonacci(n):\n    return n\n" * (int(args.text_mb * 1e6) // 31 + 1))[: int(args.text_mb * 1e6)]
    log_dir = Path(tempfile.mkdtemp(prefix="splitspec-hostile-"))
    model = without_text_bound(args.model.resolve(), log_dir) if args.no_text_bound else args.model.resolve()
    target = Target(args.source_dir.resolve(), model, log_dir / "target.log")
    streamer = Streamer(target.address)
    try:
        send_big(target.address, STREAM_PROMPT)  # warm the server's paths up
        time.sleep(args.settle_s)
        rss = [rss_anon_mib(target.proc.pid)]
        streamer.start()
        time.sleep(args.baseline_s)
        window_start = time.monotonic()
        answers = []
        for _ in range(args.repeat):
            answers.append(send_big(target.address, text))
            window_end = time.monotonic()
            time.sleep(args.settle_s)
            rss.append(rss_anon_mib(target.proc.pid))
        time.sleep(1.0)
        streamer.stop()
        baseline_gap = streamer.longest_gap(window_start - args.baseline_s + 1.0, window_start)
        stall = streamer.longest_gap(window_start, window_end)  # the settling pauses included
    finally:
        streamer.stop()
        target.stop()
        shutil.rmtree(log_dir, ignore_errors=True)

    seconds = [s for s, _ in answers]
    flags = " --no-text-bound" if args.no_text_bound else ""
    print(f"`python bench/hostile_inputs.py --text-mb {args.text_mb:g} --repeat {args.repeat}{flags}`"
          f"{' (target from ' + str(args.source_dir) + ')' if args.source_dir.resolve() != REPO else ''}")
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores; {args.model.name}")
    print(f"answer: {answers[0][1]}")
    print("| time to reject (median, max) | longest stall of a concurrent stream | before (longest gap) | "
          "RssAnon before → after 1st → after last |")
    print("|---:|---:|---:|---|")
    print(f"| {statistics.median(seconds):.3f} s, {max(seconds):.3f} s | {stall:.3f} s | {baseline_gap:.3f} s | "
          f"{rss[0]:.0f} → {rss[1]:.0f} → {rss[-1]:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
