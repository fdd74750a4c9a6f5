"""Sleeping on a 32-bit word in shared memory until another process changes it (Linux futex).

The shm channel's two sides take turns: while the drafter drafts the target waits, and the
reverse. A waiter that spins (even with `sched_yield`) holds a core the other side computes
on: on a 2-core machine the drafter's spinning thread made the target's K+1 verify cost 2.5
decode steps. A futex wait sleeps in the kernel and is woken in microseconds by the other
process's FUTEX_WAKE on the same word (8 µs for a round trip of two wake-ups on the VM this
was measured on, both sides asleep between calls); ctypes releases the GIL for the call.

Where the syscall is not available (another OS, an architecture whose number we do not
know, a libc without `syscall`), `wait` polls the word with short sleeps instead: correct,
but slower to notice a change.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import platform
import sys
import time

import numpy as np

FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not the _PRIVATE variants: the word is shared between processes
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
FALLBACK_POLL_S = 0.0001
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _load_syscall():
    """(libc's syscall function, SYS_futex), or None where futexes cannot be used from here."""
    number = _SYS_FUTEX.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.syscall
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_long
    return function, number


class Futex:
    """Wait and wake on the low 32 bits of one aligned uint64 word of a numpy view over shared memory.

    Only the low half is compared: counters that differ by less than 2**32 from what a waiter
    last saw are told apart, which is all a turn-taking protocol needs."""

    def __init__(self, words: np.ndarray, index: int) -> None:
        if words.dtype != np.uint64 or not 0 <= index < words.size:
            raise ValueError(f"a futex needs a uint64 word of the view, got {words.dtype} index {index}")
        self._words = words
        self._index = index
        # The low half of a little-endian uint64 is at its own address; of a big-endian one, 4 bytes on.
        self._address = ctypes.c_void_p(words.ctypes.data + 8 * index + (4 if sys.byteorder == "big" else 0))
        self._syscall = _load_syscall()

    @property
    def sleeps_in_kernel(self) -> bool:
        return self._syscall is not None

    def wait(self, seen: int, timeout_s: float) -> None:
        """Return once the word is no longer `seen`, or after about `timeout_s` (or spuriously:
        callers re-read the word)."""
        if int(self._words[self._index]) != seen:
            return
        if self._syscall is None:
            time.sleep(min(FALLBACK_POLL_S, timeout_s))
            return
        function, number = self._syscall
        seconds = max(timeout_s, 0.0)
        timeout = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        # syscall(2) reads every argument as a long: pass longs, not ctypes' default int
        result = function(ctypes.c_long(number), self._address, ctypes.c_long(FUTEX_WAIT),
                          ctypes.c_long(seen & 0xFFFFFFFF), ctypes.byref(timeout), None, ctypes.c_long(0))
        if result == -1 and ctypes.get_errno() not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
            raise OSError(ctypes.get_errno(), "futex wait failed")

    def wake(self) -> None:
        """Wake every waiter of the word (after it was changed)."""
        if self._syscall is not None:
            function, number = self._syscall
            function(ctypes.c_long(number), self._address, ctypes.c_long(FUTEX_WAKE), ctypes.c_long(_WAKE_ALL),
                     None, None, ctypes.c_long(0))
