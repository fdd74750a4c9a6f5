"""The KV-cache layout both services agree on, and the cache config that shares it.

`KVLayout` is everything a process must know before touching a page of the pool.
`CacheConfig` holds the operator's wishes (dtype, page size, order) plus a
`LayoutState` shared by every `dataclasses.replace()` copy: the layout is only known
after the model (and attention backend) is built, and every copy must see it then.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from splitspec.cli_args import DEFAULT_SHM_DIR

Order = Literal["NHD", "HND"]
ORDERS: tuple[Order, ...] = ("NHD", "HND")

KV_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# Aliases an operator may type; "auto" means "the model's compute dtype".
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CACHE_DTYPE_CHOICES = ("auto", "fp8", *KV_DTYPES)

LAYOUT_NOT_RESOLVED = "KV cache layout has not been resolved yet"
REGION_ALIGNMENT = 256  # bytes; keeps every layer region aligned for vectorized kernels
TRAILER_BYTES = REGION_ALIGNMENT
CHANNEL_HEADER_BYTES = 64  # the Propose channel's header words (common/shm_channel.py)
DEFAULT_CHANNEL_CAPACITY = 1 << 20  # bytes each way: a Propose of a 2048-token prefill chunk is ~12 KB


class LayoutNotResolvedError(RuntimeError):
    """The layout was read before the target resolved it (or after it was dropped)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(LAYOUT_NOT_RESOLVED + (f": {detail}" if detail else ""))


class LayoutResolutionError(ValueError):
    """No page order satisfies both the request and every backend involved."""


def check_cache_dtype(name: str) -> None:
    """A `--kv-cache-dtype` value: auto, or a KV dtype or one of its aliases."""
    if name != "auto" and KV_DTYPE_ALIASES.get(name, name) not in KV_DTYPES:
        raise ValueError(f"cache_dtype must be one of {', '.join(CACHE_DTYPE_CHOICES)}, got {name!r}")


def canonical_kv_dtype(name: str, model_dtype: torch.dtype) -> str:
    """Map a `--kv-cache-dtype` value to a key of `KV_DTYPES`."""
    if name == "auto":
        for key, dtype in KV_DTYPES.items():
            if dtype == model_dtype:
                return key
        raise ValueError(f"no KV dtype matches the model dtype {model_dtype}")
    key = KV_DTYPE_ALIASES.get(name, name)
    if key not in KV_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(CACHE_DTYPE_CHOICES)}, got {name!r}")
    return key


def is_fp8(kv_dtype: str) -> bool:
    return kv_dtype.startswith("fp8")


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's region of the pool."""

    owner: Literal["target", "draft"]
    index: int
    num_kv_heads: int
    head_dim: int
    offset: int = 0  # bytes from the start of the pool
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.owner not in ("target", "draft"):
            raise ValueError(f"layer owner must be 'target' or 'draft', got {self.owner!r}")
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"layer {self.owner}/{self.index}: heads and head_dim must be positive")
        if self.k_scale <= 0 or self.v_scale <= 0:
            raise ValueError(f"layer {self.owner}/{self.index}: k/v scales must be positive")

    @property
    def key(self) -> tuple[str, int]:
        return (self.owner, self.index)


@dataclass(frozen=True)
class StagingSpec:
    """The hidden-state staging buffer: `rows` rows of `width` values."""

    rows: int
    width: int
    dtype: str = "float32"
    offset: int = 0
    layer_ids: tuple[int, ...] = ()  # target layers whose hidden states fill a row, in order

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * KV_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class ChannelSpec:
    """The Propose channel's region (common/shm_channel.py): a header and `capacity` bytes each way."""

    capacity: int
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return CHANNEL_HEADER_BYTES + 2 * self.capacity


@dataclass(frozen=True)
class KVLayout:
    order: Order
    page_size: int
    kv_dtype: str
    num_pages: int
    layers: tuple[LayerSpec, ...]
    staging: StagingSpec | None = None
    target_id: str = ""
    epoch: int = 0
    total_bytes: int = 0
    channel: ChannelSpec | None = None  # a CPU pool's Propose channel, when the target offers one

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"kv layout order must be NHD or HND, got {self.order!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv dtype {self.kv_dtype!r}")
        if self.page_size <= 0 or self.num_pages <= 0:
            raise ValueError("page_size and num_pages must be positive")
        keys = [layer.key for layer in self.layers]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate layer in KV layout")

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def trailer_offset(self) -> int:
        """Start of the bytes after every region (the handshake canary lives there)."""
        return self.total_bytes - TRAILER_BYTES

    def layer(self, owner: str, index: int) -> LayerSpec:
        for spec in self.layers:
            if spec.owner == owner and spec.index == index:
                return spec
        raise KeyError(f"no {owner} layer {index} in the KV layout")

    def page_shape(self, spec: LayerSpec) -> tuple[int, int, int]:
        """Shape of one K (or V) page: [tokens, heads, dim] (NHD) or [heads, tokens, dim] (HND)."""
        if self.order == "NHD":
            return (self.page_size, spec.num_kv_heads, spec.head_dim)
        return (spec.num_kv_heads, self.page_size, spec.head_dim)

    def region_shape(self, spec: LayerSpec) -> tuple[int, ...]:
        return (self.num_pages, 2, *self.page_shape(spec))

    def region_bytes(self, spec: LayerSpec) -> int:
        return _numel(self.region_shape(spec)) * self.torch_dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int) -> int:
    return (n + REGION_ALIGNMENT - 1) // REGION_ALIGNMENT * REGION_ALIGNMENT


