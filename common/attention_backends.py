"""The attention backend boundary: what a backend offers, the choices, and picking one.

A backend is built once the KV layout is resolved. Each step the model runner calls
`plan(meta)` once; every layer then calls `forward(q, k, v, kv_cache, spec, scale)`,
which writes this step's K/V into the pages at `meta.slot_mapping` and attends over
each sequence's pages. Two implement it: `common.attention.TorchAttentionBackend`
(portable) and `common.flashinfer_backend.FlashInferAttentionBackend` (CUDA).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

import common.flashinfer_backend as flashinfer_backend
from common import flashinfer_probe
from common.attention import TorchAttentionBackend
from common.attention_metadata import AttentionMetadata
from common.invariant_attention import BatchInvariantTorchBackend
from common.kv_layout import LayerSpec
from common.native_attention import (
    BatchInvariantNativeBackend,
    NativeCpuAttentionBackend,
    native_unavailable_reason,
)

log = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "native", "torch", "flashinfer")  # --attention-backend


def check_backend_name(name: str) -> None:
    if name not in BACKEND_CHOICES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_CHOICES)}, got {name!r}")


class AttentionBackend(Protocol):
    name: str

    @classmethod
    def supported_orders(cls, device: torch.device) -> tuple[str, ...]: ...

    @classmethod
    def preferred_order(cls, device: torch.device) -> str: ...

    def plan(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # one layer region
        spec: LayerSpec,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]


def select_backend(
    name: str,
    device: torch.device,
    *,
    head_dims: tuple[int, ...] = (),
    model_dtype: torch.dtype | None = None,
    kv_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
) -> type:
    """The backend class for `--attention-backend` (auto | native | torch | flashinfer).

    auto on a CPU: the native C kernels (common/native_attention.py) where this machine's C
    compiler builds them and the KV dtype is one they read, else torch, with one warning saying
    why; native: the same conditions, as a ValueError. auto on CUDA: FlashInfer where `import flashinfer` works, its kernels fit the
    model (head dims, model and KV dtypes, when given) and can be loaded or built here
    (common/flashinfer_probe.py: prebuilt kernels, or nvcc and ninja), else torch, with one
    warning saying why. flashinfer: the same conditions, as a ValueError naming what to change.
    `batch_invariant`: the torch backend's variant whose rows do not depend on the rest of
    the step (common/invariant_attention.py; the native kernels are invariant by construction),
    for a reduced-precision target on a CPU."""
    check_backend_name(name)
    torch_backend = BatchInvariantTorchBackend if batch_invariant else TorchAttentionBackend
    if name == "torch":
        return torch_backend
    if name == "native" or (name == "auto" and device.type != "cuda"):
        reason = _native_problem(device, kv_dtype)
        if reason is None:
            return BatchInvariantNativeBackend if batch_invariant else NativeCpuAttentionBackend
        if name == "native":
            raise ValueError(f"attention backend 'native' is not available: {reason}")
        log.warning("attention backend auto: %s; using the torch backend", reason)
        return torch_backend
    if device.type != "cuda":
        raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device}")
    flashinfer = flashinfer_backend.FlashInferAttentionBackend
    reason = flashinfer_backend.flashinfer_import_error() or flashinfer.unsupported_reason(
        head_dims=tuple(head_dims), model_dtype=model_dtype, kv_dtype=kv_dtype
    ) or flashinfer_probe.flashinfer_runnable_reason(tuple(head_dims), model_dtype, kv_dtype)
    if reason is None:
        return flashinfer
    if name == "auto":
        log.warning("attention backend auto: %s; using the torch backend", reason)
        return TorchAttentionBackend
    raise ValueError(f"attention backend 'flashinfer' is not available: {reason}")


def _native_problem(device: torch.device, kv_dtype: torch.dtype | None) -> str | None:
    """Why the native CPU kernels cannot serve this device and KV dtype, or None."""
    if device.type != "cpu":
        return f"the native kernels run on a CPU, not {device}"
    if kv_dtype is not None and kv_dtype not in NativeCpuAttentionBackend.DTYPE_KINDS:
        return f"the native kernels do not read {kv_dtype} pages"
    return native_unavailable_reason()
