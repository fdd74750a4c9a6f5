"""The process heap: the startup heap frozen out of the collector's full passes once warm."""

from __future__ import annotations

import gc
import weakref

from common.kv_layout import CacheConfig
from common.memory import freeze_startup_heap
from target_service.config import EngineConfig
from target_service.engine import build_engine_core
from tests.tiny_models import make_qwen3


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


def test_a_warm_engine_has_frozen_its_heap(tmp_path):
    gc.unfreeze()
    model = make_qwen3(tmp_path / "model")
    core = build_engine_core(EngineConfig(model=str(model), dtype="float32",
                                          cache=CacheConfig(cache_dtype="float32", shm_dir=str(tmp_path))))
    try:
        assert gc.get_freeze_count() == 0
        core.warmup()
        assert gc.get_freeze_count() > 1000  # the model's modules, the tokenizer, the engine
    finally:
        core.close()
        gc.unfreeze()
