"""Page allocation for the paged KV pool, with automatic prefix caching. No torch here.

Page ids are shared by every layer (target and draft): one id, one slot in each region.

A page full of computed tokens is identified by a hash chained over the previous page's
hash and its own token ids, rooted in what else decides its KV (the model, the KV dtype
and scales: the `namespace`) and the request's `cache_salt`. Sequences whose prompts
share full pages share those pages (reference-counted). A page nobody holds any more
stays cached, and is evicted least-recently-used only when a page is needed: a freed
sequence's pages are queued tail first, so its prefix outlives its suffix.

Each page also records the handshake epoch whose drafter wrote its draft layers for
every token of the page (`drafter_epoch`): a cached page serves speculation only while
that is the current epoch (a re-attached drafter's pages are void).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from target_service.sequence import Sequence

NO_EPOCH = -1


class OutOfPagesError(RuntimeError):
    pass


def root_hash(namespace: str, cache_salt: str = "") -> bytes:
    """The hash every chain starts from: what the KV depends on besides the tokens."""
    return hashlib.sha256(f"splitspec-prefix\0{namespace}\0{cache_salt}".encode()).digest()


def page_hash(parent: bytes, token_ids: Iterable[int]) -> bytes:
    """A full page's identity: its tokens, after everything before them (`parent`)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass(frozen=True)
class PrefixHit:
    """The cached pages a waiting sequence can start from, in order."""

    pages: tuple[int, ...] = ()
    drafter_valid_pages: int = 0  # leading pages whose draft layers the current drafter wrote

    def __len__(self) -> int:
        return len(self.pages)

    def truncated(self, num_pages: int) -> PrefixHit:
        return PrefixHit(self.pages[:num_pages], min(self.drafter_valid_pages, num_pages))


