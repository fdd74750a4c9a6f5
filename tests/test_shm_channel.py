"""The Propose channel in the pool's shm region (common/shm_channel.py), on its own: round
trips, error replies, and what a crafted region gets (bounded, answered, never a hang).

The region here is a plain bytearray both threads see, as two processes see the pool file;
the channel through real drafter processes is in tests/test_speculative_faults.py."""

from __future__ import annotations

import mmap
import multiprocessing
import random
import threading
import time

import grpc
import pytest

from common.kv_layout import ChannelSpec
from common.shm_channel import (
    HEADER_BYTES,
    HEARTBEAT,
    REPLY_LEN,
    REPLY_SEQ,
    REPLY_STATUS,
    REQUEST_LEN,
    REQUEST_SEQ,
    SERVING,
    ChannelClient,
    ChannelError,
    ChannelRequestTooLarge,
    ChannelServer,
    _Region,
)

CAPACITY = 4096


def error_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, (ValueError, ChannelRequestTooLarge)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def region() -> memoryview:
    return memoryview(bytearray(ChannelSpec(CAPACITY).nbytes))


@pytest.fixture
def echo():
    buffer = region()
    calls: list[bytes] = []

    def handler(raw: bytes) -> bytes:
        calls.append(raw)
        if raw == b"fail":
            raise ValueError("the request said fail")
        if raw == b"crash":
            raise RuntimeError("boom")
        return raw[::-1]

    server = ChannelServer(buffer, CAPACITY, handler, error_status)
    yield buffer, ChannelClient(buffer, CAPACITY), calls
    server.close()


def test_requests_are_answered_in_order(echo):
    _, client, calls = echo
    for i in range(200):
        payload = f"request {i}".encode() * (1 + i % 7)
        assert client.call(payload, timeout_s=10.0) == payload[::-1]
    assert len(calls) == 200
    assert client.call(b"", timeout_s=10.0) == b""  # an empty message is a message
    assert client.call(b"x" * CAPACITY, timeout_s=10.0) == b"x" * CAPACITY  # exactly the capacity fits


def test_an_error_is_an_answer_with_grpc_s_code_and_the_channel_keeps_serving(echo):
    _, client, _ = echo
    with pytest.raises(ChannelError) as refused:
        client.call(b"fail", timeout_s=10.0)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details == "the request said fail"
    with pytest.raises(ChannelError) as crashed:
        client.call(b"crash", timeout_s=10.0)
    assert crashed.value.code == grpc.StatusCode.INTERNAL and "RuntimeError" in crashed.value.details
    assert client.call(b"abc", timeout_s=10.0) == b"cba"


def test_a_request_larger_than_the_channel_is_refused_before_it_is_written(echo):
    _, client, calls = echo
    with pytest.raises(ValueError, match=f"does not fit the channel's {CAPACITY}"):
        client.call(b"y" * (CAPACITY + 1), timeout_s=10.0)
    assert not calls
    assert client.call(b"ok", timeout_s=10.0) == b"ko"


def test_a_crafted_request_length_gets_an_error_reply_not_a_read_past_the_region(echo):
    """A writer that is not our target (or a corrupted header) claims 2^60 bytes."""
    buffer, client, calls = echo
    words = _Region(buffer, CAPACITY)
    seq = words.word(REQUEST_SEQ) + 1
    words.set_word(REQUEST_LEN, 1 << 60)
    words.set_word(REQUEST_SEQ, seq)
    while words.word(REPLY_SEQ) != seq:
        pass
    assert words.word(REPLY_STATUS) == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    details = words.read(1, words.word(REPLY_LEN)).decode()
    assert f"exceeds its capacity of {CAPACITY} bytes" in details
    assert not calls  # the handler never saw it
    client._seq = seq  # the crafted request took a sequence number
    assert client.call(b"after", timeout_s=10.0) == b"retfa"  # still serving


def call_against_a_rogue_server(write_reply) -> ChannelError:
    """The client's call against a "server" that answers by writing the region by hand
    (`write_reply(words)`, then the reply counter), beating the heartbeat once so that the
    client waits for that answer; the error the call raised."""
    buffer = region()
    words = _Region(buffer, CAPACITY)
    words.set_word(SERVING, 1)
    words.set_word(HEARTBEAT, time.monotonic_ns())
    client = ChannelClient(buffer, CAPACITY)

    def rogue_server() -> None:
        while words.word(REQUEST_SEQ) == 0:
            pass
        write_reply(words)
        words.set_word(REPLY_SEQ, words.word(REQUEST_SEQ))

    thread = threading.Thread(target=rogue_server)
    thread.start()
    try:
        with pytest.raises(ChannelError) as bad:
            client.call(b"hello", timeout_s=10.0)
    finally:
        thread.join()
    return bad.value


def test_a_crafted_reply_is_bounded_before_it_is_read():
    def too_long(words: _Region) -> None:
        words.set_word(REPLY_LEN, CAPACITY + 1)  # more than the reply area holds
        words.set_word(REPLY_STATUS, 0)

    bad = call_against_a_rogue_server(too_long)
    assert bad.code == grpc.StatusCode.INTERNAL
    assert "claims 4097 bytes" in bad.details


