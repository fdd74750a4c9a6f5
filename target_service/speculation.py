"""What the engine tells the drafter each step, and what it asks of it.

After every forward, each sequence the drafter follows gets an update (`PendingUpdate`,
sent as a `SequenceUpdate`): the tokens whose target KV now exists, the staging rows
holding their hidden states, and the pages added to its page table. The next step's one
batched `Propose` carries those updates together with the draft requests. A step that asks
for no drafts sends no Propose: its updates wait for the next one that does (`StagedRows`
keeps the hidden states such an update points at: the next forward writes after them).
A sequence is speculated only if the drafter of the current epoch saw it from position 0;
any failure ends the epoch, so no half-delivered update is ever trusted.

A sequence admitted from the prefix cache starts its first forward past position 0. Its
first update still starts at 0, and says how many of those tokens have the drafter's own
layers written in their (cached) pages (`cached_context_tokens`): the drafter computes
only the rest. The drafter reports, per sequence, how far its layers are written
(`ContextWritten`), and the page manager marks those pages valid for this epoch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from common.pool_transport import sync_for_handoff
from splitspec.v1 import drafter_pb2 as dpb
from target_service.draft_policy import Decision, DraftPolicy
from target_service.drafter_link import DrafterLink, describe_rpc_error
from target_service.handshake import SharedPool
from target_service.metrics import TargetMetrics
from target_service.page_manager import NO_EPOCH, PageManager
from target_service.scheduler import ScheduledSeq, SchedulerOutput
from target_service.sequence import Sequence

log = logging.getLogger(__name__)

MAX_DEFERRED_RELEASES = 256  # released sequence ids that may wait for the next Propose
# Forwards after a Propose that run cold: the drafter's work evicted the target's weights from the
# caches, so the first step without drafts after one took 1.67 ms where such steps take 1.09 (row 7,
# AMD EPYC, docs/performance.md#the-adaptive-policys-rules). Priced as steps without drafts, they made
# those look 20% dearer than they are to a policy that was drafting at a loss.
COLD_STEPS = 2
# While quiet (no drafts pay, nothing followed: `Speculator._quiet`), one step in this many is priced:
# the cost table keeps each width's median of its last 9 samples, which moves no faster than that
QUIET_PRICE_EVERY = 8


@dataclass
class StepRecord:
    """What one forward did, as speculation learns from it (`after_forward`)."""

    scheduled: list[ScheduledSeq]
    drafts: dict[int, list[int]]  # seq id → the drafts the forward verified
    accepted: dict[int, int]  # seq id → how many of them were accepted
    computed_before: list[int]  # per scheduled sequence, its computed tokens before the step
    row_starts: list[int]  # per scheduled sequence, its first row of the forward (its staging row)
    seconds: float
    prefilled: bool  # a prefill chunk was in it (the policy prices decode and verify steps only)


class NoSpeculation:
    """The engine's speculation when it has no drafter: every step decodes."""

    page_manager: PageManager | None = None

    def pages_epoch(self) -> int:
        return NO_EPOCH

    def needs_hidden_states(self, seq: Sequence) -> bool:
        return False

    def follows_for_drafts(self) -> bool:
        return False

    def reads_hidden_states(self, scheduled: list[ScheduledSeq]) -> bool:
        return False

    def staging_row(self) -> int:
        return 0

    def due_for_handshake(self) -> bool:
        return False

    def lookahead(self, running: list[Sequence], metrics: TargetMetrics) -> dict[int, int]:
        return {}

    def before_forward(self, plan: SchedulerOutput, metrics: TargetMetrics) -> dict[int, list[int]]:
        return {}

    def after_forward(self, record: StepRecord) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def forget_measurements(self) -> None:
        pass


@dataclass(slots=True)
class PendingUpdate:
    """A sequence's `SequenceUpdate` while it waits for a Propose: plain lists, extended step by
    step (a step without drafts touches no protobuf), made a message only when it is sent."""

    seq_id: int
    context_start: int
    context_token_ids: list[int]
    staging_row: int
    last_token_id: int
    new_pages: list[int] = field(default_factory=list)
    num_speculative_tokens: int = 0
    cached_context_tokens: int = 0  # with context_start 0: leading tokens whose draft layers are in the pages

    def to_proto(self) -> dpb.SequenceUpdate:
        return dpb.SequenceUpdate(seq_id=self.seq_id, context_start=self.context_start,
                                  context_token_ids=self.context_token_ids, staging_row=self.staging_row,
                                  new_pages=self.new_pages, last_token_id=self.last_token_id,
                                  num_speculative_tokens=self.num_speculative_tokens,
                                  cached_context_tokens=self.cached_context_tokens)


