"""The process heap: the startup heap frozen out of the collector's full passes once warm."""

from __future__ import annotations

import gc
import weakref

from common.memory import freeze_startup_heap
from tests.test_engine import _core, model_dir  # noqa: F401  (the module fixture)


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_a_freeze_keeps_what_is_alive_from_full_collections_and_a_refreeze_collects_what_died_since():
    try:
        kept, dropped = Node(), Node()
        dead = weakref.ref(dropped)
        assert freeze_startup_heap() >= 2
        del dropped
        gc.collect()
        assert dead() is not None, "a frozen cycle is not the collector's to free"
        assert not any(obj is kept for obj in gc.get_objects()), "the frozen heap is out of the collector's walk"
        freeze_startup_heap()  # e.g. a drafter's next Attach: the last epoch's cycles go now
        assert dead() is None
    finally:
        gc.unfreeze()


def test_a_warm_engine_has_frozen_its_heap(model_dir, tmp_path):  # noqa: F811
    gc.unfreeze()
    core = _core(model_dir, tmp_path)
    try:
        assert gc.get_freeze_count() == 0
        core.warmup()
        assert gc.get_freeze_count() > 1000  # the model's modules, the tokenizer, the engine
    finally:
        core.close()
        gc.unfreeze()
