"""oneDNN-packed CPU linears (common/cpu_linear.py): the same products as `nn.Linear` on
either path, the model's parameters and state dict untouched, tied weights still tied."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

from common.cpu_linear import (EXACT_ROWS, MAX_PACKED_ROWS, MIN_PACKED_ROWS, PackedLinear, native_cpu_bf16,
                               pack_cpu_linears, packed_row_counts, padded_rows, select_kernels)
from common.qwen3 import Qwen3ForCausalLM
from tests.tiny_models import make_qwen3

log = logging.getLogger(__name__)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS - 1, MIN_PACKED_ROWS, 9, EXACT_ROWS, EXACT_ROWS + 1, 72, 100,
                                  MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1])
def test_packed_linear_computes_what_nn_linear_does(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-5)
        stacked = torch.randn(3, rows, 96)  # [B, T, in]: any leading shape
        torch.testing.assert_close(packed(stacked), linear(stacked), rtol=1e-4, atol=1e-5)


def test_a_model_is_packed_in_place_with_its_parameters_and_state_dict_unchanged(tmp_path):
    path = make_qwen3(tmp_path / "m", tie_word_embeddings=True)
    model = Qwen3ForCausalLM.from_pretrained(path, torch.float32, "cpu")
    reference = Qwen3ForCausalLM.from_pretrained(path, torch.float32, "cpu")
    keys = set(model.state_dict())
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())  # StackedLinear (q/k/v, gate/up) too
    assert pack_cpu_linears(model, log) == linears > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert set(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    hidden = torch.randn(12, model.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), reference.compute_logits(hidden),
                                   rtol=1e-4, atol=1e-4)
    assert model.fingerprint() == reference.fingerprint()


def test_only_cpu_layers_of_a_packable_dtype_are_packed():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.float16), nn.Linear(8, 8, device="meta"),
                          nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_cpu_linears(model, log) == (1 if native_cpu_bf16() else 0)
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear
    assert (type(model[2]) is PackedLinear) == native_cpu_bf16()


@pytest.mark.skipif(not native_cpu_bf16(), reason="this CPU has no native bfloat16 dot products")
@pytest.mark.parametrize("rows", [1, 9, EXACT_ROWS + 1, MAX_PACKED_ROWS + 1])
def test_bfloat16_layers_are_packed_from_one_row_and_compute_what_nn_linear_does(rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, expected = packed(x), linear(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert not packed.plain_rows  # bfloat16: packed at every row count (one kernel: batch-invariant rows)


def test_row_counts_map_to_few_shapes_for_little_padding():
    """oneDNN keeps a primitive, with scratch memory, per shape: prompts of every length must
    not each make one (a flood of mixed requests grew the target by 40 MB with exact shapes)."""
    sizes = packed_row_counts()
    assert len(sizes) <= EXACT_ROWS + 10 and max(sizes) == MAX_PACKED_ROWS, sizes
    for rows in range(1, 4097):
        assert rows <= padded_rows(rows) <= max(rows, 1.5 * rows)
    assert [padded_rows(r) for r in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))


def _two_layers_of_one_shape_and_one_of_another() -> list[PackedLinear]:
    torch.manual_seed(0)
    return [PackedLinear(nn.Linear(48, 80)), PackedLinear(nn.Linear(48, 80)), PackedLinear(nn.Linear(80, 48, bias=False))]


def test_the_kernel_per_row_count_follows_the_measurement():
    """Timings injected: F.linear "faster" at 1, 2 and 9 rows for 48->80 and never for 80->48; each
    layer takes what was measured for its shape, and computes what nn.Linear does at every count."""
    layers = _two_layers_of_one_shape_and_one_of_another()
    seen: list[tuple[int, str, int]] = []

    def timer(kernel: str, rows: int, call) -> float:
        out = call()  # the candidate really runs
        width = out.shape[1]
        seen.append((width, kernel, rows))
        plain_wins = width == 80 and rows in (1, 2, 9)
        return 1.0 if (kernel == "F.linear") == plain_wins else 2.0

    choices = select_kernels(layers, timer=timer, budget_s=60.0)
    assert [(c.in_features, c.out_features) for c in choices] == [(48, 80), (80, 48)]
    assert layers[0].plain_rows == layers[1].plain_rows == {1, 2, 9}
    assert layers[2].plain_rows == frozenset()
    assert {rows for width, _, rows in seen if width == 80} == set(packed_row_counts())  # every count, once per shape
    assert choices[0].describe() == "48->80: F.linear at 1-2, 9; packed at 3-8, 10-512"
    with torch.inference_mode():
        for layer, reference in ((layers[0], nn.Linear(48, 80)), (layers[2], nn.Linear(80, 48, bias=False))):
            reference.weight, reference.bias = layer.weight, layer.bias
            for rows in (1, 2, 3, 9, 17, 600):
                x = torch.randn(rows, layer.in_features)
                torch.testing.assert_close(layer(x), reference(x), rtol=1e-4, atol=1e-4)


def test_counts_left_untimed_by_the_budget_take_the_last_timed_choice():
    """Past the budget a count runs what the last timed count chose; with none timed, the rule
    before any measurement (F.linear for one row, packed from two)."""
    layers = _two_layers_of_one_shape_and_one_of_another()

    def slow_plain_wins(kernel: str, rows: int, call) -> float:
        threading.Event().wait(0.01)
        return 1.0 if kernel == "F.linear" else 2.0

    choices = select_kernels(layers[:1], timer=slow_plain_wins, budget_s=0.05)
    assert 0 < len(choices[0].plain_us) < len(packed_row_counts())
    assert layers[0].plain_rows == set(packed_row_counts())  # the untimed counts follow the timed ones
    choices = select_kernels(layers[2:], timer=slow_plain_wins, budget_s=0.0)
    assert not choices[0].plain_us and layers[2].plain_rows == {1}


def test_a_shape_is_measured_once_per_process():
    """Every model of a process with a layer of this shape reuses the first measurement: engines
    loaded beside a busy drafter process chose the packed product at one row (1.7x slower) when
    each timed for itself."""
    from common.cpu_linear import _measured

    torch.manual_seed(0)
    first, second = PackedLinear(nn.Linear(40, 72)), PackedLinear(nn.Linear(40, 72))
    select_kernels([first])
    hits = _measured.cache_info().hits
    select_kernels([second])
    assert _measured.cache_info().hits == hits + 1 and second.plain_rows == first.plain_rows


def test_bfloat16_layers_are_not_timed():
    layer = PackedLinear(nn.Linear(32, 32).to(torch.bfloat16)) if native_cpu_bf16() else None
    if layer is None:
        pytest.skip("this CPU has no native bfloat16 dot products")
    assert select_kernels([layer], timer=lambda *args: pytest.fail("timed a bfloat16 layer")) == []
