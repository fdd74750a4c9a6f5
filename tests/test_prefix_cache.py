"""The prefix cache's bookkeeping without torch: hashes, sharing, eviction, accounting."""

import random

import pytest

from target_service.api_types import EngineRequest
from target_service.page_manager import NO_EPOCH, PageManager, page_hash, root_hash
from target_service.scheduler import Scheduler, SchedulerConfig
from target_service.sequence import Sequence
from tests.scheduler_steps import finish_step

PAGE = 4


def _seq(seq_id: int, tokens, salt: str = "") -> Sequence:
    return Sequence.from_request(EngineRequest(f"r{seq_id}", tuple(tokens), cache_salt=salt), seq_id)


def _compute(pm: PageManager, seq: Sequence) -> None:
    """Admit `seq` from its prefix hit and compute the rest of its tokens (as the engine does)."""
    hit = pm.find_prefix(seq)
    start = len(hit) * PAGE
    pm.share(seq, hit.pages)
    pm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    pm.commit(seq)
    return start


def test_hash_chains_over_previous_pages_and_salt():
    root = root_hash("model")
    a = page_hash(root, [1, 2, 3, 4])
    assert a == page_hash(root_hash("model"), [1, 2, 3, 4])
    assert a != page_hash(root, [1, 2, 3, 5])
    assert a != page_hash(root_hash("model", "tenant"), [1, 2, 3, 4])
    assert a != page_hash(root_hash("other model"), [1, 2, 3, 4])
    assert page_hash(a, [5, 6, 7, 8]) != page_hash(page_hash(root, [9, 2, 3, 4]), [5, 6, 7, 8])


def test_finished_prompt_is_reused_and_last_token_recomputed():
    pm = PageManager(16, PAGE)
    first = _seq(0, range(1, 13))  # 3 full pages
    assert _compute(pm, first) == 0
    pages = list(first.page_table)
    pm.free(first)
    assert pm.num_free_pages == 16 and pm.num_cached_pages == 3
    same = _seq(1, range(1, 13))
    hit = pm.find_prefix(same)
    assert list(hit.pages) == pages[:2]  # all cached, but the last token is computed: its page too
    longer = _seq(2, [*range(1, 13), 99, 98])
    assert list(pm.find_prefix(longer).pages) == pages
    other = _seq(3, [1, 2, 3, 5, *range(5, 13)])
    assert len(pm.find_prefix(other)) == 0


def test_concurrent_sequences_share_pages_with_refcounts():
    pm = PageManager(16, PAGE)
    a = _seq(0, range(1, 11))
    _compute(pm, a)  # a keeps running: its 2 full pages are cached and held
    b = _seq(1, [*range(1, 9), 50, 51, 52])
    assert _compute(pm, b) == 8
    assert b.page_table[:2] == a.page_table[:2] and b.page_table[2] != a.page_table[2]
    assert [pm.refcount(p) for p in a.page_table[:2]] == [2, 2]
    pm.free(a)
    assert [pm.refcount(p) for p in b.page_table[:2]] == [1, 1]
    assert pm.num_free_pages == 16 - len(b.page_table)
    pm.free(b)
    pm.check_invariants()
    assert pm.num_free_pages == 16


def test_eviction_is_least_recently_used_and_tail_first():
    pm = PageManager(6, PAGE)
    old = _seq(0, range(1, 10))  # pages: 2 full + 1 partial
    _compute(pm, old)
    old_pages = list(old.page_table)
    pm.free(old)
    new = _seq(1, range(100, 109))
    _compute(pm, new)
    new_pages = list(new.page_table)
    pm.free(new)
    assert pm.num_cached_pages == 4
    # Partial pages went back free; of the cached ones, the older sequence's go first, its tail before its head
    taker = _seq(2, range(500, 516))
    pm.allocate(taker, 16)
    taken = set(taker.page_table)
    assert {old_pages[2], new_pages[2]} <= taken  # free (uncached) pages first
    assert old_pages[1] in taken and old_pages[0] in taken  # then the LRU sequence's, tail first
    assert not taken & set(new_pages[:2])
    assert pm.find_prefix(_seq(3, range(100, 109))).pages == tuple(new_pages[:2])
    assert len(pm.find_prefix(_seq(4, range(1, 10)))) == 0
    pm.free(taker)
    pm.check_invariants()


