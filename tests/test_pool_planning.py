"""The pool the target plans for a drafter's facts: what a drafter asks for is its word, so it is
bounded before it sizes anything."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from common.drafter_facts import DrafterFacts
from common.kv_layout import CacheConfig
from common.native_attention import NativeCpuAttentionBackend
from common.qwen3 import Qwen3ForCausalLM
from target_service.config import EngineConfig
from target_service.pool_planning import STAGING_BYTES, PoolPlanner, available_memory, staging_rows
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


def test_staging_rows_default_to_sixteen_steps_within_the_byte_cap_or_as_configured(planner):
    """Rows of steps that ask no drafts wait in the staging buffer: by default 16 steps' tokens, at
    most STAGING_BYTES of them but never fewer than one step's; or what the operator sets."""
    assert staging_rows(512, 2304) == 16 * 512  # the demo target's 3 layers of 384, bfloat16
    assert staging_rows(512, 3 * 4096 * 2) == STAGING_BYTES // (3 * 4096 * 2)
    assert staging_rows(512, STAGING_BYTES) == 512
    layout = planner.plan(facts((0, 1)), "t", 1)
    row_bytes = layout.staging.width * 4  # a float32 target
    assert layout.staging.rows == staging_rows(planner.config.max_num_batched_tokens, row_bytes)
    configured = dataclasses.replace(planner, config=dataclasses.replace(planner.config, staging_rows=600))
    assert configured.plan(facts((0, 1)), "t", 1).staging.rows == 600
    with pytest.raises(ValueError, match="staging_rows must hold one step's tokens"):
        dataclasses.replace(planner.config, staging_rows=100)


def test_a_cpu_pool_is_budgeted_from_what_linux_could_hand_out_not_its_free_pages(tmp_path):
    """MemAvailable counts the page cache the kernel can drop; free pages alone shrink to a sliver on a
    host that has just read its checkpoints. Without a readable MemAvailable, free pages it is."""
    cpu = torch.device("cpu")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683568 kB\nMemFree:          409600 kB\nMemAvailable:   21495808 kB\n")
    assert available_memory(cpu, str(meminfo)) == 21495808 * 1024
    free_pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for text in ("MemTotal:       24683568 kB\nMemFree:          409600 kB\n",  # a kernel before 3.14
                 "MemAvailable:   lots kB\n", "MemAvailable:   123 MB\n"):
        meminfo.write_text(text)
        assert 0 < available_memory(cpu, str(meminfo)) <= max(free_pages, 1) * 2  # free pages, give or take
    assert available_memory(cpu, str(tmp_path / "absent")) > 0
