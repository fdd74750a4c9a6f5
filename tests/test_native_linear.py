"""bfloat16 products on AMX tiles (common/native_linear.py): what `F.linear` computes, each row's
bits independent of the row count, chosen against oneDNN by measurement, and a clear refusal
where the CPU or the compiler cannot run it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from common.cpu_linear import PackedLinear, TileChoice, pack_cpu_linears
from common.native_linear import AmxLinear, _load_amx, amx_unavailable_reason, pack_for_tiles
from common.qwen3 import Qwen3ForCausalLM
from tests.tiny_models import make_qwen3

log = logging.getLogger(__name__)
AMX_MISSING = amx_unavailable_reason()
needs_amx = pytest.mark.skipif(AMX_MISSING is not None, reason=f"no AMX products here: {AMX_MISSING}")


def _layer(in_features: int = 96, out_features: int = 160, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


def test_the_weight_is_packed_in_tile_order():
    weight = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)  # [out 32, in 64]
    packed = pack_for_tiles(weight)  # [out/16, in/32, 16, 16, 2]
    assert packed.shape == (2, 2, 16, 16, 2)
    for block, k_block, pair, n, j in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (0, 1, 3, 7, 1), (1, 0, 8, 2, 0)]:
        assert packed[block, k_block, pair, n, j] == weight[block * 16 + n, k_block * 32 + 2 * pair + j]


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 100, 513])
def test_amx_linear_computes_what_f_linear_does(bias, rows):
    linear = _layer(bias=bias)
    amx = AmxLinear(linear)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got, expected = amx(x), linear(x)
        stacked = torch.randn(3, rows, 96).to(torch.bfloat16)  # [B, T, in]: any leading shape
        got_stacked, expected_stacked = amx(stacked), linear(stacked)
    assert got.dtype == torch.bfloat16 and got_stacked.shape == (3, rows, 160)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_stacked.float(), expected_stacked.float(), rtol=2e-2, atol=2e-2)


@needs_amx
def test_a_row_has_the_same_bits_whatever_the_row_count():
    """What lossless bfloat16 needs: a row computed alone (a decode), among 9 (a verify), in a
    batch or a long prefill gets the same bits; an odd block of outputs included (80 = 5 × 16)."""
    amx = AmxLinear(_layer(64, 80))
    x = torch.randn(300, 64).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([amx(x[r : r + 1]) for r in range(x.shape[0])])
        for rows in (2, 9, 15, 16, 17, 33, 300):
            assert torch.equal(amx(x[:rows]), alone[:rows]), rows
        assert torch.equal(amx(x[100:109]), alone[100:109])


@needs_amx
def test_threads_do_not_change_the_bits():
    amx = AmxLinear(_layer(64, 512))
    x = torch.randn(9, 64).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = amx(x)
            torch.set_num_threads(max(2, threads))
            assert torch.equal(amx(x), one)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_shapes_that_do_not_fit_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of 32 inputs and 16 outputs, got 40->160"):
        AmxLinear(_layer(40, 160))
    with pytest.raises(ValueError, match="multiple of 32 inputs"):
        AmxLinear(nn.Linear(64, 64))  # float32
    amx = AmxLinear(_layer())
    with pytest.raises(ValueError, match="input of 64 features for a 96->160 layer"):
        amx(torch.randn(2, 64).to(torch.bfloat16))


def _pack_with_timings(model: nn.Module, amx_faster: bool) -> None:
    def timer(kernel: str, rows: int, call) -> float:
        call()  # the candidate really runs
        return 1e-6 if (kernel == "amx") == amx_faster else 2e-6  # seconds

    pack_cpu_linears(model, log, timer=timer)


@needs_amx
@pytest.mark.parametrize("amx_faster", [True, False])
def test_the_bfloat16_kernel_follows_the_measurement(amx_faster, caplog):
    model = nn.Sequential(_layer(96, 160), _layer(96, 160, seed=1), _layer(40, 48))
    with caplog.at_level(logging.INFO):
        _pack_with_timings(model, amx_faster)
    expected = AmxLinear if amx_faster else PackedLinear
    assert type(model[0]) is expected and type(model[1]) is expected
    assert type(model[2]) is PackedLinear  # 40 inputs fit no tile: never AMX
    winner = "amx" if amx_faster else "packed"
    assert f"96->160: AMX {1.0 if amx_faster else 2.0:.1f}/" in caplog.text and f"at 1/9/16 rows: {winner}" in caplog.text
    assert "bfloat16 kernel measured per shape" in caplog.text


def test_a_tile_choice_takes_the_faster_over_the_timed_counts():
    choice = TileChoice(384, 384, amx_us={1: 5.0, 9: 30.0}, packed_us={1: 20.0, 9: 20.0})
    assert choice.kernel == "amx"  # 35 against 40 µs
    choice.amx_us[9] = 40.0
    assert choice.kernel == "packed"


@needs_amx
def test_a_model_on_amx_keeps_its_parameters_state_dict_and_ties(tmp_path):
    path = make_qwen3(tmp_path / "m", tie_word_embeddings=True)  # every tiny shape fits whole tiles
    model = Qwen3ForCausalLM.from_pretrained(path, torch.bfloat16, "cpu")
    reference = Qwen3ForCausalLM.from_pretrained(path, torch.bfloat16, "cpu")
    keys = set(model.state_dict())
    _pack_with_timings(model, amx_faster=True)
    assert any(isinstance(m, AmxLinear) for m in model.modules())
    assert set(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(12, model.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden).float(), reference.compute_logits(hidden).float(),
                                   rtol=3e-2, atol=3e-2)


def test_without_a_compiler_bfloat16_stays_with_onednn_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPLITSPEC_KERNEL_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    _load_amx.cache_clear()
    try:
        model = nn.Sequential(_layer(96, 160))
        with caplog.at_level(logging.INFO):
            pack_cpu_linears(model, log)
        assert not isinstance(model[0], AmxLinear)
        reason = amx_unavailable_reason()
        assert reason is not None and ("no C compiler" in reason or "no AMX-BF16" in reason)
    finally:
        _load_amx.cache_clear()


@needs_amx
def test_a_forward_run_in_one_call_puts_every_fitting_product_on_tiles_untimed(caplog):
    """The native forward needs every product on tiles: no product-by-product race (which a busy
    machine once lost for one layer, and with it the whole step's native call)."""
    model = nn.Sequential(_layer(96, 160), _layer(40, 48))

    def onednn_faster(kernel: str, rows: int, call) -> float:
        pytest.fail("timed a product the forward needs on tiles")

    with caplog.at_level(logging.INFO):
        pack_cpu_linears(model, log, timer=onednn_faster, whole_forward_on_tiles=True)
    assert type(model[0]) is AmxLinear and type(model[1]) is PackedLinear  # 40 inputs fit no tile
    assert "the forward runs in one native call" in caplog.text
