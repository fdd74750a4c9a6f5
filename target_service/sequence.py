"""Per-request bookkeeping. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from target_service.api_types import EngineRequest, Usage


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    seq_id: int
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose KV sits in the pages
    page_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    drafter_epoch: int | None = None  # the handshake epoch whose drafter saw this sequence from its start
    drafter_pages_sent: int = 0  # page-table entries the drafter already knows
    page_hashes: list[bytes] = field(default_factory=list, repr=False)  # chained hashes of its full pages (page_manager.py)
    num_committed_pages: int = 0  # leading pages of page_table offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    num_started_tokens: int = 0  # tokens cached when it was last admitted: its first forward starts there
    drafter_written_tokens: int = 0  # leading tokens whose draft layers the drafter reported written
    index: int = 0  # which of the request's n sequences
    prompt_logprobs_done: int = 1  # prompt positions below this have their logprob reported (position 0 has none)

    @classmethod
    def from_request(cls, request: EngineRequest, seq_id: int, index: int = 0) -> Sequence:
        prompt = list(request.prompt_token_ids)
        return cls(request=request, seq_id=seq_id, token_ids=prompt, num_prompt_tokens=len(prompt), index=index)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.num_cached_tokens,
            completion_tokens=self.num_output_tokens,
            num_drafts=self.spec.num_drafts,
            draft_tokens=self.spec.draft_tokens,
            accepted_tokens=self.spec.accepted_tokens,
            accepted_per_position=tuple(self.spec.accepted_per_position),
        )
