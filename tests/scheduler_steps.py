"""Driving the scheduler without a model (the scheduler's and the prefix cache's tests)."""

from __future__ import annotations


def finish_step(out) -> None:
    """Pretend the model ran a SchedulerOutput: its query tokens are computed, and a sequence
    computed to its end samples token 7."""
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_query_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.token_ids.append(7)
