"""Bookkeeping without torch: page manager and scheduler."""

import pytest

from target_service.api_types import EngineRequest
from target_service.page_manager import OutOfPagesError, PageManager
from target_service.scheduler import Scheduler, SchedulerConfig
from target_service.sequence import Sequence, SequenceStatus
from tests.scheduler_steps import finish_step


def _seq(i, n):
    return Sequence.from_request(EngineRequest(f"r{i}", tuple(range(1, n + 1))), i)


def test_page_manager_allocate_free_roundtrip():
    bm = PageManager(num_pages=4, page_size=4)
    s = _seq(0, 5)
    assert bm.pages_needed(s, 5) == 2
    bm.allocate(s, 5)
    assert len(s.page_table) == 2 and bm.num_free_pages == 2
    with pytest.raises(OutOfPagesError):
        bm.allocate(s, 17)
    bm.free(s)
    assert bm.num_free_pages == 4 and s.page_table == []


def test_chunked_prefill_respects_token_budget():
    bm = PageManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=256), bm)
    a, b = _seq(0, 25), _seq(1, 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_query_tokens) for s in out.scheduled] == [("r0", 10)]
    finish_step(out)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_query_tokens) for s in out.scheduled] == [("r0", 10)]
    finish_step(out)
    out = sched.schedule()  # the last 5 of r0, then r1 joins in the same step
    assert [(s.seq.request_id, s.num_query_tokens) for s in out.scheduled] == [("r0", 5), ("r1", 3)]
    assert all(s.samples for s in out.scheduled)


def test_max_num_seqs_limits_running():
    bm = PageManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=256), bm)
    for i in range(3):
        sched.add(_seq(i, 2))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_by_recompute_when_pages_run_out():
    bm = PageManager(num_pages=3, page_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=64), bm)
    a, b = _seq(0, 4), _seq(1, 4)
    sched.add(a)
    sched.add(b)
    finish_step(sched.schedule())  # both prefilled: 1 page each, 5 tokens each now
    out = sched.schedule()  # a needs a 2nd page (1 free), then b needs one too → b preempted
    assert [s.seq for s in out.scheduled] == [a]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.page_table == []
    assert sched.waiting[0] is b
    assert bm.num_free_pages == 3 - len(a.page_table)


def test_remove_frees_pages():
    bm = PageManager(8, 4)
    sched = Scheduler(SchedulerConfig(), bm)
    s = _seq(0, 9)
    sched.add(s)
    sched.schedule()
    sched.remove(s)
    assert bm.num_free_pages == 8 and not sched.has_work


def test_lookahead_reserves_draft_slots_for_decodes_only():
    bm = PageManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=256), bm)
    s = _seq(0, 6)
    sched.add(s)
    out = sched.schedule(lookahead={0: 4})
    assert out.scheduled[0].num_lookahead_tokens == 0  # prefill
    finish_step(out)
    out = sched.schedule(lookahead={0: 4})
    assert (out.scheduled[0].num_query_tokens, out.scheduled[0].num_lookahead_tokens) == (1, 4)
    assert len(s.page_table) * 4 >= s.num_tokens + 4
