"""A small paged runner for model tests: pages from a shuffled free list (never contiguous),
one batched forward per step, through the torch attention backend and a real page pool."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.attention import TorchAttentionBackend
from common.attention_metadata import AttentionMetadata
from common.kv_layout import build_layout
from common.kv_pool import PagePool
from common.qwen3 import Qwen3ForCausalLM

CPU = torch.device("cpu")
PAGE_SIZE = 4


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0
    table: list[int] = field(default_factory=list)


class PagedRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        shm_dir: Path,
        *,
        order: str = "NHD",
        kv_dtype: str = "float32",
        num_pages: int = 512,
    ) -> None:
        layout = build_layout(
            order=order,
            page_size=PAGE_SIZE,
            kv_dtype=kv_dtype,
            num_pages=num_pages,
            layers=model.kv_layer_specs(),
            target_id="7e57",
        )
        self.model = model
        self.pool = PagePool.create(layout, CPU, shm_dir=shm_dir)
        self.caches = self.pool.kv_caches("target")
        self.backend = TorchAttentionBackend(layout)
        self.free = list(range(num_pages))
        random.Random(0).shuffle(self.free)  # non-contiguous pages

    def close(self) -> None:
        self.pool.close()

    def step(self, seqs: list[Seq], chunk_lens: list[int], capture: tuple[int, ...] = ()):
        """Run the next chunk_lens[b] uncomputed tokens of each sequence; logits [T, V] per sequence."""
        ids, positions = [], []
        for seq, n in zip(seqs, chunk_lens):
            end = seq.computed + n
            while len(seq.table) * PAGE_SIZE < end:
                seq.table.append(self.free.pop())
            ids += seq.tokens[seq.computed : end]
            positions += range(seq.computed, end)
        meta = AttentionMetadata.build(
            query_lens=list(chunk_lens),
            seq_lens=[s.computed + n for s, n in zip(seqs, chunk_lens)],
            page_tables=[s.table for s in seqs],
            page_size=PAGE_SIZE,
            device=CPU,
        )
        self.backend.plan(meta)
        with torch.inference_mode():
            hidden, captured = self.model(
                torch.tensor(ids),
                torch.tensor(positions),
                meta,
                self.caches,
                self.backend,
                capture_layers=capture,
            )
            logits = self.model.compute_logits(hidden)  # [T, V]
        for seq, n in zip(seqs, chunk_lens):
            seq.computed += n
        return list(logits.split(chunk_lens)), captured

    def greedy(self, prompts: list[list[int]], max_new: int, eos: int) -> list[list[int]]:
        seqs = [Seq(list(p)) for p in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(seqs)))
        chunk = [len(p) for p in prompts]
        while live:
            logits, _ = self.step([seqs[b] for b in live], chunk)
            still = []
            for b, rows in zip(live, logits):
                token = int(rows[-1].argmax())
                outs[b].append(token)
                seqs[b].tokens.append(token)
                if token != eos and len(outs[b]) < max_new:
                    still.append(b)
            live, chunk = still, [1] * len(still)
        return outs
