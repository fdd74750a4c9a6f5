"""The one place where scheduled sequences become tensors and the model runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.attention_metadata import AttentionMetadata
from common.compiled_forward import CompileConfig, CompiledForward, decoder_stack
from common.kv_pool import PagePool
from target_service.api_types import PositionLogprobs
from target_service.logits_shaping import LogitsShaper, RowContext, shape_rows
from target_service.logprobs import position_logprobs, prompt_logprobs
from target_service.sampling import SamplingSpec
from target_service.scheduler import ScheduledSeq
from target_service.sequence import Sequence
from target_service.spec_decode import verify_batch
from target_service.structured_output import SequenceGrammar, constrain_rows


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    row_starts: list[int]  # first query row of each scheduled sequence


@dataclass(frozen=True)
class SequenceSampling:
    """How a sequence's tokens are chosen at each step, and which logprobs it reports."""

    spec: SamplingSpec
    generator: torch.Generator | None
    shaper: LogitsShaper | None = None  # None: the raw logits are sampled
    top_logprobs: int | None = None  # None: no logprobs; else the alternatives per token

    def context(self, seq: Sequence, draft: list[int]) -> RowContext:
        split = seq.num_prompt_tokens
        return RowContext(seq.token_ids[:split], seq.token_ids[split:], draft)


@dataclass
class StepResult:
    """What one step chose, per sampling sequence in order, and the prompt logprobs it computed."""

    tokens: list[list[int]]  # 1..K+1 emitted tokens each
    logprobs: list[list[PositionLogprobs] | None]  # one entry per emitted token, when asked
    prompt_logprobs: dict[int, list[PositionLogprobs]]  # seq id → this step's prompt positions, in order
    row_starts: list[int]  # the first staging row of every scheduled sequence


