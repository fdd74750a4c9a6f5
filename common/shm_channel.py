"""A request/reply channel in a region of the shared pool: the `Propose` hot path without gRPC.

A CPU pool is one shm file both services map, so the target can hand the drafter a
`Propose` the way the two already hand over KV pages: bytes in shared memory and a
counter that says they are there. gRPC's round trip on the demo pair costs ~1.1 ms after
the few milliseconds of a verify (thread wake-ups on both sides, a halted vCPU on this
VM); a counter polled by a waiting thread is seen in microseconds. vLLM's shm message
queue (vllm/distributed/device_communicators/shm_broadcast.py) makes the same trade for
its scheduler → worker broadcast: a thread that spins while traffic is expected.

Region (`ChannelSpec`, placed by common/kv_layout.build_layout), u64 words in the machine's
own byte order (both processes run on it):

    [0] request_seq   the target's: bumped after each request is written
    [1] request_len
    [2] reply_seq     the drafter's: the request_seq it answers, after the reply is written
    [3] reply_len
    [4] reply_status  0 OK, else a grpc.StatusCode number; the reply bytes are its details
    [5] heartbeat_ns  the drafter's CLOCK_MONOTONIC, refreshed every HEARTBEAT_S while it serves
    [6] serving       1 while the drafter's server thread runs
    [7] poll_us       how long the drafter now sleeps between polls (0: spinning)
    then `capacity` bytes of request, then `capacity` bytes of reply.

Writers store the payload, then its length, then (after a fence) the sequence number;
readers load the sequence number, fence, then the rest. Everything read from the region
is bounded before use (a length past `capacity` is an error, never a read), and request
bytes are parsed by the caller like gRPC's, so a crafted region gets an error reply, not
a hang or a crash. The drafter's side polls with `os.sched_yield` (which releases the
GIL) for `spin_s` after each request, then every `idle_poll_s`, doubling every
`backoff_s` up to `max_idle_poll_s`: spinning while steps come every few milliseconds,
next to nothing when idle. The interval is published (`poll_us`): a target whose drafter
sleeps longer than 1 ms between polls sends that request over gRPC, which wakes the
drafter at once and tells its thread to spin again (`note_activity`). The target's side
spins while it waits (its engine thread would be blocked anyway) and gives up at the
call's deadline, or as soon as the drafter's heartbeat stops (killed, stopped):
UNAVAILABLE, as gRPC says for a drafter that went away.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from common.kv_layout import CHANNEL_HEADER_BYTES as HEADER_BYTES
from common.kv_layout import ChannelSpec

REQUEST_SEQ, REQUEST_LEN, REPLY_SEQ, REPLY_LEN, REPLY_STATUS, HEARTBEAT, SERVING, POLL_US = range(8)
AWAKE_POLL_US = 1000  # a drafter polling at least this often answers the channel faster than gRPC
HEARTBEAT_S = 0.01  # the drafter's heartbeat period
STALE_HEARTBEAT_S = 0.5  # a heartbeat this old means the drafter stopped serving the channel


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

    def fence(self) -> None:
        with self._fence_lock:
            pass

    def word(self, index: int) -> int:
        return int(self._words[index])

    def set_word(self, index: int, value: int) -> None:
        self._words[index] = value

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

    def awake(self) -> bool:
        """The drafter polls often enough that a request here beats gRPC's wake-up: after a pause
        it sleeps up to 10 ms between polls, and a gRPC call, which wakes it at once, also
        tells it to spin again (ChannelServer.note_activity)."""
        return self._region.word(POLL_US) <= AWAKE_POLL_US

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
        region.fence()
        region.set_word(REQUEST_SEQ, self._seq)
        deadline = time.monotonic() + timeout_s
        polls = 0
        while region.word(REPLY_SEQ) != self._seq:
            polls += 1
            if polls % 256 == 0:
                if time.monotonic() > deadline:
                    raise ChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout_s:g} s")
                if not self.serving():
                    raise ChannelError(grpc.StatusCode.UNAVAILABLE, "the drafter stopped serving the shm channel")
            os.sched_yield()
        region.fence()
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


@dataclass
class ChannelServerConfig:
    spin_s: float = 0.02  # keep polling without sleeping this long after a request (a step is ~5-15 ms)
    idle_poll_s: float = 0.0005  # then poll this often ...
    backoff_s: float = 0.05  # ... doubling the interval every this long without requests ...
    max_idle_poll_s: float = 0.01  # ... up to this

    def __post_init__(self) -> None:
        if self.spin_s < 0 or self.backoff_s <= 0 or not 0 < self.idle_poll_s <= self.max_idle_poll_s:
            raise ValueError(f"spin_s must be >= 0, backoff_s > 0 and 0 < idle_poll_s <= max_idle_poll_s, got "
                             f"{self.spin_s}, {self.backoff_s}, {self.idle_poll_s}, {self.max_idle_poll_s}")

    def poll_interval(self, idle_s: float) -> float:
        """Seconds to sleep between polls `idle_s` after the last request (0: spin). An idle
        drafter must not keep waking up on a machine the target and other services share."""
        if idle_s < self.spin_s:
            return 0.0
        doublings = min(int((idle_s - self.spin_s) / self.backoff_s), 16)
        return min(self.idle_poll_s * 2**doublings, self.max_idle_poll_s)


class ChannelServer:
    """The drafter's side: a thread that answers each request with `handler`, and one that
    beats the heartbeat (it runs while a request is being handled, too)."""

    def __init__(self, buffer: memoryview, capacity: int, handler: Handler, error_status: ErrorStatus,
                 config: ChannelServerConfig | None = None, name: str = "shm-channel") -> None:
        self._region = _Region(buffer, capacity)
        self._handler = handler
        self._error_status = error_status
        self._config = config or ChannelServerConfig()
        self._stop = threading.Event()
        self._last_request = time.monotonic()
        self._published_poll_us = 0
        self._publish_lock = threading.Lock()  # note_activity vs the serving thread's publish of a longer poll
        self._answered = self._region.word(REQUEST_SEQ)  # a request already there is not ours
        self._region.set_word(REPLY_SEQ, self._answered)
        self._region.set_word(POLL_US, 0)
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

    def note_activity(self) -> None:
        """A request came another way (gRPC): requests are coming, spin again."""
        with self._publish_lock:
            self._last_request = time.monotonic()
            self._region.set_word(POLL_US, 0)
            self._published_poll_us = 0

    def _publish_poll(self, last_request: float, poll_us: int) -> None:
        """Say how long we sleep between polls, unless a request was noted since `last_request`
        (then a stale, longer interval would send the target to gRPC for nothing)."""
        with self._publish_lock:
            if self._last_request == last_request:
                self._region.set_word(POLL_US, poll_us)
                self._published_poll_us = poll_us

    def _serve(self) -> None:
        region, config = self._region, self._config
        while not self._stop.is_set():
            seq = region.word(REQUEST_SEQ)
            if seq == self._answered:
                last_request = self._last_request
                pause = config.poll_interval(time.monotonic() - last_request)
                if (poll_us := int(pause * 1e6)) != self._published_poll_us:
                    self._publish_poll(last_request, poll_us)
                if pause:
                    self._stop.wait(pause)
                else:
                    os.sched_yield()
                continue
            region.fence()
            self._answer(seq)
            self._last_request = time.monotonic()

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
        region.fence()
        region.set_word(REPLY_SEQ, seq)
        self._answered = seq

    def close(self) -> None:
        """Stop answering: a call waiting on the channel then ends UNAVAILABLE."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        self._region.set_word(SERVING, 0)


class ChannelRequestTooLarge(ValueError):
    def __init__(self, size: int, capacity: int, what: str = "request") -> None:
        super().__init__(f"the shm channel's {what} of {size} bytes exceeds its capacity of {capacity} bytes")
