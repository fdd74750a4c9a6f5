"""Prompt lookup: propose what followed the most recent earlier occurrence of the suffix."""

from __future__ import annotations

from collections.abc import Sequence

from common.kv_layout import CacheConfig
from draft_service.drafters.base import DEFAULT_NUM_SPECULATIVE_TOKENS, Drafter, ProposeItem


def ngram_lookup(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """For n from max_n down to min_n: find the most recent occurrence of the last n
    tokens that starts before them, and return up to k tokens that followed it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(tokens[total - n :])
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []


class NgramDrafter(Drafter):
    kind = "ngram"

    def __init__(
        self, cache_config: CacheConfig, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS, min_n: int = 1, max_n: int = 4
    ) -> None:
        super().__init__(cache_config, "cpu", num_speculative_tokens)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min <= max, got min {min_n}, max {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.model_id = f"ngram[{min_n}..{max_n}]"

    def propose(self, items: list[ProposeItem]) -> dict[int, list[int]]:
        self.layout  # noqa: B018 - LayoutNotResolvedError before Attach, like every drafter
        drafts = {}
        for seq, _rows, k in items:
            seq.num_context = seq.num_tokens  # no KV: everything known is "written"
            if k > 0:
                drafts[seq.seq_id] = ngram_lookup(seq.token_ids, k, self.min_n, self.max_n)
        return drafts
