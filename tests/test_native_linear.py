"""bfloat16 products, tile-packed on AMX or AVX512-BF16 (common/native_linear.py): what `F.linear`
computes, each row's bits independent of the row count on every kernel the CPU runs, chosen
against oneDNN by measurement, and a clear refusal where the CPU or the compiler cannot run it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from common import cpu_linear
from common.cpu_linear import PackedLinear, TileChoice, native_cpu_bf16, pack_cpu_linears
from common.native_linear import (
    KERNEL_AMX,
    KERNEL_DPBF16,
    KERNEL_ENV,
    KERNEL_FMA256,
    KERNEL_NAMES,
    TiledLinear,
    TileKernels,
    _load_tile_kernels,
    chosen_kernel,
    pack_for_tiles,
    tile_kernels_unavailable_reason,
)
from common.qwen3 import Qwen3ForCausalLM
from tests.tiny_models import make_qwen3

log = logging.getLogger(__name__)
TILES_MISSING = tile_kernels_unavailable_reason()
needs_tiles = pytest.mark.skipif(TILES_MISSING is not None, reason=f"no tile-packed bfloat16 products here: {TILES_MISSING}")


def _kernels() -> list:
    """Each product kernel this machine runs (AMX and VDPBF16PS on a CPU with AMX; VDPBF16PS alone on
    one with AVX512-BF16 only), so every test below covers each."""
    if TILES_MISSING is not None:
        skip = pytest.mark.skip(reason=f"no tile-packed bfloat16 products here: {TILES_MISSING}")
        return [pytest.param(None, marks=skip)]
    return [pytest.param(kernel, id=KERNEL_NAMES[kernel]) for kernel in sorted(TileKernels.load().available)]


KERNELS = _kernels()


def _layer(in_features: int = 96, out_features: int = 160, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


def test_the_weight_is_packed_in_tile_order():
    weight = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)  # [out 32, in 64]
    packed = pack_for_tiles(weight)  # [out/16, in/32, 16, 16, 2]
    assert packed.shape == (2, 2, 16, 16, 2)
    for block, k_block, pair, n, j in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (0, 1, 3, 7, 1), (1, 0, 8, 2, 0)]:
        assert packed[block, k_block, pair, n, j] == weight[block * 16 + n, k_block * 32 + 2 * pair + j]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 9, 12, 13, 16, 17, 100, 513])
def test_tiled_linear_computes_what_f_linear_does(bias, rows, kernel):
    linear = _layer(bias=bias)
    tiled = TiledLinear(linear, kernel)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got, expected = tiled(x), linear(x)
        stacked = torch.randn(3, rows, 96).to(torch.bfloat16)  # [B, T, in]: any leading shape
        got_stacked, expected_stacked = tiled(stacked), linear(stacked)
    assert got.dtype == torch.bfloat16 and got_stacked.shape == (3, rows, 160)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_stacked.float(), expected_stacked.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("out_f32", [False, True])
def test_a_row_has_the_same_bits_whatever_the_row_count(kernel, out_f32):
    """What lossless bfloat16 needs: a row computed alone (a decode), among 9 (a verify), in a
    batch or a long prefill gets the same bits; an odd block of outputs included (80 = 5 × 16),
    row counts on both sides of each kernel's row blocks (16 on AMX tiles, 12 with VDPBF16PS), in
    bfloat16 and in float32 (what the native forward reads)."""
    tiled = TiledLinear(_layer(64, 80), kernel)
    x = torch.randn(300, 64).to(torch.bfloat16)

    def product(rows: torch.Tensor) -> torch.Tensor:
        if not out_f32:
            return tiled(rows)
        out = torch.empty(rows.shape[0], 80)
        assert tiled._linear(rows.data_ptr(), rows.shape[0], 64, tiled._packed_address, 80, out.data_ptr(), 1, 2,
                             tiled.kernel) == 0
        return out

    with torch.inference_mode():
        alone = torch.cat([product(x[r : r + 1]) for r in range(x.shape[0])])
        for rows in (2, 9, 11, 12, 13, 15, 16, 17, 24, 25, 33, 300):
            assert torch.equal(product(x[:rows]), alone[:rows]), rows
        assert torch.equal(product(x[100:109]), alone[100:109])


@pytest.mark.parametrize("kernel", KERNELS)
def test_threads_do_not_change_the_bits(kernel):
    tiled = TiledLinear(_layer(64, 512), kernel)
    x = torch.randn(9, 64).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = tiled(x)
            torch.set_num_threads(max(2, threads))
            assert torch.equal(tiled(x), one)
    finally:
        torch.set_num_threads(threads)


@needs_tiles
def test_shapes_that_do_not_fit_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of 32 inputs and 16 outputs, got 40->160"):
        TiledLinear(_layer(40, 160))
    with pytest.raises(ValueError, match="multiple of 32 inputs"):
        TiledLinear(nn.Linear(64, 64))  # float32
    tiled = TiledLinear(_layer())
    with pytest.raises(ValueError, match="input of 64 features for a 96->160 layer"):
        tiled(torch.randn(2, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="the 7 product kernel does not run here"):
        TiledLinear(_layer(), kernel=7)


@needs_tiles
def test_the_default_kernel_is_the_first_of_amx_avx512_bf16_avx2_that_runs(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    kernels = TileKernels.load()
    assert TiledLinear(_layer()).kernel == kernels.default
    assert kernels.default == next(k for k in (KERNEL_AMX, KERNEL_DPBF16, KERNEL_FMA256) if k in kernels.available)
    if KERNEL_AMX in kernels.available:
        assert KERNEL_DPBF16 in kernels.available  # every CPU with AMX-BF16 has AVX512-BF16 too


def test_an_operator_names_the_kernel_and_a_wrong_name_is_refused():
    everything = frozenset(KERNEL_NAMES)
    assert chosen_kernel("avx2-fma", everything) == KERNEL_FMA256
    assert chosen_kernel(" AVX512-BF16 ", everything) == KERNEL_DPBF16
    assert chosen_kernel("auto", frozenset({KERNEL_DPBF16, KERNEL_FMA256})) == KERNEL_DPBF16
    with pytest.raises(ValueError, match="'sse9': not a product kernel"):
        chosen_kernel("sse9", everything)
    with pytest.raises(ValueError, match="'amx': that kernel does not run on this CPU \\(here: AVX2-FMA\\)"):
        chosen_kernel("amx", frozenset({KERNEL_FMA256}))


@needs_tiles
def test_the_environment_picks_the_default_kernel(monkeypatch):
    available = TileKernels.load().available
    for kernel in available:
        monkeypatch.setenv(KERNEL_ENV, KERNEL_NAMES[kernel].lower())
        assert TiledLinear(_layer()).kernel == kernel


def _pack_with_timings(model: nn.Module, tiles_faster: bool) -> None:
    def timer(kernel: str, rows: int, call) -> float:
        call()  # the candidate really runs
        return 1e-6 if (kernel == "tiles") == tiles_faster else 2e-6  # seconds

    pack_cpu_linears(model, log, timer=timer)


@needs_tiles
@pytest.mark.parametrize("bf16_packs", [True, False], ids=["onednn-packs-bf16", "avx2-alone"])
@pytest.mark.parametrize("tiles_faster", [True, False])
def test_the_bfloat16_kernel_follows_the_measurement(tiles_faster, bf16_packs, monkeypatch, caplog):
    """Tiles race oneDNN's packed product where the CPU multiplies bfloat16 natively, and plain
    `F.linear` where it does not (AVX2 alone: oneDNN does not pack bfloat16 there, and the tiles
    once were never tried, which left a bfloat16 target on torch's emulated products)."""
    if bf16_packs and not native_cpu_bf16():
        pytest.skip("oneDNN packs bfloat16 only where the CPU multiplies it natively")
    if not bf16_packs:  # on any CPU: what one with AVX2 alone chooses between
        monkeypatch.setattr(cpu_linear, "packable_dtypes", lambda: (torch.float32,))
    model = nn.Sequential(_layer(96, 160), _layer(96, 160, seed=1), _layer(40, 48))
    with caplog.at_level(logging.INFO):
        _pack_with_timings(model, tiles_faster)
    other, other_name = (PackedLinear, "packed") if bf16_packs else (nn.Linear, "F.linear")
    expected = TiledLinear if tiles_faster else other
    assert type(model[0]) is expected and type(model[1]) is expected
    assert type(model[2]) is other  # 40 inputs fit no tile: never tiled
    winner = "tiles" if tiles_faster else other_name
    assert f"96->160: tiles {1.0 if tiles_faster else 2.0:.1f}/" in caplog.text and f"at 1/9/16 rows: {winner}" in caplog.text
    assert ("oneDNN packed" in caplog.text) == bf16_packs
    assert "bfloat16 kernel measured per shape" in caplog.text


def test_a_tile_choice_takes_the_faster_over_the_timed_counts():
    choice = TileChoice(384, 384, tiled_us={1: 5.0, 9: 30.0}, packed_us={1: 20.0, 9: 20.0})
    assert choice.kernel == "tiles"  # 35 against 40 µs
    choice.tiled_us[9] = 40.0
    assert choice.kernel == "packed"


@needs_tiles
def test_a_tiled_model_keeps_its_parameters_state_dict_and_ties(tmp_path):
    path = make_qwen3(tmp_path / "m", tie_word_embeddings=True)  # every tiny shape fits whole tiles
    model = Qwen3ForCausalLM.from_pretrained(path, torch.bfloat16, "cpu")
    reference = Qwen3ForCausalLM.from_pretrained(path, torch.bfloat16, "cpu")
    keys = set(model.state_dict())
    _pack_with_timings(model, tiles_faster=True)
    assert any(isinstance(m, TiledLinear) for m in model.modules())
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
    _load_tile_kernels.cache_clear()
    try:
        model = nn.Sequential(_layer(96, 160))
        with caplog.at_level(logging.INFO):
            pack_cpu_linears(model, log)
        assert not isinstance(model[0], TiledLinear)
        reason = tile_kernels_unavailable_reason()
        assert reason is not None and ("no C compiler" in reason or "runs none of the kernels" in reason)
    finally:
        _load_tile_kernels.cache_clear()


@needs_tiles
def test_a_forward_run_in_one_call_puts_every_fitting_product_on_tiles_untimed(caplog):
    """The native forward needs every product on tiles: no product-by-product race (which a busy
    machine once lost for one layer, and with it the whole step's native call)."""
    model = nn.Sequential(_layer(96, 160), _layer(40, 48))

    def onednn_faster(kernel: str, rows: int, call) -> float:
        pytest.fail("timed a product the forward needs on tiles")

    with caplog.at_level(logging.INFO):
        pack_cpu_linears(model, log, timer=onednn_faster, whole_forward_on_tiles=True)
    # 40 inputs fit no tile: oneDNN's where it packs bfloat16, else F.linear's
    assert type(model[0]) is TiledLinear and type(model[1]) is (PackedLinear if native_cpu_bf16() else nn.Linear)
    assert "the forward runs in one native call" in caplog.text