def bytes_per_page(page_size: int, kv_dtype: str, layers: list[LayerSpec]) -> int:
    """Bytes one page id costs across every layer (K and V)."""
    itemsize = KV_DTYPES[kv_dtype].itemsize
    return sum(2 * page_size * spec.num_kv_heads * spec.head_dim * itemsize for spec in layers)


def build_layout(
    *,
    order: Order,
    page_size: int,
    kv_dtype: str,
    num_pages: int,
    layers: list[LayerSpec],
    staging: StagingSpec | None = None,
    target_id: str = "",
    epoch: int = 0,
    channel: ChannelSpec | None = None,
) -> KVLayout:
    """Place every layer region, the staging buffer and the channel in one storage, aligned."""
    draft = KVLayout(order, page_size, kv_dtype, num_pages, tuple(layers), None, target_id, epoch)
    cursor = 0
    placed: list[LayerSpec] = []
    for spec in layers:
        placed.append(dataclasses.replace(spec, offset=cursor))
        cursor = _align(cursor + draft.region_bytes(spec))
    if staging is not None:
        staging = dataclasses.replace(staging, offset=cursor)
        cursor = _align(cursor + staging.nbytes)
    if channel is not None:
        channel = dataclasses.replace(channel, offset=cursor)
        cursor = _align(cursor + channel.nbytes)
    # a trailer no region uses: the handshake canary lives there
    return dataclasses.replace(draft, layers=tuple(placed), staging=staging, channel=channel,
                               total_bytes=cursor + TRAILER_BYTES)


def resolve_order(
    requested: str,
    *,
    target_supported: tuple[str, ...],
    target_preferred: str,
    drafter_supported: tuple[str, ...] | None = None,
) -> Order:
    """Pick the page order: an explicit request must suit every side; else the target's
    preference if everyone supports it, else the first common order."""
    sides = {"target": tuple(target_supported)}
    if drafter_supported is not None:
        sides["drafter"] = tuple(drafter_supported)
    common = [o for o in ORDERS if all(o in s for s in sides.values())]
    if requested != "auto":
        if requested not in ORDERS:
            raise LayoutResolutionError(f"--kv-layout must be NHD, HND or auto, got {requested!r}")
        missing = [name for name, s in sides.items() if requested not in s]
        if missing:
            detail = _supported_detail(sides)
            raise LayoutResolutionError(
                f"--kv-layout {requested} is not supported by the {' and '.join(missing)} ({detail})"
            )
        return requested  # type: ignore[return-value]
    if not common:
        detail = _supported_detail(sides)
        raise LayoutResolutionError(f"no KV page order is supported by every side ({detail})")
    return target_preferred if target_preferred in common else common[0]  # type: ignore[return-value]


def _supported_detail(sides: dict[str, tuple[str, ...]]) -> str:
    return "; ".join(f"{name} supports {', '.join(s) or 'no known order'}" for name, s in sides.items())


class LayoutState:
    """The one mutable cell every copy of a `CacheConfig` points at."""

    def __init__(self) -> None:
        self._layout: KVLayout | None = None

    def get(self) -> KVLayout:
        if self._layout is None:
            raise LayoutNotResolvedError()
        return self._layout

    def set(self, layout: KVLayout) -> None:
        self._layout = layout

    def clear(self) -> None:
        self._layout = None

    @property
    def is_resolved(self) -> bool:
        return self._layout is not None

    def __repr__(self) -> str:
        return f"LayoutState({self._layout!r})"


@dataclass
class CacheConfig:
    """KV-cache settings. `replace(cfg, cache_dtype=...)` copies share the resolved layout."""

    cache_dtype: str = "auto"
    page_size: int = 16
    kv_layout: str = "auto"
    memory_bytes: int | None = None  # KV budget; None means memory_fraction of what is free
    memory_fraction: float = 0.5
    num_pages: int | None = None  # overrides the budget when set
    shm_dir: str = DEFAULT_SHM_DIR
    # init=True on purpose: dataclasses.replace() passes it on, so copies share the cell.
    layout_state: LayoutState = field(default_factory=LayoutState, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_cache_dtype(self.cache_dtype)
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.kv_layout not in ("auto", *ORDERS):
            raise ValueError(f"kv_layout must be NHD, HND or auto, got {self.kv_layout!r}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError("memory_bytes must be positive")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError("num_pages must be positive")

    @property
    def layout(self) -> KVLayout:
        return self.layout_state.get()

    @property
    def is_layout_resolved(self) -> bool:
        return self.layout_state.is_resolved

    def resolve_layout(self, layout: KVLayout) -> None:
        """Publish the late-resolved layout to this config and every copy of it."""
        self.layout_state.set(layout)