@dataclass
class StagedRows:
    """Hidden-state rows of context a drafter that reads them (DFlash) has not been sent yet.

    Each forward writes its tokens' rows to the staging buffer from `used` on (`staging_row`),
    so a step that sends no Propose keeps its rows where they are: the next forward writes
    after them. When a Propose goes, `restage` packs each update's rows (its held ones, then
    the last forward's) into consecutive rows from row 0 and points the update at them, one
    gather at most (none when they already lie in that order, as one sequence's always do).
    After the Propose the drafter has read them, and the next forward writes from row 0."""

    fresh: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id → (first row, count), last forward's
    held: dict[int, list[range]] = field(default_factory=dict)  # seq_id → its earlier rows, in context order
    used: int = 0  # rows written since the last Propose (a dropped sequence's stay counted)

    def note_fresh(self, seq_id: int, row: int, count: int) -> None:
        if count > 0:
            self.fresh[seq_id] = (row, count)

    def rows_after_holding(self) -> int:
        return max(self.used, max((row + count for row, count in self.fresh.values()), default=0))

    def hold(self) -> None:
        """Keep the last forward's rows for a later Propose: the next forward writes past them."""
        if not self.fresh:
            return
        self.used = self.rows_after_holding()
        for seq_id, (row, count) in self.fresh.items():
            self.held.setdefault(seq_id, []).append(range(row, row + count))
        self.fresh.clear()

    def restage(self, staging: torch.Tensor, updates: dict[int, PendingUpdate]) -> None:
        """Each update's rows packed from row 0 of `staging` [rows, width], in context order."""
        order: list[int] = []
        for seq_id, update in updates.items():
            first = len(order)
            for rows in self.held.get(seq_id, ()):
                order.extend(rows)
            if seq_id in self.fresh:
                row, count = self.fresh[seq_id]
                order.extend(range(row, row + count))
            if len(order) > first:
                update.staging_row = first
        if order and order != list(range(len(order))):
            index = torch.tensor(order, dtype=torch.long, device=staging.device)
            staging[: len(order)] = staging[index]  # [len(order), width]: gathered first, so rows may overlap
        self.clear()

    def drop(self, seq_id: int) -> None:
        self.held.pop(seq_id, None)  # its rows are reclaimed after the next Propose
        self.fresh.pop(seq_id, None)

    def clear(self) -> None:
        self.fresh.clear()
        self.held.clear()
        self.used = 0


