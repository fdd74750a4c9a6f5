"""Each service sizes torch's CPU thread pool on the thread that runs its model."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from splitspec.cli_args import positive_int
from common.kv_layout import CacheConfig
from common.threads import drafter_threads
from draft_service.drafters import DrafterConfig
from draft_service.server import DraftServeConfig
from target_service.async_engine import AsyncEngine
from target_service.config import EngineConfig
from tests.procs import Service, free_port
from tests.tiny_models import make_qwen3


def _thread_counts(info: str) -> dict[str, int]:
    """`torch.__config__.parallel_info()` of one thread: ATen's count and MKL's (thread-local)."""
    return {name: int(n) for name, n in re.findall(r"(at::get_num_threads|mkl_get_max_threads)\(\) : (\d+)", info)}


def test_engine_steps_run_with_the_configured_thread_count(tmp_path):
    model = make_qwen3(tmp_path / "model")
    config = EngineConfig(model=str(model), threads=2, cache=CacheConfig(cache_dtype="float32", shm_dir=str(tmp_path)))
    engine = AsyncEngine.build(config)

    async def engine_thread_info() -> str:
        await engine.start()
        try:
            return await engine.run_on_engine_thread(torch.__config__.parallel_info)
        finally:
            await engine.shutdown(grace_s=1.0)

    counts = _thread_counts(asyncio.run(engine_thread_info()))
    assert counts and all(n == 2 for n in counts.values()), counts
    assert torch.get_num_threads() == 1  # the caller's thread (conftest) is untouched


def test_the_drafter_takes_one_thread_on_a_cpu_unless_told():
    assert drafter_threads(None, "cpu") == 1
    assert drafter_threads(None, "cuda:0") is None  # torch's default beside a GPU
    assert drafter_threads(3, "cpu") == 3


@pytest.mark.parametrize("build", [
    lambda: EngineConfig(model="m", threads=0),
    lambda: DraftServeConfig(DrafterConfig(kind="ngram"), token="t", threads=-2),
])
def test_a_non_positive_thread_count_is_rejected(build):
    with pytest.raises(ValueError, match="threads must be positive"):
        build()
    with pytest.raises(Exception, match="positive"):
        positive_int("0")


def test_the_drafter_process_reports_its_thread_count(tmp_path):
    port = free_port()
    drafter = Service("draft_service.cli", ["--kind", "ngram", "--port", str(port), "--metrics-port", "0"],
                      tmp_path / "draft.log", env={"SPLITSPEC_INTERNAL_TOKEN": "t" * 32})
    try:
        drafter.wait_serving()
        assert "torch uses 1 CPU thread(s)" in drafter.log()
    finally:
        drafter.stop()
