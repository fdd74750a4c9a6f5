"""The asyncio front of the engine: admission, the step loop, and one stream per request.

`AsyncEngine` queues admissions and aborts from the event loop and applies them between
steps, so new requests join the next step and a cancelled request's pages are free within
one step. Steps (and warmup, and handshakes while idle) run on one worker thread, where
torch's thread settings apply; the event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from common.threads import apply_threads
from target_service.api_types import (
    EngineRequest,
    InvalidRequestError,
    QueueFullError,
    RequestOutput,
    ShuttingDownError,
    validate_prompt,
)
from target_service.config import EngineConfig
from target_service.engine import build_engine_core
from target_service.engine_core import EngineCore

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """asyncio front of an `EngineCore`; implements `EngineClient`."""

    def __init__(self, core: EngineCore, threads: int | None = None) -> None:
        self._core = core
        self.model_info = core.model_info
        # torch's thread count is per thread (MKL's is thread-local): size it where steps run
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine", initializer=apply_threads, initargs=(threads, log))
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending_adds: list[EngineRequest] = []
        self._pending_aborts: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._admitting = True

    @classmethod
    def build(cls, config: EngineConfig) -> AsyncEngine:
        return cls(build_engine_core(config), config.threads)

    def tokenizer(self):
        return self._core.tokenizer

    @property
    def core(self) -> EngineCore:
        return self._core

    async def start(self) -> None:
        await self.run_on_engine_thread(self._core.warmup)
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name="engine-loop")
        if (link := self._core.link) is not None and link.health is not None:  # handshake when it turns SERVING
            loop = asyncio.get_running_loop()
            link.health.call_on_news(lambda: loop.call_soon_threadsafe(self._notify))

    async def run_on_engine_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine's one thread, between steps (where torch's thread settings apply)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def stop_admitting(self) -> None:
        self._admitting = False

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate and admit now (raising on bad input); stream outputs lazily."""
        self._check_admission(request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._pending_adds.append(request)
        self._notify()
        return RequestStream(self, request.request_id, queue, request.n)

    def _check_admission(self, request: EngineRequest) -> None:
        if not self._admitting or self._loop_task is None:
            raise ShuttingDownError("the server is not admitting requests")
        if request.request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in flight")
        validate_prompt(request, self.model_info)
        if request.structured_output is not None and request.grammar is None:
            raise InvalidRequestError("structured_output", "its grammar was not compiled before admission")
        if self._core.num_waiting + len(self._pending_adds) >= self._core.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self._core.config.max_waiting} requests)")

    def _close_stream(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.abort(request_id)
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self._pending_aborts.add(request_id)
        self._notify()
        return True

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _drain_pending(self) -> None:
        """Apply admissions and aborts; only ever between steps."""
        adds, self._pending_adds = self._pending_adds, []
        aborts, self._pending_aborts = self._pending_aborts, set()
        for request in adds:  # a request aborted before it got here still counts: admitted, then aborted
            self._core.add(request)
        for request_id in aborts:
            for out in self._core.abort(request_id):
                self._deliver(out)

    def _deliver(self, output: RequestOutput | BaseException, request_id: str | None = None) -> None:
        rid = request_id or output.request_id  # type: ignore[union-attr]
        if (queue := self._streams.get(rid)) is not None:
            queue.put_nowait(output)

    async def _run(self) -> None:
        while True:
            self._drain_pending()
            if not self._core.has_work():
                self._wake.clear()
                if not (self._pending_adds or self._pending_aborts):
                    await self._idle()
                continue
            try:
                outputs = await self.run_on_engine_thread(self._core.step)
            except Exception as exc:  # a failed step must not take the server down
                log.exception("engine step failed; aborting the affected requests")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)

    async def _idle(self) -> None:
        """Sleep until work arrives; meanwhile keep re-handshaking with a lost drafter."""
        link = self._core.link
        if link is None or link.ready:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.05, link.seconds_until_retry()))
        except asyncio.TimeoutError:
            if link.due_for_handshake():
                await self.run_on_engine_thread(self._core.handshake)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in {out.request_id for out in self._core.abort_all()}:
            self._deliver(RuntimeError(f"engine step failed: {exc}"), request_id)

    def server_info(self) -> dict:
        state = self._core.state()
        return {
            "kv_layout": state.layout,
            "num_pages": state.num_pages,
            "free_pages": state.free_pages,
            "running": state.running,
            "waiting": state.waiting + len(self._pending_adds),
            "drafter": state.drafter,
            "prefix_cache": state.prefix_cache,
        }

    async def shutdown(self, grace_s: float) -> None:
        """Finish in-flight requests within `grace_s`, abort the rest, free the pool."""
        self.stop_admitting()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        for _ in range(100):  # let the loop deliver the aborts
            if not self._streams:
                break
            await asyncio.sleep(0.01)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        await asyncio.to_thread(self._core.close)  # it may wait (briefly) on the drafter: not on the loop


class RequestStream:
    """The outputs of one admitted request (all its n sequences), as an async iterator that
    ends after the n-th last output.

    Closing it before the last output aborts the request (its pages are free at the next
    step), whether or not it was ever iterated: a handler cancelled between admission and
    its first read (a client cancel, a deadline, a failed metadata write) must not leave
    the request running with nobody reading it. An async generator cannot promise that:
    `aclose()` on one that never started skips its `finally`.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue, n: int = 1) -> None:
        self._engine = engine
        self._request_id = request_id
        self._queue = queue
        self._unfinished = n  # sequences whose last output has not come
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed or self._finished:
            await self.aclose()
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finish_reason is not None:
            self._unfinished -= 1
            self._finished = self._unfinished == 0
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._close_stream(self._request_id, self._finished)
