"""A request/reply channel in a region of the shared pool: the `Propose` hot path without gRPC.

A CPU pool is one shm file both services map, so the target can hand the drafter a
`Propose` the way the two already hand over KV pages: bytes in shared memory and a
counter that says they are there. gRPC's round trip on the demo pair costs ~1.1 ms after
the few milliseconds of a verify (thread wake-ups on both sides, a halted vCPU on this
VM); a futex on the counter wakes the other side in microseconds (common/futex.py).

Region (`ChannelSpec`, placed by common/kv_layout.build_layout), u64 words in the machine's
own byte order (both processes run on it):

    [0] request_seq   the target's: bumped after each request is written
    [1] request_len
    [2] reply_seq     the drafter's: the request_seq it answers, after the reply is written
    [3] reply_len
    [4] reply_status  0 OK, else a grpc.StatusCode number; the reply bytes are its details
    [5] heartbeat_ns  the drafter's CLOCK_MONOTONIC, refreshed every HEARTBEAT_S while it serves
    [6] serving       1 while the drafter's server thread runs
    [7] reserved      0
    then `capacity` bytes of request, then `capacity` bytes of reply.

Writers store the payload, then its length, then (after a fence) the sequence number, then
wake the sequence number's futex; readers sleep on the sequence number's futex, load it,
fence, then the rest. Neither side spins: the two take turns on the same cores, and a
spinning waiter takes a core from the side that computes (measured: the drafter's
`sched_yield` loop made a K+1 verify cost 2.5 decodes on 2 cores; see docs/performance.md).
Everything read from the region is bounded before use (a length past `capacity` is an
error, never a read), and request bytes are parsed by the caller like gRPC's, so a crafted
region gets an error reply, not a hang or a crash. The target's side gives up at the
call's deadline, or as soon as the drafter's heartbeat stops (killed, stopped):
UNAVAILABLE, as gRPC says for a drafter that went away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from common.kv_layout import CHANNEL_HEADER_BYTES as HEADER_BYTES
from common.futex import Futex
from common.kv_layout import ChannelSpec

REQUEST_SEQ, REQUEST_LEN, REPLY_SEQ, REPLY_LEN, REPLY_STATUS, HEARTBEAT, SERVING, RESERVED = range(8)
HEARTBEAT_S = 0.1  # the drafter's heartbeat period: each beat takes a core from the target for a moment, and at
# 10 ms that cost an idle split 5% of its step on 2 cores (docs/design.md)
STALE_HEARTBEAT_S = 0.5  # a heartbeat this old means the drafter stopped serving the channel
WAIT_SLICE_S = 0.05  # a waiter wakes at least this often to check its deadline, the heartbeat or a stop


class ChannelError(RuntimeError):
    """A call over the channel failed: `code` is what gRPC would have said."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Region:
    """Words and byte areas of one channel region, over a writable buffer.

    The words go through a numpy uint64 view: one aligned 8-byte load or store each, which
    another process never sees half-done. `struct.pack_into` is not that: it stores a word
    byte by byte, and a reader in the other process saw a counter read back as 0 in
    between (tests/test_shm_channel.py: a request answered twice)."""

    def __init__(self, buffer: memoryview, capacity: int) -> None:
        if capacity <= 0 or len(buffer) != ChannelSpec(capacity).nbytes:
            raise ValueError(f"a channel of capacity {capacity} needs {ChannelSpec(capacity).nbytes} bytes, "
                             f"got {len(buffer)}")
        self.buffer = buffer
        self.capacity = capacity
        self._words = np.frombuffer(buffer[:HEADER_BYTES], dtype=np.uint64)  # [8], aligned: the pool aligns regions
        self._fence_lock = threading.Lock()  # acquire + release: a full memory barrier (as vLLM's)
        self.futexes = {index: Futex(self._words, index) for index in (REQUEST_SEQ, REPLY_SEQ)}

    def fence(self) -> None:
        with self._fence_lock:
            pass

    def word(self, index: int) -> int:
        return int(self._words[index])

    def set_word(self, index: int, value: int) -> None:
        self._words[index] = value

    def publish(self, index: int, value: int) -> None:
        """Store a sequence number after a fence (everything written before it is visible
        first) and wake whoever sleeps on it."""
        self.fence()
        self.set_word(index, value)
        self.futexes[index].wake()

    def wait_change(self, index: int, seen: int, timeout_s: float) -> int:
        """The word's value once it is no longer `seen`, or `seen` after about `timeout_s`."""
        self.futexes[index].wait(seen, timeout_s)
        value = self.word(index)
        if value != seen:
            self.fence()
        return value

    def write(self, area: int, data: bytes) -> None:
        start = HEADER_BYTES + area * self.capacity
        self.buffer[start : start + len(data)] = data

    def read(self, area: int, length: int) -> bytes:
        start = HEADER_BYTES + area * self.capacity
        return bytes(self.buffer[start : start + length])


REQUEST_AREA, REPLY_AREA = 0, 1