@dataclass
class Speculator:
    """Metrics are passed to each call, not kept: the engine decides where a step's counts go
    (warmup steps count nowhere that Prometheus reads)."""

    shared: SharedPool  # its link talks to the drafter; its layout holds the target id and epoch
    server_k: int
    max_model_len: int
    vocab_size: int
    device: torch.device
    disable_batch_size: int | None = None  # no drafts while this many sequences or more run
    max_num_batched_tokens: int | None = None  # the step's token budget (caps the policy's base width)
    policy: DraftPolicy | None = None  # how many drafts per step; None → a fixed K (set in __post_init__)
    page_manager: PageManager | None = None  # the engine's (set by it): pages the drafter's layers are valid in
    _followed: dict[int, Sequence] = field(default_factory=dict)  # seq id → the sequences the drafter follows
    _pending: dict[int, PendingUpdate] = field(default_factory=dict)
    _released: list[int] = field(default_factory=list)
    _staged: StagedRows = field(default_factory=StagedRows)
    _probe_turn: int = 0
    _probe_seq: int | None = None
    _probing: bool = False  # this step's drafts are a probe (lookahead): its Propose's cost is recorded
    _steps_since_propose: int = COLD_STEPS  # 0: this step called the drafter (`propose`); counts forwards since
    # Per sequence, the context tokens computed since it last drafted, outside its drafting steps
    # (a prompt, steps without drafts): the drafter catches up on them when it next drafts
    _behind: dict[int, int] = field(default_factory=dict)
    # seq id → whether a sequence in its first forward since admission starts being followed
    # (`_follows_from_admission`), decided once for that forward's capture and its record
    _admitted: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy is None:
            self.policy = DraftPolicy(self.server_k, adaptive=False)

    @property
    def link(self) -> DrafterLink:
        return self.shared.link

    @property
    def epoch(self) -> int:
        return self.shared.layout.epoch

    def reset(self) -> None:
        """A new epoch: nothing pending belongs to it."""
        self._pending.clear()
        self._released.clear()
        self._staged.clear()
        self._behind.clear()
        self._followed.clear()
        self._admitted.clear()

    def follows(self, seq: Sequence) -> bool:
        return self.link.ready and seq.drafter_epoch == self.epoch

    def drafter_has_layers(self) -> bool:
        return any(layer.owner == "draft" for layer in self.shared.layout.layers)

    def pages_epoch(self) -> int:
        """The epoch cached pages must carry for their draft layers to be valid (NO_EPOCH: no
        drafter attached, or one without layers in the pool)."""
        if not self.link.ready or not self.drafter_has_layers():
            return NO_EPOCH
        return self.epoch

    def staging_row(self) -> int:
        """The staging row the next forward writes its hidden states from (the rows before it are held).
        Row 0 while the link is down: what was held belongs to the failed epoch, and nobody reads it."""
        return self._staged.used if self.link.ready else 0

    def reads_hidden_states(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the drafter will read this step's hidden states (the forward then captures them
        into the staging rows): a drafter that reads them, and a scheduled sequence it follows or
        may start following (in its first forward since admission, `record_step`); not for a step
        of sequences that disabled speculation or went unfollowed (the idle split's rows 9 and 7)."""
        if not self.link.ready or self.shared.layout.staging is None:
            return False
        epoch = self.epoch
        return any(not s.seq.request.speculation.disable
                   and (s.seq.drafter_epoch == epoch or (s.seq.num_computed_tokens == s.seq.num_started_tokens
                                                         and self._follows_from_admission(s.seq)))
                   for s in scheduled)

    def _follows_from_admission(self, seq: Sequence) -> bool:
        """Whether a sequence in its first forward since admission starts being followed: always
        while drafts pay; while none do (`DraftPolicy.idle`), only if the next probe comes due before
        it can end, and no other sequence is followed for it (a probe asks one sequence). Following
        costs every step (its hidden states captured and queued, its updates recorded), and a
        sequence no probe reaches is never drafted for; the policy's clock runs on without it
        (`lookahead`), so a later sequence is followed for the probe."""
        decision = self._admitted.get(seq.seq_id)
        if decision is None:
            tokens_left = seq.request.stop.max_tokens - seq.num_output_tokens
            decision = not self.policy.idle or (self.policy.steps_until_probe() < tokens_left
                                                and not self._followed and not any(self._admitted.values()))
            self._admitted[seq.seq_id] = decision
        return decision

    def needs_hidden_states(self, seq: Sequence) -> bool:
        """Whether the drafter, to follow `seq`, needs the target's hidden states of every token
        its layers are not written for (DFlash): then only pages it wrote serve as a prefix, unless
        following does not pay (`follows_for_drafts`)."""
        return self.link.ready and self.shared.layout.staging is not None and not seq.request.speculation.disable

    def follows_for_drafts(self) -> bool:
        """Whether a new sequence is worth recomputing cached prompt pages for, so that the drafter
        can follow it: not while the policy finds that no drafts pay (`DraftPolicy.idle`). Then a
        prompt takes its whole prefix-cache hit and the sequence is not followed (never drafted
        for), where recomputing it would cost every sequence in the batch and buy nothing."""
        return not self.policy.idle

    def _drafter_cached_tokens(self, seq: Sequence, start: int) -> int:
        """Of `seq`'s first `start` tokens (cached, not computed by this admission), those the
        drafter need not compute: all for a drafter without layers, else the pages it wrote."""
        if not self.drafter_has_layers() or self.page_manager is None:
            return start
        return min(start, self.page_manager.drafter_valid_tokens(seq, self.epoch))

    def draft_limit(self, seq: Sequence, drafter_k: int) -> int:
        """The target side's one bound on k: the most drafts `seq` may ask for this step, under the
        server's K, the drafter's (`drafter_k`), its request's own, the model length and its
        max_tokens (the bonus token emitted with the drafts counts)."""
        speculation = seq.request.speculation
        if speculation.disable:
            return 0
        tokens_left = seq.request.stop.max_tokens - seq.num_output_tokens
        return min(self.server_k, drafter_k, speculation.num_speculative_tokens or self.server_k,
                   self.max_model_len - seq.num_tokens, tokens_left - 1)

    def lookahead(self, running: list[Sequence], metrics: TargetMetrics) -> dict[int, int]:
        """Draft slots to reserve for each decoding sequence the drafter follows.

        Nothing while the batch is at `disable_batch_size` or more: verifying K+1 tokens for
        every sequence of a large batch costs more than the drafts save. The drafter still
        receives every sequence's context, so drafting resumes as soon as the batch shrinks.
        Otherwise the policy picks one k for the step (draft_policy.py), each sequence's own
        limit (its request, the model length, max_tokens) capping it further."""
        self._probing = False
        if self.disable_batch_size is not None and len(running) >= self.disable_batch_size:
            if self.link.ready:
                metrics.batch_disabled_steps.inc()
            return {}
        if not self.link.ready or self.link.facts is None:
            return {}
        if self._quiet():
            self._pass_without_decision(metrics)
            return {}
        batch = (len(running), sum(seq.num_uncomputed_tokens for seq in running))
        if self.policy.keeps_no_drafts(batch):
            self._count_decision(Decision(0), metrics)
            return {}
        drafter_k = self.link.facts.num_speculative_tokens
        limits = {}
        catch_up_rows = 0.0
        epoch = self.epoch  # follows(seq), once per step rather than per sequence
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or seq.drafter_epoch != epoch:
                continue
            if (k := self.draft_limit(seq, drafter_k)) > 0:
                limits[seq.seq_id] = k
                tokens_left = seq.request.stop.max_tokens - seq.num_output_tokens
                catch_up_rows += self.policy.amortized_rows(self._behind.get(seq.seq_id, 0), tokens_left)
        if not limits:
            if self.policy.idle:
                self._pass_without_decision(metrics)
            return {}
        decision = self._decide(running, limits, catch_up_rows, batch, metrics)
        drafts = {seq_id: min(limit, decision.k) for seq_id, limit in limits.items()}
        if decision.probe_k:
            # A probe asks one sequence for more: acceptance is learnt per draft position, and a
            # probe of the whole batch would pay a wide verify and every sequence's catch-up.
            seq_id = self._probe_sequence(limits)
            drafts[seq_id] = min(limits[seq_id], decision.probe_k)
            self._probing = True
        return {seq_id: k for seq_id, k in drafts.items() if k > 0}

    def _quiet(self) -> bool:
        """No drafts pay and the drafter follows no sequence: a step has nothing to ask, send or
        record for it (only sequences in their first forward are decided, `_follows_from_admission`),
        and the releases waiting for the next Propose may wait on (`_may_defer`). An idle split's
        every step passes here, so this is the one check such a step pays, where the full path
        cost 3-4% of a 2 ms step on a 2-core EPYC (docs/performance.md)."""
        return (not self._followed and not self._pending and len(self._released) < MAX_DEFERRED_RELEASES
                and self.policy.idle)

    def _probe_sequence(self, limits: dict[int, int]) -> int:
        """The sequence probed last while it still runs, else the next in turn: a drafter
        catches a sequence up on everything since it last drafted (DFlash writes that
        context, a draft LM decodes it), so probing one sequence keeps that to the gap
        between probes, where turns would make each probe catch up a whole context."""
        if self._probe_seq not in limits:
            self._probe_turn += 1
            self._probe_seq = sorted(limits)[self._probe_turn % len(limits)]
        return self._probe_seq

    def _decide(self, running: list[Sequence], limits: dict[int, int], catch_up_rows: float, batch: tuple[int, int],
                metrics: TargetMetrics) -> Decision:
        base = batch[1]  # decodes 1 each, prefills their rest
        if self.max_num_batched_tokens is not None:
            base = min(base, self.max_num_batched_tokens)
        decision = self.policy.decide(len(limits), base, max(limits.values()), catch_up_rows, batch_seqs=len(running),
                                      batch=batch)
        self._count_decision(decision, metrics)
        return decision

    @staticmethod
    def _count_decision(decision: Decision, metrics: TargetMetrics) -> None:
        metrics.draft_decisions.record(decision.k, probe=bool(decision.probe_k))

    def _pass_without_decision(self, metrics: TargetMetrics) -> None:
        """Nobody to decide for while no drafts pay: the step still counts toward the next probe,
        and as a k = 0 decision."""
        self.policy.pass_step_without_decision()
        metrics.draft_decisions.record(0)

    def propose(self, scheduled: list[ScheduledSeq], metrics: TargetMetrics) -> dict[int, list[int]]:
        """One batched Propose: pending updates, releases, and draft requests."""
        if not self.link.ready:
            return {}
        asks = [s for s in scheduled if s.num_lookahead_tokens and self.follows(s.seq)]
        if not asks and self._pending and self.policy.idle and not self._staging_has_room(scheduled):
            self._unfollow_pending()  # rather than a Propose that only catches the drafter up
        if not asks and (not self._pending and not self._released or self._may_defer(scheduled)):
            if self._pending and self.shared.layout.staging is not None:
                self._staged.hold()
            return {}
        updates = dict(self._pending)
        for s in asks:
            update = updates.get(s.seq.seq_id) or self._empty_update(s.seq)
            update.num_speculative_tokens = s.num_lookahead_tokens
            updates[s.seq.seq_id] = update
        if self.shared.layout.staging is not None:
            self._staged.restage(self.shared.pool.staging(), updates)
        for s in scheduled:  # pages added by this step's scheduling
            if s.seq.seq_id in updates:
                self._attach_new_pages(updates[s.seq.seq_id], s.seq)
        request = dpb.ProposeRequest(target_id=self.shared.layout.target_id, epoch=self.epoch,
                                     sequences=[u.to_proto() for u in updates.values()],
                                     released_seq_ids=self._released)
        asked = {u.seq_id: u.num_speculative_tokens for u in updates.values() if u.num_speculative_tokens}
        rows_behind = sum(self._behind.pop(seq_id, 0) for seq_id in asked)  # a drafter may put context
        self._pending.clear()  # off until the sequence drafts: the others stay behind
        self._released.clear()
        self._staged.clear()
        sync_for_handoff(self.device)  # the drafter reads what this process's last step wrote
        started = time.monotonic()
        try:
            reply = self.link.propose(request)
        except Exception as exc:  # down, hung past the deadline, or an error: no speculation
            self.link.mark_failed(describe_rpc_error(exc))
            return {}
        self._note_written(reply)
        self._steps_since_propose = 0
        elapsed = time.monotonic() - started
        metrics.propose_latency.observe(elapsed)
        if asked:
            # Priced by draft positions, n·(k+1), in steady state: what drafting every step costs. A
            # call that also catches the drafter up (a prompt, or steps that asked for no drafts) costs
            # more once: that is learnt per row apart, and charged only to steps that would catch up.
            positions = sum(asked.values()) + len(asked)
            if rows_behind:
                self.policy.record_catch_up(positions, rows_behind, elapsed)
            else:
                self.policy.record_propose(positions, elapsed)
            if self._probing:
                self.policy.record_probe(elapsed)
        return self._valid_drafts(reply, {s.seq.seq_id: s.num_lookahead_tokens for s in scheduled}, metrics)

    # --- the two calls of a step -------------------------------------------------------------

    def due_for_handshake(self) -> bool:
        return self.link.due_for_handshake()

    def before_forward(self, plan: SchedulerOutput, metrics: TargetMetrics) -> dict[int, list[int]]:
        """Forget the preempted sequences, then one batched Propose for what was scheduled:
        the drafts by seq id (none when the drafter failed this step, which is counted)."""
        for seq in plan.preempted:
            self.release(seq)
        if plan.is_empty:
            return {}
        # quiet: nothing asked (lookahead) and nothing owed, so no Propose
        drafts = {} if self._quiet() else self.propose(plan.scheduled, metrics)
        if not self.link.ready:
            metrics.fallback_steps.inc()
        return drafts

    def after_forward(self, record: StepRecord) -> None:
        """What the step taught the policy (its cost, its acceptance), and each followed
        sequence's new context queued for the next Propose."""
        scheduled = record.scheduled
        cold = self._steps_since_propose < COLD_STEPS  # a Propose ran in this step or the one before
        self._steps_since_propose += 1
        quiet = self._quiet()
        if not record.prefilled and (record.drafts or not cold) and (not quiet or self._steps_since_propose
                                                                     % QUIET_PRICE_EVERY == 0):
            # A prefill chunk's tokens cost less each (no logits, one sequence), and would make
            # wide verifies look cheap. A step without drafts is priced warm (`COLD_STEPS`): what it
            # costs cold is what drafting leaves behind, not what declining it costs.
            query_tokens = sum(s.num_query_tokens for s in scheduled) + sum(map(len, record.drafts.values()))
            self.policy.record_forward(len(scheduled), query_tokens, record.seconds)
        if not quiet and self.link.ready:  # quiet, nothing was asked
            self.record_acceptance(scheduled, record.accepted)
        if not quiet or any(start == s.seq.num_started_tokens for s, start in zip(scheduled, record.computed_before)):
            # quiet, only a sequence in its first forward since admission may start being followed
            self.record_step(scheduled, record.drafts, record.computed_before, record.row_starts)

    def forget_measurements(self) -> None:
        """Warmup's first calls pay one-time costs: not a measure."""
        self.policy.forget_measurements()

    def record_acceptance(self, scheduled: list[ScheduledSeq], accepted: dict[int, int]) -> None:
        """What the policy learns from a step: every sequence asked for k drafts, with the drafts
        it got accepted (`accepted`, by seq id). Asked is what counts, not what came back: the
        verify costs every ask, so an empty answer (an n-gram drafter without a match) is a miss
        (why: docs/performance.md#the-adaptive-policys-rules)."""
        for s in scheduled:
            if s.num_lookahead_tokens and self.follows(s.seq):
                self.policy.record_verify(s.num_lookahead_tokens, accepted.get(s.seq.seq_id, 0))

    def _may_defer(self, scheduled: list[ScheduledSeq]) -> bool:
        """A step that asks for no drafts need not call the drafter: its updates are merged into the
        next Propose that asks for drafts (record_step) instead of costing a round trip now. For a
        drafter that reads hidden states (DFlash) the rows they point at are held meanwhile, as long
        as what is held, plus this step's rows, still fits the staging buffer when packed; past
        that, a context-only Propose goes now. Releases pile up at most MAX_DEFERRED_RELEASES."""
        if len(self._released) >= MAX_DEFERRED_RELEASES:
            return False
        return self._staging_has_room(scheduled)

    def _staging_has_room(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether what is held, plus this step's rows, fits the staging buffer (always, without one)."""
        staging = self.shared.layout.staging
        if staging is None:
            return True
        step_rows = sum(s.num_query_tokens for s in scheduled)  # at most what the forward adds
        return self._staged.rows_after_holding() + step_rows <= staging.rows

    def _unfollow_pending(self) -> None:
        """Stop following every sequence with context waiting to be sent: while no drafts pay
        (`DraftPolicy.idle`), a full staging buffer would otherwise force a Propose that only
        catches the drafter up on their contexts (at concurrency 16 on the demo pair, a step
        in ten, each 1.4 ms). They are never drafted for; a drafter that was sent any of one's
        context is told to release it. Sequences admitted from here on are followed."""
        for seq_id, update in list(self._pending.items()):
            seq = self._followed.pop(seq_id, None)
            if seq is not None:
                seq.drafter_epoch = None
            if update.context_start > 0:  # the drafter holds its earlier context
                self._released.append(seq_id)
            self._behind.pop(seq_id, None)
        self._pending.clear()
        self._staged.clear()  # every held row was a pending sequence's

    def _valid_drafts(self, reply: dpb.ProposeResponse, reserved: dict[int, int],
                      metrics: TargetMetrics) -> dict[int, list[int]]:
        """Drop garbage: unknown sequences, out-of-vocabulary ids, more tokens than reserved,
        and every draft of a sequence named twice (which one would be meant?)."""
        drafts: dict[int, list[int]] = {}
        seen: set[int] = set()
        duplicated: set[int] = set()
        invalid = 0
        for draft in reply.drafts:
            tokens = list(draft.token_ids)
            if not tokens:
                continue
            if draft.seq_id in seen:
                invalid += 1
                duplicated.add(draft.seq_id)
                continue
            seen.add(draft.seq_id)
            if len(tokens) > reserved.get(draft.seq_id, 0) or any(not 0 <= t < self.vocab_size for t in tokens):
                invalid += 1
                continue
            drafts[draft.seq_id] = tokens
        for seq_id in duplicated:
            if drafts.pop(seq_id, None) is not None:
                invalid += 1
        if invalid:
            log.warning("drafter returned %d invalid draft(s); ignored", invalid)
            metrics.invalid_drafts.inc(invalid)
        return drafts

    def _note_written(self, reply: dpb.ProposeResponse) -> None:
        """Pages whose draft layers the drafter reports written become valid for this epoch."""
        if self.page_manager is None:
            return
        epoch = self.epoch
        for written in reply.written:
            seq = self._followed.get(written.seq_id)
            if seq is not None and not seq.is_finished:
                seq.drafter_written_tokens = min(max(seq.drafter_written_tokens, written.num_tokens),
                                                 seq.num_computed_tokens)
                self.page_manager.mark_drafter_written(seq, seq.drafter_written_tokens, epoch)

    @staticmethod
    def _empty_update(seq: Sequence) -> PendingUpdate:
        return PendingUpdate(seq.seq_id, seq.num_computed_tokens, [], 0, seq.token_ids[seq.num_computed_tokens])

    @staticmethod
    def _attach_new_pages(update: PendingUpdate, seq: Sequence) -> None:
        if seq.drafter_pages_sent < len(seq.page_table):
            update.new_pages.extend(seq.page_table[seq.drafter_pages_sent :])
            seq.drafter_pages_sent = len(seq.page_table)

    def record_step(self, scheduled: list[ScheduledSeq], drafts: dict[int, list[int]],
                    computed_before: list[int], row_starts: list[int]) -> None:
        """After a forward: queue each followed sequence's new context for the next Propose."""
        if not self.link.ready:
            return
        epoch = self.epoch
        for s, start, row in zip(scheduled, computed_before, row_starts):
            seq = s.seq
            if seq.is_finished or seq.request.speculation.disable:  # never drafted for: never followed
                continue
            count = seq.num_computed_tokens - start
            if start == seq.num_started_tokens:  # its first forward since admission
                follows = self._follows_from_admission(seq)  # as its capture was decided before the forward
                self._admitted.pop(seq.seq_id, None)
                if not follows:
                    seq.drafter_epoch = None  # no probe reaches it while no drafts pay: never followed
                    continue
                update = self._first_update(seq, start, count, row)
                if update is None:
                    continue
            elif seq.drafter_epoch != epoch:
                continue
            elif (update := self._pending.get(seq.seq_id)) is not None:  # deferred, not yet sent: extend it
                update.context_token_ids.extend(seq.token_ids[start : start + count])
                update.last_token_id = seq.token_ids[seq.num_computed_tokens]
            else:
                update = PendingUpdate(seq.seq_id, start, seq.token_ids[start : start + count], row,
                                       seq.token_ids[seq.num_computed_tokens])
            if seq.seq_id not in drafts:  # a drafting step's own tokens are the steady state
                self._behind[seq.seq_id] = self._behind.get(seq.seq_id, 0) + count
            self._staged.note_fresh(seq.seq_id, row, count)
            self._attach_new_pages(update, seq)
            self._pending[seq.seq_id] = update

    def _first_update(self, seq: Sequence, start: int, count: int, row: int) -> PendingUpdate | None:
        """The update that starts (or restarts) `seq` at position 0 in this epoch, its first
        `start` tokens cached; None when the drafter cannot follow it from there (it would need
        hidden states of tokens this admission did not compute)."""
        cached = self._drafter_cached_tokens(seq, start)
        if cached < start and self.shared.layout.staging is not None:
            seq.drafter_epoch = None
            return None
        seq.drafter_epoch, seq.drafter_pages_sent = self.epoch, 0  # seen from its start
        seq.drafter_written_tokens = cached
        self._followed[seq.seq_id] = seq
        self._behind[seq.seq_id] = start - cached  # the drafter computes these itself
        return PendingUpdate(seq.seq_id, 0, seq.token_ids[: start + count], row, seq.token_ids[seq.num_computed_tokens],
                             cached_context_tokens=cached)

    def release(self, seq: Sequence) -> None:
        self._followed.pop(seq.seq_id, None)
        self._admitted.pop(seq.seq_id, None)
        if self.follows(seq):
            self._released.append(seq.seq_id)
        self._pending.pop(seq.seq_id, None)
        self._staged.drop(seq.seq_id)
        self._behind.pop(seq.seq_id, None)