def test_a_hit_refreshes_recency():
    pm = PageManager(4, PAGE)
    a, b = _seq(0, range(1, 6)), _seq(1, range(50, 55))
    _compute(pm, a)
    pm.free(a)
    _compute(pm, b)
    pm.free(b)
    again = _seq(2, range(1, 6))  # reuses a's first page: b's is now the least recently used
    _compute(pm, again)
    pm.free(again)
    taker = _seq(3, range(900, 912))
    pm.allocate(taker, 12)  # 3 of 4 pages: the 2 free ones, then the least recently used cached one
    assert pm.find_prefix(_seq(4, range(1, 6))).pages != ()
    assert pm.find_prefix(_seq(5, range(50, 55))).pages == ()


def test_salt_isolates():
    pm = PageManager(16, PAGE)
    _compute(pm, _seq(0, range(1, 10), salt="tenant-a"))
    assert len(pm.find_prefix(_seq(1, range(1, 10), salt="tenant-a"))) == 2
    assert len(pm.find_prefix(_seq(2, range(1, 10), salt="tenant-b"))) == 0
    assert len(pm.find_prefix(_seq(3, range(1, 10)))) == 0


def test_disabled_cache_never_hits():
    pm = PageManager(16, PAGE, enable_prefix_caching=False)
    a = _seq(0, range(1, 10))
    _compute(pm, a)
    pm.free(a)
    assert pm.num_cached_pages == 0 and len(pm.find_prefix(_seq(1, range(1, 10)))) == 0
    pm.check_invariants()


def test_fork_shares_full_pages_only():
    pm = PageManager(16, PAGE)
    parent = _seq(0, range(1, 11))
    _compute(pm, parent)
    child = _seq(1, range(1, 11))
    pm.fork(parent, child)
    assert child.page_table == parent.page_table[:2] and child.num_computed_tokens == 8
    pm.allocate(child, child.num_tokens)
    assert child.page_table[2] != parent.page_table[2]
    pm.free(parent)
    pm.free(child)
    pm.check_invariants()
    assert pm.num_free_pages == 16


def test_drafter_validity_is_per_page_and_per_epoch():
    pm = PageManager(16, PAGE)
    a = _seq(0, range(1, 14))
    _compute(pm, a)
    pm.mark_drafter_written(a, 9, epoch=3)  # pages 0 and 1 full of written draft KV; page 2 not
    assert pm.drafter_valid_tokens(a, 3) == 8 and pm.drafter_valid_tokens(a, 4) == 0
    pm.free(a)
    b = _seq(1, range(1, 14))
    hit = pm.find_prefix(b, epoch=3)
    assert len(hit) == 3 and hit.drafter_valid_pages == 2
    assert pm.find_prefix(b, epoch=4).drafter_valid_pages == 0  # a re-attached drafter: void
    assert pm.find_prefix(b, epoch=NO_EPOCH).drafter_valid_pages == 0
    assert hit.truncated(hit.drafter_valid_pages).pages == hit.pages[:2]


def test_evicted_page_loses_drafter_validity():
    pm = PageManager(3, PAGE)
    a = _seq(0, range(1, 9))
    _compute(pm, a)
    pm.mark_drafter_written(a, 8, epoch=1)
    pm.free(a)
    filler = _seq(1, range(100, 112))
    pm.allocate(filler, 12)  # evicts everything
    pm.free(filler)
    b = _seq(2, range(500, 509))
    pm.allocate(b, 9)
    assert pm.drafter_valid_tokens(b, 1) == 0


def test_accounting_exact_after_a_flood_of_distinct_prefixes():
    """10,000 distinct prompts through a small pool, some running together, some aborted
    half-computed, some sharing: every page accounted for at every step, none lost."""
    rng = random.Random(0)
    pm = PageManager(64, PAGE)
    shared_prefix = [7] * 8
    running: list[Sequence] = []
    for i in range(10_000):
        body = [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 20))]
        tokens = (shared_prefix + body) if i % 5 == 0 else [i + 1, *body]
        seq = _seq(i, tokens)
        while running and not pm.can_start(seq, hit := pm.find_prefix(seq), seq.num_tokens):
            pm.free(running.pop(0))
        hit = pm.find_prefix(seq)
        if not pm.can_start(seq, hit, seq.num_tokens):
            continue
        pm.share(seq, hit.pages)
        pm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = rng.randrange(len(hit) * PAGE, seq.num_tokens + 1)  # aborted part-way, or not
        pm.commit(seq)
        running.append(seq)
        if len(running) > 4:
            pm.free(running.pop(rng.randrange(len(running))))
        if i % 97 == 0:
            pm.check_invariants()
    for seq in running:
        pm.free(seq)
    pm.check_invariants()
    assert pm.num_free_pages == 64 and pm.num_held_pages == 0
    assert pm.num_cached_pages <= 64
    assert pm.stats.evictions > 1000


