"""The FlashInfer attention backend (CUDA): paged prefill, verify, DFlash blocks, decode.

One step, as the model runner drives it:
  plan(meta)  builds FlashInfer's page-table inputs from the metadata on the host
              (`build_plan_inputs`, a pure function) and copies them to the device once;
  forward()   per layer: quantizes this step's K/V to the page dtype, appends it with
              `append_paged_kv_cache`, then attends with the step's wrapper. The first
              layer of a step plans the wrapper (it needs the head counts and dtypes,
              which only the layer knows); every later layer with the same shape reuses
              that plan.

Wrappers: `BatchDecodeWithPagedKVCacheWrapper` when every sequence has one query (decode
steps); `BatchPrefillWithPagedKVCacheWrapper` otherwise: prefill chunks, K+1-token verify
(causal, FlashInfer aligns the causal mask bottom-right: query i of a sequence with q
queries and kv keys sees keys 0 .. kv - q + i, as the torch backend does) and DFlash
query blocks (`meta.causal` False: every query sees all kv keys). No custom masks.

Pages: one layer region `[P, 2, ps, H, D]` (NHD) or `[P, 2, H, ps, D]` (HND), exactly
FlashInfer's single-tensor paged KV format; `kv_layout` is the resolved layout's order.
fp8 pages hold `value / scale`; the kernels read them with `k_scale` (folded into the
softmax scale) and `v_scale` (applied to the output), which is the torch backend's
`page * scale`.

Page order preference (`preferred_order`): HND on compute capability >= 9.0 (Hopper,
Blackwell), NHD below. HND keeps one head's tokens of a page contiguous
(page_size x head_dim elements: 2 KiB for fp8, page 16, dim 128), which is the tile the
decode kernels and the Blackwell trtllm-gen kernels load in one piece; FlashInfer's
trtllm-gen path only reads HND (it transposes NHD pages on every call). Both orders are
supported everywhere, so an explicit `--kv-layout` always works.

`flashinfer` is imported lazily (it needs CUDA and heavy dependencies); importing this
module works on any machine. Tests inject a pure-torch model of the kernels
(`kernels=`, tests/flashinfer_reference.py).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch

from common.attention_metadata import AttentionMetadata
from common.flashinfer_probe import KERNEL_FAMILY
from common.kv_layout import KVLayout, LayerSpec
from common.kv_quant import is_fp8_dtype, quantize

WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-KV scratch; shared by every wrapper of a backend
HOPPER = (9, 0)


# ---------------------------------------------------------------------------------------
# Availability


@lru_cache(maxsize=1)
def flashinfer_import_error() -> str | None:
    """None when `import flashinfer` works here, else why it does not (checked once)."""
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python is not installed (pip install 'splitspec[cuda]')"
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - missing CUDA libraries, wrong torch build, ...
        return f"import flashinfer failed: {type(exc).__name__}: {exc}"
    return None


def load_kernels() -> ModuleType:
    error = flashinfer_import_error()
    if error is not None:
        raise RuntimeError(f"attention backend 'flashinfer': {error}")
    return importlib.import_module("flashinfer")


# ---------------------------------------------------------------------------------------
# Plan inputs: pure, on the host


@dataclass(frozen=True)
class PagedPlanInputs:
    """FlashInfer's description of one step's batch (all int32; CPU unless moved)."""

    qo_indptr: torch.Tensor  # [B + 1] query rows of sequence b: qo_indptr[b] : qo_indptr[b + 1]
    kv_indptr: torch.Tensor  # [B + 1] its pages: kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    kv_indices: torch.Tensor  # [sum of pages] page ids, in sequence order
    kv_last_page_len: torch.Tensor  # [B] tokens in each sequence's last page (1..page_size; 0 if empty)
    batch_indices: torch.Tensor  # [T] the sequence of each query token (for the append)
    positions: torch.Tensor  # [T] each query token's position in its sequence (for the append)
    page_size: int
    causal: bool
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.batch_indices.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query: the decode wrapper serves the step."""
        return self.num_seqs > 0 and self.max_query_len == 1 and self.num_tokens == self.num_seqs

    def kv_lens(self) -> torch.Tensor:  # [B], FlashInfer's get_seq_lens
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (pages - 1).clamp(min=0) * self.page_size + self.kv_last_page_len

    def to(self, device: torch.device) -> PagedPlanInputs:
        tensors = {
            name: getattr(self, name).to(device, non_blocking=True)
            for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "batch_indices", "positions")
        }
        return PagedPlanInputs(**tensors, page_size=self.page_size, causal=self.causal,
                               max_query_len=self.max_query_len)