class ModelRunner:
    def __init__(self, model, backend_cls: type, pool: PagePool, device: torch.device,
                 compile_config: CompileConfig = CompileConfig(), native_forward: bool = False) -> None:
        """`native_forward`: every step through `common.native_forward.NativeForward` (the caller
        checked `native_forward_problem`), else the compiled or eager forward."""
        self.model = model
        stack = decoder_stack(model)
        self.forward = CompiledForward(stack, compile_config)  # the model's own forward where not compiled
        self.native_forward = None
        if native_forward:
            from common.native_forward import NativeForward

            self.native_forward = NativeForward(stack)
        self.device = device
        self.backend_cls = backend_cls
        self.install_pool(pool)

    def install_pool(self, pool: PagePool) -> None:
        """Point the runner at (new) pool views; staging receives the captured hidden states."""
        layout = pool.layout
        self.backend = self.backend_cls(layout)
        self.kv_caches = [pool.region(layout.layer("target", i)) for i in range(self.model.num_layers)]  # by layer
        self.page_size = layout.page_size
        staging = layout.staging
        self.staging = pool.staging() if staging is not None else None  # [rows, len(capture_layers) * hidden]
        self.capture_layers = staging.layer_ids if staging is not None else ()
        self._capture_direct = len(set(self.capture_layers)) == len(self.capture_layers)  # each layer once (EAGLE-3 may repeat one)

    def build_inputs(self, scheduled: list[ScheduledSeq], drafts: dict[int, list[int]]) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        row_starts: list[int] = []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            chunk = s.seq.token_ids[start : start + s.num_query_tokens] + drafts.get(s.seq.seq_id, [])
            row_starts.append(len(ids))
            ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            query_lens.append(len(chunk))
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=[s.seq.num_computed_tokens + q for s, q in zip(scheduled, query_lens)],
            page_tables=[s.seq.page_table for s in scheduled],
            page_size=self.page_size,
            device=self.device,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            row_starts=row_starts,
        )

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[ScheduledSeq],
        drafts: dict[int, list[int]],
        sampling: list[SequenceSampling],  # one per sampling sequence (`ScheduledSeq.samples`), in order
        grammars: list[SequenceGrammar | None] | None = None,  # structured output, per sampling sequence
        staging_row: int | None = 0,  # where this step's hidden states go in the staging rows (rows before
                                      # it are held); None: nobody reads them, none are captured
    ) -> StepResult:
        """One step (prefill chunks, decodes and verifies together): each sampling sequence's
        rows are shaped (its `LogitsShaper`) and masked to what its grammar allows (drafts the
        grammar forbids cut there), then verified or sampled. Logprobs read the raw rows."""
        inputs = self.build_inputs(scheduled, drafts)
        self.backend.plan(inputs.meta)
        staged = self._staging_rows(staging_row, inputs.meta.num_tokens) if staging_row is not None else None
        capture = self.capture_layers if staged is not None else ()
        if self.native_forward is not None and self._capture_direct:
            hidden, _ = self.native_forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches,
                                            self.backend, capture_layers=capture,
                                            capture_into=staged)  # [T, hidden]; captures written into `staged`
        else:
            forward = self.native_forward or self.forward
            hidden, captured = forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, self.backend,
                                       capture_layers=capture)  # [T, hidden]
            self._stage_hidden(captured, staged)
        row_starts = [(staging_row or 0) + row for row in inputs.row_starts]
        prompt = self._prompt_logprobs(scheduled, inputs, hidden)
        rows, spans = self._logit_rows(scheduled, drafts, inputs)
        if not spans:  # a step of prefill chunks only: no logits are read
            return StepResult([], [], prompt, row_starts)
        sampling_seqs = [s.seq for s in scheduled if s.samples]
        logits = self.model.compute_logits(hidden[rows])  # [N, V]
        shaped = shape_rows(logits, spans, [
            (entry.shaper, entry.context(seq, draft)) if entry.shaper is not None else None
            for (_, _, draft), entry, seq in zip(spans, sampling, sampling_seqs, strict=True)])
        if grammars is not None and any(g is not None for g in grammars):
            shaped = shaped if shaped is not logits else logits.clone()  # the raw rows stay for logprobs
            spans = constrain_rows(shaped, spans, grammars)
        tokens = verify_batch(spans, shaped, [e.spec for e in sampling], [e.generator for e in sampling])
        logprobs = [position_logprobs(logits[lo : lo + len(emitted)], emitted, entry.top_logprobs)
                    if entry.top_logprobs is not None else None
                    for (lo, _, _), emitted, entry in zip(spans, tokens, sampling)]
        return StepResult(tokens, logprobs, prompt, row_starts)

    def _prompt_logprobs(self, scheduled: list[ScheduledSeq], inputs: StepInputs,
                         hidden: torch.Tensor) -> dict[int, list[PositionLogprobs]]:
        """Logprobs of the prompt tokens this step's chunks predict that no earlier step did (a
        recomputed sequence's were reported already): row at position p predicts token p + 1, so a
        chunk of positions [s, e) predicts prompt positions s + 1 .. e (e is the next chunk's first)."""
        out: dict[int, list[PositionLogprobs]] = {}
        for s, start in zip(scheduled, inputs.row_starts):
            seq, params = s.seq, s.seq.request.logprobs
            if not params.prompt or seq.index != 0:
                continue
            first = max(seq.num_computed_tokens + 1, seq.prompt_logprobs_done)  # the first prompt position predicted
            end = min(seq.num_computed_tokens + s.num_query_tokens + 1, seq.num_prompt_tokens)  # past the last
            if first >= end:
                continue
            rows = [start + (p - 1 - seq.num_computed_tokens) for p in range(first, end)]
            out[seq.seq_id] = prompt_logprobs(self.model, hidden, rows, seq.token_ids[first:end], params.prompt_top)
            seq.prompt_logprobs_done = end
        return out

    def _staging_rows(self, first: int, num_tokens: int) -> torch.Tensor | None:
        """The staging rows [num_tokens, width] this step's captured hidden states go to (None: none kept)."""
        if self.staging is None or not self.capture_layers:
            return None
        if not 0 <= first <= self.staging.shape[0] - num_tokens:
            raise ValueError(f"staging rows {first}..{first + num_tokens} outside the buffer's {self.staging.shape[0]}")
        return self.staging[first : first + num_tokens]

    def _stage_hidden(self, captured: dict[int, torch.Tensor], staged: torch.Tensor | None) -> None:
        if staged is None:
            return
        width = staged.shape[1] // len(self.capture_layers)
        for slot, layer in enumerate(self.capture_layers):  # straight into the staging rows, no [T, n·hidden] concat
            staged[:, slot * width : (slot + 1) * width].copy_(captured[layer])  # [T, hidden]

    @staticmethod
    def _logit_rows(scheduled: list[ScheduledSeq], drafts: dict[int, list[int]], inputs: StepInputs):
        """Rows whose logits are needed: all K+1 of a verify, else the last of a sampling chunk; as a
        slice where they follow each other (a decode, one verify: a view, where a tensor of indices
        would gather a copy)."""
        rows: list[int] = []
        spans: list[tuple[int, int, list[int]]] = []
        for s, start, q_len in zip(scheduled, inputs.row_starts, inputs.meta.query_lens):
            if not s.samples:
                continue
            draft = drafts.get(s.seq.seq_id, [])
            first = start + q_len - 1 - len(draft)
            spans.append((len(rows), len(rows) + len(draft) + 1, draft))
            rows.extend(range(first, start + q_len))
        if rows and rows[-1] - rows[0] == len(rows) - 1:  # rows only grow: no gap, so one slice
            return slice(rows[0], rows[-1] + 1), spans
        return torch.tensor(rows, dtype=torch.long), spans
