"""The native CPU attention kernels (common/native_attention.py): the model's head sizes against
the torch backend, bit-identical rows whatever the batch, crafted page tables refused, and the
fall back to torch where no C compiler is found. (tests/test_attention.py runs every paging
case of the torch backend through the native one too.)"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from common.attention import TorchAttentionBackend
from common.attention_backends import select_backend
from common.attention_metadata import AttentionMetadata
from common.kv_layout import LayerSpec, build_layout
from common.native_attention import BatchInvariantNativeBackend, NativeCpuAttentionBackend
from common.native_build import NativeKernelUnavailable, build_library

PAGE_SIZE = 16


class Pages:
    """One layer's pool region with a few sequences written into it through `backend`."""

    def __init__(self, backend_cls: type, head_dim: int, kv_dtype: str = "float32", order: str = "NHD",
                 q_heads: int = 6, kv_heads: int = 3, num_pages: int = 64, seed: int = 0) -> None:
        spec = LayerSpec("target", 0, kv_heads, head_dim, k_scale=0.5 if kv_dtype.startswith("fp8") else 1.0)
        self.layout = build_layout(order=order, page_size=PAGE_SIZE, kv_dtype=kv_dtype, num_pages=num_pages,
                                   layers=[spec])
        self.spec = self.layout.layers[0]
        self.cache = torch.zeros(self.layout.region_shape(self.spec), dtype=self.layout.torch_dtype)
        self.backend = backend_cls(self.layout)
        self.gen = torch.Generator().manual_seed(seed)
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        ids = list(range(1, num_pages))
        random.Random(seed).shuffle(ids)
        self.free = ids

    def table(self, length: int) -> list[int]:
        pages, self.free = self.free[: -(-length // PAGE_SIZE)], self.free[-(-length // PAGE_SIZE):]
        return pages

    def qkv(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def make(heads: int) -> torch.Tensor:
            return torch.randn(rows, heads, self.head_dim, generator=self.gen)
        return make(self.q_heads), make(self.kv_heads), make(self.kv_heads)

    def step(self, query_lens, seq_lens, tables, q, k, v, causal: bool = True) -> torch.Tensor:
        meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, page_tables=tables,
                                       page_size=PAGE_SIZE, device=torch.device("cpu"), causal=causal)
        self.backend.plan(meta)
        return self.backend.forward(q, k, v, self.cache, self.spec, self.spec.head_dim ** -0.5)


def run_steps(backend_cls: type, head_dim: int, kv_dtype: str, order: str) -> list[torch.Tensor]:
    """A prefill of two sequences, a decode of both, a verify of 9 beside a decode, a non-causal block."""
    torch.manual_seed(0)
    pages = Pages(backend_cls, head_dim, kv_dtype, order)
    tables = [pages.table(200), pages.table(200)]
    outs = [pages.step([30, 12], [30, 12], tables, *pages.qkv(42))]
    outs.append(pages.step([1, 1], [31, 13], tables, *pages.qkv(2)))
    outs.append(pages.step([9, 1], [40, 14], tables, *pages.qkv(10)))
    outs.append(pages.step([8, 8], [48, 22], tables, *pages.qkv(16), causal=False))
    return outs


@pytest.mark.parametrize("head_dim", [64, 128, 12])  # the register path, whole vectors, the scalar tail
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_native_computes_what_the_torch_backend_does(head_dim, kv_dtype, order):
    expected = run_steps(TorchAttentionBackend, head_dim, kv_dtype, order)
    for backend_cls in (NativeCpuAttentionBackend, BatchInvariantNativeBackend):
        got = run_steps(backend_cls, head_dim, kv_dtype, order)
        for step, (a, b) in enumerate(zip(got, expected, strict=True)):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"{backend_cls.name} step {step}")


def test_a_row_has_the_same_bits_in_a_decode_a_verify_a_batch_and_a_prefill_chunk():
    """What lossless speculation on a reduced-precision target needs of attention."""
    pages = Pages(BatchInvariantNativeBackend, 64)
    table, other = pages.table(300), pages.table(300)
    q, k, v = pages.qkv(200)
    oq, ok, ov = pages.qkv(200)
    pages.step([150], [150], [table], q[:150], k[:150], v[:150])  # the prefix, written once
    pages.step([150], [150], [other], oq[:150], ok[:150], ov[:150])
    decodes = torch.cat([pages.step([1], [p + 1], [table], q[p:p + 1], k[p:p + 1], v[p:p + 1])
                         for p in range(150, 159)])
    ways = {
        "a verify of 9": pages.step([9], [159], [table], q[150:159], k[150:159], v[150:159]),
        "a verify beside other sequences": pages.step(
            [2, 9], [152, 159], [other, table], torch.cat([oq[150:152], q[150:159]]),
            torch.cat([ok[150:152], k[150:159]]), torch.cat([ov[150:152], v[150:159]]))[2:],
        "a prefill chunk of 40": pages.step([40], [159], [table], q[119:159], k[119:159], v[119:159])[-9:],
    }
    for way, rows in ways.items():
        assert torch.equal(rows, decodes), f"attention gives a row other bits in {way} than in its decode"


def test_crafted_page_tables_are_refused_not_read():
    """Page ids and lengths may come from another process: the kernel checks every one it reads."""
    pages = Pages(NativeCpuAttentionBackend, 64, num_pages=8)
    table = pages.table(40)
    for bad_page, why in ((10**6, "page id outside the pool"), (-3, "page id outside the pool")):
        meta = AttentionMetadata.build(query_lens=[1], seq_lens=[40], page_tables=[table], page_size=PAGE_SIZE,
                                       device=torch.device("cpu"))
        meta.page_table_tensor[0, 1] = bad_page
        pages.backend.plan(meta)
        with pytest.raises(ValueError, match=why):
            pages.backend.forward(*pages.qkv(1), pages.cache, pages.spec, 0.125)
    meta = AttentionMetadata.build(query_lens=[1], seq_lens=[40], page_tables=[table], page_size=PAGE_SIZE,
                                   device=torch.device("cpu"))
    meta.slot_mapping[0] = 8 * PAGE_SIZE + 3  # a write past the pool
    pages.backend.plan(meta)
    with pytest.raises(ValueError, match="page id outside the pool"):
        pages.backend.forward(*pages.qkv(1), pages.cache, pages.spec, 0.125)
    meta.slot_mapping[0] = table[0] * PAGE_SIZE
    pages.backend.plan(meta)
    q, k, v = pages.qkv(1)
    wide = torch.randn(1, k.shape[1] + 1, k.shape[2])  # more heads than a page row holds
    with pytest.raises(ValueError, match="does not fit pages"):
        pages.backend.forward(q, wide, wide, pages.cache, pages.spec, 0.125)
    with pytest.raises(ValueError, match="disagree"):
        pages.backend.forward(q, k, torch.cat([v, v]), pages.cache, pages.spec, 0.125)
    short = AttentionMetadata.build(query_lens=[2], seq_lens=[40], page_tables=[table], page_size=PAGE_SIZE,
                                    device=torch.device("cpu"))
    short.slot_mapping = short.slot_mapping[:1]  # fewer slots than tokens
    with pytest.raises(ValueError, match="1 slots for 1 sequences of 2 tokens"):
        pages.backend.plan(short)
    meta.seq_lens[0] = 49  # more keys than the table's 3 pages hold
    meta.slot_mapping[0] = table[0] * PAGE_SIZE
    pages.backend.plan(meta)
    with pytest.raises(ValueError, match="does not fit its page table"):
        pages.backend.forward(*pages.qkv(1), pages.cache, pages.spec, 0.125)


def test_without_a_c_compiler_auto_falls_back_to_torch_and_native_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPLITSPEC_KERNEL_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", cpu) is TorchAttentionBackend
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="'native' is not available: no C compiler"):
        select_backend("native", cpu)


def test_the_library_is_compiled_once_per_machine_and_reused(tmp_path):
    first = build_library("paged_attention", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_library("paged_attention", tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_a_cache_another_user_could_write_is_not_loaded_from(tmp_path, monkeypatch):
    """The library runs as this process: a shared, writable cache folder or a planted link is refused."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(NativeKernelUnavailable, match="only it can write"):
        build_library("paged_attention", shared)
    private = tmp_path / "private"
    built = build_library("paged_attention", private)
    built.unlink()
    built.symlink_to(tmp_path / "elsewhere.so")  # a link where the library should be
    with pytest.raises(NativeKernelUnavailable, match="not loading kernels"):
        build_library("paged_attention", private)
    monkeypatch.setenv("SPLITSPEC_KERNEL_CACHE", str(shared))
    with pytest.raises(ValueError, match="'native' is not available: .*only it can write"):
        select_backend("native", torch.device("cpu"))
