"""`--attention-backend auto` picks FlashInfer only where its kernels can run (defect 4 of issue 12).

`import flashinfer` working is not enough: without prebuilt kernels, FlashInfer compiles
them with nvcc through ninja on first use, so a machine with neither dies in the warm-up.
The decision is a pure function of facts (common/flashinfer_probe.py); here the facts are
injected, and `select_backend` is driven through them.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

import common.flashinfer_backend as fib
import common.flashinfer_probe as probe
from common.attention import TorchAttentionBackend
from common.attention_backends import select_backend
from common.flashinfer_backend import FlashInferAttentionBackend
from common.flashinfer_probe import FlashInferFacts, flashinfer_runnable_reason, why_flashinfer_cannot_run

PREFILL = "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_e4m3_..._kv_stride_equal"
NEEDED = ("page", PREFILL)
CUDA = torch.device("cuda")
FITS = {"head_dims": (128,), "model_dtype": torch.bfloat16, "kv_dtype": torch.float8_e4m3fn}


def facts(**overrides) -> FlashInferFacts:
    """A machine with ninja and nothing else: no nvcc, no prebuilt kernels, an empty JIT cache."""
    return FlashInferFacts(**{"needed_modules": NEEDED, "ninja": "/usr/bin/ninja", "jit_dir": "/cache/cached_ops",
                              **overrides})


@pytest.mark.parametrize("overrides,runs", [
    ({}, False),  # imports, but nothing can build or load the kernels
    ({"nvcc": "/usr/local/cuda/bin/nvcc"}, True),  # compiles them on first use
    ({"nvcc": "/usr/local/cuda/bin/nvcc", "ninja": None}, False),  # ninja drives every JIT build and load
    ({"aot_modules": frozenset(NEEDED), "ninja": None}, True),  # prebuilt: loaded as they are
    ({"aot_modules": frozenset({"page"})}, False),  # one module still has to be compiled
    ({"jit_cached_modules": frozenset(NEEDED), "cuda_home": "/usr/local/cuda"}, True),  # ninja: up to date
    ({"jit_cached_modules": frozenset(NEEDED)}, False),  # FlashInfer cannot resolve a CUDA home to run ninja
    ({"aot_modules": frozenset({"page"}), "jit_cached_modules": frozenset({PREFILL}), "cuda_home": "/cuda"}, True),
    ({"nvcc": "/usr/local/cuda/bin/nvcc", "jit_disabled": True}, False),  # FLASHINFER_DISABLE_JIT
    ({"aot_modules": frozenset(NEEDED), "jit_disabled": True}, True),
])
def test_flashinfer_runs_only_with_prebuilt_kernels_or_the_tools_to_build_them(overrides, runs):
    reason = why_flashinfer_cannot_run(facts(**overrides))
    assert (reason is None) == runs, reason


def test_the_reason_names_what_is_missing_and_how_to_fix_it():
    reason = why_flashinfer_cannot_run(facts(jit_cached_modules=frozenset({"page"})))
    assert "no CUDA compiler" in reason and "CUDA_HOME" in reason and "/cache/cached_ops" in reason
    assert reason.endswith(f"hold {PREFILL}")
    assert "ninja is not on PATH" in why_flashinfer_cannot_run(facts(ninja=None))
    assert "FLASHINFER_DISABLE_JIT" in why_flashinfer_cannot_run(facts(jit_disabled=True))


def test_auto_falls_back_to_torch_with_one_line_saying_why(monkeypatch, caplog):
    """flashinfer imports, the model fits its kernels, but nothing can build them."""
    monkeypatch.setattr(fib, "flashinfer_import_error", lambda: None)
    monkeypatch.setattr(probe, "gather_facts", lambda head_dims, q, kv: facts(), raising=False)
    with caplog.at_level(logging.WARNING, logger="common.attention_backends"):
        assert select_backend("auto", CUDA, **FITS) is TorchAttentionBackend
    lines = [r.getMessage() for r in caplog.records if r.name == "common.attention_backends"]
    assert len(lines) == 1 and "no CUDA compiler" in lines[0] and "using the torch backend" in lines[0]
    with pytest.raises(ValueError, match="not available: no CUDA compiler"):
        select_backend("flashinfer", CUDA, **FITS)
    monkeypatch.setattr(probe, "gather_facts", lambda head_dims, q, kv: facts(nvcc="/cuda/bin/nvcc"))
    assert select_backend("auto", CUDA, **FITS) is FlashInferAttentionBackend


def test_the_probe_asks_for_the_models_modules_and_survives_a_changed_flashinfer():
    asked = []

    def gather(head_dims, q_dtype, kv_dtype):
        asked.append((head_dims, q_dtype, kv_dtype))
        return facts(nvcc="/cuda/bin/nvcc")

    assert flashinfer_runnable_reason((64, 128), torch.bfloat16, torch.float8_e4m3fn, gather) is None
    assert flashinfer_runnable_reason((128,), None, None, gather) is None  # unknown dtypes: bf16 queries and pages
    assert asked == [((64, 128), torch.bfloat16, torch.float8_e4m3fn), ((128,), torch.bfloat16, torch.bfloat16)]

    def broken(*args):
        raise AttributeError("module 'flashinfer.jit' has no attribute 'env'")

    assert "cannot check FlashInfer's kernels (AttributeError" in flashinfer_runnable_reason((128,), None, None, broken)


def test_the_backend_pins_the_kernel_family_the_probe_checks():
    default = inspect.signature(FlashInferAttentionBackend.__init__).parameters["kernel_backend"].default
    assert default == probe.KERNEL_FAMILY == "fa2"
