import shutil
from pathlib import Path

import pytest
import torch

from tests.procs import private_shm_dir
from tests.tiny_models import TARGET_LAYERS, make_qwen3


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


@pytest.fixture(scope="module")
def target_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 target with the layers a reference DFlash drafter reads (per test module)."""
    return make_qwen3(tmp_path_factory.mktemp("target"), num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def draft_lm(target_model, tmp_path_factory) -> Path:
    """A copy of the target: its drafts are the target's argmax, so every one is accepted."""
    out = tmp_path_factory.mktemp("draft") / "lm"
    shutil.copytree(target_model, out)
    return out


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
