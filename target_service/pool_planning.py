"""How big the KV pool is and what it holds: every layer, target and draft, in one pool.

The target plans its pool at start with its own layers, and again (when idle) whenever a
drafter brings layers or a staging buffer the current pool lacks. The page count comes from an explicit `--num-pages`, or from the memory budget capped at what
`max_num_seqs` sequences of `max_model_len` tokens can use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.attention_backends import select_backend
from common.drafter_facts import DrafterFacts
from common.kv_layout import (
    DEFAULT_CHANNEL_CAPACITY,
    KV_DTYPES,
    CacheConfig,
    ChannelSpec,
    KVLayout,
    StagingSpec,
    build_layout,
    bytes_per_page,
    canonical_kv_dtype,
    resolve_order,
)
from target_service.config import IN_PROCESS_DRAFTER, EngineConfig


def available_memory(device: torch.device, meminfo: str = "/proc/meminfo") -> int:
    """Memory the pool may claim: free device memory on a GPU; on a CPU what Linux could hand out
    without swapping (MemAvailable: free pages plus the page cache it can drop). Free pages alone
    shrink to a sliver on a host that has just read its checkpoints, which would size the pool by
    how recently files were read (here 1,313 pages planned where 2,049 were wanted, 20 of 23 GiB
    being page cache)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return _mem_available(meminfo) or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _mem_available(meminfo: str) -> int | None:
    """MemAvailable in bytes, where the kernel reports it (Linux 3.14 on)."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == "MemAvailable":
                    value, unit = rest.split()
                    return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError):
        return None
    return None


def plan_num_pages(cache: CacheConfig, per_page: int, device: torch.device, max_num_seqs: int, max_model_len: int) -> int:
    """Pages from the explicit count, or the memory budget capped at what the limits can use."""
    if cache.num_pages is not None:
        return cache.num_pages
    budget = cache.memory_bytes or int(available_memory(device) * cache.memory_fraction)
    useful = max_num_seqs * -(-max_model_len // cache.page_size) + 1
    return max(1, min(budget // per_page, useful))


STAGING_STEPS = 16  # the automatic staging buffer holds this many full steps' rows ...
STAGING_BYTES = 64 << 20  # ... within this many bytes, and never fewer than one step's


def staging_rows(max_num_batched_tokens: int, row_bytes: int) -> int:
    """The staging buffer's rows when not configured. Rows of steps that ask no drafts wait there
    until a Propose asks (the drafter computes a sequence's context only if it drafts, so one that
    ends first costs it nothing), and a full buffer forces a Propose that only catches the
    drafter up; one step's budget (the former size) filled within a few prompts at concurrency 16
    (docs/performance.md). 16 steps' rows are 19 MB for the demo target, 201 MB for three captured
    layers of a 4,096-wide model in bfloat16, hence the byte cap."""
    return max(max_num_batched_tokens, min(STAGING_STEPS * max_num_batched_tokens, STAGING_BYTES // row_bytes))


def choose_backend(config: EngineConfig, model, device: torch.device, batch_invariant: bool = False) -> type:
    """The attention backend class for this model, KV dtype and device (once, at start)."""
    model_dtype = next(model.parameters()).dtype
    kv_dtype = KV_DTYPES[canonical_kv_dtype(config.cache.cache_dtype, model_dtype)]
    head_dims = tuple(sorted({spec.head_dim for spec in model.kv_layer_specs()}))
    return select_backend(config.attention_backend, device, head_dims=head_dims, model_dtype=model_dtype,
                          kv_dtype=kv_dtype, batch_invariant=batch_invariant)


@dataclass(frozen=True)
class PoolPlanner:
    """Plans the pool for the target's model, attention backend and limits."""

    config: EngineConfig
    model: object  # common.qwen3.Qwen3ForCausalLM
    backend_cls: type
    device: torch.device
    max_model_len: int

    def plan(self, facts: DrafterFacts | None, target_id: str, epoch: int) -> KVLayout:
        """Every layer (target and draft) and the staging buffer in one pool, sized by the budget."""
        config, cache, model = self.config, self.config.cache, self.model
        order = resolve_order(
            cache.kv_layout,
            target_supported=self.backend_cls.supported_orders(self.device),
            target_preferred=self.backend_cls.preferred_order(self.device),
            drafter_supported=facts.supported_orders if facts else None,
        )
        model_dtype = next(model.parameters()).dtype
        kv_dtype = canonical_kv_dtype(cache.cache_dtype, model_dtype)
        specs = model.kv_layer_specs() + (list(facts.layers) if facts else [])
        staging = None
        if facts and facts.target_layer_ids:
            layer_ids = facts.target_layer_ids  # the drafter's word: bounded before it sizes the staging rows
            most = max(3, model.num_layers)  # EAGLE-3 reads 3 (a layer may repeat on a shallow target), DFlash distinct ones
            if len(layer_ids) > most or not all(0 <= i < model.num_layers for i in layer_ids):
                raise ValueError(f"the drafter asks for the hidden states of target layers {list(layer_ids)[:16]}: "
                                 f"at most {most} of the layers 0..{model.num_layers - 1}")
            width = len(layer_ids) * model.hidden_size
            rows = config.staging_rows or staging_rows(config.max_num_batched_tokens, width * model_dtype.itemsize)
            staging = StagingSpec(rows=rows, width=width,
                                  dtype=str(model_dtype).removeprefix("torch."), layer_ids=tuple(layer_ids))
        num_pages = plan_num_pages(cache, bytes_per_page(cache.page_size, kv_dtype, specs), self.device,
                                   config.max_num_seqs, self.max_model_len)
        return build_layout(order=order, page_size=cache.page_size, kv_dtype=kv_dtype, num_pages=num_pages,
                            layers=specs, staging=staging, target_id=target_id, epoch=epoch,
                            channel=self._channel(facts))

    def _channel(self, facts: DrafterFacts | None) -> ChannelSpec | None:
        """A Propose channel in the pool: only a CPU pool is a file both processes map (a GPU
        pool is device memory), and an in-process drafter is called directly."""
        config = self.config
        if (facts is None or self.device.type != "cpu" or config.propose_transport != "auto"
                or config.drafter == IN_PROCESS_DRAFTER):
            return None
        return ChannelSpec(capacity=DEFAULT_CHANNEL_CAPACITY)


def same_regions(a: KVLayout, b: KVLayout) -> bool:
    """Same storage plan (an epoch bump may reuse the pool)."""
    return (a.order, a.page_size, a.kv_dtype, a.layers, a.staging, a.channel, a.num_pages) == (
        b.order, b.page_size, b.kv_dtype, b.layers, b.staging, b.channel, b.num_pages)
