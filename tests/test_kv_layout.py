import dataclasses
import os
import stat

import pytest
import torch

from common.kv_layout import (
    CacheConfig,
    LayerSpec,
    LayoutNotResolvedError,
    LayoutResolutionError,
    StagingSpec,
    build_layout,
    bytes_per_page,
    canonical_kv_dtype,
    resolve_order,
)
from common.kv_pool import PagePool, remove_stale_shm_files
from common.pool_transport import write_canary
from common.shm_file import map_pool_file


def _layout(order="NHD", kv_dtype="float32", **kw):
    layers = [LayerSpec("target", i, 2, 16) for i in range(2)] + [LayerSpec("draft", 0, 1, 8)]
    return build_layout(order=order, page_size=4, kv_dtype=kv_dtype, num_pages=5, layers=layers, target_id="abc123", **kw)


def test_seed_replace_shares_resolved_layout_but_not_cache_dtype():
    target_cfg = CacheConfig()
    draft_cfg = dataclasses.replace(target_cfg, cache_dtype="fp8")
    with pytest.raises(LayoutNotResolvedError, match="KV cache layout has not been resolved yet"):
        _ = draft_cfg.layout
    assert target_cfg.cache_dtype == "auto"
    assert draft_cfg.cache_dtype == "fp8"

    layout = _layout()
    target_cfg.resolve_layout(layout)  # resolved late, after both configs exist
    assert draft_cfg.layout is layout and target_cfg.layout is layout

    relayout = _layout(order="HND", epoch=1)
    draft_cfg.resolve_layout(relayout)  # a re-handshake is visible from either side
    assert target_cfg.layout is relayout
    assert target_cfg.cache_dtype == "auto" and draft_cfg.cache_dtype == "fp8"


def test_fresh_config_does_not_share_state():
    a, b = CacheConfig(), CacheConfig()
    a.resolve_layout(_layout())
    assert not b.is_layout_resolved


@pytest.mark.parametrize("kwargs, match", [
    ({"cache_dtype": "int4"}, "cache_dtype"),
    ({"page_size": 12}, "page_size"),
    ({"kv_layout": "NDH"}, "kv_layout"),
    ({"memory_fraction": 0.0}, "memory_fraction"),
])
def test_cache_config_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_resolve_order_rules():
    assert resolve_order("auto", target_supported=("NHD", "HND"), target_preferred="HND") == "HND"
    assert resolve_order("auto", target_supported=("NHD", "HND"), target_preferred="HND",
                         drafter_supported=("NHD",)) == "NHD"
    assert resolve_order("NHD", target_supported=("NHD", "HND"), target_preferred="HND") == "NHD"
    with pytest.raises(LayoutResolutionError, match="not supported by the drafter"):
        resolve_order("HND", target_supported=("NHD", "HND"), target_preferred="NHD", drafter_supported=("NHD",))
    with pytest.raises(LayoutResolutionError, match="no KV page order"):
        resolve_order("auto", target_supported=("HND",), target_preferred="HND", drafter_supported=("NHD",))


def test_layout_regions_are_aligned_and_disjoint():
    layout = _layout(kv_dtype="fp8_e4m3", staging=StagingSpec(rows=8, width=24))
    spans = sorted((s.offset, s.offset + layout.region_bytes(s)) for s in layout.layers)
    spans.append((layout.staging.offset, layout.staging.offset + layout.staging.nbytes))
    spans.sort()
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert all(off % 256 == 0 for off, _ in spans)
    assert layout.total_bytes >= spans[-1][1]
    assert bytes_per_page(4, "fp8_e4m3", list(layout.layers)) == 2 * 4 * (2 * 16 * 2 + 8)


def test_canonical_kv_dtype():
    assert canonical_kv_dtype("auto", torch.bfloat16) == "bfloat16"
    assert canonical_kv_dtype("fp8", torch.float32) == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv cache dtype"):
        canonical_kv_dtype("int8", torch.float32)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_pool_is_one_private_shm_file_shared_by_a_second_mapping(tmp_path, order):
    layout = _layout(order=order, kv_dtype="fp8_e4m3", staging=StagingSpec(rows=4, width=8))
    pool = PagePool.create(layout, torch.device("cpu"), tmp_path)
    path = pool.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    region = pool.region(layout.layer("target", 1))
    assert region.shape == layout.region_shape(layout.layer("target", 1))
    assert region.dtype == torch.float8_e4m3fn
    region[3, 1].fill_(1.5)
    pool.staging()[2].fill_(7.0)

    canary = write_canary(pool)
    storage = map_pool_file(tmp_path, str(path), layout.total_bytes, canary.offset, canary.value)  # the drafter's
    other = PagePool(layout, storage, torch.device("cpu"))
    assert torch.equal(other.region(layout.layer("target", 1))[3, 1].float(), torch.full_like(region[3, 1].float(), 1.5))
    assert other.staging()[2].eq(7.0).all()
    assert other.region(layout.layer("target", 0)).float().abs().sum() == 0
    pool.close()
    assert not path.exists()


def test_stale_shm_files_removed_only_for_dead_targets(tmp_path):
    dead = tmp_path / "splitspec-abcd-999999999-e0.kv"
    mine = tmp_path / f"splitspec-abcd-{os.getpid()}-e0.kv"
    unrelated = tmp_path / "something-else.kv"
    for p in (dead, mine, unrelated):
        p.write_bytes(b"x")
    removed = remove_stale_shm_files(tmp_path)
    assert removed == [dead]
    assert mine.exists() and unrelated.exists()


def test_a_locked_pool_file_is_kept_even_when_its_pid_looks_dead(tmp_path):
    """A target in another pid namespace: its pid means nothing here, its flock does."""
    import fcntl

    path = tmp_path / "splitspec-abcd-999999999-e0.kv"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_stale_shm_files(tmp_path) == [] and path.exists()
    finally:
        os.close(fd)
    assert remove_stale_shm_files(tmp_path) == [path]


def test_a_pool_holds_its_files_lock_until_closed(tmp_path):
    import fcntl

    layout = build_layout(order="NHD", page_size=4, kv_dtype="float32", num_pages=2,
                          layers=[LayerSpec("target", 0, 1, 8)], target_id="abcd", epoch=0)
    pool = PagePool.create(layout, torch.device("cpu"), tmp_path)
    fd = os.open(pool.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    pool.close()
    assert pool.lock_fd is None and not list(tmp_path.iterdir())
