"""How many CPU threads torch may use in a service process.

The target and the drafter share one node. On a CPU they take turns (the target waits
while the drafter drafts, and the reverse), but torch's OpenMP workers spin for a while
after every op; two processes each sized to every core make the one computing share its
cores with the other's spinning workers. Measured on the demo pair (2 cores): 19.9 ms per
speculative step with both at torch's default, 14.0 ms with the drafter on one thread.
"""

from __future__ import annotations

import logging

import torch


def drafter_threads(configured: int | None, device: str) -> int | None:
    """The drafter's default: one thread on a CPU (the target owns the cores), torch's on a GPU."""
    if configured is not None:
        return configured
    return 1 if torch.device(device).type == "cpu" else None


def apply_threads(threads: int | None, log: logging.Logger) -> None:
    """Size torch's intra-op pool (None: torch's default). Call it on the thread that runs
    the model: MKL's count is thread-local, so another thread's setting does not reach it."""
    if threads is not None:
        torch.set_num_threads(threads)
    log.info("torch uses %d CPU thread(s)", torch.get_num_threads())
