"""Giving freed heap memory back to the operating system after a large request.

glibc's malloc keeps what a large request freed (its message, its text, the tokenizer's
buffers) in its arenas for reuse, spread over the threads that touched it; `malloc_trim`
returns the free pages. Elsewhere (musl, macOS) there is no such call and nothing to do.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own C library


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True when some were (ctypes releases the GIL)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
