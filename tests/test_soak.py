"""Soak: mixed load against a target whose drafter is SIGKILLed and restarted (same port)
at random, for SPLITSPEC_SOAK_S seconds (default: 300 under CI=true, else 60).

The load mixes greedy and sampled requests, short and long ones, and streams cancelled
by the client or cut by deadlines. Every request that is not cancelled completes: greedy
ones token-identical to target-only decoding, sampled ones at full length. At the end no
page has leaked, nothing runs or waits, the drafter is back and speculating, and the
target's resident memory at start and end is printed (the number to report).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from collections import Counter

import grpc
import pytest

from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from tests.procs import (
    Service,
    collect_stream,
    free_port,
    private_shm_dir,
    rss_kib,
    stream_tokens,
    wait_drafter,
    wait_idle,
)
from tests.tiny_models import PROMPTS, make_pair

pytestmark = pytest.mark.slow
SOAK_S = float(os.environ.get("SPLITSPEC_SOAK_S") or (300 if os.environ.get("CI") == "true" else 60))
WORKERS = 4
READY = pb.DrafterState.STATUS_READY
SHORT, LONG = 16, 96


def request(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
            **speculation) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(text=prompt, stop=pb.StopParams(max_tokens=max_tokens, ignore_eos=True),
                             speculation=pb.SpeculationParams(**speculation))
    if temperature:
        msg.sampling.temperature, msg.sampling.seed = temperature, seed
    return msg


class Load:
    """WORKERS threads of mixed requests; counts outcomes, records failures."""

    def __init__(self, address: str, reference: dict[tuple[int, int], list[int]], seed: int) -> None:
        self.address = address
        self.reference = reference
        self.seed = seed
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.speculated = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(WORKERS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _note(self, outcome: str, failure: str | None = None, drafts: int = 0) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            self.speculated += drafts > 0
            if failure is not None:
                self.failures.append(failure)

    def _work(self, worker: int) -> None:
        rng = random.Random(self.seed * 100 + worker)
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while not self._stop.is_set():
                kind = rng.choice(["greedy", "greedy", "sampled", "cancel", "deadline"])
                try:
                    getattr(self, f"_{kind}")(stub, rng)
                except grpc.RpcError as err:
                    self._note("failed", f"{kind}: {err.code().name}: {err.details()}")

    def _greedy(self, stub, rng) -> None:
        key = (rng.randrange(len(PROMPTS)), rng.choice([SHORT, LONG]))
        tokens, complete = collect_stream(stub, request(PROMPTS[key[0]], key[1]))
        wrong = None if tokens == self.reference[key] else f"greedy {key}: tokens differ from target-only"
        self._note("failed" if wrong else "greedy", wrong, complete.usage.num_drafts)

    def _sampled(self, stub, rng) -> None:
        max_tokens = rng.choice([SHORT, LONG])
        msg = request(rng.choice(PROMPTS), max_tokens, temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(2**31))
        tokens, complete = collect_stream(stub, msg)
        ok = len(tokens) == max_tokens and complete.finish_reason == pb.FINISH_REASON_LENGTH
        self._note("sampled" if ok else "failed", None if ok else f"sampled: {complete}", complete.usage.num_drafts)

    def _cancel(self, stub, rng) -> None:
        call = stub.Generate(request(rng.choice(PROMPTS), LONG * 4), timeout=120)
        for _, _ in zip(range(rng.randint(0, 10)), call):
            pass
        call.cancel()
        self._note("cancelled")

    def _deadline(self, stub, rng) -> None:
        try:
            collect_stream(stub, request(rng.choice(PROMPTS), LONG * 4), timeout=rng.uniform(0.05, 1.0))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            self._note("deadline")
            return
        self._note("deadline_met")


def test_soak_with_random_drafter_restarts(tmp_path):
    rng = random.Random(2024)
    target_model, draft_model = make_pair(tmp_path, max_position_embeddings=1024)
    port = free_port()
    shm = private_shm_dir()
    drafter_args = ["--model", str(draft_model), "--port", str(port), "--num-speculative-tokens", "4",
                    "--shm-dir", str(shm)]
    logs = tmp_path / "logs"
    logs.mkdir()
    drafter = Service("draft_service.cli", drafter_args, logs / "drafter-0.log")
    target = None
    try:
        drafter.wait_serving()
        target = Service("target_service.cli", [
            "--model", str(target_model), "--port", "0", "--shm-dir", str(shm), "--num-pages", "1024",
            "--page-size", "8", "--max-num-batched-tokens", "128", "--drafter", f"127.0.0.1:{port}",
            "--drafter-timeout-s", "1", "--speculative-policy", "fixed",  # counts drafts: ask every step
        ], logs / "target.log")
        address = target.wait_serving()
        wait_drafter(address, READY)
        reference = {(i, n): stream_tokens(address, request(p, n, disable=True))[0]
                     for i, p in enumerate(PROMPTS) for n in (SHORT, LONG)}
        rss_start = rss_kib(target.proc.pid)

        load = Load(address, reference, seed=7)
        started = time.monotonic()
        load.start()
        restarts = 0
        try:
            while time.monotonic() - started < SOAK_S:
                time.sleep(min(rng.uniform(5, 20), max(0.0, SOAK_S - (time.monotonic() - started))))
                if time.monotonic() - started >= SOAK_S - 5:
                    break
                drafter.signal(signal.SIGKILL)
                drafter.proc.wait(10)
                time.sleep(rng.uniform(0, 2))
                restarts += 1
                drafter = Service("draft_service.cli", drafter_args, logs / f"drafter-{restarts}.log")
                drafter.wait_serving()
        finally:
            load.stop()
        elapsed = time.monotonic() - started

        info = wait_idle(address, timeout=30)
        rss_end = rss_kib(target.proc.pid)
        print(f"\nsoak: {elapsed:.0f} s, {restarts} drafter restarts, {sum(load.outcomes.values())} requests "
              f"{dict(load.outcomes)}, {load.speculated} speculated; {info.free_pages}/{info.num_pages} pages free; "
              f"target RSS {rss_start / 1024:.1f} MiB at start, {rss_end / 1024:.1f} MiB at end "
              f"({(rss_end - rss_start) / 1024:+.1f} MiB)")
        assert not load.failures, f"{len(load.failures)} failed requests, e.g. {load.failures[:5]}"
        assert load.outcomes["greedy"] and load.outcomes["sampled"] and load.speculated
        assert restarts >= (1 if SOAK_S < 120 else 5)
        # the last drafter is back, and speculation with it
        assert wait_drafter(address, READY).drafter.epoch >= 2
        for _ in range(3):  # one Propose may miss its deadline on a loaded machine
            tokens, complete = stream_tokens(address, request(PROMPTS[0], LONG))
            assert tokens == reference[(0, LONG)]
            if complete.usage.num_drafts > 0:
                break
            wait_drafter(address, READY)
        assert complete.usage.num_drafts > 0, "speculation never came back"
    finally:
        stopped = target.stop() if target is not None else 0  # the drafter is killed whatever this says
        drafter.kill()
        leftovers = list(shm.iterdir())
        shutil.rmtree(shm, ignore_errors=True)
    assert stopped == 0, target.log()
    assert not leftovers, leftovers
