"""The pool the target plans for a drafter's facts: what a drafter asks for is its word, so it is
bounded before it sizes anything."""

from __future__ import annotations

import pytest
import torch

from common.drafter_facts import DrafterFacts
from common.kv_layout import CacheConfig
from common.native_attention import NativeCpuAttentionBackend
from common.qwen3 import Qwen3ForCausalLM
from target_service.config import EngineConfig
from target_service.pool_planning import PoolPlanner
from tests.tiny_models import make_qwen3


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    path = make_qwen3(tmp_path_factory.mktemp("planning") / "target")
    model = Qwen3ForCausalLM.from_pretrained(path, torch.float32, "cpu")
    config = EngineConfig(model=str(path), cache=CacheConfig(cache_dtype="float32", num_pages=16))
    return PoolPlanner(config, model, NativeCpuAttentionBackend, torch.device("cpu"), 64)


def facts(layer_ids: tuple[int, ...]) -> DrafterFacts:
    return DrafterFacts(kind="dflash", layers=(), target_layer_ids=layer_ids, supported_orders=("NHD", "HND"),
                        num_speculative_tokens=4, model_id="crafted")


def test_staging_rows_hold_the_layers_asked_for_a_repeat_included(planner):
    layers = planner.model.num_layers
    layout = planner.plan(facts((0, layers - 1, layers - 1)), "t", 1)
    assert layout.staging.layer_ids == (0, layers - 1, layers - 1)
    assert layout.staging.width == 3 * planner.model.hidden_size


@pytest.mark.parametrize("layer_ids", [(99,), (-1,), (0,) * 1000])
def test_a_layer_outside_the_target_or_a_flood_of_them_is_refused_before_anything_is_sized(planner, layer_ids):
    with pytest.raises(ValueError, match="hidden states of target layers"):
        planner.plan(facts(layer_ids), "t", 1)