@dataclass
class PrefixCacheStats:
    """Counts since the page manager was made (vLLM's prefix cache queries and hits, in tokens)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


class PageManager:
    """Free pages, pages held by sequences (with a reference count each), and cached pages
    nobody holds (evictable, least recently used first)."""

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 namespace: str = "") -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self._free: deque[int] = deque(range(num_pages))  # holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest first
        self._refs: dict[int, int] = {}  # held page → how many sequences hold it
        self._hash_of: dict[int, bytes] = {}  # cached page → its hash
        self._page_of: dict[bytes, int] = {}  # hash → cached page
        self._drafter_epoch: list[int] = [NO_EPOCH] * num_pages
        self.stats = PrefixCacheStats()

    # --- accounting ----------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_of)

    @property
    def num_held_pages(self) -> int:
        return len(self._refs)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages

    def describe_cache(self) -> dict:
        """The prefix cache at a glance (GetServerInfo, `splitspec info`)."""
        stats = self.stats
        return {"enabled": self.enable_prefix_caching, "cached_pages": self.num_cached_pages,
                "evictable_pages": len(self._evictable), "queries": stats.queries, "hits": stats.hits,
                "evictions": stats.evictions}

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def is_cached(self, page: int) -> bool:
        return page in self._hash_of

    def check_invariants(self) -> None:
        """Every page is in exactly one of free, evictable or held; the hash maps agree."""
        free, evictable, held = set(self._free), set(self._evictable), set(self._refs)
        if len(free) != len(self._free):
            raise AssertionError("a page is free twice")
        if free & evictable or free & held or evictable & held:
            raise AssertionError("a page is in two states")
        if len(free) + len(evictable) + len(held) != self.num_pages:
            raise AssertionError(f"pages lost: {len(free)} free + {len(evictable)} evictable + {len(held)} held "
                                 f"!= {self.num_pages}")
        if any(count <= 0 for count in self._refs.values()):
            raise AssertionError("a held page has no holder")
        if free & self._hash_of.keys():
            raise AssertionError("a free page is still cached")
        if not evictable <= self._hash_of.keys():
            raise AssertionError("an evictable page is not cached")
        if {self._page_of[h] for h in self._hash_of.values()} != self._hash_of.keys():
            raise AssertionError("hash maps disagree")

    # --- prefix hits ---------------------------------------------------------------------

    def compute_page_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Extend `seq.page_hashes` over its full pages among its first `num_tokens` tokens."""
        hashes = seq.page_hashes
        full = min(num_tokens, seq.num_tokens) // self.page_size
        parent = hashes[-1] if hashes else root_hash(self.namespace, seq.request.cache_salt)
        for index in range(len(hashes), full):
            start = index * self.page_size
            parent = page_hash(parent, seq.token_ids[start : start + self.page_size])
            hashes.append(parent)
        return hashes

    def find_prefix(self, seq: Sequence, epoch: int = NO_EPOCH) -> PrefixHit:
        """The cached pages `seq` (holding none yet) may start from. At least its last token is
        left to compute (its logits give the next token), so a prompt that is all cached still
        recomputes its last page."""
        if not self.enable_prefix_caching or seq.page_table:
            return PrefixHit()
        limit = (seq.num_tokens - 1) // self.page_size
        pages = []
        for page_hash_ in self.compute_page_hashes(seq, limit * self.page_size)[:limit]:
            page = self._page_of.get(page_hash_)
            if page is None:
                break
            pages.append(page)
        valid = 0
        while valid < len(pages) and self._drafter_epoch[pages[valid]] == epoch != NO_EPOCH:
            valid += 1
        return PrefixHit(tuple(pages), valid)

    def record_query(self, seq: Sequence, hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.stats.queries += seq.num_tokens
            self.stats.hits += hit_tokens

    def can_start(self, seq: Sequence, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether `seq` can take the hit's pages and then pages for `num_tokens` tokens."""
        reused_evictable = sum(1 for page in hit.pages if page in self._evictable)
        needed = max(0, -(-num_tokens // self.page_size) - len(hit.pages))
        return needed <= self.num_free_pages - reused_evictable

    def share(self, seq: Sequence, pages: Iterable[int]) -> None:
        """Append already-written pages to `seq`'s table (a prefix hit, or a fork of another
        sequence's full pages): each gains a holder, and none is evicted while held."""
        for page in pages:
            if page in self._evictable:
                del self._evictable[page]
            elif page not in self._refs:
                raise RuntimeError(f"page {page} is neither cached nor held")
            self._refs[page] = self._refs.get(page, 0) + 1
            seq.page_table.append(page)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (holding nothing) shares `parent`'s full computed pages: its prompt's KV is
        computed once. Only full pages are shared; the child writes its own from there on."""
        if child.page_table:
            raise RuntimeError(f"sequence {child.request_id} already holds pages")
        full = parent.num_computed_tokens // self.page_size
        self.commit(parent)
        self.share(child, parent.page_table[:full])
        child.num_computed_tokens = full * self.page_size
        child.page_hashes = parent.page_hashes[:full]
        child.num_committed_pages = full

    # --- allocation ----------------------------------------------------------------------

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra pages `seq` needs so its table covers `num_tokens` tokens."""
        want = -(-num_tokens // self.page_size)
        return max(0, want - len(seq.page_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.num_free_pages

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.pages_needed(seq, num_tokens)
        if needed > self.num_free_pages:
            raise OutOfPagesError(f"sequence {seq.request_id} needs {needed} pages, {self.num_free_pages} free")
        for _ in range(needed):
            page = self._take_page()
            self._refs[page] = 1
            seq.page_table.append(page)

    def _take_page(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)  # least recently used
        del self._page_of[self._hash_of.pop(page)]
        self._drafter_epoch[page] = NO_EPOCH
        self.stats.evictions += 1
        return page

    def commit(self, seq: Sequence) -> None:
        """Cache `seq`'s pages that are now full of computed tokens. Where the same prefix is
        cached already, a page another sequence holds keeps the hash (this one stays private);
        an unheld one gives it up and is freed (it was not reused: its draft layers were void)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.page_size, len(seq.page_table))
        if full <= seq.num_committed_pages:
            return
        hashes = self.compute_page_hashes(seq, full * self.page_size)
        for index in range(seq.num_committed_pages, full):
            page, key = seq.page_table[index], hashes[index]
            if page in self._hash_of:
                continue  # shared from the cache
            duplicate = self._page_of.get(key)
            if duplicate is not None:
                if duplicate not in self._evictable:
                    continue  # another running sequence holds the same prefix: this page stays private
                self._drop_cached(duplicate)  # nobody holds it; the page just computed is at least as valid
            self._page_of[key] = page
            self._hash_of[page] = key
        seq.num_committed_pages = full

    def _drop_cached(self, page: int) -> None:
        """An evictable page forgets its hash and becomes free."""
        del self._evictable[page]
        del self._page_of[self._hash_of.pop(page)]
        self._drafter_epoch[page] = NO_EPOCH
        self._free.append(page)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its pages (caching its full computed ones first). Pages nobody
        holds become evictable if cached, free otherwise; the table's tail is queued first,
        so it is evicted before the prefix other requests are likelier to share."""
        self.commit(seq)
        for page in reversed(seq.page_table):
            count = self._refs.get(page, 0)
            if count <= 0:
                raise RuntimeError(f"page {page} freed by sequence {seq.request_id}, which does not hold it")
            if count > 1:
                self._refs[page] = count - 1
                continue
            del self._refs[page]
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._drafter_epoch[page] = NO_EPOCH
                self._free.append(page)
        seq.page_table.clear()
        seq.num_committed_pages = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached page nobody holds (held ones stay cached) and the counts; how
        many pages were dropped."""
        dropped = len(self._evictable)
        self.stats = PrefixCacheStats()
        for page in list(self._evictable):
            self._drop_cached(page)
        return dropped

    # --- the drafter's layers ------------------------------------------------------------

    def mark_drafter_written(self, seq: Sequence, num_tokens: int, epoch: int) -> None:
        """The drafter of `epoch` wrote its layers for `seq`'s first `num_tokens` tokens."""
        full = min(num_tokens, seq.num_computed_tokens) // self.page_size
        for page in seq.page_table[:full]:
            self._drafter_epoch[page] = epoch

    def drafter_valid_tokens(self, seq: Sequence, epoch: int) -> int:
        """Leading tokens of `seq` whose pages hold the current drafter's layers."""
        count = 0
        for page in seq.page_table:
            if self._drafter_epoch[page] != epoch or epoch == NO_EPOCH:
                break
            count += 1
        return count * self.page_size
