"""A small draft LM sharing the target's tokenizer, its KV in the shared pool.

Its layers are `LayerSpec("draft", i, ...)` regions indexed by the target's page ids.
A proposal runs the LM over every token whose draft KV is not yet written (positions
num_context .. last), then K-1 single-token greedy steps, batched across sequences.
The KV of the drafts themselves (positions past the last token) is scratch: the target
reserved pages for last_pos + K, and the part it accepts is kept as valid context.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from common.attention_metadata import AttentionMetadata
from common.compiled_forward import CompileConfig, CompiledForward, decoder_stack
from common.cpu_linear import pack_cpu_linears
from common.kv_layout import CacheConfig, LayerSpec
from common.qwen3 import Qwen3ForCausalLM
from common.row_argmax import argmax_last
from draft_service.drafters.base import DraftSequence, PooledDrafter, ProposeItem

log = logging.getLogger(__name__)


class DraftModelDrafter(PooledDrafter):
    kind = "draft_model"

    def __init__(self, model: Qwen3ForCausalLM, cache_config: CacheConfig,
                 num_speculative_tokens: int, model_id: str = "",
                 attention_backend: str = "auto", compile_config: CompileConfig = CompileConfig()) -> None:
        super().__init__(cache_config, model, num_speculative_tokens, attention_backend, model_id=model_id)
        self.compiled = CompiledForward(decoder_stack(model), compile_config)  # its K single-token steps and catch-ups
        self.vocab_size = model.vocab_size

    @classmethod
    def load(cls, path: str, cache_config: CacheConfig, dtype: torch.dtype, device: str, k: int,
             attention_backend: str = "auto", compile_config: CompileConfig = CompileConfig()) -> DraftModelDrafter:
        model = Qwen3ForCausalLM.from_pretrained(path, dtype, device)
        pack_cpu_linears(model, log)
        return cls(model, cache_config, k, model_id=str(path), attention_backend=attention_backend,
                   compile_config=compile_config)

    # -- handshake ------------------------------------------------------------------------

    def layer_specs(self) -> list[LayerSpec]:
        return [dataclasses.replace(spec, owner="draft") for spec in self.model.kv_layer_specs()]

    # -- drafting -------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> dict[int, list[int]]:
        # k > 0 only; the rest catch up at their next proposal (the LM needs token ids only)
        wanted = self._draft_counts(items)
        if not wanted:
            return {}
        seqs = [seq for seq, _ in wanted]
        drafts = [[token] for token in self._catch_up(seqs)]
        for step in range(1, max(k for _, k in wanted)):
            active = [b for b, (_, k) in enumerate(wanted) if k > step]
            tokens = self._decode([seqs[b] for b in active], [drafts[b][-1] for b in active], step)
            for b, token in zip(active, tokens):
                drafts[b].append(token)
        out = {}
        for (seq, k), seq_drafts in zip(wanted, drafts):
            seq.num_context = seq.num_tokens
            seq.scratch_token_ids = seq_drafts[: k - 1]  # their KV sits at last_pos + 1 ..
            out[seq.seq_id] = seq_drafts[:k]
        return out

    def _catch_up(self, seqs: list[DraftSequence]) -> list[int]:
        """Forward every unwritten token up to the last one; the greedy next token of each."""
        starts = [min(seq.num_context, seq.last_position) for seq in seqs]
        ids = [t for seq, s in zip(seqs, starts) for t in seq.token_ids[s:]]
        positions = [p for seq, s in zip(seqs, starts) for p in range(s, seq.num_tokens)]
        query_lens = [seq.num_tokens - s for seq, s in zip(seqs, starts)]
        return self._forward(ids, positions, query_lens, [seq.num_tokens for seq in seqs],
                             [seq.page_table for seq in seqs])

    def _decode(self, seqs: list[DraftSequence], tokens: list[int], step: int) -> list[int]:
        """Feed draft `step` (at last_pos + step) of each sequence; the next greedy token."""
        positions = [seq.last_position + step for seq in seqs]
        return self._forward(tokens, positions, [1] * len(seqs), [p + 1 for p in positions],
                             [seq.page_table for seq in seqs])

    def _warmup(self, kv_caches: dict[int, torch.Tensor], page_table: list[int], ctx: int) -> None:
        """A prefill of the scratch context, then one decode step after it."""
        self._forward([0] * ctx, list(range(ctx)), [ctx], [ctx], [page_table], kv_caches)
        self._forward([0], [ctx], [1], [ctx + 1], [page_table], kv_caches)

    def compile_ahead(self) -> None:
        """Every bucket of the compiled forward (when on)."""
        self.compiled.prepare(self.compiled.buckets())

    def _forward(
        self,
        ids: list[int],
        positions: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        page_tables: list[list[int]],
        kv_caches: dict[int, torch.Tensor] | None = None,  # default: the pool's draft layers
    ) -> list[int]:
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            page_tables=page_tables,
            page_size=self.layout.page_size,
            device=self.device,
        )
        self._backend.plan(meta)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        caches = self._kv_caches if kv_caches is None else kv_caches
        hidden, _ = self.compiled(input_ids, pos, meta, caches, self._backend)  # [T, hidden]
        last_rows = meta.query_start_loc[1:].long() - 1  # [B]
        return argmax_last(self.model.compute_logits(hidden[last_rows])).tolist()  # [B]
