"""The pools the target exported to the drafter, and the drafter's note of what it mapped.

The target keeps every exported pool alive until the drafter has attached to a later
epoch (so a replaced pool's memory never moves under the drafter), and on a GPU returns
torch's CUDA IPC reference for the exports the drafter never mapped
(`references_to_return`). The drafter keeps a bounded record of the epochs it mapped
(`MappedExports`) to answer the target's `unconfirmed_epochs`. docs/design.md#transports.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch

from common import pool_transport
from common.kv_pool import PagePool
from common.pool_transport import return_reference, sync_for_handoff
from splitspec.v1 import drafter_pb2 as dpb

log = logging.getLogger(__name__)

MAX_UNCONFIRMED_EPOCHS = 1024  # the unconfirmed exports an Attach may ask about


@dataclass(eq=False)
class _Export:
    pool: PagePool
    target_id: str
    epoch: int
    handle: dpb.PoolHandle
    mapped: bool = False  # the drafter mapped it (its Attach succeeded, or the drafter said so)

    @property
    def is_cuda(self) -> bool:
        return self.handle.WhichOneof("transport") == "cuda_ipc"


def references_to_return(older: list[_Export], reported_mapped: Collection[int]) -> list[_Export]:
    """The exports whose CUDA IPC reference the target must return itself, once the drafter
    has attached to a later epoch (so it maps none of `older` any more).

    torch's protocol (torch/csrc/CudaIPCTypes.cpp, StorageSharing.cpp): each `_share_cuda_()`
    puts a fresh counter at 1 for the consumer; the consumer's storage deleter decrements it
    (an int64) when its mapping dies; the producer frees the memory once every counter of
    the storage reads 0 — read as uint64, so a counter decremented twice (-1) reads
    2**64 - 1 and pins the memory forever. So each export needs exactly one decrement: the
    drafter's, when it mapped it (its Attach succeeded, or it lists the epoch in
    `reported_mapped`), else ours. A drafter killed while mapping a pool never returns its
    reference; as with torch.multiprocessing, that pool stays allocated."""
    return [e for e in older if e.is_cuda and not e.mapped and e.epoch not in reported_mapped]


class PoolExports:
    """The target's record of the pools it handed to the drafter, keeping them alive.

    A pool that the target replaces (a re-plan for another drafter) may still be mapped
    by the drafter until the drafter attaches to the new one: its Attach drops every old
    mapping first (docs/design.md#the-handshake). Until then the old pool stays referenced here, so its
    memory is never handed to another tensor under the drafter's feet (on CUDA the caching
    allocator would reuse the block at once).

    `attached(target_id, epoch, mapped_epochs)` (after a successful Attach) releases every
    older export, returning torch's IPC reference for those the drafter never mapped
    (`references_to_return`); `unconfirmed_epochs` lists the exports whose Attach the
    target never saw succeed, for the drafter to say which of them it mapped. `close()`
    (target stop) releases everything.
    """

    def __init__(self) -> None:
        self._exports: list[_Export] = []

    def export(self, pool: PagePool) -> dpb.PoolHandle:
        handle = pool_transport.export_pool(pool)  # looked up at call time: tests stand in for CUDA
        self._exports.append(_Export(pool, pool.layout.target_id, pool.layout.epoch, handle))
        return handle

    def unconfirmed_epochs(self, target_id: str, before_epoch: int) -> list[int]:
        """Epochs of the exports older than `before_epoch` not known to be mapped, oldest first."""
        return [e.epoch for e in self._exports
                if e.target_id == target_id and e.epoch < before_epoch and e.is_cuda and not e.mapped]

    def attached(self, target_id: str, epoch: int, mapped_epochs: Collection[int] = (), *,
                 mapped: bool = True) -> None:
        """The drafter attached to (target_id, epoch) and has dropped every older mapping;
        `mapped`: it mapped this export (an n-gram drafter maps none); `mapped_epochs`:
        older epochs it says it had mapped."""
        current = [e for e in self._exports if (e.target_id, e.epoch) == (target_id, epoch)]
        if not current:
            raise ValueError(f"no pool was exported for target {target_id!r} epoch {epoch}")
        for e in current:
            e.mapped = mapped
        older = [e for e in self._exports if e.epoch < epoch or e.target_id != target_id]
        self._exports = [e for e in self._exports if all(e is not o for o in older)]
        for e in references_to_return([e for e in older if e.target_id == target_id], set(mapped_epochs)):
            return_reference(e.handle.cuda_ipc)
        self._release(older, live_pools=[e.pool for e in self._exports])

    def close(self) -> None:
        """The target stops: let go of every exported pool."""
        exports, self._exports = self._exports, []
        self._release(exports, live_pools=[])

    @property
    def live(self) -> list[tuple[str, int]]:
        """(target_id, epoch) of the exports still held, oldest first."""
        return [(e.target_id, e.epoch) for e in self._exports]

    def holds(self, pool: PagePool) -> bool:
        return any(e.pool is pool for e in self._exports)

    @staticmethod
    def _release(exports: list[_Export], live_pools: list[PagePool]) -> None:
        cuda_devices = {e.pool.device for e in exports if e.is_cuda}
        for e in exports:
            if all(e.pool is not live for live in live_pools):
                e.pool.close()  # unlinks a CPU pool's file once nothing exported it any more
        for device in cuda_devices:
            sync_for_handoff(device)
            torch.cuda.ipc_collect()  # free blocks no process references any more
        if exports:
            log.info("released %d exported KV pool handle(s)", len(exports))


class MappedExports:
    """The drafter's note of which exports of its target it mapped, to answer the target's
    `unconfirmed_epochs` (an Attach reply the target never saw; a failure after mapping).
    Bounded: it keeps only what the target can still ask about."""

    def __init__(self, limit: int = MAX_UNCONFIRMED_EPOCHS) -> None:
        self.target_id = ""
        self._epochs: set[int] = set()
        self._limit = limit

    def record(self, target_id: str, epoch: int) -> None:
        if target_id != self.target_id:
            self.target_id, self._epochs = target_id, set()
        self._epochs.add(epoch)
        if len(self._epochs) > self._limit:
            self._epochs.discard(min(self._epochs))

    def answer(self, target_id: str, asked: Collection[int], current_epoch: int) -> list[int]:
        """Those of `asked` it mapped; then it forgets every epoch but `asked` and the current."""
        if len(asked) > self._limit:
            raise ValueError(f"unconfirmed_epochs lists {len(asked)} epochs, at most {self._limit}")
        if target_id != self.target_id:
            return []
        asked = set(asked)
        mapped = sorted(self._epochs & asked)
        self._epochs &= asked | {current_epoch}
        return mapped
