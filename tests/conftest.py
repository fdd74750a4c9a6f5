import multiprocessing
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests import procs
from tests.procs import openai_client, private_shm_dir, wait_idle
from tests.tiny_models import TARGET_LAYERS, make_pair

# What makes a test module `stack`: it starts processes, through these helpers or the stdlib.
PROCESS_HELPERS = (procs.Service, procs.served_target, procs.served_drafter, procs.client_cmd, procs.start_target,
                   subprocess, multiprocessing)


def pytest_configure(config):
    # Two cores, shared by the test process and the servers it starts: one torch thread
    # per process keeps step times steady instead of thrashing.
    torch.set_num_threads(1)


@pytest.fixture
def shm_dir():
    """A private pool folder that must be empty again when the test ends."""
    path = private_shm_dir()
    yield path
    leftovers = list(path.iterdir())
    shutil.rmtree(path, ignore_errors=True)
    assert not leftovers, f"files left in the shm dir: {leftovers}"


@pytest.fixture
def client(stack):
    """The official `openai` client on the module's `stack["gateway"]`; the target is idle again after."""
    with openai_client(stack["gateway"], timeout=120) as c:
        yield c
    wait_idle(stack["target"])


@pytest.fixture(scope="module")
def target_model(checkpoint_pair) -> Path:
    """A tiny Qwen3 target with the layers a reference DFlash drafter reads (per test module)."""
    return checkpoint_pair[0]


@pytest.fixture(scope="module")
def checkpoint_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The target of `target_model`'s shape and a copy of it as the draft LM: the copy's drafts
    are the target's argmax, so every one is accepted."""
    return make_pair(tmp_path_factory.mktemp("pair"), num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory):
    """tiny_models.SpecModels: a target, its copy as draft LM, a reference DFlash drafter (built
    once per session: tests read them, never write them)."""
    from tests.tiny_models import make_spec_models

    return make_spec_models(tmp_path_factory.mktemp("spec-models"))


@pytest.fixture(scope="module")
def draft_lm(checkpoint_pair) -> Path:
    return checkpoint_pair[1]


@pytest.fixture
def speculative_engine(shm_dir):
    """Builds engine cores with an in-process drafter; each is closed at teardown unless the test closed it.

    `speculative_engine(target, draft, kind=..., drafter={...}, shm=..., **engine_config)`: the
    pool in `shm` (default: the test's `shm_dir`), a float32 target and KV cache unless `dtype` or
    `cache` is given (so that what a test checks does not depend on this CPU multiplying bfloat16 natively),
    `drafter` adding DrafterConfig fields."""
    from common.kv_layout import CacheConfig
    from draft_service.drafters import DrafterConfig
    from draft_service.local import LocalDrafterStub
    from target_service.config import EngineConfig
    from target_service.engine import build_engine_core

    open_cores = []

    def build(target: Path, draft: Path, kind: str = "draft_model", drafter: dict | None = None,
              shm: Path | None = None, **engine):
        pool_dir = str(shm or shm_dir)
        stub = LocalDrafterStub(DrafterConfig(kind=kind, model=str(draft), target_model=str(target),
                                              shm_dir=pool_dir, **(drafter or {})))
        engine.setdefault("cache", CacheConfig(cache_dtype="float32", shm_dir=pool_dir))
        engine.setdefault("dtype", "float32")  # not auto: bfloat16 on an x86 with AMX, AVX512-BF16 or AVX2
        config = EngineConfig(model=str(target), drafter="in-process", internal_token="unused", **engine)
        core = build_engine_core(config, drafter_stub=stub)
        close = core.close

        def close_once() -> None:
            if core in open_cores:
                open_cores.remove(core)
                close()

        core.close = close_once
        open_cores.append(core)
        return core

    yield build
    for core in list(open_cores):
        core.close()


def _starts_processes(item: pytest.Item) -> bool:
    module_globals = vars(item.module).values() if item.module is not None else ()
    return any(value is helper for value in module_globals for helper in PROCESS_HELPERS)


def pytest_collection_modifyitems(config, items):
    stack = pytest.mark.stack
    for item in items:
        if _starts_processes(item):
            item.add_marker(stack)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
