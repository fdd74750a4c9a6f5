"""Per-step attention inputs, built once by the model runner and shared by every layer.

The batch is token-flat: sequence b owns query rows
`query_start_loc[b] : query_start_loc[b + 1]`, its KV after this step's writes spans
`seq_lens[b]` tokens in the pages `page_tables[b]`, and its queries sit at the last
`query_lens[b]` positions of that span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def slot_of(page_table: list[int], position: int, page_size: int) -> int:
    """The KV slot (page_id * page_size + offset) of a token position in a page table."""
    return page_table[position // page_size] * page_size + position % page_size


def check_table_holds(table: Sequence[int], page_size: int, tokens: int) -> None:
    """A sequence's page table covers its first `tokens` positions, else a ValueError saying so."""
    if len(table) * page_size < tokens:
        raise ValueError(f"page table of {len(table)} pages cannot hold {tokens} tokens")


def padded_page_tables(page_tables: list[list[int]], device: torch.device | None = None) -> torch.Tensor:
    """[B, max_pages] int32: each sequence's page ids, padded with 0 (past its keys: never read)."""
    max_pages = max((len(t) for t in page_tables), default=0)
    padded = [list(t) + [0] * (max_pages - len(t)) for t in page_tables]
    return torch.tensor(padded, dtype=torch.int32, device=device).view(len(page_tables), max_pages)


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # per sequence
    seq_lens: list[int]  # per sequence: KV length after this step's writes (includes the queries)
    page_tables: list[list[int]]  # per sequence: page ids covering seq_lens
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens_tensor: torch.Tensor  # [B] int32
    page_table_tensor: torch.Tensor  # [B, max_pages] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset of each query token's KV
    page_size: int
    causal: bool = True  # False for DFlash query blocks: each block sees all of itself

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def check_page_size(self, page_size: int) -> None:
        """Every backend's plan: the metadata was built for the pool's pages."""
        if self.page_size != page_size:
            raise ValueError(f"attention metadata page_size {self.page_size} != KV layout page_size {page_size}")

    @classmethod
    def build(
        cls,
        *,
        query_lens: list[int],
        seq_lens: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device,
        causal: bool = True,
    ) -> AttentionMetadata:
        if not (len(query_lens) == len(seq_lens) == len(page_tables)):
            raise ValueError("query_lens, seq_lens and page_tables must have one entry per sequence")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, page_tables):
            if q_len > s_len:
                raise ValueError(f"query length {q_len} exceeds sequence length {s_len}")
            check_table_holds(table, page_size, s_len)
            slots.extend(slot_of(table, pos, page_size) for pos in range(s_len - q_len, s_len))
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            page_tables=[list(t) for t in page_tables],
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            page_table_tensor=padded_page_tables(page_tables, device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            page_size=page_size,
            causal=causal,
        )
