"""The synchronous engine core: add, abort, step. Only one thread touches it at a time.

One step (`EngineCore.step`): schedule (decodes, prefill chunks and draft slots under one
token budget) → one batched Propose to the drafter → one forward that prefills, decodes
and verifies → accept → append, check stops, emit. `AsyncEngine` (async_engine.py) drives
it from the event loop; `build_engine_core` (engine.py) assembles it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from common.kv_layout import KVLayout
from common.memory import freeze_startup_heap
from target_service.api_types import (
    EngineRequest,
    FinishReason,
    ModelInfo,
    PositionLogprobs,
    RequestOutput,
    StopParams,
    TokenLogprob,
)
from target_service.config import EngineConfig
from target_service.detokenizer import IncrementalDetokenizer
from target_service.draft_policy import DraftPolicy
from target_service.drafter_link import DrafterLink
from target_service.handshake import SharedPool
from target_service.logits_shaping import LogitsShaper
from target_service.metrics import EngineState, TargetMetrics
from target_service.model_runner import ModelRunner, SequenceSampling
from target_service.page_manager import PageManager, PrefixHit
from target_service.sampling import SamplingSpec, make_generator
from target_service.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from target_service.sequence import Sequence
from target_service.speculation import NoSpeculation, Speculator, StepRecord
from target_service.structured_output import SequenceGrammar

log = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "__warmup__"


ChoiceKey = tuple[str, int]  # (request id, index): one of a request's n sequences


@dataclass
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer
    sampling: SequenceSampling
    prompt_logprobs: list[PositionLogprobs] | None = None  # gathered over prefill chunks until the first output
    grammar: SequenceGrammar | None = None  # structured output: its state follows the emitted tokens


class EngineCore:
    """Synchronous engine: add, abort, step. One thread at a time."""

    def __init__(self, config: EngineConfig, model, tokenizer, runner: ModelRunner, shared: SharedPool,
                 model_info: ModelInfo) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner
        self.shared = shared
        self.model_info = model_info
        self._cache_namespace = f"{model_info.model_id}\0{model_info.dtype}\0{model.fingerprint()}"
        self.page_manager = self._new_page_manager()
        self.speculator: Speculator | NoSpeculation = (
            Speculator(shared, config.num_speculative_tokens, model_info.max_model_len, model_info.vocab_size,
                       runner.device, config.speculative_disable_batch_size, config.max_num_batched_tokens,
                       DraftPolicy(config.num_speculative_tokens, adaptive=config.speculative_policy == "adaptive"))
            if shared.link is not None else NoSpeculation())
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, model_info.max_model_len),
            self.page_manager,
            lookahead=lambda running: self.speculator.lookahead(running, self.metrics),  # draft slots, asked each step
            prefix_hit=self._prefix_hit,
        )
        self.speculator.page_manager = self.page_manager
        self._tracked: dict[ChoiceKey, _Tracked] = {}
        self._next_seq_id = 0
        self.metrics = TargetMetrics()  # what Prometheus reads; warmup swaps in a throwaway one
        self.metrics.watch(self.state)

    @property
    def layout(self) -> KVLayout:
        return self.shared.layout

    @property
    def link(self) -> DrafterLink | None:
        return self.shared.link

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def _new_page_manager(self) -> PageManager:
        """Page ids of the current pool, its prefix cache keyed by what decides the KV: the
        model, the KV dtype, the page size and the target layers' scales."""
        layout = self.layout
        scales = ",".join(f"{layer.k_scale!r}/{layer.v_scale!r}" for layer in layout.layers if layer.owner == "target")
        namespace = f"{self._cache_namespace}\0{layout.kv_dtype}\0{layout.page_size}\0{scales}"
        return PageManager(layout.num_pages, layout.page_size, enable_prefix_caching=self.config.enable_prefix_caching,
                           namespace=namespace)

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The cached pages a waiting sequence starts from: all of them, except that a drafter
        which reads the target's hidden states (DFlash) can follow the sequence only from pages
        its own layers are written in, so past those the target computes the tokens again (while
        drafts pay: else the sequence takes them all and goes unfollowed); and a sequence that
        still owes its prompt's logprobs computes its prompt (as vLLM: only a forward over a
        prompt token gives the logprob of the next one)."""
        if seq.request.logprobs.prompt and seq.index == 0 and seq.prompt_logprobs_done < seq.num_prompt_tokens:
            return PrefixHit()
        hit = self.page_manager.find_prefix(seq, self.speculator.pages_epoch())
        if self.speculator.needs_hidden_states(seq) and self.speculator.follows_for_drafts():
            return hit.truncated(hit.drafter_valid_pages)
        return hit

    def state(self) -> EngineState:
        pages = self.page_manager
        return EngineState(self.num_running, self.num_waiting, pages.num_pages, pages.num_free_pages, self.layout,
                           self.shared.describe_drafter(), prefix_cache=pages.describe_cache())

    # --- requests ------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Admit a request as its n sequences, each sampling on its own (`SamplingParams.for_choice`)
        and, with structured output, following its own grammar state."""
        for index in range(request.n):
            seq = Sequence.from_request(request, self._next_seq_id, index)
            self._next_seq_id += 1
            detok = IncrementalDetokenizer(self.tokenizer, list(request.prompt_token_ids), request.stop.stop)
            grammar = request.grammar.new_sequence() if request.grammar is not None else None
            self._tracked[(request.request_id, index)] = _Tracked(seq, detok, self._sequence_sampling(request, index),
                                                                  grammar=grammar)
            self.scheduler.add(seq)
            self.metrics.on_admitted(seq)

    def _sequence_sampling(self, request: EngineRequest, index: int) -> SequenceSampling:
        sampling = request.sampling.for_choice(index)
        spec = SamplingSpec(sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
        generator = None if spec.greedy else make_generator(sampling.seed, self.runner.device)
        stop = request.stop
        stop_ids = [*stop.stop_token_ids, *(() if stop.ignore_eos else self.model_info.eos_token_ids)]
        shaper = LogitsShaper.for_request(sampling, stop.min_tokens, stop_ids, self.runner.device)
        top = request.logprobs.top if request.logprobs.completion else None
        return SequenceSampling(spec, generator, shaper, top)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End every sequence of the request still running; their last outputs (empty when none)."""
        keys = [key for key in self._tracked if key[0] == request_id]
        outputs = []
        for key in keys:
            tracked = self._tracked.pop(key)
            self._remove(tracked.seq)
            outputs.append(self._finish_output(tracked, FinishReason.ABORT, ()))
        return outputs

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in {key[0] for key in self._tracked} for out in self.abort(rid)]

    def in_flight(self, request_id: str) -> bool:
        return any(key[0] == request_id for key in self._tracked)

    def _remove(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.speculator.release(seq)

    # --- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule (with draft slots), propose, run (prefill + decode + verify), accept, emit."""
        self._handshake_if_due()
        plan = self.scheduler.schedule()
        self.metrics.preemptions.inc(len(plan.preempted))
        for num_tokens, num_hit in plan.prefix_queries:
            self.metrics.on_prefix_query(num_tokens, num_hit)
        drafts = self.speculator.before_forward(plan, self.metrics)
        if plan.is_empty:
            return []
        self._note_first_scheduling(plan.scheduled)
        tracked = [self._tracked[(s.seq.request_id, s.seq.index)] for s in plan.scheduled if s.samples]
        verified = self._grammar_checked(tracked, drafts)
        started = time.perf_counter()
        result = self.runner.execute(plan.scheduled, verified, [t.sampling for t in tracked],
                                     [t.grammar for t in tracked],  # host lists: the device is done
                                     staging_row=self.speculator.staging_row()
                                     if self.speculator.reads_hidden_states(plan.scheduled) else None)
        seconds = time.perf_counter() - started
        emitted, row_starts = result.tokens, result.row_starts
        self._gather_prompt_logprobs(plan.scheduled, result.prompt_logprobs)
        prefilled = any(s.num_query_tokens > 1 for s in plan.scheduled)
        self.metrics.observe_forward(seconds, verified=bool(drafts), prefilled=prefilled)
        computed_before = self._advance(plan.scheduled)
        accepted = {t.seq.seq_id: len(tokens) - 1 for t, tokens in zip(tracked, emitted) if drafts.get(t.seq.seq_id)}
        outputs = [out for t, tokens, logprobs in zip(tracked, emitted, result.logprobs)
                   if (out := self._accept(t, drafts.get(t.seq.seq_id), tokens, logprobs)) is not None]
        for s in plan.scheduled:  # pages now full of computed tokens serve later prompts at once
            if not s.seq.is_finished:
                self.page_manager.commit(s.seq)
        self.speculator.after_forward(StepRecord(plan.scheduled, verified, accepted, computed_before, row_starts,
                                                 seconds, prefilled))
        return outputs

    @staticmethod
    def _grammar_checked(tracked: list[_Tracked], drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """The drafts to verify: each constrained sequence's cut at the first token its grammar forbids,
        which would be rejected anyway, so the forward computes no row for it or after it. A draft cut
        to nothing stays as [] (the sequence drafted this step); it counts as proposed and rejected."""
        verified = drafts
        for t in tracked:
            draft = drafts.get(t.seq.seq_id)
            if not draft or t.grammar is None:
                continue
            kept = t.grammar.valid_prefix(draft)
            if kept < len(draft):
                verified = dict(verified) if verified is drafts else verified  # the proposals stay as they came
                verified[t.seq.seq_id] = draft[:kept]
        return verified

    def _note_first_scheduling(self, scheduled: list[ScheduledSeq]) -> None:
        now = time.monotonic()
        for s in scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
                self.metrics.on_scheduled(s.seq, now)

    @staticmethod
    def _advance(scheduled: list[ScheduledSeq]) -> list[int]:
        """Count this step's query tokens as computed; the counts before, per sequence."""
        computed_before = [s.seq.num_computed_tokens for s in scheduled]
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_query_tokens
        return computed_before

    def _gather_prompt_logprobs(self, scheduled: list[ScheduledSeq],
                                computed: dict[int, list[PositionLogprobs]]) -> None:
        for s in scheduled:
            if (entries := computed.get(s.seq.seq_id)) is not None:
                tracked = self._tracked[(s.seq.request_id, s.seq.index)]
                tracked.prompt_logprobs = (tracked.prompt_logprobs or []) + entries

    def _accept(self, tracked: _Tracked, draft: list[int] | None, tokens: list[int],
                logprobs: list[PositionLogprobs] | None) -> RequestOutput | None:
        """A sampling sequence's emitted tokens: accepted drafts (their KV is written), then output."""
        if draft:
            accepted = len(tokens) - 1
            self.metrics.on_verified(len(draft), accepted)
            tracked.seq.spec.record(len(draft), accepted)
            tracked.seq.num_computed_tokens += accepted  # the accepted drafts' KV was written by the verify
        return self._append_tokens(tracked, tokens, logprobs)

    def _append_tokens(self, tracked: _Tracked, tokens: list[int],
                       logprobs: list[PositionLogprobs] | None) -> RequestOutput | None:
        """Append emitted tokens, check stops, return the stream's increment."""
        seq, detok = tracked.seq, tracked.detok
        emitted: list[int] = []
        reason = None
        for token in tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            detok.add_token(token)
            reason = self._stop_reason(seq, token, detok)
            # a complete structure stops, even on the length limit's token; a broken grammar aborts, even on EOS
            if tracked.grammar is not None and (reason is not FinishReason.STOP or tracked.grammar.broken):
                reason = self._grammar_stop(tracked, token) or reason
            if reason is not None:
                break
        self._note_tokens(seq, len(emitted))
        kept_logprobs = tuple(logprobs[: len(emitted)]) if logprobs is not None else None
        if reason is None:
            text = detok.take(final=False)
            if not (emitted or text):
                return None
            return RequestOutput(seq.request_id, tuple(emitted), text, index=seq.index, logprobs=kept_logprobs,
                                 prompt_logprobs=self._take_prompt_logprobs(tracked))
        del self._tracked[(seq.request_id, seq.index)]
        self._remove(seq)
        return self._finish_output(tracked, reason, tuple(emitted), kept_logprobs)

    @staticmethod
    def _take_prompt_logprobs(tracked: _Tracked) -> tuple[PositionLogprobs, ...] | None:
        """The prompt's logprobs, handed out once (with the first output), the first token's
        without a value (nothing predicts it)."""
        entries, tracked.prompt_logprobs = tracked.prompt_logprobs, None
        if entries is None:
            return None
        first = PositionLogprobs(TokenLogprob(tracked.seq.token_ids[0], None, None))
        return (first, *entries)

    def _note_tokens(self, seq: Sequence, n: int) -> None:
        now = time.monotonic()
        first = seq.first_token_time is None
        self.metrics.on_tokens(seq, n, now, first, seq.last_token_time)
        if first:
            seq.first_token_time = now
        seq.last_token_time = now

    def _stop_reason(self, seq: Sequence, token: int, detok: IncrementalDetokenizer) -> FinishReason | None:
        stop: StopParams = seq.request.stop
        if seq.num_output_tokens < stop.min_tokens:  # (min_tokens <= max_tokens)
            return FinishReason.MODEL_LENGTH if seq.num_tokens >= self.model_info.max_model_len else None
        if token in stop.stop_token_ids:
            return FinishReason.STOP
        if not stop.ignore_eos and token in self.model_info.eos_token_ids:
            return FinishReason.STOP
        if detok.find_stop():
            return FinishReason.STOP
        if seq.num_output_tokens >= stop.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.model_info.max_model_len:
            return FinishReason.MODEL_LENGTH
        return None

    @staticmethod
    def _grammar_stop(tracked: _Tracked, token: int) -> FinishReason | None:
        """Advance the sequence's grammar by its new token: STOP once the grammar allows nothing more
        (the structure is complete). A forbidden token cannot come from the masked rows, but a matcher
        can break (a mask past its fuel): the sequence then ends (ABORT) rather than emit output its
        grammar cannot vouch for."""
        grammar = tracked.grammar
        if grammar is None:
            return None
        if grammar.broken or not grammar.accept(token):
            log.error("request %s: token %d broke its grammar (%s); aborting it", tracked.seq.request_id, token,
                      grammar.error())
            return FinishReason.ABORT
        return FinishReason.STOP if grammar.terminated else None

    def _finish_output(self, tracked: _Tracked, reason: FinishReason, tokens: tuple[int, ...],
                       logprobs: tuple[PositionLogprobs, ...] | None = None) -> RequestOutput:
        self.metrics.on_finished(tracked.seq, reason.name.lower(), time.monotonic())
        text = tracked.detok.take(final=True)
        if logprobs is None and tracked.sampling.top_logprobs is not None:
            logprobs = ()
        return RequestOutput(tracked.seq.request_id, tokens, text, reason, tracked.seq.usage(), tracked.seq.index,
                             logprobs, self._take_prompt_logprobs(tracked))

    # --- the drafter handshake (handshake.py) ---------------------------------------------

    def _handshake_if_due(self) -> None:
        """A drafter that came back (or a first one) is negotiated with before the step is scheduled."""
        if self.speculator.due_for_handshake():
            self.handshake()

    def handshake(self) -> bool:
        """Negotiate and attach; a pool without the drafter's layers is re-planned, when idle."""
        outcome = self.shared.handshake(may_replan=not self.scheduler.has_work)
        if outcome.replanned:
            self._use_pool()
        if outcome.result is not None:
            self.metrics.handshakes.labels(result=outcome.result).inc()
        if outcome.ok:
            self.speculator.reset()
            self.speculator.policy.new_epoch()
        return outcome.ok

    def _use_pool(self) -> None:
        """Page ids and runner views for the (idle) engine's new pool."""
        self.page_manager = self._new_page_manager()
        self.scheduler.use_page_manager(self.page_manager)
        self.speculator.page_manager = self.page_manager
        self.runner.install_pool(self.shared.pool)

    # --- life ----------------------------------------------------------------------------

    def warmup(self) -> None:
        """One prefill and a few decodes through every code path, then free everything; every bucket
        of the compiled forward (when on) is compiled first. Last, the heap is frozen
        (`common.memory.freeze_startup_heap`): the process is ready to serve."""
        forward = self.runner.forward
        forward.prepare(forward.buckets())
        if forward.stats.seconds:
            log.info("compiled forward: %d buckets in %.1f s", len(forward.stats.seconds),
                     sum(forward.stats.seconds.values()))
        n = min(32, self.config.max_num_batched_tokens, self.model_info.max_model_len - 4)
        request = EngineRequest(WARMUP_REQUEST_ID, tuple([0] * max(1, n)), stop=StopParams(max_tokens=3, ignore_eos=True))
        served, self.metrics = self.metrics, TargetMetrics()  # warmup traffic is not served traffic
        try:
            self.add(request)
            while self.in_flight(request.request_id):
                self.step()
        finally:
            self.metrics = served
            self.speculator.forget_measurements()
            self.page_manager.reset_prefix_cache()  # warmup's prompt is nobody's prefix
        log.info("startup heap frozen: %d objects out of the collector's full passes", freeze_startup_heap())

    def close(self) -> None:
        self.runner.forward.close()
        self.shared.close()