class ChannelClient:
    """The target's side: one call at a time, from the engine thread."""

    def __init__(self, buffer: memoryview, capacity: int) -> None:
        self._region = _Region(buffer, capacity)
        self._seq = self._region.word(REQUEST_SEQ)

    @property
    def capacity(self) -> int:
        return self._region.capacity

    def serving(self) -> bool:
        region = self._region
        return region.word(SERVING) == 1 and self._heartbeat_age() < STALE_HEARTBEAT_S

    def _heartbeat_age(self) -> float:
        return (time.monotonic_ns() - self._region.word(HEARTBEAT)) / 1e9

    def call(self, request: bytes, timeout_s: float) -> bytes:
        """The reply's bytes; ChannelError with gRPC's code for an error reply, a deadline
        passed (DEADLINE_EXCEEDED) or a drafter that stopped serving (UNAVAILABLE)."""
        region = self._region
        if len(request) > region.capacity:
            raise ValueError(f"a request of {len(request)} bytes does not fit the channel's {region.capacity}")
        self._seq += 1
        region.write(REQUEST_AREA, request)
        region.set_word(REQUEST_LEN, len(request))
        reply_seq = region.word(REPLY_SEQ)
        region.publish(REQUEST_SEQ, self._seq)
        deadline = time.monotonic() + timeout_s
        while reply_seq != self._seq:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout_s:g} s")
            if not self.serving():
                raise ChannelError(grpc.StatusCode.UNAVAILABLE, "the drafter stopped serving the shm channel")
            reply_seq = region.wait_change(REPLY_SEQ, reply_seq, min(left, WAIT_SLICE_S))
        return self._reply(region)

    @staticmethod
    def _reply(region: _Region) -> bytes:
        length, status = region.word(REPLY_LEN), region.word(REPLY_STATUS)
        if length > region.capacity:
            raise ChannelError(grpc.StatusCode.INTERNAL, f"the drafter's reply claims {length} bytes, "
                                                         f"more than the channel's {region.capacity}")
        payload = region.read(REPLY_AREA, length)
        if status == 0:
            return payload
        try:
            code = next(c for c in grpc.StatusCode if c.value[0] == status)
        except StopIteration:
            code = grpc.StatusCode.UNKNOWN
        raise ChannelError(code, payload.decode("utf-8", "replace"))


Handler = Callable[[bytes], bytes]  # request bytes → reply bytes; raises to answer an error
ErrorStatus = Callable[[BaseException], tuple[grpc.StatusCode, str]]


class ChannelServer:
    """The drafter's side: a thread that answers each request with `handler`, and one that
    beats the heartbeat (it runs while a request is being handled, too)."""

    def __init__(self, buffer: memoryview, capacity: int, handler: Handler, error_status: ErrorStatus,
                 name: str = "shm-channel") -> None:
        self._region = _Region(buffer, capacity)
        self._handler = handler
        self._error_status = error_status
        self._stop = threading.Event()
        self._answered = self._region.word(REQUEST_SEQ)  # a request already there is not ours
        self._region.set_word(REPLY_SEQ, self._answered)
        self._region.set_word(RESERVED, 0)
        self._beat()
        self._region.fence()
        self._region.set_word(SERVING, 1)
        self._threads = [threading.Thread(target=self._serve, name=name, daemon=True),
                         threading.Thread(target=self._heartbeat, name=f"{name}-heartbeat", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _beat(self) -> None:
        self._region.set_word(HEARTBEAT, time.monotonic_ns())

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._beat()

    def _serve(self) -> None:
        region = self._region
        while not self._stop.is_set():
            seq = region.wait_change(REQUEST_SEQ, self._answered, WAIT_SLICE_S)
            if seq != self._answered and not self._stop.is_set():
                self._answer(seq)

    def _answer(self, seq: int) -> None:
        region = self._region
        length = region.word(REQUEST_LEN)
        try:
            if length > region.capacity:
                raise ChannelRequestTooLarge(length, region.capacity)
            reply, status = self._handler(region.read(REQUEST_AREA, length)), 0
            if len(reply) > region.capacity:
                raise ChannelRequestTooLarge(len(reply), region.capacity, what="reply")
        except Exception as exc:  # noqa: BLE001 - every failure is an answer: the target must not wait out its deadline
            code, details = self._error_status(exc)
            reply, status = details.encode("utf-8")[: region.capacity], code.value[0]
        region.write(REPLY_AREA, reply)
        region.set_word(REPLY_LEN, len(reply))
        region.set_word(REPLY_STATUS, status)
        self._answered = seq
        region.publish(REPLY_SEQ, seq)

    def close(self) -> None:
        """Stop answering: a call waiting on the channel then ends UNAVAILABLE."""
        self._stop.set()
        self._region.futexes[REQUEST_SEQ].wake()  # the serving thread sleeps on it
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        self._region.set_word(SERVING, 0)


class ChannelRequestTooLarge(ValueError):
    def __init__(self, size: int, capacity: int, what: str = "request") -> None:
        super().__init__(f"the shm channel's {what} of {size} bytes exceeds its capacity of {capacity} bytes")
