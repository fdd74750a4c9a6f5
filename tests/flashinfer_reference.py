"""A pure-torch model of the FlashInfer calls the backend makes, for CPU tests and the GPU checks.

`ReferenceKernels` stands in for the `flashinfer` module (`FlashInferAttentionBackend(...,
kernels=ReferenceKernels())`): its wrappers and `append_paged_kv_cache` compute, with
`reference_append` and `reference_attention`, what FlashInfer's kernels compute from the
same plan inputs, and record each call so that tests can count plans and appends.
"""

from __future__ import annotations

import math

import torch

from common.flashinfer_backend import PagedPlanInputs
from common.kv_quant import dequantize, is_fp8_dtype


def kv_slots(inputs: PagedPlanInputs, seq: int) -> list[int]:
    """The slots (page * page_size + offset) of sequence `seq`'s keys 0 .. kv_len - 1."""
    ps = inputs.page_size
    lo = int(inputs.kv_indptr[seq])
    kv_len = int(inputs.kv_lens()[seq])
    pages = inputs.kv_indices.tolist()
    return [pages[lo + j // ps] * ps + j % ps for j in range(kv_len)]


def append_slots(inputs: PagedPlanInputs) -> torch.Tensor:
    """[T] int64: the slot `append_paged_kv_cache` writes each query token's K/V to."""
    ps = inputs.page_size
    b = inputs.batch_indices.long()
    pos = inputs.positions.long()
    pages = inputs.kv_indices.long()[inputs.kv_indptr.long()[b] + pos // ps]
    return pages * ps + pos % ps


def visible_keys(inputs: PagedPlanInputs, seq: int, query: int) -> int:
    """How many of the sequence's keys (0 .. n - 1) query `query` of it attends to."""
    kv_len = int(inputs.kv_lens()[seq])
    if not inputs.causal:
        return kv_len
    q_len = int(inputs.qo_indptr[seq + 1] - inputs.qo_indptr[seq])
    return kv_len - q_len + query + 1


def reference_append(
    k: torch.Tensor,  # [T, H, D] already in the page dtype
    v: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [P, 2, ps, H, D] (NHD) or [P, 2, H, ps, D] (HND)
    inputs: PagedPlanInputs,
    order: str,
) -> None:
    """What `append_paged_kv_cache` does: token t goes to its sequence's page for its position."""
    slots = append_slots(inputs)
    pages, offsets = slots // inputs.page_size, slots % inputs.page_size
    for plane, x in ((0, k), (1, v)):
        if order == "NHD":
            kv_cache[pages, plane, offsets] = x
        else:
            kv_cache[pages, plane, :, offsets] = x


def reference_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,
    inputs: PagedPlanInputs,
    order: str,
    *,
    sm_scale: float,
    k_scale: float | None = None,
    v_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """What the paged wrappers compute, in float32: softmax(q k^T * sm_scale * k_scale) v * v_scale."""
    if is_fp8_dtype(kv_cache.dtype):
        kv_cache = dequantize(kv_cache, torch.float32)  # the page values; the scales come below
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    heads = q.shape[1]
    ps = inputs.page_size
    for b in range(inputs.num_seqs):
        lo, hi = int(inputs.qo_indptr[b]), int(inputs.qo_indptr[b + 1])
        if hi == lo:
            continue
        slots = torch.tensor(kv_slots(inputs, b), dtype=torch.long, device=kv_cache.device)
        pages, offsets = slots // ps, slots % ps
        if order == "NHD":
            keys, values = kv_cache[pages, 0, offsets], kv_cache[pages, 1, offsets]  # [S, Hkv, D]
        else:
            keys, values = kv_cache[pages, 0, :, offsets], kv_cache[pages, 1, :, offsets]
        keys, values = keys.float(), values.float()
        group = heads // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[lo:hi].float().transpose(0, 1)  # [Hq, Q, D]
        scores = queries @ keys.transpose(1, 2) * (sm_scale * (k_scale or 1.0))  # [Hq, Q, S]
        seen = torch.tensor([visible_keys(inputs, b, i) for i in range(hi - lo)], device=q.device)  # [Q]
        hidden = torch.arange(keys.shape[1], device=q.device)[None, :] >= seen[:, None]  # [Q, S]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[lo:hi] = (scores.softmax(-1) @ values).transpose(0, 1) * (v_scale or 1.0)
    return out.to(out_dtype or q.dtype)


class ReferenceKernels:
    """The slice of FlashInfer's API the backend uses, computed by the pure-torch model.

    Signatures follow flashinfer-python 0.7.2: the wrappers take the workspace and the
    layout, `plan` takes host page tables and head counts, `run(q, paged_kv_cache,
    k_scale=, v_scale=)`. It records calls so that tests can count plans and appends, and
    the workspace each wrapper was given.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.workspaces: list[torch.Tensor] = []  # one per wrapper built, in order
        kernels = self

        class _Wrapper:
            kind = ""

            def __init__(self, float_workspace_buffer, kv_layout="NHD", **kwargs) -> None:
                kernels.calls.append(f"new_{self.kind}")
                kernels.workspaces.append(float_workspace_buffer)
                self.workspace = float_workspace_buffer
                self.kv_layout = kv_layout
                self.options = kwargs
                self.inputs: PagedPlanInputs | None = None

            def _plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
                      head_dim, page_size, causal, q_data_type, kv_data_type, o_data_type, sm_scale) -> None:
                kernels.calls.append(f"plan_{self.kind}")
                num_tokens = int(qo_indptr[-1])
                self.inputs = PagedPlanInputs(
                    qo_indptr, kv_indptr, kv_indices, last_page_len,
                    torch.zeros(num_tokens, dtype=torch.int32), torch.zeros(num_tokens, dtype=torch.int32),
                    page_size, causal, int((qo_indptr[1:] - qo_indptr[:-1]).max()) if num_tokens else 0,
                )
                self.shape = (num_qo_heads, num_kv_heads, head_dim)
                self.dtypes = (q_data_type, kv_data_type, o_data_type)
                self.sm_scale = sm_scale if sm_scale is not None else 1 / math.sqrt(head_dim)

            def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None):
                kernels.calls.append(f"run_{self.kind}")
                if self.inputs is None:
                    raise RuntimeError("run before plan")
                if (q.shape[1], paged_kv_cache.shape[-1]) != (self.shape[0], self.shape[2]):
                    raise RuntimeError(f"planned {self.shape}, ran q {tuple(q.shape)}")
                if (q.dtype, paged_kv_cache.dtype) != self.dtypes[:2]:
                    raise RuntimeError(f"planned dtypes {self.dtypes[:2]}, ran {q.dtype}, {paged_kv_cache.dtype}")
                return reference_attention(q, paged_kv_cache, self.inputs, self.kv_layout, sm_scale=self.sm_scale,
                                           k_scale=k_scale, v_scale=v_scale, out_dtype=self.dtypes[2])

        class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
            kind = "prefill"

            def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                     num_kv_heads, head_dim_qk, page_size, *, causal=False, q_data_type="float16",
                     kv_data_type=None, o_data_type=None, sm_scale=None, **_) -> None:
                self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                           num_kv_heads, head_dim_qk, page_size, causal, q_data_type,
                           kv_data_type or q_data_type, o_data_type or q_data_type, sm_scale)

        class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
            kind = "decode"

            def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                     q_data_type="float16", kv_data_type=None, o_data_type=None, sm_scale=None, **_) -> None:
                batch = last_page_len.shape[0]
                qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
                self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                           page_size, True, q_data_type, kv_data_type or q_data_type, o_data_type or q_data_type,
                           sm_scale)

        self.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
        self.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper

    def append_paged_kv_cache(self, append_key, append_value, batch_indices, positions, paged_kv_cache,
                              kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD") -> None:
        self.calls.append("append")
        if append_key.dtype != paged_kv_cache.dtype:
            raise RuntimeError(f"append: keys in {append_key.dtype}, pages in {paged_kv_cache.dtype}")
        page_size = paged_kv_cache.shape[2] if kv_layout == "NHD" else paged_kv_cache.shape[3]
        inputs = PagedPlanInputs(
            torch.zeros(kv_last_page_len.shape[0] + 1, dtype=torch.int32), kv_indptr, kv_indices, kv_last_page_len,
            batch_indices, positions, page_size, True, 1,
        )
        reference_append(append_key, append_value, paged_kv_cache, inputs, kv_layout)
