"""Page allocation for the paged KV pool. No torch here.

Page ids are shared by every layer (target and draft): one id, one slot in each region.
"""

from __future__ import annotations

from collections import deque

from target_service.sequence import Sequence


class OutOfPagesError(RuntimeError):
    pass


class PageManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, int] = {}  # page id → seq id, to catch double frees

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_pages

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra pages `seq` needs so its table covers `num_tokens` tokens."""
        want = -(-num_tokens // self.page_size)
        return max(0, want - len(seq.page_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.pages_needed(seq, num_tokens)
        if needed > len(self._free):
            raise OutOfPagesError(f"sequence {seq.request_id} needs {needed} pages, {len(self._free)} free")
        for _ in range(needed):
            page = self._free.popleft()
            self._owner[page] = seq.seq_id
            seq.page_table.append(page)

    def free(self, seq: Sequence) -> None:
        for page in seq.page_table:
            if self._owner.pop(page, None) != seq.seq_id:
                raise RuntimeError(f"page {page} freed by sequence {seq.request_id}, which does not own it")
            self._free.append(page)
        seq.page_table.clear()
