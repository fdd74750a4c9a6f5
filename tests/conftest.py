import shutil

import pytest
import torch

from tests.procs import private_shm_dir


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
