"""Continuous batching with chunked prefill and preemption by recompute. No torch here.

Each step: running sequences first (decodes and unfinished prefill chunks, in arrival
order), then waiting ones, all under one per-step token budget. When pages run out, the
most recently admitted running sequence is preempted: its pages are freed and it
returns to the front of the queue to be recomputed (prompt + what it generated).

A sequence is admitted from the longest prefix of full pages the page manager has cached
(`PrefixHit`): those pages are shared, their tokens count as computed, and its first
forward starts after them. `prefix_hit` decides how much of a hit a sequence may use
(speculation's drafter may need the tokens' hidden states, engine_core.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from target_service.page_manager import PageManager, PrefixHit
from target_service.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_query_tokens: int  # tokens of seq.token_ids computed this step
    num_lookahead_tokens: int = 0  # draft slots reserved after them (speculation)

    @property
    def samples(self) -> bool:
        """The step reaches the end of the sequence, so its last logit yields a token."""
        return self.seq.num_computed_tokens + self.num_query_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queries: list[tuple[int, int]] = field(default_factory=list)  # per admission: (tokens, tokens cached)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens + s.num_lookahead_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


Lookahead = Callable[[list[Sequence]], dict[int, int]]  # running sequences → draft slots by seq id
PrefixLookup = Callable[[Sequence], PrefixHit]  # a waiting sequence → the cached pages it may start from


class Scheduler:
    def __init__(self, config: SchedulerConfig, page_manager: PageManager, lookahead: Lookahead | None = None,
                 prefix_hit: PrefixLookup | None = None) -> None:
        self.config = config
        self.page_manager = page_manager
        self.lookahead = lookahead  # asked each step when `schedule` is given no slots (speculation's)
        self.prefix_hit = prefix_hit  # None: the page manager's whole hit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def use_page_manager(self, page_manager: PageManager) -> None:
        """The pool was replaced (only while idle): page ids come from `page_manager` now."""
        if self.has_work:
            raise RuntimeError("the page manager can only change while no sequence waits or runs")
        self.page_manager = page_manager

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.page_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self, lookahead: dict[int, int] | None = None) -> SchedulerOutput:
        """Pick this step's work. `lookahead[seq_id]` asks for draft slots after a decode (by
        default, what the `lookahead` provider says for the running sequences)."""
        if lookahead is None and self.lookahead is not None:
            lookahead = self.lookahead(self.running)
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget, lookahead or {})
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, lookahead: dict[int, int]) -> int:
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            extra = lookahead.get(seq.seq_id, 0) if n == 1 else 0
            extra = max(0, min(extra, budget - n, self.config.max_model_len - seq.num_tokens))
            if not self._reserve(seq, seq.num_computed_tokens + n + extra, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, n, extra))
            budget -= n + extra
        return budget

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make pages for `seq`, preempting later-admitted sequences; False if seq itself went."""
        while not self.page_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.page_manager.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.page_manager.free(seq)  # its full pages stay cached: it is likely to find them again
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        pages = self.page_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self._find_prefix(seq)
            start = len(hit) * pages.page_size
            n = min(seq.num_tokens - start, budget)
            if not pages.can_start(seq, hit, start + n):
                break
            self._start_from(seq, hit, start)
            if pages.enable_prefix_caching:
                out.prefix_queries.append((seq.num_tokens, start))
            pages.allocate(seq, start + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _find_prefix(self, seq: Sequence) -> PrefixHit:
        if self.prefix_hit is not None:
            return self.prefix_hit(seq)
        return self.page_manager.find_prefix(seq)

    def _start_from(self, seq: Sequence, hit: PrefixHit, start: int) -> None:
        """Admit `seq` holding the hit's pages, its tokens before `start` computed."""
        self.page_manager.share(seq, hit.pages)
        self.page_manager.record_query(seq, start)
        seq.num_computed_tokens = seq.num_started_tokens = start
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = start
