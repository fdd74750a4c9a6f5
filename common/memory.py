"""The process heap: freed memory given back to the OS, the startup heap kept from the collector.

glibc's malloc keeps what a large request freed (its message, its text, the tokenizer's
buffers) in its arenas for reuse, spread over the threads that touched it; `malloc_trim`
returns the free pages. Elsewhere (musl, macOS) there is no such call and nothing to do.

Python's full collections walk every tracked object; a served process's startup heap is most
of them and lives for good, so it is frozen once the process is warm (`freeze_startup_heap`).
"""

from __future__ import annotations

import ctypes
import functools
import gc


@functools.cache
def _malloc_trim():
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own C library


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True when some were (ctypes releases the GIL)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def freeze_startup_heap() -> int:
    """Move every object alive now out of the cyclic collector's reach (`gc.freeze`), after a
    collection; the count frozen. Called once warm, it spares each later full collection the
    startup heap (~340k objects for the demo stack: modules, tensors' Python side, the tokenizer),
    which otherwise stalled one step in a few hundred by about 0.2 s. Called again (a drafter's
    next Attach), the earlier freeze is lifted first, so what the last epoch left in cycles is
    collected rather than kept for good. vLLM freezes its engine's heap the same way."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
