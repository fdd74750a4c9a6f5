"""The one place where scheduled sequences become tensors and the model runs."""

from __future__ import annotations

import torch

from common.attention_metadata import AttentionMetadata
from common.sampling import SamplingSpec, sample_tokens
from target_service.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model, backend, kv_caches: list[torch.Tensor], page_size: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches  # index = target layer
        self.page_size = page_size
        self.device = device

    def build_inputs(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            ids.extend(s.seq.token_ids[start : start + s.num_query_tokens])
            positions.extend(range(start, start + s.num_query_tokens))
        meta = AttentionMetadata.build(
            query_lens=[s.num_query_tokens for s in scheduled],
            seq_lens=[s.seq.num_computed_tokens + s.num_query_tokens for s in scheduled],
            block_tables=[s.seq.block_table for s in scheduled],
            page_size=self.page_size,
            device=self.device,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        return input_ids, pos, meta

    @torch.inference_mode()
    def forward_logits(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the scheduled chunks; logits of the last query row of each sampling sequence."""
        input_ids, positions, meta = self.build_inputs(scheduled)
        self.backend.plan(meta)
        hidden, _ = self.model(input_ids, positions, meta, self.kv_caches, self.backend)  # [T, hidden]
        ends = meta.query_start_loc[1:].long() - 1  # [B] last row of each sequence
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        return self.model.compute_logits(hidden[ends[rows]])  # [N, V]

    def execute(
        self,
        scheduled: list[ScheduledSeq],
        specs: list[SamplingSpec],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """One step; a sampled token for each sequence whose chunk reached its end (in order)."""
        logits = self.forward_logits(scheduled)
        return sample_tokens(logits, specs, generators)
