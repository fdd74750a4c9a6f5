"""Giving the heap back after a flood.

What a flood of requests allocates (1,100 requests in flight at once, 2 MiB bodies, 300,000
token ids parsed into Python ints) is freed when it is answered, but glibc's malloc keeps
the freed pages in its arenas for reuse, so the gateway's RSS stayed at its high-water
mark (64 → 126 MiB, bench/gateway_flood.py) although nothing was alive. Two things give
it back: `fix_mmap_threshold` keeps large blocks out of the heap, and `HeapTrimmer` calls
`malloc_trim(0)` on a thread every `interval_s` in which requests were answered, which
returns the heap's free pages. What remains above the start is CPython's small-object
arenas and heap pages that a few long-lived objects pin: it is set by the largest burst
(the connection cap bounds that) and does not grow from one flood to the next.
(Without glibc — musl, macOS — there is no such call and nothing to do.)
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger("splitspec.gateway")


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at 128 KiB: allocations above it are their own mappings,
    unmapped when freed. By default glibc raises the threshold to the size of each mapped
    block freed (up to 32 MiB), after which a flood's 2 MiB bodies and token-id arrays are
    carved from the heap and fragment it. True when set."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) if mallopt is not None else False


def malloc_trim() -> Callable[[int], int] | None:
    """The C library's malloc_trim, or None without one."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


class HeapTrimmer:
    """Trims the heap every `interval_s` seconds in which `activity()` changed."""

    def __init__(self, activity: Callable[[], int], interval_s: float) -> None:
        self._activity = activity
        self._interval_s = interval_s
        self._trim = malloc_trim()
        self.trims = 0

    async def run(self) -> None:
        if self._trim is None or self._interval_s <= 0:
            return
        seen = self._activity()
        while True:
            await asyncio.sleep(self._interval_s)
            if (now := self._activity()) != seen:
                seen = now
                await asyncio.to_thread(self._trim, 0)  # ctypes releases the GIL meanwhile
                self.trims += 1