def test_double_free_is_caught():
    pm = PageManager(4, PAGE)
    a = _seq(0, range(1, 6))
    pm.allocate(a, 5)
    table = list(a.page_table)
    pm.free(a)
    a.page_table = table
    with pytest.raises(RuntimeError, match="does not hold it"):
        pm.free(a)


def test_scheduler_admits_from_the_cache_and_reports_the_query():
    pm = PageManager(32, PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128), pm)
    first = _seq(0, range(1, 20))
    sched.add(first)
    out = sched.schedule()
    assert out.prefix_queries == [(19, 0)]
    finish_step(out)
    sched.remove(first)
    second = _seq(1, [*range(1, 20), 30, 31])
    sched.add(second)
    out = sched.schedule()
    assert out.prefix_queries == [(21, 16)]
    assert [(s.seq.request_id, s.num_query_tokens) for s in out.scheduled] == [("r1", 5)]
    assert second.num_cached_tokens == 16 and second.usage().cached_tokens == 16
    finish_step(out)
    sched.remove(second)
    pm.check_invariants()


def test_preempted_sequence_finds_its_own_pages_again():
    pm = PageManager(8, PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128), pm)
    a, b = _seq(0, range(1, 13)), _seq(1, range(100, 112))
    sched.add(a)
    sched.add(b)
    finish_step(sched.schedule())  # both prefilled: 3 + 3 pages of 8 (one token each generated)
    for _ in range(5):  # decodes until b, admitted last, is preempted for a's pages
        out = sched.schedule()
        finish_step(out)
        if out.preempted:
            break
    assert out.preempted == [b] and b.num_computed_tokens == 0
    pm.check_invariants()
    sched.remove(a)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [b]
    assert out.prefix_queries[0][1] == 12  # its prompt's full pages were still cached
    assert b.num_cached_tokens == 0  # usage counts the first admission only
    sched.remove(b)
    pm.check_invariants()
    assert pm.num_free_pages == 8


def test_a_prefix_computed_again_takes_the_hash_from_an_unheld_page_only():
    pm = PageManager(16, PAGE)
    a = _seq(0, range(1, 10))
    _compute(pm, a)
    old = a.page_table[:2]
    pm.free(a)
    # Computed again without using the cache (a drafter that needed its own layers): the new
    # pages replace the unheld old ones, which become free
    b = _seq(1, range(1, 10))
    pm.allocate(b, 9)
    b.num_computed_tokens = 9
    pm.commit(b)
    assert pm.find_prefix(_seq(2, range(1, 10))).pages == tuple(b.page_table[:2])
    assert not any(pm.is_cached(p) for p in old)
    # While b holds them, a third copy stays private
    c = _seq(3, range(1, 10))
    pm.allocate(c, 9)
    c.num_computed_tokens = 9
    pm.commit(c)
    assert pm.find_prefix(_seq(4, range(1, 10))).pages == tuple(b.page_table[:2])
    assert not any(pm.is_cached(p) for p in c.page_table)
    pm.free(b)
    pm.free(c)
    pm.check_invariants()
    assert pm.num_free_pages == 16 and pm.num_cached_pages == 2


def test_scheduler_flood_of_distinct_prefixes_keeps_accounting_exact():
    """10,000 requests with distinct prompts (a fifth sharing a prefix) through the scheduler on
    a pool small enough to preempt, some aborted mid-flight: after each step every page is
    accounted for, and at the end all are free."""
    rng = random.Random(1)
    pm = PageManager(48, PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=40, max_model_len=256), pm)
    admitted = finished = aborted = 0
    while finished + aborted < 10_000:
        while admitted < 10_000 and len(sched.waiting) < 4:
            body = [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 30))]
            tokens = [7] * 12 + body if admitted % 5 == 0 else [admitted + 1, *body]
            sched.add(_seq(admitted, tokens))
            admitted += 1
        out = sched.schedule()
        finish_step(out)
        for s in out.scheduled:
            if s.seq.num_computed_tokens == s.seq.num_tokens - 1 and s.seq.num_output_tokens >= 3:
                sched.remove(s.seq)
                finished += 1
        if sched.running and rng.random() < 0.05:
            sched.remove(sched.running[rng.randrange(len(sched.running))])
            aborted += 1
        if (finished + aborted) % 250 == 0:
            pm.check_invariants()
    for seq in [*sched.running, *sched.waiting]:
        sched.remove(seq)
    pm.check_invariants()
    assert pm.num_free_pages == 48 and pm.num_held_pages == 0
    assert pm.stats.evictions > 1000 and pm.stats.hits > 0
