import pytest
import torch


def pytest_configure(config):
    # Two cores, shared by the test process and the servers it starts: one torch thread
    # per process keeps step times steady instead of thrashing.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