def build_plan_inputs(meta: AttentionMetadata) -> PagedPlanInputs:
    """From the metadata's host lists: each sequence's first ceil(seq_len / page_size) pages."""
    page_size = meta.page_size
    kv_indptr, indices, last_lens, batch_indices, positions = [0], [], [], [], []
    for b, (q_len, s_len, table) in enumerate(zip(meta.query_lens, meta.seq_lens, meta.page_tables)):
        num_pages = -(-s_len // page_size)
        if len(table) < num_pages:
            raise ValueError(f"sequence {b}: page table of {len(table)} pages cannot hold {s_len} tokens")
        indices.extend(table[:num_pages])
        kv_indptr.append(len(indices))
        last_lens.append(s_len - (num_pages - 1) * page_size if num_pages else 0)
        batch_indices.extend([b] * q_len)
        positions.extend(range(s_len - q_len, s_len))
    qo_indptr = [0]
    for q_len in meta.query_lens:
        qo_indptr.append(qo_indptr[-1] + q_len)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return PagedPlanInputs(
        qo_indptr=i32(qo_indptr),
        kv_indptr=i32(kv_indptr),
        kv_indices=i32(indices),
        kv_last_page_len=i32(last_lens),
        batch_indices=i32(batch_indices),
        positions=i32(positions),
        page_size=page_size,
        causal=meta.causal,
        max_query_len=max(meta.query_lens, default=0),
    )


# ---------------------------------------------------------------------------------------
# The backend


@dataclass
class _Step:
    """One planned step: host inputs, their device copy, and the wrappers planned so far."""

    host: PagedPlanInputs
    device: PagedPlanInputs
    planned: dict[tuple, Any] = field(default_factory=dict)  # problem key -> planned wrapper


class FlashInferAttentionBackend:
    """Paged attention with FlashInfer kernels (CUDA; NHD and HND; bf16/fp16/fp8 pages)."""

    name = "flashinfer"
    SUPPORTED_Q_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    SUPPORTED_KV_DTYPES: tuple[torch.dtype, ...] = (
        torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
    )
    SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)

    def __init__(
        self,
        layout: KVLayout,
        *,
        workspace_bytes: int = WORKSPACE_BYTES,
        kernels: Any = None,  # the `flashinfer` module, or a stand-in with the same API
        kernel_backend: str = KERNEL_FAMILY,  # fa2, pinned: what flashinfer_probe checks and the GPU checks test
    ) -> None:
        self.layout = layout
        self.workspace_bytes = workspace_bytes
        self.kernel_backend = kernel_backend
        self._kernels = kernels
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple, Any] = {}  # (kind, problem key) -> wrapper, built once
        self._step: _Step | None = None
        self._checked: set[tuple] = set()
        self.num_plans = 0  # wrapper.plan calls so far (one per step per distinct layer shape)

    @classmethod
    def unsupported_reason(
        cls,
        *,
        head_dims: tuple[int, ...] = (),
        model_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> str | None:
        """Why FlashInfer's kernels cannot serve this model (None: they can); for start-up checks."""
        problems = []
        if model_dtype is not None and model_dtype not in cls.SUPPORTED_Q_DTYPES:
            problems.append(f"the model computes in {model_dtype}; FlashInfer needs bfloat16 or float16")
        if kv_dtype is not None and kv_dtype not in cls.SUPPORTED_KV_DTYPES:
            problems.append(f"KV pages of {kv_dtype} are not supported (use bfloat16, float16 or fp8)")
        bad = sorted({d for d in head_dims if d not in cls.SUPPORTED_HEAD_DIMS})
        if bad:
            dims = ", ".join(map(str, cls.SUPPORTED_HEAD_DIMS))
            problems.append(f"head_dim {', '.join(map(str, bad))} is not one of FlashInfer's ({dims})")
        return "; ".join(problems) or None

    # -- layout resolution --------------------------------------------------------------

    @classmethod
    def supported_orders(cls, device: torch.device) -> tuple[str, ...]:
        return ("NHD", "HND")

    @classmethod
    def preferred_order(cls, device: torch.device) -> str:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= HOPPER:
            return "HND"
        return "NHD"

    # -- per step -----------------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> None:
        meta.check_page_size(self.layout.page_size)
        host = build_plan_inputs(meta)
        device = meta.slot_mapping.device
        self._ensure_workspace(device)
        self._step = _Step(host, host.to(device))

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        spec: LayerSpec,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        step = self._require_step(q.shape[0])
        self._check_problem(q, kv_cache, spec)
        self._append(k, v, kv_cache, spec, step)
        wrapper = self._planned_wrapper(step, q, kv_cache, spec, scale)
        k_scale, v_scale = (spec.k_scale, spec.v_scale) if is_fp8_dtype(kv_cache.dtype) else (None, None)
        return wrapper.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale)

    # -- internals ----------------------------------------------------------------------

    @property
    def kernels(self) -> Any:
        if self._kernels is None:
            self._kernels = load_kernels()
        return self._kernels

    def _ensure_workspace(self, device: torch.device) -> None:
        """One zeroed scratch buffer, allocated on the first plan and kept (FlashInfer wants 0s)."""
        if self._workspace is None:
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        elif self._workspace.device != device:
            raise ValueError(f"attention backend planned on {self._workspace.device}, now asked for {device}")

    def _append(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, spec: LayerSpec,
                step: _Step) -> None:
        """Quantize K/V to the page dtype (fp8: value / scale), then append them at their positions."""
        if step.host.num_tokens == 0:
            return
        d = step.device
        self.kernels.append_paged_kv_cache(
            quantize(k, kv_cache.dtype, spec.k_scale).contiguous(),
            quantize(v, kv_cache.dtype, spec.v_scale).contiguous(),
            d.batch_indices, d.positions, kv_cache, d.kv_indices, d.kv_indptr, d.kv_last_page_len,
            kv_layout=self.layout.order,
        )

    def _planned_wrapper(self, step: _Step, q: torch.Tensor, kv_cache: torch.Tensor, spec: LayerSpec,
                         scale: float) -> Any:
        """The wrapper planned for this step and this layer shape; planned on first use."""
        key = (q.shape[1], spec.num_kv_heads, spec.head_dim, q.dtype, kv_cache.dtype, float(scale))
        if key in step.planned:
            return step.planned[key]
        kind = "decode" if step.host.is_decode else "prefill"
        wrapper = self._wrapper(kind, key)
        h = step.host
        num_qo_heads, num_kv_heads, head_dim = key[0], key[1], key[2]
        dtypes = {"q_data_type": q.dtype, "kv_data_type": kv_cache.dtype, "o_data_type": q.dtype,
                  "sm_scale": float(scale)}
        if kind == "decode":
            wrapper.plan(h.kv_indptr, h.kv_indices, h.kv_last_page_len, num_qo_heads, num_kv_heads, head_dim,
                         h.page_size, **dtypes)
        else:
            wrapper.plan(h.qo_indptr, h.kv_indptr, h.kv_indices, h.kv_last_page_len, num_qo_heads, num_kv_heads,
                         head_dim, h.page_size, causal=h.causal, **dtypes)
        self.num_plans += 1
        step.planned[key] = wrapper
        return wrapper

    def _wrapper(self, kind: str, key: tuple) -> Any:
        """One wrapper per kind and layer shape for the backend's life, all on one workspace."""
        if (kind, key) not in self._wrappers:
            fi = self.kernels
            if kind == "decode":
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, self.layout.order, use_tensor_cores=True, backend=self.kernel_backend
                )
            else:
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, self.layout.order, backend=self.kernel_backend
                )
            self._wrappers[(kind, key)] = wrapper
        return self._wrappers[(kind, key)]

    def _check_problem(self, q: torch.Tensor, kv_cache: torch.Tensor, spec: LayerSpec) -> None:
        key = (q.dtype, kv_cache.dtype, spec.head_dim, q.shape[1], spec.num_kv_heads)
        if key in self._checked:
            return
        reason = self.unsupported_reason(head_dims=(spec.head_dim,), model_dtype=q.dtype, kv_dtype=kv_cache.dtype)
        if q.shape[1] % spec.num_kv_heads:
            grouping = f"{q.shape[1]} query heads are not a multiple of {spec.num_kv_heads} KV heads"
            reason = f"{reason}; {grouping}" if reason else grouping
        if reason:
            raise ValueError(f"attention backend 'flashinfer', {spec.owner} layer {spec.index}: {reason} "
                             "(use --dtype bfloat16, or --attention-backend torch)")
        self._checked.add(key)

    def _require_step(self, num_tokens: int) -> _Step:
        if self._step is None:
            raise RuntimeError("attention backend: plan(meta) must be called before forward()")
        if self._step.host.num_tokens != num_tokens:
            raise RuntimeError(
                f"attention backend: planned for {self._step.host.num_tokens} tokens, got {num_tokens} "
                "(was plan(meta) called for this step?)"
            )
        return self._step
