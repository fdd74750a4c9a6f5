"""The target's side of the internal channel: handshake, Propose, Release, and fallback.

Only the engine thread calls it, between steps. Any failure (down, past the per-step
deadline, an error, garbage) turns the link UNAVAILABLE: the step runs without
speculation and the engine re-handshakes later with exponential backoff. Every
re-handshake bumps the epoch, so the drafter drops all state of the old one. The epoch and
target id live in the pool's layout (target_service/handshake.py), not here.

Beside that backoff, a `DrafterHealthWatch` follows the drafter's grpc.health.v1 status:
a drafter that turns SERVING (done loading its model, or back after a restart) is
handshaken at once instead of at the next backoff retry (up to 30 s later), and while it
reports NOT_SERVING no handshake is spent on it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import splitspec.contract as defaults
from common.auth import auth_metadata
from common.drafter_facts import DrafterFacts
from common.grpc_errors import parse_request
from common.layout_proto import drafter_facts_from_proto
from common.shm_channel import ChannelClient, ChannelError
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc

log = logging.getLogger(__name__)

DRAFTER_SERVICE = dpb.DESCRIPTOR.services_by_name["Drafter"].full_name  # "splitspec.v1.Drafter"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class LinkState(enum.Enum):
    NONE = "none"
    CONNECTING = "connecting"
    READY = "ready"
    UNAVAILABLE = "unavailable"


class DrafterRejected(RuntimeError):
    """The drafter answered Negotiate with an incompatibility (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class DrafterLinkConfig:
    address: str
    token: str
    propose_timeout_s: float = defaults.PROPOSE_TIMEOUT_S  # the per-step deadline
    handshake_timeout_s: float = 10.0  # the first handshake, at startup
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_message_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("drafter address is empty")
        if self.propose_timeout_s <= 0 or self.handshake_timeout_s <= 0:
            raise ValueError("drafter timeouts must be positive")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")


class DrafterHealthWatch:
    """The drafter's health status, followed on a thread through a streaming Watch call.

    The call waits for the channel to connect (a drafter that is not up yet costs nothing),
    and is made again whenever it ends (the drafter went away); closing the channel ends
    it for good. `status` is the last one reported, None while not connected. A change to
    SERVING is news: kept until a handshake takes it, and announced to the callback given
    to `call_on_news`."""

    RETRY_S = 0.5  # between two Watch calls, when one ends

    def __init__(self, channel: grpc.Channel, address: str) -> None:
        self.address = address
        self.on_news: Callable[[], None] | None = None  # set by call_on_news
        self.status: int | None = None
        self._news = threading.Event()
        self._closed = threading.Event()
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._thread = threading.Thread(target=self._run, name="drafter-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        request = health_pb2.HealthCheckRequest(service=DRAFTER_SERVICE)
        while not self._closed.is_set():
            try:
                for reply in self._stub.Watch(request, wait_for_ready=True):
                    self._update(reply.status)
            except grpc.RpcError as exc:  # the drafter went away, or the channel closed
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("drafter %s serves no health service: retrying on the backoff only", self.address)
                    return
            self._update(None)
            self._closed.wait(self.RETRY_S)

    def _update(self, status: int | None) -> None:
        became_serving = status == SERVING and self.status != SERVING
        self.status = status
        if became_serving and not self._closed.is_set():
            log.info("drafter %s reports SERVING", self.address)
            self._news.set()
            if self.on_news is not None:
                try:
                    self.on_news()
                except RuntimeError:  # the engine's event loop is gone: it is stopping
                    pass

    @property
    def has_news(self) -> bool:
        return self._news.is_set()

    def call_on_news(self, callback: Callable[[], None]) -> None:
        """From now on, announce a change to SERVING through `callback` (from the watch's thread)."""
        self.on_news = callback

    def take_news(self) -> bool:
        news = self._news.is_set()
        self._news.clear()
        return news

    def wait_for_news(self, timeout_s: float) -> bool:
        return self._news.wait(timeout_s)

    def close(self) -> None:
        self._closed.set()  # the channel's close ends the Watch call; the thread then exits
        self._thread.join(timeout=5.0)


@dataclass
class DrafterLink:
    config: DrafterLinkConfig
    state: LinkState = LinkState.CONNECTING
    facts: DrafterFacts | None = None
    detail: str = ""
    rejected: bool = False  # the last handshake was refused as incompatible
    serving: bool = False  # once the engine serves (`start_serving`), handshakes get short deadlines
    num_proposes: int = 0
    propose_sequences: int = 0  # sequence updates sent, summed over Proposes
    propose_bytes: int = 0  # serialized request bytes, summed over Proposes
    _next_attempt: float = 0.0
    _backoff: float = 0.0
    _channel: grpc.Channel | None = field(default=None, repr=False)
    # Anything with the DrafterStub methods; a gRPC stub unless one is given (benchmarks
    # pass an in-process stub to measure what the split itself costs).
    _stub: dpb_grpc.DrafterStub | None = field(default=None, repr=False)
    health: DrafterHealthWatch | None = field(default=None, repr=False)  # None for an in-process stub
    # The pool's shm channel, while the drafter of this epoch answers on it (common/shm_channel.py)
    shm_channel: ChannelClient | None = field(default=None, repr=False)
    channel_proposes: int = 0  # Proposes that went over the shm channel

    def __post_init__(self) -> None:
        self._backoff = self.config.backoff_initial_s
        if self._stub is not None:
            return
        options = [("grpc.max_send_message_length", self.config.max_message_bytes),
                   ("grpc.max_receive_message_length", self.config.max_message_bytes),
                   # the link falls back and re-handshakes itself; gRPC's retry layer would only
                   # buffer every Propose on the hot path
                   ("grpc.enable_retries", 0)]
        self._channel = grpc.insecure_channel(self.config.address, options=options)
        self._stub = dpb_grpc.DrafterStub(self._channel)
        self.health = DrafterHealthWatch(self._channel, self.config.address)

    @property
    def ready(self) -> bool:
        return self.state is LinkState.READY

    @property
    def metadata(self):
        return auth_metadata(self.config.token)

    def start_serving(self) -> None:
        """From now on a handshake runs between steps and must not stall the streams for long."""
        self.serving = True

    def due_for_handshake(self) -> bool:
        """Not ready, and the drafter just turned SERVING or the backoff is over (unless
        the drafter says it is not serving: a handshake would only fail)."""
        if self.state not in (LinkState.CONNECTING, LinkState.UNAVAILABLE):
            return False
        if self.health is not None and self.health.has_news:
            return True
        if self.health is not None and self.health.status == NOT_SERVING:
            return False
        return time.monotonic() >= self._next_attempt

    def seconds_until_retry(self) -> float:
        if self.health is not None and self.health.has_news:
            return 0.0
        return max(0.0, self._next_attempt - time.monotonic())

    def wait_for_drafter(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, less when the drafter turns SERVING meanwhile."""
        if self.health is None:
            time.sleep(timeout_s)
        else:
            self.health.wait_for_news(timeout_s)

    @property
    def handshake_timeout_s(self) -> float:
        """Deadline of each handshake RPC. Once serving, a retry runs on the engine thread
        between steps, so it gets about one Propose deadline (at least 1 s), not the startup
        wait: a hung drafter (SIGSTOP, a wedged process) then costs a retry no more than a
        failed step, instead of stalling every stream for the full handshake timeout."""
        if not self.serving:
            return self.config.handshake_timeout_s
        return min(self.config.handshake_timeout_s, max(1.0, self.config.propose_timeout_s))

    def negotiate(self, request: dpb.NegotiateRequest) -> DrafterFacts:
        early = self._next_attempt - time.monotonic()
        if self.health is not None and self.health.take_news() and early > 0:
            log.info("drafter %s is SERVING: handshaking now, %.1f s before the backoff's retry",
                     self.config.address, early)
        try:
            reply = self._stub.Negotiate(request, timeout=self.handshake_timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise DrafterRejected(exc.details()) from exc
            raise
        return drafter_facts_from_proto(reply)

    def attach(self, request: dpb.AttachRequest) -> dpb.AttachResponse:
        return self._stub.Attach(request, timeout=self.handshake_timeout_s, metadata=self.metadata)

    def detach(self, target_id: str, epoch: int) -> None:
        """Best effort, on shutdown: the drafter forgets this target and unmaps its pool now
        (else the pool's memory stays mapped there until another target negotiates)."""
        if not self.ready:
            return
        request = dpb.ReleaseRequest(target_id=target_id, epoch=epoch, detach=True)
        try:
            self._stub.Release(request, timeout=min(1.0, self.config.handshake_timeout_s), metadata=self.metadata)
        except grpc.RpcError as exc:
            log.info("drafter %s did not take the detach: %s", self.config.address, describe_rpc_error(exc))
        self.state = LinkState.UNAVAILABLE

    def propose(self, request: dpb.ProposeRequest) -> dpb.ProposeResponse:
        """Over the shm channel when the drafter answers there and the request fits; else gRPC."""
        self.num_proposes += 1
        self.propose_sequences += len(request.sequences)
        size = request.ByteSize()
        self.propose_bytes += size
        channel = self.shm_channel
        if channel is not None and size <= channel.capacity:
            self.channel_proposes += 1
            reply = channel.call(request.SerializeToString(), self.config.propose_timeout_s)
            return parse_request(reply, dpb.ProposeResponse.FromString)  # the drafter's bytes: hostile as any
        return self._stub.Propose(request, timeout=self.config.propose_timeout_s, metadata=self.metadata)

    def use_channel(self, channel: ChannelClient | None) -> None:
        self.shm_channel = channel

    def mark_ready(self, facts: DrafterFacts, epoch: int) -> None:
        self.facts = facts
        self.state, self.detail = LinkState.READY, ""
        if self.health is not None:
            self.health.take_news()  # whatever it said is acted on
        self._backoff = self.config.backoff_initial_s
        log.info("drafter %s ready: %s, K=%d, epoch %d", self.config.address, facts.kind,
                 facts.num_speculative_tokens, epoch)

    def mark_failed(self, detail: str, rejected: bool = False) -> None:
        """Serve without speculation; try again after a backoff that doubles up to a cap."""
        self.rejected = rejected
        self.shm_channel = None  # the next Attach offers a new one
        if self.state is not LinkState.UNAVAILABLE or detail != self.detail:
            log.warning("drafter %s unavailable (%s); serving without speculation, retrying in %.1fs",
                        self.config.address, detail, self._backoff)
        self.state, self.detail = LinkState.UNAVAILABLE, detail
        self._next_attempt = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.config.backoff_max_s)

    def describe(self, epoch: int) -> dict:
        facts = self.facts
        return {
            "state": self.state.value,
            "address": self.config.address,
            "kind": facts.kind if facts else "",
            "num_speculative_tokens": facts.num_speculative_tokens if facts else 0,
            "epoch": epoch,
            "propose_transport": "shm" if self.shm_channel is not None else "grpc",
            "detail": self.detail,
        }

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.health is not None:
            self.health.close()


def describe_rpc_error(exc: Exception) -> str:
    if isinstance(exc, DrafterRejected):
        return f"FAILED_PRECONDITION: {exc}"
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, ChannelError):
        return f"{exc.code.name}: {exc.details} (shm channel)"
    return f"{type(exc).__name__}: {exc}"