def test_a_reply_with_an_unknown_status_is_unknown_not_a_crash():
    def unknown_status(words: _Region) -> None:
        words.write(1, b"\xff\xfe not utf-8")
        words.set_word(REPLY_LEN, 13)
        words.set_word(REPLY_STATUS, 12345)

    assert call_against_a_rogue_server(unknown_status).code == grpc.StatusCode.UNKNOWN


def test_a_stopped_server_is_unavailable_at_once_not_at_the_deadline():
    """A deadline of an hour: the call must end on the server's stop flag (or its heartbeat),
    else this test would hang."""
    buffer = region()
    release = threading.Event()

    def slow(raw: bytes) -> bytes:
        release.wait()
        return raw

    server = ChannelServer(buffer, CAPACITY, slow, error_status)
    client = ChannelClient(buffer, CAPACITY)
    stopper = threading.Timer(0.2, lambda: _Region(buffer, CAPACITY).set_word(SERVING, 0))  # as close() does
    stopper.start()
    with pytest.raises(ChannelError) as gone:
        client.call(b"anyone?", timeout_s=3600.0)
    assert gone.value.code == grpc.StatusCode.UNAVAILABLE
    release.set()
    server.close()
    assert not client.serving()


def test_a_slow_answer_passes_the_deadline():
    buffer = region()
    release = threading.Event()
    server = ChannelServer(buffer, CAPACITY, lambda raw: release.wait(30) and raw, error_status)
    client = ChannelClient(buffer, CAPACITY)
    with pytest.raises(ChannelError) as late:
        client.call(b"late", timeout_s=0.05)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    release.set()
    server.close()


def test_the_region_must_be_the_size_its_capacity_needs():
    with pytest.raises(ValueError, match=f"needs {HEADER_BYTES + 2 * CAPACITY} bytes"):
        ChannelClient(memoryview(bytearray(100)), CAPACITY)


def test_neither_side_burns_a_core_while_it_waits():
    """The two services take turns on the same cores: a side that spins while the other
    computes takes a core from it (the drafter's sched_yield loop made a verify cost 2.5
    decodes on 2 cores). A call waiting 0.3 s on a slow handler, then 0.3 s with nothing to
    do, costs this process (both sides are threads of it here) a few ms of CPU, not 0.6 s."""
    buffer = region()
    server = ChannelServer(buffer, CAPACITY, lambda raw: time.sleep(0.3) or raw, error_status)
    client = ChannelClient(buffer, CAPACITY)
    try:
        client.call(b"warm", timeout_s=10.0)
        cpu, wall = time.process_time(), time.monotonic()
        assert client.call(b"slow", timeout_s=10.0) == b"slow"
        threading.Event().wait(0.3)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        server.close()
    assert wall >= 0.6 and cpu < 0.1, (cpu, wall)


def test_without_futexes_the_channel_polls_and_still_answers_in_order(monkeypatch):
    """Another OS or an architecture whose futex syscall we do not know: waits fall back to
    short sleeps, slower but the same protocol."""
    import common.futex as futex

    monkeypatch.setattr(futex, "_load_syscall", lambda: None)
    buffer = region()
    server = ChannelServer(buffer, CAPACITY, lambda raw: raw[::-1], error_status)
    client = ChannelClient(buffer, CAPACITY)
    try:
        assert not client._region.futexes[REQUEST_SEQ].sleeps_in_kernel
        for i in range(50):
            assert client.call(b"%d" % i, timeout_s=10.0) == (b"%d" % i)[::-1]
    finally:
        server.close()


def _counting_server(path: str, ready, done) -> None:
    """A server in another process whose handler checks each request comes exactly once."""
    size = ChannelSpec(CAPACITY).nbytes
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), size)
    seen = {"last": 0, "wrong": 0}

    def handler(raw: bytes) -> bytes:
        value = int(raw)
        if value != seen["last"] + 1:
            seen["wrong"] += 1
        seen["last"] = value
        return b"%d,%d" % (value, seen["wrong"])

    server = ChannelServer(memoryview(mapped), CAPACITY, handler, error_status)
    ready.set()
    done.wait(120)
    server.close()


def test_across_processes_each_request_is_handled_exactly_once(tmp_path):
    """Two processes, the client pausing at random (none, a little, a verify's few ms): every
    request reaches the handler once, in order. With the header words stored by
    struct.pack_into this failed (about once in 200 calls here): the server read the counter
    as 0 mid-store and answered the previous request a second time."""
    size = ChannelSpec(CAPACITY).nbytes
    path = tmp_path / "channel"
    path.write_bytes(bytes(size))
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    process = context.Process(target=_counting_server, args=(str(path), ready, done))
    process.start()
    try:
        assert ready.wait(60)
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), size)
        client = ChannelClient(memoryview(mapped), CAPACITY)
        pauses = random.Random(0)
        for i in range(1, 10001):
            value, wrong = map(int, client.call(b"%d" % i, timeout_s=30.0).split(b","))
            assert (value, wrong) == (i, 0), (i, value, wrong)
            if pauses.random() < 0.3:
                threading.Event().wait(pauses.choice([0.0, 0.0001, 0.001, 0.004]))
    finally:
        done.set()
        process.join(30)
