"""A cancellation storm against one real target: 500 long streams ended at random points
(client cancel, short deadlines, the Abort RPC; while waiting, prefilling or decoding)
while survivor streams run among them. Afterwards no page has leaked, nothing runs or
waits, every doomed request id can be used again (no stream outlived its client), and
each survivor's output equals its solo output.
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.kv_layout import CacheConfig
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc
from target_service.api_types import EngineRequest, StopParams
from target_service.async_engine import AsyncEngine
from target_service.config import EngineConfig
from target_service.engine import build_engine_core
from tests.procs import collect_stream, rss_kib, served_target, wait_idle
from tests.tiny_models import PROMPTS, make_qwen3

NUM_DOOMED = 500
CONCURRENCY = 32
MAX_NUM_SEQS = 16  # half of the storm waits in the queue: cancels hit waiting requests too
DOOMED_MAX_TOKENS = 600  # far longer than any doomed stream is allowed to live
MODEL_LEN = 1024


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("storm")
    model = make_qwen3(root / "model", max_position_embeddings=MODEL_LEN)
    args = ("--num-pages", "1024", "--page-size", "16", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", "256", "--max-waiting", "1024")
    with served_target(model, root / "target.log", *args) as proc:
        yield proc


def survivor_requests() -> list[pb.GenerateRequest]:
    out = []
    for i, prompt in enumerate(PROMPTS[:12]):
        msg = pb.GenerateRequest(text=prompt * (1 + i % 2), request_id=f"survivor-{i}",
                                 stop=pb.StopParams(max_tokens=40 + 10 * (i % 5), ignore_eos=True))
        if i % 3 == 2:
            msg.sampling.temperature, msg.sampling.top_p, msg.sampling.seed = 0.9, 0.95, 100 + i
        out.append(msg)
    return out


class Doomed:
    """One doomed stream: how it dies is drawn from `rng`."""

    WAYS = ("cancel_at_once", "cancel_after_chunks", "deadline", "abort_rpc")

    def __init__(self, i: int, rng: random.Random) -> None:
        self.way = self.WAYS[i % len(self.WAYS)]
        self.chunks = rng.randint(0, 6)
        self.deadline = rng.uniform(0.02, 0.6)
        self.msg = pb.GenerateRequest(text=rng.choice(PROMPTS) * rng.randint(1, 4), request_id=f"doomed-{i}",
                                      stop=pb.StopParams(max_tokens=DOOMED_MAX_TOKENS, ignore_eos=True))
        if rng.random() < 0.3:
            msg = self.msg.sampling
            msg.temperature, msg.seed = 0.8, i

    def run(self, stub) -> str:
        """How it ended, e.g. 'CANCELLED' or 'ABORT'."""
        if self.way == "deadline":
            try:
                collect_stream(stub, self.msg, timeout=self.deadline)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
                return "DEADLINE_EXCEEDED"
            pytest.fail(f"{self.msg.request_id} finished within {self.deadline:.2f} s")
        call = stub.Generate(self.msg, timeout=120)
        if self.way == "cancel_at_once":
            call.cancel()
            return "CANCELLED"
        if self.way == "cancel_after_chunks":
            for _, _ in zip(range(self.chunks), call):
                pass
            call.cancel()
            return "CANCELLED"
        call.initial_metadata()  # sent once the request is admitted: Abort will find it
        for _, _ in zip(range(self.chunks), call):
            pass
        assert stub.Abort(pb.AbortRequest(request_id=self.msg.request_id), timeout=30).found
        responses = list(call)
        assert responses[-1].complete.finish_reason == pb.FINISH_REASON_ABORT, responses[-1]
        return "ABORT"


@pytest.mark.slow
def test_cancellation_storm_leaks_nothing_and_leaves_survivors_unchanged(target):
    rng = random.Random(1234)
    channel = grpc.insecure_channel(target.address)
    stub = pb_grpc.GenerationStub(channel)
    survivors = survivor_requests()
    solo = [collect_stream(stub, msg) for msg in survivors]
    rss_before = rss_kib(target.proc.pid)

    doomed = [Doomed(i, rng) for i in range(NUM_DOOMED)]
    # survivors enter spread over the storm, so they share batches with dying streams
    tasks: list = list(doomed)
    for k, msg in enumerate(survivors):
        tasks.insert(k * NUM_DOOMED // len(survivors) + k, msg)
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(t.run, stub) if isinstance(t, Doomed) else pool.submit(collect_stream, stub, t)
                   for t in tasks]
        results = [f.result() for f in futures]
    storm_s = time.monotonic() - started
    endings = {}
    for t, result in zip(tasks, results):
        if isinstance(t, Doomed):
            endings[result] = endings.get(result, 0) + 1
    together = [r for t, r in zip(tasks, results) if not isinstance(t, Doomed)]

    info = wait_idle(target.address, timeout=10)  # 0 leaked pages, nothing running or waiting
    for msg, (tokens, complete), (want, want_complete) in zip(survivors, together, solo):
        assert tokens == want, f"{msg.request_id}: output changed during the storm"
        assert complete.finish_reason == want_complete.finish_reason == pb.FINISH_REASON_LENGTH
    # no stream outlived its client: every doomed request id is free again
    reuse = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), request_id=d.msg.request_id,
                                stop=pb.StopParams(max_tokens=1)) for d in doomed]
    with ThreadPoolExecutor(16) as pool:
        assert all(c.finish_reason == pb.FINISH_REASON_LENGTH for _, c in pool.map(lambda m: collect_stream(stub, m), reuse))
    wait_idle(target.address, timeout=10)
    channel.close()
    print(f"\nstorm: {NUM_DOOMED} doomed + {len(survivors)} survivors in {storm_s:.1f} s at concurrency "
          f"{CONCURRENCY}; endings {endings}; {info.num_pages} pages free; target RSS {rss_before // 1024} -> "
          f"{rss_kib(target.proc.pid) // 1024} MiB")
    assert sum(endings.values()) == NUM_DOOMED


def idle(info: dict) -> bool:
    return (info["running"], info["waiting"], info["free_pages"]) == (0, 0, info["num_pages"])


async def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll a public signal until it holds (no sleep standing in for synchronization)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        await asyncio.sleep(0.01)


def test_a_stream_closed_before_its_first_read_is_aborted(tmp_path):
    """The gap the storm aims at, made deterministic: a handler cancelled after admitting its
    request but before reading from it (a client cancel, a deadline, a failed metadata write)
    closes a stream it never iterated. The request must be aborted, its pages freed and its
    id released; an async generator's `finally` would never run here."""
    model = make_qwen3(tmp_path / "model")

    async def main():
        cache = CacheConfig(cache_dtype="float32", shm_dir=str(tmp_path), num_pages=64, page_size=16)
        engine = AsyncEngine(build_engine_core(EngineConfig(model=str(model), cache=cache)))
        await engine.start()
        try:
            request = EngineRequest("never-read", (1, 2, 3), stop=StopParams(max_tokens=400, ignore_eos=True))
            stream = engine.generate(request)
            await wait_until(lambda: engine.server_info()["running"] == 1, "the request to run")
            await stream.aclose()
            await wait_until(lambda: idle(engine.server_info()), "the request to be aborted and its pages freed")
            again = engine.generate(EngineRequest("never-read", (1, 2, 3), stop=StopParams(max_tokens=1)))
            assert [out async for out in again][-1].finish_reason is not None  # the id is free again
        finally:
            await engine.shutdown(0)

    asyncio.run(main())
