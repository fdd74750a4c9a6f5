"""The target's side of the internal channel: handshake, Propose, Release, and fallback.

Only the engine thread calls it, between steps. Any failure (down, past the per-step
deadline, an error, garbage) turns the link UNAVAILABLE: the step runs without
speculation and the engine re-handshakes later with exponential backoff. Every
re-handshake bumps the epoch, so the drafter drops all state of the old one. The epoch and
target id live in the pool's layout (target_service/handshake.py), not here.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import grpc

from common.auth import auth_metadata
from common.drafter_facts import DrafterFacts
from common.layout_proto import drafter_facts_from_proto
from splitspec.v1 import drafter_pb2 as dpb
from splitspec.v1 import drafter_pb2_grpc as dpb_grpc

log = logging.getLogger(__name__)


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
    propose_timeout_s: float = 1.0  # the per-step deadline
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
        return self.state in (LinkState.CONNECTING, LinkState.UNAVAILABLE) and time.monotonic() >= self._next_attempt

    def seconds_until_retry(self) -> float:
        return max(0.0, self._next_attempt - time.monotonic())

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
        self.num_proposes += 1
        self.propose_sequences += len(request.sequences)
        self.propose_bytes += request.ByteSize()
        return self._stub.Propose(request, timeout=self.config.propose_timeout_s, metadata=self.metadata)

    def mark_ready(self, facts: DrafterFacts, epoch: int) -> None:
        self.facts = facts
        self.state, self.detail = LinkState.READY, ""
        self._backoff = self.config.backoff_initial_s
        log.info("drafter %s ready: %s, K=%d, epoch %d", self.config.address, facts.kind,
                 facts.num_speculative_tokens, epoch)

    def mark_failed(self, detail: str, rejected: bool = False) -> None:
        """Serve without speculation; try again after a backoff that doubles up to a cap."""
        self.rejected = rejected
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
            "detail": self.detail,
        }

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


def describe_rpc_error(exc: Exception) -> str:
    if isinstance(exc, DrafterRejected):
        return f"FAILED_PRECONDITION: {exc}"
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
